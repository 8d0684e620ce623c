"""The base of every supervised actor: a failing start is reported like any crash.

pykka stops an actor whose ``on_start`` raises without calling its ``on_failure``, so a
supervised actor that failed while starting (a record it cannot read, the store gone)
would die untold: nothing restarts it, nothing is logged in the ``runtime`` stream. A
:class:`Supervised` actor does its start in :meth:`started`; when that raises, its
``on_failure`` runs (which reports the crash to its supervisor) before pykka stops it.
"""

from __future__ import annotations

import sys

import pykka

__all__ = ["Supervised"]


class Supervised(pykka.ThreadingActor):
    """A ThreadingActor whose failing start goes through ``on_failure``."""

    def on_start(self) -> None:
        try:
            self.started()
        except Exception:
            self.on_failure(*sys.exc_info())
            raise

    def started(self) -> None:
        """The actor's start (what ``on_start`` would do)."""
