"""``stalwart replay STREAM --verify`` and ``stalwart replay --all --verify``.

Reads the log (one stream with the ``runtime`` stream's starts and stops, or every
stream in global order), feeds it to :class:`~stalwart.state.Verification` with the
built-in verifiers plus the tool breaker's, and renders what it found. A corrupt record is
reported and skipped, never the end of the walk.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any

import msgspec

from stalwart._text import escaped
from stalwart.config import AgentSettings, Config, ProviderSettings
from stalwart.context.pipeline import PipelineConfig
from stalwart.errors import CorruptRecordError, StoreError
from stalwart.events import (
    Event,
    ProviderRecovered,
    RecordedEvent,
    RuntimeStarted,
    RuntimeStopped,
    SupervisorRestarted,
    ToolBlocked,
    ToolCompleted,
    ToolFailed,
    ToolStarted,
    UnknownEvent,
)
from stalwart.state import (
    VERIFIERS,
    ApplyFolder,
    Knobs,
    Registry,
    Selective,
    Verification,
    Verifier,
)
from stalwart.state import VerifyReport as Report
from stalwart.state._verify_registry import _is_number
from stalwart.store import EventStore, Passed, read_all_passing
from stalwart.tools import ToolBreakerState, apply_tool_breaker, decide_tool_call

from ._render import fmt_ts, to_json

__all__ = ["REGISTRY", "default_knobs", "read_for_verify", "render", "verify_store"]


# -- what is verified ---------------------------------------------------------------------


class _ToolBreakerAggregate:
    """The tool retry breaker's fold of a session, for ``tool:blocked``."""

    name = "verify_tool_breaker"
    version = 1
    state_type = ToolBreakerState

    def initial(self, stream: str) -> ToolBreakerState:
        return ToolBreakerState()

    def apply(self, state: ToolBreakerState, record: RecordedEvent) -> ToolBreakerState:
        return apply_tool_breaker(state, record)

    def folder(self, state: ToolBreakerState) -> ApplyFolder[ToolBreakerState]:
        return ApplyFolder(apply_tool_breaker, state)


def _tool_blocked(state: ToolBreakerState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    found = record.event
    assert isinstance(found, ToolBlocked)
    # the Agent uses decide_tool_call's own thresholds (no knob sets them)
    decided = decide_tool_call(state, found.tool, found.arguments, call_id=found.call_id)
    return [] if decided is None else [decided]


#: The built-in verifiers and the tool breaker's (the tools package sits above state).
REGISTRY: Registry = VERIFIERS.with_(
    Verifier(
        "tool:blocked",
        Selective(_ToolBreakerAggregate(), (ToolStarted, ToolCompleted, ToolFailed, ToolBlocked)),
        _tool_blocked,
        "session:",
    )
)


def _defaults_of(kind: type[msgspec.Struct]) -> dict[str, Any]:
    return {
        f.name: msgspec.to_builtins(f.default)
        for f in msgspec.structs.fields(kind)
        if f.default is not msgspec.NODEFAULT
    }


def default_knobs() -> dict[str, Any]:
    """The defaults under the recorded config: ``Config()``'s, and every provider's and
    agent's field defaults under ``*`` (a provider the recorded config does not name)."""
    record = Config().to_record()
    record["providers"] = {"*": _defaults_of(ProviderSettings)}
    record["agents"] = {"*": _defaults_of(AgentSettings)}
    record["context_engine"]["pipeline"] = _defaults_of(PipelineConfig)
    # the widest health window of any process in the log (set by verify_store): a health
    # fold keeps that much, so a window widened by a later process is still re-derived
    record["verify"] = {"health_horizon_ms": 0}
    return record


def _widest_health_window(store: EventStore, until: int | None) -> int:
    widest = 0
    for item in _runtime(store, "", until):
        if isinstance(item, RecordedEvent) and isinstance(item.event, RuntimeStarted):
            health = item.event.config.get("health")
            window = health.get("window_ms", 0) if isinstance(health, dict) else 0
            if _is_number(window, whole=True):  # as the verifier reads it (600000.0 too)
                widest = max(widest, int(window))
    return widest


# -- reading ------------------------------------------------------------------------------


class Corrupt(msgspec.Struct, frozen=True):
    """A record the store could not decode, where it was (``through``: the last position
    of a run of such records that starts at ``position``; 0 for one record)."""

    position: int
    reason: str
    stream: str = ""
    through: int = 0


Item = RecordedEvent | Corrupt


def _all(store: EventStore, until: int | None) -> Iterator[Item]:
    """The log, each run of records that cannot be read in its place as one
    :class:`Corrupt` (read on after its end, not record by record), and the records the
    streams' rows name past the log's last one (a log cut short) as one more."""
    claimed = _claimed_end(store)  # before the log is read: each of these was in it
    position = 1
    for item in read_all_passing(store, 1, until):
        if isinstance(item, Passed):
            yield Corrupt(item.position, item.error.reason, through=item.through)
            position = item.through + 1
        else:
            yield item
            position = item.position + 1
    end = claimed if until is None else min(claimed, until)
    if end >= position:
        cut = f"the log ends at position {position - 1}; the streams name records up to {claimed}"
        yield Corrupt(position, cut, through=end)


def _claimed_end(store: EventStore) -> int:
    """The newest position a stream's row says its last record is at (0 when a row
    cannot be read: ``stalwart db check`` names it)."""
    try:
        return max((info.last_position for info in store.streams()), default=0)
    except StoreError:
        return 0


def _stream(store: EventStore, stream: str, until: int | None) -> Iterator[Item]:
    version, position = 1, 0
    while True:
        try:
            for record in store.read_stream(stream, version):
                if until is not None and record.position > until:
                    return
                version, position = record.version + 1, record.position
                yield record
            return
        except CorruptRecordError as exc:
            at = exc.position if exc.position > 0 else position + 1
            if until is not None and at > until:
                return
            yield Corrupt(at, exc.reason, stream)
            version += 1  # the corrupt record held this version


#: what verifying one stream reads of the ``runtime`` stream, and of the providers' (for
#: the ``deadletter`` stream): one of these a newer version wrote in a shape this one
#: cannot read is reported (a start whose config is not read: the verdict rests on it)
_RUNTIME_TAGS = frozenset({"runtime:started", "runtime:stopped", "supervisor:restarted"})
_RECOVERED = frozenset({"provider:recovered"})


def _unknown(event: Event, tags: frozenset[str]) -> bool:
    return isinstance(event, UnknownEvent) and event.tag in tags


def _not_known(record: RecordedEvent) -> Corrupt:
    event = record.event
    assert isinstance(event, UnknownEvent)
    reason = f"a {event.tag!r} event (schema {event.schema}) this version does not know"
    return Corrupt(record.position, reason, record.stream)


def _runtime(store: EventStore, stream: str, until: int | None) -> Iterator[Item]:
    """The ``runtime`` stream's process starts and stops, and the restarts of ``stream``'s
    actor (they drop the timers it kept); and each of its records that cannot be read
    (it may have been a start with its config: the verdict rests on it)."""
    for item in _stream(store, "runtime", until):
        if not isinstance(item, RecordedEvent):
            yield item
            continue
        event = item.event
        if isinstance(event, RuntimeStarted | RuntimeStopped) or (
            isinstance(event, SupervisorRestarted) and event.actor == stream
        ):
            yield item
        elif _unknown(event, _RUNTIME_TAGS):
            yield _not_known(item)


def _recoveries(store: EventStore, until: int | None) -> Iterator[Item]:
    """Every provider's ``provider:recovered``, in log order (a dead-letter drain follows
    one: verifying the ``deadletter`` stream checks that it did), and each record of a
    provider's stream that cannot be read (it may have been one)."""
    providers = [s.stream for s in store.streams() if s.stream.startswith("provider:")]
    yield from heapq.merge(
        *(_recovered(store, name, until) for name in providers), key=lambda item: item.position
    )


def _recovered(store: EventStore, provider: str, until: int | None) -> Iterator[Item]:
    for item in _stream(store, provider, until):
        if not isinstance(item, RecordedEvent) or isinstance(item.event, ProviderRecovered):
            yield item
        elif _unknown(item.event, _RECOVERED):
            yield _not_known(item)


def read_for_verify(store: EventStore, stream: str | None, until: int | None) -> Iterator[Item]:
    """Every record (``stream`` None), or ``stream``'s merged with the ``runtime`` stream's
    starts and stops (the config in force, the processes' lives) and its actor's restarts,
    in log order."""
    if stream is None:
        return _all(store, until)
    if stream == "runtime":
        return _stream(store, stream, until)
    beside = [_runtime(store, stream, until)]
    if stream == "deadletter":
        beside.append(_recoveries(store, until))
    merged: Iterator[Item] = heapq.merge(
        _stream(store, stream, until), *beside, key=lambda item: item.position
    )
    return merged


def verify_store(
    store: EventStore,
    stream: str | None,
    *,
    until: int | None = None,
    grace_ms: int = 5_000,
    registry: Registry = REGISTRY,
) -> Report:
    """Verify ``stream`` (None: every stream) up to position ``until``."""
    if stream is not None and store.stream_version(stream) == 0:
        raise StoreError(f"no stream named {stream!r} in {store.location}")
    defaults = default_knobs()
    defaults["verify"]["health_horizon_ms"] = _widest_health_window(store, until)
    verification = Verification(
        registry,
        defaults=defaults,
        grace_ms=grace_ms,
        verify=None if stream is None else (lambda name: name == stream),
    )
    # read past --until only to settle what it cut in two: a deadline suspected missed at
    # its last record whose decision came at that same moment (the whole log forgives it)
    for item in read_for_verify(store, stream, None):
        if until is not None and item.position > until:
            if not verification.suspected:
                break
            if isinstance(item, RecordedEvent):
                verification.past_the_end(item)
        elif isinstance(item, Corrupt):
            through = item.through if until is None else min(item.through, until)
            verification.undecodable(item.position, item.reason, item.stream, through=through)
        else:
            verification.add(item)
    return verification.report()


# -- the report ---------------------------------------------------------------------------

_WORDS = {
    "mismatch": ("decision that does not follow", "decisions that do not follow"),
    "missed": ("missed deadline", "missed deadlines"),
    "unwatched": ("deadline not watched", "deadlines not watched"),
    "undecodable": ("undecodable record", "undecodable records"),
}
_LABEL = {
    "mismatch": "DOES NOT FOLLOW",
    "missed": "MISSED DEADLINE",
    "unwatched": "NOT WATCHED",
    "undecodable": "UNDECODABLE",
}


def _counts(table: dict[str, int]) -> str:
    return ", ".join(f"{tag} x{count}" for tag, count in table.items()) or "none"


def render(report: Report, what: str, as_json: bool) -> list[str]:
    """The report as lines of text, or one JSON object."""
    if as_json:
        data = msgspec.to_builtins(report)
        return [to_json({"target": what, "clean": report.clean, **data})]
    checked = sum(report.checked.values())
    last = f", up to position {report.last_position}" if report.last_position else ""
    lines = [
        f"verify {escaped(what)}: {report.events} events{last}, {checked} decisions re-derived",
        f"  re-derived: {_counts(report.checked)}",
    ]
    if report.unchecked:
        lines.append(f"  no verifier (not checked): {_counts(report.unchecked)}")
    for finding in report.findings:
        # a stream id, or an unknown event's tag, may hold any character: one line a finding
        stream = escaped(finding.stream)
        where = f"{stream} v{finding.version}" if finding.version else stream
        lines.append("")
        lines.append(
            f"{_LABEL[finding.kind]}  position {finding.position}  {where or '-'}  "
            f"{escaped(finding.tag) or '-'}  {fmt_ts(finding.ts) if finding.ts else ''}".rstrip()
        )
        lines.append(f"  {escaped(finding.message)}")
        if finding.kind == "mismatch":
            # JSON leaves C1 controls and bidirectional overrides as they are
            shown = escaped(to_json(finding.expected[0])) if finding.expected else "nothing"
            lines.append(f"  expected: {shown}")
            lines.append(f"  found:    {escaped(to_json(finding.found))}")
    lines.append("")
    if report.clean:
        lines.append("clean: every decision follows from the state just before it")
    else:
        counts = [sum(1 for f in report.findings if f.kind == kind) for kind in _WORDS]
        summary = ", ".join(
            f"{n} {words[0] if n == 1 else words[1]}"
            for n, words in zip(counts, _WORDS.values(), strict=True)
            if n
        )
        lines.append(f"NOT CLEAN: {summary}")
    return lines
