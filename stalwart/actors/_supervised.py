"""The base of every supervised actor: a failing start is reported like any crash.

pykka stops an actor whose ``on_start`` raises without calling its ``on_failure``, so a
supervised actor that failed while starting (a record it cannot read, the store gone)
would die untold: nothing restarts it, nothing is logged in the ``runtime`` stream. A
:class:`Supervised` actor does its start in :meth:`started`; when that raises, its
``on_failure`` runs (which reports the crash to its supervisor) before pykka stops it.

pykka also drops, without a word, the messages told to an actor that dies before it
handled them. An actor whose mail must outlive it (the supervisor's: a crash told to it
is the only word that a crashed actor needs restarting) takes them out in its
``on_failure`` with :meth:`Supervised.take_inbox` and hands them to its successor.
"""

from __future__ import annotations

import sys
from typing import Any

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

    def take_inbox(self) -> list[Any]:
        """In ``on_failure``: the messages told to this actor that it will never handle,
        oldest first, taken out of its inbox (pykka would drop them). From here on a
        ``tell`` to it raises ``ActorDeadError`` (as it does once pykka has stopped it),
        so a sender that holds messages for a successor keeps them instead. An ``ask``
        still waiting is answered as pykka answers it (``ActorDeadError``; a stop: None)."""
        self.actor_stopped.set()  # pykka sets it too (after a failing start: only after this)
        told: list[Any] = []
        inbox = self.actor_inbox
        while not inbox.empty():  # this thread is the inbox's only reader
            envelope = inbox.get()
            if envelope.reply_to is None:
                told.append(envelope.message)
                continue
            if isinstance(envelope.message, pykka.messages._ActorStop):
                envelope.reply_to.set(None)  # as pykka answers a stop it never ran
                continue
            error = pykka.ActorDeadError(f"{self.actor_ref} stopped before handling the message")
            envelope.reply_to.set_exception(exc_info=(pykka.ActorDeadError, error, None))
        return told
