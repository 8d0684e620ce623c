"""Which deadlines replay verification is waiting on, and when one counts as missed.

:class:`DeadlineWatch` is told when a stream's deadline moves (:meth:`~DeadlineWatch.moved`)
and sees every record before it is folded (:meth:`~DeadlineWatch.before`). A deadline
is *suspected* once a record is later than ``due + slack + grace`` (unless that record is
the decision itself, late), and *missed* once time moves past that record still without
the decision: a later record, or the end of the log (:meth:`~DeadlineWatch.end`). A
suspect whose deadline moves or is met at the same moment as its proof is dropped (a
fake clock that jumped made them simultaneous). A new process (:meth:`~DeadlineWatch.
restarted`) drops the timers of the old one; deadlines that survive a restart are owed
again from its start. The supervisor restarting the actor that owns a stream
(:meth:`~DeadlineWatch.actor_restarted`) drops that stream's timers the same way, except
those the new actor re-arms. A deadline whose slack the config in force does not record
as a number cannot be judged: once a record is later than it (plus the grace) it is
*unwatched* (:meth:`~DeadlineWatch.unwatched`), said once, never taken for a miss. One
whose own setting is no number (:class:`DueUnknown`) has no time to pass: what was pending
on it is unwatched once it ends (or the log does), said once per stream and deadline, at
the record that left it pending; unless its own decision ended it, which is checked, or
no record came later than the soonest it could fall due under any setting (plus its
slack and the grace) while it was pending: then no setting made its decision late.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from typing import Any

import msgspec

from stalwart.errors import StalwartError
from stalwart.events import RecordedEvent

from ._verify_registry import Deadline, Knobs

Key = tuple[str, int]  # (stream, the deadline's index in the registry)


class Missed(msgspec.Struct, frozen=True):
    """A deadline that passed: its stream and index, when it was due, the record proving it."""

    stream: str
    index: int
    due: float
    proof: RecordedEvent


class Unwatched(msgspec.Struct, frozen=True):
    """A deadline that passed while its slack was no number (``reason`` says which): its
    stream and index, when it was due, the first record later than it and the grace. With
    no ``due``, its own setting was no number: ``proof`` is the record that left something
    pending on it."""

    stream: str
    index: int
    due: float | None
    proof: RecordedEvent
    reason: str


class DueUnknown(msgspec.Struct, frozen=True):
    """What a deadline's ``due`` gives when something is pending on it but its own setting
    is recorded as no number (``reason`` says which): when it falls due cannot be said.
    ``earliest``: the soonest it could fall due under any setting (None: not known)."""

    reason: str
    earliest: float | None = None


class _Unknown:
    """A deadline pending at a time its setting cannot give: why, the record that left it
    pending, the time a record must pass to be able to prove its decision late under some
    setting (``at``), and whether one did before ``at`` moved (a new process owes it)."""

    __slots__ = ("at", "mattered", "reason", "since")

    def __init__(self, reason: str, since: RecordedEvent, at: float) -> None:
        self.reason = reason
        self.since = since
        self.at = at
        self.mattered = False


class _Armed(msgspec.Struct, frozen=True, order=True):
    at: float  # due + slack + grace: a record later than this proves the miss
    due: float
    stream: str
    index: int
    #: why its slack is unknown ("" when it is known): passing it proves nothing
    unwatched: str = ""


class DeadlineWatch:
    """The pending deadlines of every stream, a heap of when each would be missed."""

    def __init__(self, deadlines: tuple[Deadline[Any], ...], grace_ms: int) -> None:
        self._deadlines = deadlines
        self._grace_s = grace_ms / 1000
        self._pending: dict[Key, float] = {}
        self._orphaned: dict[Key, float] = {}
        self._heap: list[_Armed] = []
        self._suspects: dict[Key, tuple[float, RecordedEvent]] = {}
        #: the misses confirmed, by stream: their deadline and the record that proved each,
        #: until their deadline moves (see :meth:`made_in_time`)
        self._confirmed: dict[str, dict[int, RecordedEvent]] = {}
        self._confirmed_due: dict[Key, float] = {}  # when each confirmed miss fell due
        self._unwatched: list[Unwatched] = []
        self._told: set[tuple[Key, float]] = set()  # the unwatched ones said, with their due
        #: the deadlines pending whose own setting is no number
        self._unknown: dict[Key, _Unknown] = {}
        #: the latest time a record that can prove a miss showed (a start cannot)
        self._latest = -math.inf
        self._told_unknown: set[Key] = set()  # those said (once per stream and deadline)
        self._cut = False  # records after the end of the walk are being read

    def before(self, record: RecordedEvent, *, restart: bool = False) -> list[Missed]:
        """Look at ``record`` before it is folded; the deadlines it proves missed. A
        ``restart`` record (a new process's start) proves the suspects earlier records
        raised, but raises none itself: the timers it finds overdue belonged to a process
        that may have died before they were due, and the log cannot say when it did."""
        missed = self._confirm(record) if self._suspects else []
        if restart:
            return missed
        self._latest = max(self._latest, record.ts)
        if self._heap and self._heap[0].at < record.ts:
            self._expire(record)
        return missed

    def moved(
        self,
        stream: str,
        index: int,
        due: float | DueUnknown | None,
        record: RecordedEvent,
        knobs: Knobs,
    ) -> None:
        """``stream``'s deadline ``index`` is now ``due`` (None: nothing pending;
        :class:`DueUnknown`: something pending, at a time its setting cannot give)."""
        key = (stream, index)
        if isinstance(due, DueUnknown):
            if key not in self._unknown and not self._cut:
                self._forget(key, record)
                at = self._provable_after(index, due, knobs)
                self._unknown[key] = _Unknown(due.reason, record, at)
            return
        if key in self._unknown:
            self._unknown_ended(key, record)
        if due == self._pending.get(key):
            return
        self._forget(key, record)
        if due is None:
            return
        self._pending[key] = due
        if self._orphaned.get(key) == due:
            return  # armed by a process that is gone: nobody owes it
        self._orphaned.pop(key, None)
        self._push(stream, index, due, knobs)

    def _forget(self, key: Key, record: RecordedEvent) -> None:
        """``key``'s former deadline no longer stands (at ``record``): nothing pending."""
        stream, index = key
        confirmed = self._confirmed.get(stream)
        if confirmed is not None and index in confirmed:
            del confirmed[index]  # a miss of the former deadline stands
            if not confirmed:
                del self._confirmed[stream]
        suspect = self._suspects.get(key)
        if suspect is not None and suspect[1] is not record:
            del self._suspects[key]  # settled at the proof's moment (the clock had jumped)
        self._pending.pop(key, None)

    def _unknown_ended(self, key: Key, record: RecordedEvent | None) -> None:
        """What was pending on ``key``, at a time its setting could not give, is no longer
        (at ``record``; None: its timer died with its process or actor, or the log ended).
        Unwatched, said once per stream and deadline (a miss is never invented), unless
        its decision ended it (that decision's own check says whether it follows), or no
        record came late enough to prove its decision late under any setting."""
        unknown = self._unknown.pop(key)
        stream, index = key
        decision = self._deadlines[index].decision
        if record is not None and record.stream == stream and record.type == decision:
            return
        if not (unknown.mattered or self._latest > unknown.at):
            return  # ended before its decision could be late, whatever the setting
        if key not in self._told_unknown:
            self._told_unknown.add(key)
            found = Unwatched(stream, index, None, unknown.since, unknown.reason)
            self._unwatched.append(found)

    def _provable_after(
        self, index: int, due: DueUnknown, knobs: Knobs, *, start: float = -math.inf
    ) -> float:
        """When a record, late past this, could prove ``due``'s decision missed under some
        setting (owed no earlier than ``start``): its floor plus its slack and the grace;
        with no floor, at once."""
        if due.earliest is None:
            return -math.inf
        slack, _ = self._slack_s(index, knobs)
        return max(due.earliest, start) + slack + self._grace_s

    def _slack_s(self, index: int, knobs: Knobs) -> tuple[float, str]:
        """The deadline's slack in seconds, and why it is unknown ("" when it is known:
        unknown, it is 0)."""
        try:
            return self._deadlines[index].slack_ms(knobs) / 1000, ""
        except StalwartError as exc:
            return 0.0, str(exc)

    def restarted(
        self,
        record: RecordedEvent,
        dues: Iterable[tuple[Key, float | DueUnknown | None]],
        knobs: Knobs,
    ) -> None:
        """A new process (its start: ``record``) with the deadlines ``dues`` (under the new
        config)."""
        ts = record.ts
        self._heap = []
        for key, due in dues:
            survives = self._deadlines[key[1]].survives_restart
            if isinstance(due, DueUnknown):
                self._pending.pop(key, None)
                if survives:
                    self._owe_unknown(key, due, record, knobs)  # the new process owes it
                elif key in self._unknown:
                    self._unknown_ended(key, None)  # the old process's timer, gone with it
                # a timer the old process armed at a known time died with it: none is owed
                continue
            if key in self._unknown:
                self._unknown_ended(key, None)
            if due is None:
                self._pending.pop(key, None)
                continue
            self._pending[key] = due
            if self._deadlines[key[1]].survives_restart:
                # owed by the new process from its start (armed with its own due, so that
                # _expire knows it for the one still pending)
                self._push(key[0], key[1], due, knobs, start=ts)
            else:
                self._orphaned[key] = due

    def _owe_unknown(self, key: Key, due: DueUnknown, record: RecordedEvent, knobs: Knobs) -> None:
        """A new process (its start: ``record``) owes ``key``, at a time its setting cannot
        give, from its start on; what the old process's life already proved stands."""
        at = self._provable_after(key[1], due, knobs, start=record.ts)
        unknown = self._unknown.get(key)
        if unknown is None:
            self._unknown[key] = _Unknown(due.reason, record, at)
            return
        unknown.mattered = unknown.mattered or self._latest > unknown.at
        unknown.at = at

    def actor_restarted(self, stream: str, ts: float) -> list[Key]:
        """The supervisor restarted the actor owning ``stream``, deciding so at ``ts``: the
        timers it kept died with it (a model call's prompt timeout, its turn's execution
        timeout), unless the deadline survives a restart (read from the log) or the new
        actor re-arms it. A deadline that fell due before ``ts`` was missed while the
        actor lived and stays missed; one that fell due after it was not owed, also when
        the restart's record comes after the record that seemed to prove it missed (the
        supervisor appends its decision late, after records of later times): those misses
        are returned, to be taken back."""
        taken_back: list[Key] = []
        for key in [key for key in self._unknown if key[0] == stream]:
            if not self._survives_actor(key[1]):
                self._unknown_ended(key, None)  # a timer that died with the actor
        for key, due in list(self._pending.items()):
            if key[0] != stream or self._survives_actor(key[1]):
                continue
            if key in self._suspects:
                if ts > due:
                    continue  # missed before the crash: it stays missed
                del self._suspects[key]
            self._orphaned[key] = due
        confirmed = self._confirmed.get(stream)
        if confirmed is None:
            return taken_back
        for index in list(confirmed):
            fell_due = self._confirmed_due.get((stream, index))
            if fell_due is not None and ts <= fell_due and not self._survives_actor(index):
                del confirmed[index]
                taken_back.append((stream, index))
        if not confirmed:
            del self._confirmed[stream]
        return taken_back

    def _survives_actor(self, index: int) -> bool:
        deadline = self._deadlines[index]
        return deadline.survives_restart or deadline.survives_actor_restart

    def owed(self) -> list[Key]:
        """The deadlines pending (at a known time or not) or orphaned: the only ones a new
        config can move (one with nothing pending has nothing pending under any config)."""
        return list(dict.fromkeys([*self._pending, *self._orphaned, *self._unknown]))

    def made_in_time(self, record: RecordedEvent) -> list[Key]:
        """The confirmed misses ``record`` takes back: it is their decision, at a time no
        later than the record that proved the miss, appended after records of later times
        (a worker that decided several sessions at one reading of its clock appends their
        decisions one by one, while other actors append what they do meanwhile)."""
        confirmed = self._confirmed.get(record.stream)
        if confirmed is None:
            return []
        made = [
            index
            for index, proof in confirmed.items()
            if record.type == self._deadlines[index].decision and record.ts <= proof.ts
        ]
        for index in made:
            del confirmed[index]
        if not confirmed:
            del self._confirmed[record.stream]
        return [(record.stream, index) for index in made]

    def unwatched(self) -> list[Unwatched]:
        """The deadlines found, since the last call, that could not be watched: passed
        while their slack was no number, or pending while their own setting was none."""
        found, self._unwatched = self._unwatched, []
        return found

    def suspected(self) -> bool:
        """Whether a deadline is suspected missed and no later record has settled it."""
        return bool(self._suspects)

    def past_the_end(self, record: RecordedEvent) -> list[Missed]:
        """A record after the end of the walk (``replay --until`` cut the log before it):
        it settles the suspects as :meth:`before` would (the decision at its proof's
        moment drops one, time moving on past the proof confirms it) and raises none:
        what it leaves pending at no time its setting gives is not said either."""
        self._cut = True
        return self._confirm(record) if self._suspects else []

    def end(self) -> list[Missed]:
        """The log ended: suspects it leaves unconfirmed are missed (their proof is late);
        deadlines still pending at no time their setting gives are unwatched."""
        for key in sorted(self._unknown, key=lambda key: self._unknown[key].since.position):
            self._unknown_ended(key, None)
        missed = [
            Missed(stream, index, due, proof)
            for (stream, index), (due, proof) in sorted(
                self._suspects.items(), key=lambda item: item[1][1].position
            )
        ]
        self._suspects.clear()
        return missed

    def _push(
        self, stream: str, index: int, due: float, knobs: Knobs, *, start: float = 0.0
    ) -> None:
        """Arm ``due``, missed once ``max(due, start)`` plus its slack and the grace pass.
        When the config in force records no number for the slack, how late the sweep may
        come cannot be said, and a miss is never invented: passing ``max(due, start)``
        plus the grace makes it unwatched instead."""
        slack, reason = self._slack_s(index, knobs)
        at = max(due, start) + slack + self._grace_s
        heapq.heappush(self._heap, _Armed(at, due, stream, index, reason))

    def _expire(self, record: RecordedEvent) -> None:
        heap = self._heap
        while heap and heap[0].at < record.ts:
            armed = heapq.heappop(heap)
            key = (armed.stream, armed.index)
            if self._pending.get(key) != armed.due or key in self._suspects:
                continue  # moved or decided since it was armed
            if self._orphaned.get(key) == armed.due:
                continue  # its actor was restarted since: nobody owes it
            decision = self._deadlines[armed.index].decision
            if record.stream == armed.stream and record.type == decision:
                continue  # the decision itself, late: made, not missed
            if armed.unwatched:
                if (key, armed.due) not in self._told:  # once, though armed again
                    self._told.add((key, armed.due))
                    found = Unwatched(armed.stream, armed.index, armed.due, record, armed.unwatched)
                    self._unwatched.append(found)
                continue
            self._suspects[key] = (armed.due, record)

    def _confirm(self, record: RecordedEvent) -> list[Missed]:
        missed = []
        for key, (due, proof) in list(self._suspects.items()):
            stream, index = key
            if record.stream == stream and record.type == self._deadlines[index].decision:
                del self._suspects[key]  # made at the proof's moment (the clock had jumped)
            elif record.ts > proof.ts:
                del self._suspects[key]
                missed.append(Missed(stream, index, due, proof))
                self._confirmed.setdefault(stream, {})[index] = proof
                self._confirmed_due[key] = due
        return missed
