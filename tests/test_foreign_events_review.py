"""Review: logs written by other stalwart versions, and bad input, across every reader.

A newer stalwart (or a plugin this process does not load) writes events whose tag this
version does not know, and known tags at a schema newer than this version's (one that
only added fields still decodes; one that no longer fits is kept as ``UnknownEvent``). An
older one wrote payloads that need an upcaster. docs/events.md promises such a record is
"never dropped and never a crash", that upcasters turn old payloads into the current
shape, and docs/cli.md that a CLI error is one line on stderr with exit 1. Each record
here is written for real, through a ``Codec`` that knows the other version's classes, into
a real LMDB directory (or the PostgreSQL fixture), and every reader is run over it: a
restarted runtime, the context engine, every fold and its snapshots, every CLI read
command, and the config loader.

Tests marked ``# Was:`` fail on the current code; the others pin behaviour that holds.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Literal

import anyio
import msgspec
import psycopg
import pytest
import structlog.testing
from click.testing import CliRunner
from psycopg import sql

from stalwart import store as store_module
from stalwart.actors import ABANDONED_TEXT, LEDGER_STREAM, RunReport
from stalwart.channels import MemoryChannel
from stalwart.cli import cli
from stalwart.clock import FakeClock
from stalwart.config import load_config, parse_config
from stalwart.errors import ConfigError
from stalwart.events import (
    Codec,
    ContextDagDegraded,
    Event,
    MessageAppended,
    RecordedEvent,
    RuntimeStopped,
    SessionCreated,
    SubagentSpawned,
    TurnCompleted,
    UnknownEvent,
)
from stalwart.runtime import Runtime
from stalwart.state import (
    ACTIVATIONS,
    BREAKER,
    CONTEXT_DAG,
    CONTEXT_PIPELINE,
    DEADLETTER,
    DRAFTS,
    FAILED_CALLS,
    HEALTH,
    NOTICES,
    PAUSES,
    RECENT_MESSAGES,
    RUN,
    SESSION,
    SUMMARIZER_LEDGER,
    SUMMARY,
    fold,
)
from stalwart.store import EventStore, load_state
from stalwart.store._postgres_connect import PostgresUrl
from stalwart.testing import Answer, FakeProvider
from tests._old_events import CompactedV1
from tests._runtime_support import GUARD, delivered, has, log_until, runtime_config

# -- what other versions wrote ----------------------------------------------------------


class Mystery(Event, frozen=True, tag="future:mystery"):
    """An event of a newer stalwart (or a plugin): a tag this version does not know."""

    clue: str
    depth: int = 0


class TurnStartedV9(Event, frozen=True, tag="turn:started"):
    """``turn:started`` as a newer stalwart writes it: a field's type changed (schema 9),
    so this version cannot read it and must keep it as an UnknownEvent."""

    turn_id: int
    schema_version = 9


class RuntimeStoppedV4(Event, frozen=True, tag="runtime:stopped"):
    """``runtime:stopped`` at a newer schema that only added a field: it still fits."""

    reason: str = "shutdown"
    drained: int = 0
    schema_version = 4


class SummaryV2(Event, frozen=True, tag="context:summary_created"):
    """``context:summary_created`` as a newer stalwart writes it after widening the
    ``fallback`` Literal (docs/events.md rule 3: a widening bumps ``schema_version``, so
    an older stalwart shows a record holding the new value as unknown). A record without
    the new value still fits this version's class and decodes as usual."""

    summary_id: str
    depth: int
    covers: tuple[str, ...]
    descendant_count: int
    tokens: int = 0
    fallback: Literal["emergency-truncation", "hard-cut"] | None = None
    body: str = ""
    first_seq: int = 0
    last_seq: int = 0
    earliest: float = 0.0
    latest: float = 0.0
    topics: tuple[str, ...] = ()
    input_tokens: int = 0
    output_tokens: int = 0
    tenant: str | None = None
    schema_version = 2


NEWER = Codec(extra_types=[Mystery, TurnStartedV9, RuntimeStoppedV4])

#: every kind of stream the runtime keeps (the run's stream is added when it is known)
STREAMS = (
    "session:s1",
    "context:s1",
    "deadletter",
    "runtime",
    "provider:main",
    "context-calibration:openai:m1",
    LEDGER_STREAM,
)


def _foreign(stream: str) -> list[Event]:
    return [
        Mystery(clue=f"from the future in {stream}", depth=3),
        TurnStartedV9(turn_id=7),
        RuntimeStoppedV4(reason="upgrade", drained=2),
    ]


def _raw(event: Event) -> bytes:
    """The bytes a newer stalwart stores for ``event`` (the record's event map)."""
    return msgspec.msgpack.encode(event)


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"`stalwart {' '.join(args)}` raised {result.exception!r}")
    return result.exit_code, result.stdout, result.stderr


def _stalwart(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stalwart", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# -- a store with foreign events in every stream, built once --------------------------------


class Foreign(msgspec.Struct):
    """Where the module's store is, and what was written into it by the "newer" codec."""

    path: Path
    run_stream: str
    #: position -> the raw bytes written there by the newer stalwart
    written: dict[int, bytes]
    #: positions whose record this version cannot read (kept as UnknownEvent)
    unknown: set[int]


def _answered_session(rt: Runtime, chat: MemoryChannel, count: int) -> None:
    session = rt.session("s1", channel="chat")
    session.send(f"message {count}")
    delivered(rt, chat, count)


@pytest.fixture(scope="module")
def foreign_store(tmp_path_factory: pytest.TempPathFactory) -> Foreign:
    """A runtime's store (a session, a sub-agent run, provider calls, calibration) into
    which a newer stalwart appended foreign events: into the run's stream while the run
    was under way, and into every stream kind after the runtime stopped."""
    path = tmp_path_factory.mktemp("foreign") / "store"
    clock = FakeClock(start=1_800_000_000.0)
    written: dict[int, bytes] = {}
    unknown: set[int] = set()

    def keep(records: list[RecordedEvent], events: list[Event]) -> None:
        for record, event in zip(records, events, strict=True):
            written[record.position] = _raw(event)
            if not isinstance(event, RuntimeStoppedV4):
                unknown.add(record.position)

    with FakeProvider() as fake:
        fake.set_default(Answer(text="default answer"))
        store = store_module.open(path, clock=clock)
        newer = store_module.open(path, codec=NEWER, clock=clock)
        gate = threading.Event()

        async def work(report: RunReport) -> str:
            await anyio.to_thread.run_sync(gate.wait, GUARD)
            return "the sub-agent's answer"

        try:
            chat = MemoryChannel("chat")
            with Runtime(
                runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
            ) as rt:
                _answered_session(rt, chat, 1)
                run = rt.spawn("s1", "find the answer", task_class="research", work=work)
                log_until(store, run.stream, has(SubagentSpawned))
                events = _foreign(run.stream)
                keep(newer.append(run.stream, events), events)  # while the run is under way
                gate.set()
                assert run.result(GUARD).outcome == "succeeded"
                run_stream = run.stream
            for stream in (*STREAMS, run_stream):
                events = _foreign(stream)
                keep(newer.append(stream, events), events)
        finally:
            gate.set()
            newer.close()
            store.close()
    return Foreign(path=path, run_stream=run_stream, written=written, unknown=unknown)


def _copy(foreign: Foreign, tmp_path: Path) -> Path:
    target = tmp_path / "store"
    shutil.copytree(foreign.path, target)
    return target


# -- 1. a restarted runtime carries on over them ------------------------------------------


def test_a_restarted_runtime_carries_on_over_foreign_events_in_every_stream(
    foreign_store: Foreign, tmp_path: Path, clock: FakeClock, fake: FakeProvider
) -> None:
    """The wake of a session whose stream ends in foreign events, a new session beside
    it, the health and dead-letter actors (whose streams hold them too), and a newer
    stalwart appending to the session while this one runs a turn: nothing crashes,
    loops or drops the session, and every foreign record is still there byte for byte."""
    path = _copy(foreign_store, tmp_path)
    with (
        store_module.open(path, clock=clock) as store,
        store_module.open(path, codec=NEWER) as newer,
    ):  # type: ignore[attr-defined]
        chat = MemoryChannel("chat")
        with Runtime(
            runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
        ) as rt:
            _answered_session(rt, chat, 1)
            rt.session("s2", channel="chat").send("a new session beside it")
            delivered(rt, chat, 2)
            newer.append("session:s1", [Mystery(clue="between two turns")])
            _answered_session(rt, chat, 3)
            assert rt.health(GUARD)["main"].status == "healthy"
            assert rt.dead_letters(GUARD).entries == ()
            report = rt.session("s1").status(GUARD)
        assert report.session.turns == 3, report
        assert report.session.last_turn_outcome == "answered", report
        kept = {r.position: r for r in store.read_all() if r.position in foreign_store.written}
    assert sorted(kept) == sorted(foreign_store.written)
    for position, record in kept.items():
        event = record.event
        if position in foreign_store.unknown:
            assert isinstance(event, UnknownEvent), record
            assert event.raw == foreign_store.written[position], position
        else:
            assert event == RuntimeStopped(reason="upgrade"), record


# -- 2. every CLI read command ------------------------------------------------------------


READ_COMMANDS = [
    ["tail"],
    ["streams"],
    ["streams", "--json"],
    ["status"],
    ["status", "s1"],
    ["incidents"],
    ["activations"],
    ["session", "events", "s1"],
    ["watch", "--once"],
    ["db", "check"],
    ["context", "search", "s1", "message"],
]


@pytest.mark.parametrize("command", READ_COMMANDS, ids="-".join)
def test_every_read_command_reads_past_foreign_events(
    foreign_store: Foreign, command: list[str]
) -> None:
    code, out, err = _run("--store", str(foreign_store.path), *command)
    assert (code, err) == (0, ""), (command, out[-500:], err)


def test_tail_shows_every_foreign_event_with_its_raw_bytes(foreign_store: Foreign) -> None:
    """docs/events.md: ``stalwart tail`` shows an unknown event with ``(unknown type)`` and
    every field it can read; ``--json`` adds ``_unknown``, ``_schema`` and ``_raw_b64``:
    the bytes exactly as the newer stalwart wrote them."""
    code, out, err = _run("--store", str(foreign_store.path), "tail", "--json")
    assert (code, err) == (0, "")
    lines = {row["position"]: row for row in map(json.loads, out.splitlines())}
    for position in foreign_store.unknown:
        data = lines[position]["data"]
        assert data["_unknown"] is True
        assert base64.b64decode(data["_raw_b64"]) == foreign_store.written[position]
    [mystery, *_] = [
        p for p in sorted(foreign_store.unknown) if lines[p]["type"] == "future:mystery"
    ]
    assert lines[mystery]["data"]["depth"] == 3
    assert lines[mystery]["data"]["_schema"] == 1
    code, out, _ = _run("--store", str(foreign_store.path), "tail")
    human = {int(line.split()[0]): line for line in out.splitlines()}
    assert "future:mystery (unknown type)" in human[mystery]
    assert "depth=3" in human[mystery]


@pytest.mark.parametrize("which", ["session:s1", "run", *STREAMS[1:]])
def test_replay_folds_every_stream_holding_foreign_events(
    foreign_store: Foreign, which: str
) -> None:
    stream = foreign_store.run_stream if which == "run" else which
    for extra in ([], ["--no-snapshots"]):
        code, out, err = _run(
            "--store", str(foreign_store.path), "replay", stream, "--json", *extra
        )
        assert (code, err) == (0, ""), (stream, err)
        state = json.loads(out)
        if "version" in state:  # the ledger's governor keeps none
            assert state["version"] == _versions(foreign_store, stream)[-1], state
    if which == "run":
        assert state["status"] == "succeeded"


def _versions(foreign: Foreign, stream: str) -> list[int]:
    with store_module.open(foreign.path, read_only=True) as store:  # type: ignore[attr-defined]
        return [r.version for r in store.read_stream(stream)]


def test_replay_verify_reports_each_foreign_record_once_and_reads_on(
    foreign_store: Foreign,
) -> None:
    """docs/replay.md: an UnknownEvent is reported UNDECODABLE and replay reads on past
    it; exit 1, the report on stdout, nothing on stderr."""
    proc = _stalwart("--store", str(foreign_store.path), "replay", "--all", "--verify")
    assert proc.returncode == 1
    assert proc.stderr == ""
    reported = [line for line in proc.stdout.splitlines() if line.startswith("UNDECODABLE")]
    positions = sorted(int(line.split()[2]) for line in reported)
    assert positions == sorted(foreign_store.unknown)


# -- 3. every fold, and snapshots over foreign events ----------------------------------------

FOLDS = [
    SESSION,
    RUN,
    ACTIVATIONS,
    RECENT_MESSAGES,
    BREAKER,
    HEALTH,
    DEADLETTER,
    CONTEXT_DAG,
    CONTEXT_PIPELINE,
    SUMMARIZER_LEDGER,
    DRAFTS,
    FAILED_CALLS,
    NOTICES,
    PAUSES,
]


def _without_version(state: Any) -> Any:
    data = msgspec.to_builtins(state)
    if isinstance(data, dict):
        data.pop("version", None)
    return data


def test_every_fold_ignores_foreign_events_and_snapshots_keep_them(
    foreign_store: Foreign, tmp_path: Path
) -> None:
    """docs/events.md: folds ignore an unknown event except for moving the stream version.
    Each fold of each stream holding foreign events equals its fold without them; a state
    rebuilt from a snapshot taken over them equals the full fold; and the records
    themselves are still in the log with their bytes after the snapshots."""
    path = _copy(foreign_store, tmp_path)
    streams = (*STREAMS, foreign_store.run_stream)
    with store_module.open(path) as store:  # type: ignore[attr-defined]
        for stream in streams:
            records = list(store.read_stream(stream))
            known = [r for r in records if not isinstance(r.event, UnknownEvent)]
            for aggregate in FOLDS:
                full = fold(aggregate, stream, records)
                assert _without_version(full) == _without_version(fold(aggregate, stream, known)), (
                    stream,
                    aggregate.name,
                )
                saved = load_state(store, stream, aggregate, snapshot_every=1)
                assert saved == full, (stream, aggregate.name)
            summary = fold(SUMMARY, stream, records)
            assert summary.counts["future:mystery"] >= 1, summary  # shown, not dropped
        # one more foreign and one more known event after the snapshots
        with store_module.open(path, codec=NEWER) as newer:  # type: ignore[attr-defined]
            newer.append("session:s1", [Mystery(clue="after the snapshot")])
        store.append("session:s1", [MessageAppended(message_id="late", role="user", content="hi")])
        records = list(store.read_stream("session:s1"))
        from_snapshot = load_state(store, "session:s1", SESSION)
        assert from_snapshot == fold(SESSION, "session:s1", records)
        again = {r.position: r.event for r in store.read_all()}
    for position, raw in foreign_store.written.items():
        event = again[position]
        assert not isinstance(event, UnknownEvent) or event.raw == raw, position


# -- 4. an old payload is upcast where the runtime reads it ---------------------------------


def _two_turns(store_dir: Path, clock: FakeClock, cfg: Any, first: str) -> list[str]:
    """Session ``s1`` answered twice (``first``, then ``second``) by a runtime on the
    store at ``store_dir``, then closed: its messages' ids, oldest first."""
    with store_module.open(store_dir, clock=clock) as store:  # type: ignore[attr-defined]
        chat = MemoryChannel("chat")
        with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
            session = rt.session("s1", channel="chat")
            session.send(first)
            delivered(rt, chat, 1)
            session.send("second")
            delivered(rt, chat, 2)
        return [
            r.event.message_id
            for r in store.read_stream("session:s1")
            if isinstance(r.event, MessageAppended)
        ]


def test_a_schema_1_compaction_is_upcast_into_the_pipeline_engines_prompt(
    store_dir: Path, clock: FakeClock, fake: FakeProvider
) -> None:
    """A ``context:compacted`` record an older stalwart wrote (schema 1, ``covers``) in a
    session's context stream: after a restart the pipeline engine applies it (its upcaster
    makes ``covers`` into ``added``), so the next request carries its summary in place of
    the two messages it covers."""
    cfg = runtime_config(fake.base_url, context_engine={"version": "pipeline"})
    ids = _two_turns(store_dir, clock, cfg, "hello there")
    old = Codec(extra_types=[CompactedV1], versions={"context:compacted": 1})
    with store_module.open(store_dir, codec=old) as store:  # type: ignore[attr-defined]
        store.append(
            "context:s1",
            [
                CompactedV1(
                    summary_id="old",
                    turn=1,
                    covers=tuple(ids[:2]),
                    through_seq=1,
                    tokens=900,
                    budget=1_000,
                    threshold=0.85,
                    body="OLD SUMMARY of the greeting",
                )
            ],
        )
    with store_module.open(store_dir, clock=clock) as store:  # type: ignore[attr-defined]
        assert list(store.read_stream("context:s1"))[-1].schema == 1
        chat = MemoryChannel("chat")
        with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
            rt.session("s1", channel="chat").send("third")
            delivered(rt, chat, 1)
    contents = [m.get("content") for m in fake.requests[-1].body["messages"]]
    assert "OLD SUMMARY of the greeting" in contents, contents
    assert "hello there" not in contents, contents
    assert contents[-1] == "third"


# -- 5. PostgreSQL keeps them too -----------------------------------------------------------


def test_postgres_keeps_foreign_events_byte_for_byte_and_names_a_damaged_payload(
    pg_url: str, pg_store: EventStore
) -> None:
    """The PostgreSQL store joins a row's event bytes back into a record: an unknown tag
    and a known tag from a newer schema come back as UnknownEvent with the exact bytes,
    through the store and through ``stalwart tail --json`` on the URL. A row whose event
    bytes were cut short is a one-line error naming its position, after every good record."""
    pg_store.append("session:p", [SessionCreated(title="pg")])
    with store_module.open(pg_url, codec=NEWER) as newer:  # type: ignore[attr-defined]
        events: list[Event] = [Mystery(clue="pg", depth=1), TurnStartedV9(turn_id=1)]
        newer.append("session:p", events)
    pg_store.append("session:p", [TurnCompleted(turn_id="t", outcome="answered")])
    records = list(pg_store.read_stream("session:p"))
    assert [type(r.event) for r in records] == [
        SessionCreated,
        UnknownEvent,
        UnknownEvent,
        TurnCompleted,
    ]
    assert [r.event.raw for r in records[1:3]] == [_raw(e) for e in events]  # type: ignore[attr-defined]
    code, out, err = _run("--store", pg_url, "tail", "--json")
    assert (code, err) == (0, "")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [base64.b64decode(r["data"]["_raw_b64"]) for r in rows[1:3]] == [_raw(e) for e in events]
    url = PostgresUrl(pg_url)
    with psycopg.connect(url.conninfo, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "UPDATE {}.events SET data = substring(data from 1 for 5) WHERE position = 4"
            ).format(sql.Identifier(url.schema))
        )
    code, out, err = _run("--store", pg_url, "tail")
    assert code == 1
    assert len(out.splitlines()) == 3
    assert err.startswith("stalwart: error: record at position 4 is corrupt"), err
    assert err.count("\n") == 1


# -- 6. malformed config files --------------------------------------------------------------


GOOD = (
    '[providers.p]\nkind = "openai"\nbase_url = "http://127.0.0.1:9"\n'
    '[agents.default]\nprovider = "p"\nmodel = "m"\n'
)

BAD_CONFIGS = {
    "syntax.toml": ("providers = [\n", "is not valid TOML/YAML/JSON"),
    "negative.toml": (
        GOOD + "[supervision]\nexecution_timeout_ms = -5\n",
        "supervision.execution_timeout_ms",
    ),
    "unknown.toml": (GOOD + "[store]\nsnapshots = 3\n", "unknown key 'store.snapshots'"),
    "type.yaml": (
        "providers:\n  p:\n    kind: openai\n    base_url: http://127.0.0.1:9\n"
        "agents:\n  default:\n    provider: p\n    model: m\n    max_retries: lots\n",
        "agents.default.max_retries",
    ),
    "kind.json": (
        '{"providers": {"p": {"kind": "gemini", "base_url": "http://x"}}}',
        "'anthropic', 'openai'",
    ),
    "cut.json": ('{"providers": {"p": ', "is not valid TOML/YAML/JSON"),
    "binary.toml": ("\udcff\udcfe", "is not valid TOML/YAML/JSON"),
    "list.yaml": ("- a\n- b\n", "Expected `object`, got `array`"),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_a_malformed_config_file_is_one_line_naming_what_is_wrong(
    tmp_path: Path, name: str
) -> None:
    text, expected = BAD_CONFIGS[name]
    config = tmp_path / name
    config.write_bytes(text.encode("utf-8", "surrogateescape"))
    code, out, err = _run(
        "--store", str(tmp_path / "store"), "worker", "--for", "0", "--config", str(config)
    )
    assert code == 1, out
    assert err.startswith("stalwart: error: "), err
    assert err.count("\n") == 1, err
    assert expected in err, err
    assert not (tmp_path / "store").exists()


# -- DEFECTS ----------------------------------------------------------------------------------


def _two_turns_then_newer_summaries(
    store_dir: Path, clock: FakeClock, fake: FakeProvider, *, condensed: bool
) -> list[str]:
    """Session ``s1`` answered twice; then a newer stalwart summarized it: leaf ``A``
    over the first turn with the new ``fallback`` value (unknown here), leaf ``B`` over the
    second (fits), and, when ``condensed``, ``C`` over both (fits). The message ids."""
    first = "hello, my order number is 4711"
    ids = _two_turns(store_dir, clock, runtime_config(fake.base_url), first)
    summaries = [
        SummaryV2(
            summary_id="A",
            depth=0,
            covers=tuple(ids[:2]),
            descendant_count=2,
            fallback="hard-cut",
            body="the order number",
        ),
        SummaryV2(
            summary_id="B", depth=0, covers=tuple(ids[2:4]), descendant_count=2, body="second part"
        ),
    ]
    if condensed:
        summaries.append(
            SummaryV2(summary_id="C", depth=1, covers=("A", "B"), descendant_count=4, body="all")
        )
    with store_module.open(store_dir, codec=Codec(extra_types=[SummaryV2])) as store:  # type: ignore[attr-defined]
        store.append("context:s1", summaries)
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        kinds = [type(r.event) for r in store.read_stream("context:s1")][-len(summaries) :]
    assert kinds[0] is UnknownEvent  # what this version makes of A
    assert all(kind is not UnknownEvent for kind in kinds[1:])
    return ids


@pytest.mark.parametrize("condensed", [True, False], ids=["condensed-over-it", "leaf-after-it"])
def test_a_session_a_newer_stalwart_summarized_is_refused_plainly(
    store_dir: Path, clock: FakeClock, fake: FakeProvider, condensed: bool
) -> None:
    # Was: add_node(C) looked up the leaf the fold never saw (KeyError: every turn
    # 'internal', requeued until abandoned); with no C, add_node(B) moved ``covered``
    # past A's messages, and "my order number is 4711" left the prompt without a trace
    """A newer stalwart widened ``context:summary_created``'s ``fallback`` (docs/events.md
    rule 3) and summarized this session: leaf A holds the new value (an UnknownEvent
    here), leaf B (and the condensed C over both) still decode. Leaves cover the history
    from its start without a gap, so this version knows a summary is missing; it cannot
    rebuild the DAG without losing A's messages, so it refuses the session, fail closed
    (``context_refused``): no model call with a prompt that silently lacks the first
    turn, the user told plainly, an ERROR log line saying why."""
    _two_turns_then_newer_summaries(store_dir, clock, fake, condensed=condensed)
    calls = len(fake.requests)
    with store_module.open(store_dir, clock=clock) as store:  # type: ignore[attr-defined]
        chat = MemoryChannel("chat")
        with (
            structlog.testing.capture_logs() as logs,
            Runtime(
                runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
            ) as rt,
        ):
            rt.session("s1", channel="chat").send("third")
            [reply] = delivered(rt, chat, 1)
            records = log_until(store, "session:s1", has(TurnCompleted, 3))
    last = [r.event for r in records if isinstance(r.event, TurnCompleted)][-1]
    assert (last.outcome, last.reason) == ("failed", "context_refused"), last
    assert (reply.text, reply.kind) == (ABANDONED_TEXT, "failure_notice")
    assert len(fake.requests) == calls, "a prompt without the first turn reached the model"
    assert any(e["event"] == "agent.context_refused" for e in logs), logs
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        refusals = [
            r.event
            for r in store.read_stream("context:s1")
            if isinstance(r.event, ContextDagDegraded)
        ]
    assert [e.reason for e in refusals][-1:] == ["fail_closed_rollover"], refusals


def test_context_search_and_expand_over_a_newer_leaf_say_why_in_one_line(
    store_dir: Path, clock: FakeClock, fake: FakeProvider
) -> None:
    # Was: both exited with "internal error: KeyError (a bug; ...)"
    """Same store, read by the operator: ``stalwart context search`` and ``expand``
    rebuild the DAG and meet the same missing summary. Each is one line on stderr that
    says a newer stalwart's summary cannot be read here, exit 1, no traceback."""
    _two_turns_then_newer_summaries(store_dir, clock, fake, condensed=True)
    for command in (["context", "search", "s1", "order"], ["context", "expand", "s1", "B"]):
        proc = _stalwart("--store", str(store_dir), *command)
        assert proc.returncode == 1, proc.stdout
        assert "Traceback" not in proc.stderr, proc.stderr[-400:]
        assert proc.stderr.startswith("stalwart: error: "), proc.stderr
        assert proc.stderr.count("\n") == 1, proc.stderr
        assert "summary this version cannot read (written by a newer" in proc.stderr, proc.stderr


def test_an_integer_provider_name_in_yaml_is_an_error_naming_the_key(tmp_path: Path) -> None:
    # Was: the ConfigError for a non-string table key names no key at all
    """YAML reads ``providers: {1: ...}`` with an integer key. ``parse_config`` checks each
    entry by name, but a key that is not a string fails the whole Config with msgspec's
    path ``$.providers[...]``, which ``config._fail`` cannot turn into a
    key: ``ConfigError("...: Expected `str`, got `int`, found a table")`` with ``key=None``.
    The operator is not told which section, let alone which entry. config.py's promise:
    errors "name the key, the value found and what is allowed". Expected: the error names
    ``providers`` (ideally ``providers.1``: a name must be a string)."""
    config = tmp_path / "stalwart.yaml"
    config.write_text(
        "providers:\n  1:\n    kind: openai\n    base_url: http://127.0.0.1:9\n"
        "agents:\n  default:\n    provider: '1'\n    model: m\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert (info.value.key or "").startswith("providers"), (
        f"the error should name the 'providers' key; it says {str(info.value)!r} "
        f"(key={info.value.key!r})"
    )


def test_a_snapshot_every_too_large_to_record_is_refused_by_the_config() -> None:
    # Was: store.snapshot_every has no upper bound: it loads, then the runtime cannot record it
    """``StoreSettings.snapshot_every`` is ``Meta(ge=0)`` with no ``le=MAX_KNOB``
    (stalwart/config.py), unlike every other whole-number knob; config.py says of
    MAX_KNOB "larger could not even be recorded in runtime:started". So
    ``snapshot_every = 18446744073709551616`` loads, and then ``Runtime.start`` (and
    ``stalwart run`` / ``stalwart worker``) fails with "cannot encode an event for
    'runtime': OverflowError: can't serialize ints ..." which names neither the file nor
    the key. Expected: a ConfigError naming ``store.snapshot_every`` at load."""
    data = {
        "providers": {"p": {"kind": "openai", "base_url": "http://127.0.0.1:9"}},
        "agents": {"default": {"provider": "p", "model": "m"}},
        "store": {"snapshot_every": 2**64},
    }
    try:
        parse_config(data)
    except ConfigError as exc:
        key = exc.key
    else:
        pytest.fail(
            "a snapshot_every of 2**64 loaded; a Runtime on it cannot even record its config"
        )
    assert key == "store.snapshot_every", key
