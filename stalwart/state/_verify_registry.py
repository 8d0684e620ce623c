"""What replay verification runs: verifiers, deadlines, the registry, the config in force.

Registering a verifier
----------------------
A :class:`Registry` is an immutable set of :class:`Verifier` and :class:`Deadline`; the
built-in one is :data:`~stalwart.state.VERIFIERS`. Adding a decision takes a few lines,
in ``stalwart/state/_verify_rules.py`` (appended to ``BUILTIN``) or wherever its policy
lives, with ``VERIFIERS.with_(...)``::

    def _leased(state: ActivationsState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
        assert isinstance(record.event, ActivationLeased | LeaseExpired)
        policy = ActivationPolicy(lease_ttl_ms=knobs.get_int("activations.lease_ttl_ms"), ...)
        # the worker's name is an input the event records; the rest is the fold and the ts
        return decide_lease(state, record.event.owner, record.ts, policy)

    VERIFIERS.with_(
        Verifier(
            tag="activation:leased",  # the decision event it checks
            fold=ACTIVATIONS,  # the Aggregate whose state (of the event's stream) decide reads
            decide=_leased,  # what the pure decide gives just before the event, at its ts
            streams="session:",  # only streams with this prefix ("" for any)
            ignore=(),  # fields not compared (ids made at decision time, say)
        ),
        Verifier("lease:expired", ACTIVATIONS, _leased, "session:"),  # a takeover's first
        Deadline(  # only where an actor is bound to decide by then (a sweep every poll_ms)
            name="lease expiry",
            decision="lease:expired",
            fold=ACTIVATIONS,
            due=lambda state, knobs: state.lease.expires_at if state.lease else None,
            streams="session:",
            slack_ms=lambda knobs: knobs.get_int("activations.poll_ms"),
            survives_restart=True,  # the next worker owes it, whoever held the lease
            # (survives_actor_restart=True: a restarted Agent re-arms it; one that survives
            # a new process survives the restart of an actor too)
            moves=frozenset({ActivationLeased, LeaseRenewed, LeaseExpired, ActivationAcked}),
        ),
    )

``fold`` is an :class:`~stalwart.state.Aggregate` (folds are shared by ``name``), or a
function of the config in force giving one (when its shape depends on a knob). A
``decide`` that raises a :class:`~stalwart.errors.StalwartError` is reported as a
mismatch; an optional ``why(state, record, knobs)`` explains a mismatch in words. A
deadline's ``due`` reads its knobs only once something is pending: one the config records
as no number (:class:`UnusableKnob`) then makes that deadline unwatched, once per stream,
where a record came later than its ``earliest`` (the soonest it could fall due under any
setting) plus its slack and the grace while it was pending.
A verifier's ``when(event)`` narrows which events of its tag it checks. A deadline's
``moves`` names the event types that can change when it falls due, so it is recomputed
only on those (and on a new config); :class:`Selective` folds only the event types that
move a fold, for speed over busy streams. Knobs are read by dotted path
(:class:`Knobs`); a ``*`` key in the defaults stands for any name
(``providers.*.breaker_failure_threshold``). An aggregate with a ``moves`` attribute (a
frozenset of event types; :class:`Selective` has one) is handed only events of those
types, so a fold that few events move costs nothing on the others.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

from stalwart.errors import ConfigError
from stalwart.events import Event, RecordedEvent

from ._aggregate import Aggregate, Folder

S = TypeVar("S")
N = TypeVar("N", int, float)


class UnusableKnob(ConfigError):
    """A knob the config in force records, but as something its reader cannot use (text
    where a number belongs, say): unlike one nobody recorded nor defaulted (a plain
    :class:`~stalwart.errors.ConfigError`), it is the log's, and verification says so."""


class Knobs:
    """The config in force: the recorded config (a ``Config.to_record()``) over defaults.

    ``recovered`` is what the log said of other streams so far that a decision may rest
    on: the providers with a ``provider:recovered`` before the record being checked
    (a drain of the dead-letter queue follows one). The verification keeps it up to date;
    None when it is not fed those streams (nothing is checked against it then)."""

    __slots__ = ("_found", "_layers", "recovered")

    def __init__(
        self,
        recorded: Mapping[str, Any] | None,
        defaults: Mapping[str, Any],
        recovered: AbstractSet[str] | None = None,
    ) -> None:
        self._layers = (recorded or {}, defaults)
        self._found: dict[str | tuple[str, ...], Any] = {}
        self.recovered = recovered

    def get(self, path: str | tuple[str, ...]) -> Any:
        """The value at ``path`` (``"subagents.per_step_timeout_ms"``, or its parts when a
        part is a name that may hold a dot: ``("agents", "support.v2", "max_retries")``);
        ConfigError if none."""
        found = self._found.get(path, _MISSING)
        if found is _MISSING:
            found = self._found[path] = self._look(path)
        return found

    def _look(self, path: str | tuple[str, ...]) -> Any:
        parts = path.split(".") if isinstance(path, str) else list(path)
        for layer in self._layers:
            found = _lookup(layer, parts)
            if found is not _MISSING:
                return found
        name = ".".join(parts)
        raise ConfigError(
            f"the config in force has no {name!r} and there is no default for it", key=name
        )

    def has(self, path: str | tuple[str, ...]) -> bool:
        """Whether the config in force or the defaults hold ``path``."""
        parts = path.split(".") if isinstance(path, str) else list(path)
        return any(_lookup(layer, parts) is not _MISSING for layer in self._layers)

    def get_int(self, path: str | tuple[str, ...]) -> int:
        return self._number(path, int)

    def get_float(self, path: str | tuple[str, ...]) -> float:
        return self._number(path, float)

    def get_text(self, path: str | tuple[str, ...]) -> str:
        """The text at ``path``; ConfigError when it is none (a config record written by
        hand or by another program)."""
        value = self.get(path)
        if isinstance(value, str):
            return value
        raise self._not(path, value, "text")

    def get_names(self, path: str | tuple[str, ...]) -> tuple[str, ...]:
        """The list of names (texts) at ``path``; ConfigError when it is none: text is not
        taken for a list of its characters, nor a number for anything."""
        value = self.get(path)
        if isinstance(value, list | tuple) and all(isinstance(name, str) for name in value):
            return tuple(value)
        raise self._not(path, value, "a list of names")

    @staticmethod
    def _not(path: str | tuple[str, ...], value: Any, what: str) -> UnusableKnob:
        name = path if isinstance(path, str) else ".".join(path)
        return UnusableKnob(
            f"the config in force has {name!r} = {reprlib.repr(value)}, not {what}", key=name
        )

    def _number(self, path: str | tuple[str, ...], kind: type[N]) -> N:
        """The value at ``path`` as a number; ConfigError when it is none (a config record
        written by hand or by another program: a decision that reads it cannot be re-run).

        Only what a config records as a number is one: text (``"60000"``), a boolean, a
        float that is not finite, or a fraction where a whole number belongs is not taken
        for one (``int()`` would read each, and re-run the decision on a number the
        config never held)."""
        value = self.get(path)
        if _is_number(value, whole=kind is int):
            return kind(value)
        raise self._not(path, value, "a number")


def _is_number(value: Any, *, whole: bool) -> bool:
    """Whether ``value`` is a number as a config records one (a whole one: an int, or a
    float with no fraction)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(value, int):
        return True
    return value.is_integer() if whole else math.isfinite(value)


_MISSING = object()


def _lookup(data: Any, parts: list[str]) -> Any:
    for part in parts:
        if not isinstance(data, Mapping):
            return _MISSING
        data = data[part] if part in data else data.get("*", _MISSING)
        if data is _MISSING:
            return _MISSING
    return data


Decide = Callable[[S, RecordedEvent, Knobs], Sequence[Event]]
FoldSpec = Aggregate[S] | Callable[[Knobs], Aggregate[S]]


@dataclass(frozen=True)
class Verifier(Generic[S]):
    """Re-derives one kind of decision event (see the module docstring)."""

    tag: str
    fold: FoldSpec[S]
    decide: Decide[S]
    streams: str = ""
    ignore: tuple[str, ...] = ()
    why: Callable[[S, RecordedEvent, Knobs], str] | None = None
    #: only events this accepts are checked (None: every event with the tag)
    when: Callable[[Event], bool] | None = None


@dataclass(frozen=True)
class Deadline(Generic[S]):
    """A decision that must come by a time the state says (see the module docstring)."""

    name: str
    decision: str
    fold: FoldSpec[S]
    due: Callable[[S, Knobs], float | None]
    streams: str = ""
    slack_ms: Callable[[Knobs], int] = lambda knobs: 0
    survives_restart: bool = False
    #: kept when the supervisor restarts the actor owning the stream (a
    #: ``supervisor:restarted`` whose ``actor`` is the stream): the new actor re-arms it
    survives_actor_restart: bool = False
    #: the event types that can move ``due`` (empty: any event); a new config moves it too
    moves: frozenset[type[Event]] = frozenset()
    #: the earliest its decision can fall due, whatever the settings ``due`` reads (None:
    #: no floor, or no such function): what was pending on it while a setting was no
    #: number, and ended before this plus the slack and the grace, was late under none
    earliest: Callable[[S], float | None] | None = None


@dataclass(frozen=True)
class Registry:
    """The verifiers and deadlines replay checks, and the tags that are decisions."""

    verifiers: tuple[Verifier[Any], ...] = ()
    deadlines: tuple[Deadline[Any], ...] = ()
    decisions: frozenset[str] = field(default_factory=frozenset)

    def with_(self, *items: Verifier[Any] | Deadline[Any]) -> Registry:
        """This registry plus ``items`` (their decision tags count as decisions too)."""
        verifiers = tuple(i for i in items if isinstance(i, Verifier))
        deadlines = tuple(i for i in items if isinstance(i, Deadline))
        tags = {v.tag for v in verifiers} | {d.decision for d in deadlines}
        return Registry(
            verifiers=(*self.verifiers, *verifiers),
            deadlines=(*self.deadlines, *deadlines),
            decisions=self.decisions | tags,
        )


def moment(ts: float) -> str:
    """A log time as replay reports say it: UTC with milliseconds (``...T14:03:05.123Z``);
    a time no calendar date can show (a deadline a knob of thousands of years sets, a
    number that is not finite) as the number itself."""
    try:
        stamp = datetime.fromtimestamp(ts, tz=UTC)
    except (ValueError, OverflowError, OSError):
        return f"{ts}"
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"


def fold_key(spec: FoldSpec[Any]) -> object:
    name = getattr(spec, "name", None)
    return ("aggregate", name) if isinstance(name, str) else spec


def aggregate_of(spec: FoldSpec[S], knobs: Knobs) -> Aggregate[S]:
    """The aggregate itself, or the one the config in force gives."""
    if hasattr(spec, "initial"):
        return spec  # type: ignore[return-value]
    return spec(knobs)


class Selective(Generic[S]):
    """``aggregate`` folding only events of ``types`` (and ignoring the rest entirely, so a
    state field counting every event, like a ``version``, is not kept): for a fold that
    replay verification runs over every stream of a prefix but that few events move."""

    def __init__(self, aggregate: Aggregate[S], types: Iterable[type[Event]]) -> None:
        self.aggregate = aggregate
        self.types = self.moves = frozenset(types)
        self.name = f"{aggregate.name}:selective"
        self.version = aggregate.version
        self.state_type = aggregate.state_type

    def initial(self, stream: str) -> S:
        return self.aggregate.initial(stream)

    def apply(self, state: S, record: RecordedEvent) -> S:
        if type(record.event) in self.types:
            return self.aggregate.apply(state, record)
        return state

    def folder(self, state: S) -> _SelectiveFolder[S]:
        return _SelectiveFolder(self.aggregate.folder(state), self.types)


class _SelectiveFolder(Generic[S]):
    __slots__ = ("_folder", "_types")

    def __init__(self, folder: Folder[S], types: frozenset[type[Event]]) -> None:
        self._folder = folder
        self._types = types

    def add(self, record: RecordedEvent) -> None:
        if type(record.event) in self._types:
            self._folder.add(record)

    def state(self) -> S:
        return self._folder.state()
