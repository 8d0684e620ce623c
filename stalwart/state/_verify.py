"""Replay verification: every decision in the log re-derived from the state just before it.

:class:`Verification` walks recorded events in log order (one stream's, or every stream's
for ``replay --all``), folds them as it goes and reports four kinds of :class:`Finding`:

* ``mismatch``: a decision event that does not follow from the state. Its verifier re-runs
  the pure ``decide`` on the fold of the decision's stream just before it, at the event's
  own ``ts``, with the config in force (the latest ``runtime:started`` before it, over
  the caller's defaults), and the recorded event must be one of the events it gives,
  compared field by field (fields a verifier names in ``ignore`` are left out).
* ``missed``: a deadline that passed with no decision. After every event a
  :class:`Deadline` says when its decision falls due in that stream. It is missed when
  the log shows time moving on without it: an event (of any stream) later than ``due +
  slack + grace``, followed by a later moment (a later event, or the end of the log)
  still without the decision. ``grace_ms`` (default 5 s) covers the scheduling delay;
  ``slack`` a periodic sweep's interval. A deadline that the log's end cuts off is never
  missed (the process may still be running), and one kept by a process (a timer) is
  not expected after that process is gone: a ``runtime:started`` drops it, unless the
  deadline ``survives_restart`` (the ghost sweep reads the log, so the next process owes
  it from its start on).
* ``unwatched``: a deadline that passed while the config in force recorded its slack
  (a sweep's interval) as no number, or one pending while it recorded the deadline's own
  setting as no number (said once per stream and deadline): whether its decision came in
  time cannot be said.
* ``undecodable``: a record of a type this version does not know (``UnknownEvent``) or a
  corrupt one the reader could not decode (:meth:`Verification.undecodable`).

The verifiers and deadlines it runs, and how to register one: :mod:`._verify_registry`;
how a deadline is watched: :mod:`._verify_deadlines`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import msgspec

from stalwart.errors import StalwartError
from stalwart.events import (
    Event,
    ProviderRecovered,
    RecordedEvent,
    RuntimeStarted,
    SupervisorRestarted,
    UnknownEvent,
)

from ._aggregate import Folder
from ._verify_deadlines import DeadlineWatch, DueUnknown, Missed, Unwatched
from ._verify_registry import (
    Deadline,
    FoldSpec,
    Knobs,
    Registry,
    UnusableKnob,
    Verifier,
    aggregate_of,
    fold_key,
    moment,
)

FindingKind = Literal["mismatch", "missed", "unwatched", "undecodable"]
#: the default grace: how late past a deadline an event may come before it proves a miss
DEFAULT_GRACE_MS = 5_000


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    """One thing replay found wrong, in words and as data.

    For a ``missed`` deadline, ``position``/``ts`` are those of the event that proved it
    (the first one after the deadline plus its grace) and ``tag`` the decision expected.
    """

    kind: FindingKind
    stream: str
    position: int
    version: int
    tag: str
    ts: float
    message: str
    expected: list[Any] = msgspec.field(default_factory=list)
    found: Any = None


class VerifyReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a verification saw and found; ``clean`` when it found nothing."""

    events: int
    streams: int
    last_position: int
    last_ts: float | None
    checked: dict[str, int]
    unchecked: dict[str, int]
    findings: tuple[Finding, ...]
    grace_ms: int

    @property
    def clean(self) -> bool:
        return not self.findings


#: what re-running a decision raises on a number in the log that no arithmetic takes (an
#: infinite or NaN float rounded to milliseconds, a time past any calendar)
_OUT_OF_RANGE = (ArithmeticError, ValueError)


def _out_of_range(exc: Exception) -> str:
    return (
        "replay could not re-run the decision: a number the log holds is out of range "
        f"({type(exc).__name__})"
    )


# -- the walk -----------------------------------------------------------------------------


def _builtins(event: Event) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(event)
    return data


def _same(expected: Event, found: Event, ignore: tuple[str, ...]) -> bool:
    if type(expected) is not type(found):
        return False
    if not ignore:
        return expected == found
    a, b = _builtins(expected), _builtins(found)
    return all(a.get(k) == b.get(k) for k in a.keys() | b.keys() if k not in ignore)


class _Plan:
    """What verifying one kind of stream takes: its folds (with the event types that move
    each, None for every type), its deadlines, and which folds each event type reaches
    (filled as types come). Streams whose names match the same registry prefixes share it."""

    __slots__ = ("deadlines", "folds", "moves", "reach")

    def __init__(
        self,
        folds: list[tuple[object, FoldSpec[Any]]],
        deadlines: list[tuple[int, object, frozenset[type[Event]]]],
    ) -> None:
        self.folds = folds
        self.deadlines = deadlines
        self.moves: list[frozenset[type[Event]] | None] = [
            getattr(spec, "moves", None) for _, spec in folds
        ]
        self.reach: dict[type[Event], list[int]] = {}

    def reached_by(self, kind: type[Event]) -> list[int]:
        """The folds (by index) that events of ``kind`` move."""
        found = self.reach.get(kind)
        if found is None:
            found = self.reach[kind] = [
                index for index, moves in enumerate(self.moves) if moves is None or kind in moves
            ]
        return found


#: a stream's folders (in its plan's order), its plan, and its deadlines
_Walk = tuple[
    list[Folder[Any]], _Plan | None, list[tuple[int, Folder[Any], frozenset[type[Event]]]]
]
#: the walk of a stream that is not verified
_SKIP: _Walk = ([], None, [])


class Verification:
    """The verification of one walk over the log; feed it with :meth:`add` in log order.

    ``verify`` says which streams are checked (default: every one); events of the other
    streams still move time and carry the config (feed the ``runtime`` stream's
    ``runtime:started`` / ``runtime:stopped`` when verifying one stream, and the
    ``supervisor:restarted`` of its actor; for the ``deadletter`` stream, the providers'
    ``provider:recovered``, which its drains follow).
    """

    def __init__(
        self,
        registry: Registry,
        *,
        defaults: Mapping[str, Any],
        grace_ms: int = DEFAULT_GRACE_MS,
        verify: Callable[[str], bool] | None = None,
    ) -> None:
        self._registry = registry
        self._defaults = defaults
        #: the providers with a ``provider:recovered`` so far (see :class:`Knobs`)
        self._recovered: set[str] = set()
        self._knobs = Knobs(None, defaults, self._recovered)
        self._grace_ms = grace_ms
        self._verify = verify or (lambda stream: True)
        self._by_tag: dict[str, list[Verifier[Any]]] = {}
        for verifier in registry.verifiers:
            self._by_tag.setdefault(verifier.tag, []).append(verifier)
        self._folders: dict[str, dict[object, Folder[Any]]] = {}
        self._plans: dict[str, _Plan] = {}
        self._shared_plans: dict[tuple[str, ...], _Plan] = {}
        self._prefixes = sorted(
            {v.streams for v in registry.verifiers} | {d.streams for d in registry.deadlines}
        )
        self._walks: dict[str, _Walk] = {}
        self._decision_kinds: set[type[Event]] = set()
        self._other_kinds: set[type[Event]] = set()
        self._deadlines = DeadlineWatch(registry.deadlines, grace_ms)
        self._findings: list[Finding] = []
        #: the missed deadlines found, until their decision may still take them back
        self._misses: dict[tuple[str, int], Finding] = {}
        self._checked: dict[str, int] = {}
        self._unchecked: dict[str, int] = {}
        self._events = 0
        self._last: RecordedEvent | None = None

    # -- feeding -------------------------------------------------------------------------------

    def add(self, record: RecordedEvent) -> None:
        """One more recorded event, in log order."""
        self._events += 1
        self._last = record
        ts = record.ts
        event = record.event
        kind = type(event)
        for missed in self._deadlines.before(record, restart=kind is RuntimeStarted):
            self._missed(missed)
        for unwatched in self._deadlines.unwatched():
            self._unwatched(unwatched)
        if self._misses:
            for key in self._deadlines.made_in_time(record):
                self._findings.remove(self._misses.pop(key))
        if kind is RuntimeStarted:
            assert isinstance(event, RuntimeStarted)
            self._knobs = Knobs(event.config, self._defaults, self._recovered)
            self._restarted(record)
        elif kind is ProviderRecovered:
            assert isinstance(event, ProviderRecovered)
            self._recovered.add(event.provider)
        elif kind is SupervisorRestarted:
            assert isinstance(event, SupervisorRestarted)
            for key in self._deadlines.actor_restarted(event.actor, ts):
                finding = self._misses.pop(key, None)
                if finding is not None:
                    self._findings.remove(finding)
        walk = self._walks.get(record.stream)
        if walk is None:
            if self._verify(record.stream):
                walk = self._walk(record.stream)
            else:
                walk = self._walks[record.stream] = _SKIP
        if walk is _SKIP:
            return
        if kind is UnknownEvent:
            assert isinstance(event, UnknownEvent)
            self._undecodable_event(record, event)  # reported once, never re-derived
        elif kind in self._decision_kinds:
            self._decision(record)
        elif kind not in self._other_kinds:
            if record.type in self._registry.decisions:
                self._decision_kinds.add(kind)
                self._decision(record)
            else:
                self._other_kinds.add(kind)
        self._fold(record, walk)

    def _decision(self, record: RecordedEvent) -> None:
        tag = record.type
        if tag not in self._registry.decisions:
            return  # an unknown event
        verifiers = self._by_tag.get(tag)
        if verifiers is None or not self._check(record, verifiers):
            # no verifier, or none that applies (a retry recorded before its inputs were)
            self._unchecked[tag] = self._unchecked.get(tag, 0) + 1

    def undecodable(
        self, position: int, reason: str, stream: str = "", *, through: int = 0
    ) -> None:
        """A record the reader could not decode (a ``CorruptRecordError``): reported.
        ``through``: the last position of a run of them starting at ``position`` (one
        finding for the run)."""
        where = f"the record at position {position}"
        if through > position:
            where = f"the {through - position + 1} records at positions {position}..{through}"
        self._findings.append(
            Finding(
                kind="undecodable",
                stream=stream,
                position=position,
                version=0,
                tag="",
                ts=self._last.ts if self._last is not None else 0.0,
                message=f"{where} cannot be decoded: {reason}",
            )
        )

    @property
    def suspected(self) -> bool:
        """Whether a deadline is suspected missed at the last record, its miss not yet
        confirmed by time moving on (see :meth:`past_the_end`)."""
        return self._deadlines.suspected()

    def past_the_end(self, record: RecordedEvent) -> None:
        """A record after the end of the walk, when the walk stops short of the log's end
        (``replay --until``): it is neither checked nor counted, but it settles a deadline
        suspected missed at the last record as the whole log would. The decision coming at
        its proof's moment (a clock that jumped), or its run ending then, was not late;
        a later record confirms the miss. Feed the records after the end, in log order,
        while :attr:`suspected` holds."""
        for missed in self._deadlines.past_the_end(record):
            self._missed(missed)
        walk = self._walks.get(record.stream)
        if walk is not None and walk is not _SKIP:
            self._fold(record, walk)

    def report(self) -> VerifyReport:
        """The findings so far (suspected misses the log's end leaves unconfirmed count)."""
        for missed in self._deadlines.end():
            self._missed(missed)
        for unwatched in self._deadlines.unwatched():
            self._unwatched(unwatched)
        last = self._last
        return VerifyReport(
            events=self._events,
            streams=len(self._folders),
            last_position=last.position if last is not None else 0,
            last_ts=last.ts if last is not None else None,
            checked=dict(sorted(self._checked.items())),
            unchecked=dict(sorted(self._unchecked.items())),
            findings=tuple(sorted(self._findings, key=lambda f: (f.position, f.kind))),
            grace_ms=self._grace_ms,
        )

    # -- folds -----------------------------------------------------------------------------------

    def _plan(self, stream: str) -> _Plan:
        plan = self._plans.get(stream)
        if plan is None:
            matched = tuple(prefix for prefix in self._prefixes if stream.startswith(prefix))
            plan = self._shared_plans.get(matched)
        if plan is None:
            folds: dict[object, FoldSpec[Any]] = {}
            for verifier in self._registry.verifiers:
                if stream.startswith(verifier.streams):
                    folds.setdefault(fold_key(verifier.fold), verifier.fold)
            deadlines: list[tuple[int, object, frozenset[type[Event]]]] = []
            for index, deadline in enumerate(self._registry.deadlines):
                if stream.startswith(deadline.streams):
                    key = fold_key(deadline.fold)
                    folds.setdefault(key, deadline.fold)
                    deadlines.append((index, key, deadline.moves))
            plan = self._shared_plans[matched] = _Plan(list(folds.items()), deadlines)
        self._plans[stream] = plan
        return plan

    def _folders_of(self, stream: str) -> dict[object, Folder[Any]]:
        folders = self._folders.get(stream)
        if folders is None:
            folders = self._folders[stream] = {}
            for key, spec in self._plan(stream).folds:
                aggregate = aggregate_of(spec, self._knobs)
                folders[key] = aggregate.folder(aggregate.initial(stream))
        return folders

    def _state(self, stream: str, spec: FoldSpec[Any]) -> Any:
        return self._folders_of(stream)[fold_key(spec)].state()

    def _walk(self, stream: str) -> _Walk:
        """The stream's folders and deadlines, made at its first event (or skipped)."""
        folders = self._folders_of(stream)
        plan = self._plan(stream)
        deadlines = [(i, folders[key], moves) for i, key, moves in plan.deadlines]
        walk = self._walks[stream] = ([folders[key] for key, _ in plan.folds], plan, deadlines)
        return walk

    def _fold(self, record: RecordedEvent, walk: _Walk) -> None:
        folders, plan, deadlines = walk
        kind = type(record.event)
        assert plan is not None
        for index in plan.reached_by(kind):
            folders[index].add(record)
        for index, folder, moves in deadlines:
            if not moves or kind in moves:
                due = self._due(index, folder)
                self._deadlines.moved(record.stream, index, due, record, self._knobs)

    # -- decisions -------------------------------------------------------------------------------

    def _check(self, record: RecordedEvent, verifiers: list[Verifier[Any]]) -> bool:
        """Run the first verifier that applies to ``record``; False when none does."""
        found = record.event
        for verifier in verifiers:
            if not record.stream.startswith(verifier.streams):
                continue
            if verifier.when is not None and not verifier.when(found):
                continue
            tag = verifier.tag
            self._checked[tag] = self._checked.get(tag, 0) + 1
            state = self._state(record.stream, verifier.fold)
            try:
                given = list(verifier.decide(state, record, self._knobs))
            except StalwartError as exc:
                self._mismatch(record, [], f"replay could not re-run the decision: {exc}")
                return True
            except _OUT_OF_RANGE as exc:
                self._mismatch(record, [], _out_of_range(exc))
                return True
            if any(_same(e, found, verifier.ignore) for e in given):
                return True
            why = self._why(verifier, state, record)
            if given:
                words = "the state just before it decides differently"
            else:
                words = "the state just before it decides nothing at this time"
            self._mismatch(record, given, f"{words}{': ' + why if why else ''}")
            return True
        return False

    def _why(self, verifier: Verifier[Any], state: Any, record: RecordedEvent) -> str:
        """The verifier's words for a mismatch; none when they cannot be worked out (a
        time or number in the log out of any range: the finding stands without them), or
        the knob that keeps them from it."""
        if verifier.why is None:
            return ""
        try:
            return verifier.why(state, record, self._knobs)
        except _OUT_OF_RANGE:
            return ""
        except StalwartError as exc:
            # a knob only the words read (one the decision did not need) is no number
            return f"why cannot be worked out: {exc}"

    def _mismatch(self, record: RecordedEvent, given: list[Event], message: str) -> None:
        self._findings.append(
            Finding(
                kind="mismatch",
                stream=record.stream,
                position=record.position,
                version=record.version,
                tag=record.type,
                ts=record.ts,
                message=message,
                expected=[_builtins(e) for e in given],
                found=_builtins(record.event),
            )
        )

    def _undecodable_event(self, record: RecordedEvent, event: UnknownEvent) -> None:
        self._findings.append(
            Finding(
                kind="undecodable",
                stream=record.stream,
                position=record.position,
                version=record.version,
                tag=event.tag,
                ts=record.ts,
                message=(
                    f"a {event.tag!r} event (schema {event.schema}) this version does not know: "
                    "kept as raw bytes, its decisions cannot be checked"
                ),
            )
        )

    # -- deadlines -------------------------------------------------------------------------------

    def _due(self, index: int, folder: Folder[Any]) -> float | DueUnknown | None:
        deadline = self._registry.deadlines[index]
        state = folder.state()
        try:
            due = deadline.due(state, self._knobs)
        except UnusableKnob as exc:
            # something is pending (a due reads its knobs only then), at no time it can say
            return DueUnknown(str(exc), _earliest(deadline, state))
        except StalwartError:
            return None  # a knob nobody recorded: the decision's own check says so
        if due is not None and not math.isfinite(due):
            # a time that is not one (an infinite or NaN float in a record): no deadline
            # falls then; the decision that recorded it is checked, and says so
            return None
        return due

    def _restarted(self, record: RecordedEvent) -> None:
        """A new process (and config): the owed deadlines again, at the new config (only
        those: one with nothing pending has nothing pending under any config)."""
        dues = []
        for stream, index in self._deadlines.owed():
            key = next(key for i, key, _ in self._plan(stream).deadlines if i == index)
            dues.append(((stream, index), self._due(index, self._folders[stream][key])))
        self._deadlines.restarted(record, dues, self._knobs)

    def _unwatched(self, unwatched: Unwatched) -> None:
        deadline = self._registry.deadlines[unwatched.index]
        if unwatched.due is None:
            self._findings.append(_unknown_finding(unwatched, deadline.name, deadline.decision))
            return
        finding = _deadline_finding(
            "unwatched",
            unwatched.stream,
            unwatched.due,
            unwatched.proof,
            deadline.decision,
            f"the {deadline.name} was due at {moment(unwatched.due)}, but whether a "
            f"{deadline.decision} came in time cannot be said: {unwatched.reason}; ",
        )
        self._findings.append(finding)

    def _missed(self, missed: Missed) -> None:
        deadline = self._registry.deadlines[missed.index]
        finding = self._misses[(missed.stream, missed.index)] = _deadline_finding(
            "missed",
            missed.stream,
            missed.due,
            missed.proof,
            deadline.decision,
            f"the {deadline.name} was due at {moment(missed.due)} but no {deadline.decision} "
            f"followed: ",
        )
        self._findings.append(finding)


def _earliest(deadline: Deadline[Any], state: Any) -> float | None:
    """The soonest ``deadline`` can fall due on ``state`` under any setting; None when its
    registration does not say, or says no finite time."""
    if deadline.earliest is None:
        return None
    try:
        earliest = deadline.earliest(state)
    except _OUT_OF_RANGE:
        return None
    return earliest if earliest is not None and math.isfinite(earliest) else None


def verify(
    records: Iterable[RecordedEvent],
    registry: Registry,
    *,
    defaults: Mapping[str, Any],
    grace_ms: int = DEFAULT_GRACE_MS,
    verify: Callable[[str], bool] | None = None,
) -> VerifyReport:
    """Verify ``records`` (in log order) at once: :class:`Verification` fed with each."""
    verification = Verification(registry, defaults=defaults, grace_ms=grace_ms, verify=verify)
    add = verification.add
    for record in records:
        add(record)
    return verification.report()


def _deadline_finding(
    kind: FindingKind, stream: str, due: float, proof: RecordedEvent, decision: str, said: str
) -> Finding:
    """A finding on a deadline: ``said`` and then the record past it (``proof``), how far
    past, and where."""
    late_ms = round((proof.ts - due) * 1000)
    where = "" if proof.stream == stream else f" in {proof.stream}"
    return Finding(
        kind=kind,
        stream=stream,
        position=proof.position,
        version=proof.version if proof.stream == stream else 0,
        tag=decision,
        ts=proof.ts,
        message=f"{said}{proof.type} at position {proof.position}{where} is {late_ms} ms past it",
        expected=[{"type": decision, "due": due}],
    )


def _unknown_finding(unwatched: Unwatched, name: str, decision: str) -> Finding:
    """A deadline pending whose own setting is no number: no time is known to pass, so
    the finding is at the record that left it pending."""
    proof, stream = unwatched.proof, unwatched.stream
    where = "" if proof.stream == stream else f" in {proof.stream}"
    return Finding(
        kind="unwatched",
        stream=stream,
        position=proof.position,
        version=proof.version if proof.stream == stream else 0,
        tag=decision,
        ts=proof.ts,
        message=(
            f"the {name} of {stream} cannot be watched: {unwatched.reason}, so when its "
            f"{decision} falls due, and whether it came in time, cannot be said; "
            f"{proof.type} at position {proof.position}{where} left it pending"
        ),
        expected=[{"type": decision, "due": None}],
    )
