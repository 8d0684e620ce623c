"""The base of every supervised actor: a failing start is reported like any crash.

pykka stops an actor whose ``on_start`` raises without calling its ``on_failure``, so a
supervised actor that failed while starting (a record it cannot read, the store gone)
would die untold: nothing restarts it, nothing is logged in the ``runtime`` stream. A
:class:`Supervised` actor does its start in :meth:`started`; when that raises, its
``on_failure`` runs (which reports the crash to its supervisor) before pykka stops it.

pykka also drops, without a word, the messages told to an actor that dies before it
handled them. An actor whose mail must outlive it (the supervisor's: a crash told to it
is the only word that a crashed actor needs restarting) takes them out in its
``on_failure`` with :meth:`Supervised.take_inbox` and hands them to its successor (an
asked message too: its asker may have stopped waiting).
A tell that checked the actor was alive before that and puts its message after it is
refused by the inbox itself (``ActorDeadError``, as a tell to a dead actor), so the
sender keeps it: no message lands in an inbox nobody reads again. Such a tell is newer
than what the inbox held, so whoever keeps both for the successor (the runtime's
``LiveRef.hand_over``) puts what is handed on ahead of it.
"""

from __future__ import annotations

import queue
import sys
import threading
from typing import Any

import pykka

__all__ = ["Supervised"]


#: What a message put into a closed inbox is refused with (an ask is answered with it).
_DEAD = "the actor stopped before handling the message"


class ClosingInbox(queue.Queue[Any]):  # of pykka's envelopes
    """An actor's inbox that :meth:`close` shuts for good: a message put after it is
    refused as pykka refuses one to a dead actor (a tell raises ``ActorDeadError``; an
    ask is answered with it, a stop with None). pykka's ``tell`` checks that the actor
    is alive and then puts, so without this a message put between an actor taking its
    inbox and its end would be lost without a word."""

    def __init__(self) -> None:
        super().__init__()
        self._gate = threading.Lock()
        self._closed = False

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        with self._gate:  # unbounded: a put never waits while it holds the gate
            if not self._closed:
                super().put(item, block, timeout)
                return
        _refuse(item)

    def close(self) -> None:
        """Refuse every later put; what was put before stays to be taken."""
        with self._gate:
            self._closed = True


def _refuse(envelope: Any) -> None:
    """Answer (or refuse) a message that reached an inbox no one will read again."""
    if envelope.reply_to is None:
        raise pykka.ActorDeadError(_DEAD)
    if isinstance(envelope.message, pykka.messages._ActorStop):
        envelope.reply_to.set(None)  # as pykka answers a stop it never ran
        return
    error = pykka.ActorDeadError(_DEAD)
    envelope.reply_to.set_exception(exc_info=(pykka.ActorDeadError, error, None))


class Supervised(pykka.ThreadingActor):
    """A ThreadingActor whose failing start goes through ``on_failure``."""

    @staticmethod
    def _create_actor_inbox() -> ClosingInbox:
        return ClosingInbox()

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
        is answered as pykka answers it (``ActorDeadError``; a stop: None) and its message
        is in the list too: its asker may have stopped waiting (an ask that timed out
        stays in the inbox), and nobody else would hand it on. An asker still waiting may
        tell it again, so a successor must take a message handed on twice (the dead-letter
        queue keeps one entry per announcement)."""
        self.actor_stopped.set()  # pykka sets it too (after a failing start: only after this)
        inbox = self.actor_inbox
        if isinstance(inbox, ClosingInbox):  # a tell that passed the check before the set
            inbox.close()  # and puts after it is refused, not left in here unread
        told: list[Any] = []
        while not inbox.empty():  # this thread is the inbox's only reader
            envelope = inbox.get()
            if envelope.reply_to is not None:
                _refuse(envelope)  # an asker still waiting asks (or tells) again
                if isinstance(envelope.message, pykka.messages._ActorStop):
                    continue
            told.append(envelope.message)
        return told
