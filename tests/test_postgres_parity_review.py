"""Review: PostgreSQL parity. The same log on LMDB and on PostgreSQL must read the same
through every read command, fail the same way when the database is wrong, and a runtime
must write the same events on either.

Real parts only: an LMDB directory in ``tmp_path``, the session's PostgreSQL cluster
(``pg_server``, a fresh schema per store), the loopback ``FakeProvider`` and a
``FakeClock``. Tests marked as defects fail on the code they were written against.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql

from stalwart import store as store_module
from stalwart.channels import MemoryChannel
from stalwart.cli import cli
from stalwart.clock import FakeClock
from stalwart.config import parse_config
from stalwart.errors import CorruptRecordError
from stalwart.events import AnnouncementDelivered, MessageAppended
from stalwart.runtime import SPAWN_TOOL, Runtime
from stalwart.store import EventStore
from stalwart.store._postgres_connect import PostgresUrl
from stalwart.testing import Answer, Fail, FakeProvider, FakeToolCall, PostgresServer
from tests._postgres import install_old_schema, installed_schema
from tests._runtime_support import (
    RETRYING,
    agent_settings,
    delivered,
    delivered_by_clock,
    has,
    log_until,
    settled,
)
from tests.golden.make_verify_golden import copy_record
from tests.test_store_index_lag import damage

_schemas = itertools.count(1)


def _fresh_url(pg_server: PostgresServer) -> str:
    """A schema of its own in the shared test database (module fixtures cannot use
    the function-scoped ``pg_url``)."""
    return pg_server.url("stalwart_test") + f"?schema=parity{next(_schemas)}"


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def _copy(source: EventStore, target: EventStore) -> None:
    """Every record of ``source`` into the empty ``target``: same positions, versions,
    ids and times."""
    for record in source.read_all():
        written = copy_record(target, record)
        assert (written.position, written.version) == (record.position, record.version)


def _msg(n: int) -> MessageAppended:
    return MessageAppended(message_id=str(n), role="user", content=f"message {n}")


# -- one scripted scenario ------------------------------------------------------------------


def _scenario(store: EventStore, clock: FakeClock) -> None:
    """A provider that fails then recovers, a tool call, a model-driven sub-agent, a
    scheduled wake: one session ``s1`` run by a real Runtime on ``store``."""
    chat = MemoryChannel("chat")
    with FakeProvider() as fake:
        fake.set_default(Answer(text="default answer"))
        config = parse_config(
            {
                "providers": {"main": {"kind": "openai", "base_url": fake.base_url}},
                "agents": {"default": agent_settings(**RETRYING) | {"subagents": True}},
            }
        )
        with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:

            @rt.tool()
            def lookup(order: int) -> str:
                """Look an order up."""
                return f"order {order} shipped"

            lookup_call = FakeToolCall(id="t1", name="lookup", arguments={"order": 7})
            fake.add(
                Fail(status=500),
                Answer(text="", tool_calls=(lookup_call,)),
                Answer(text="it shipped"),
            )
            rt.session("s1", channel="chat").send("where is order 7?", message_id="m1")
            delivered_by_clock(clock, chat, 1)
            _answers_recorded(store, 1)
            spawn = FakeToolCall(
                id="c2",
                name=SPAWN_TOOL,
                arguments={"task": "summarise the report", "task_class": "research"},
            )
            fake.add(
                Answer(text="", tool_calls=(spawn,)),
                Answer(text="The report says 42."),
                Answer(text="found 42"),
            )
            rt.session("s1", channel="chat").send("what does the report say?", message_id="m2")
            delivered(rt, chat, 2)
            _answers_recorded(store, 2)
            rt.wake_at("s1", clock.now() + 60, "check again", dedupe_key="k1")
            fake.add(Answer(text="checked"))
            clock.advance(61)
            delivered_by_clock(clock, chat, 3, step_s=1)
            _answers_recorded(store, 3)
    assert [m.text for m in chat.messages] == ["it shipped", "found 42", "checked"]


def _answers_recorded(store: EventStore, count: int) -> None:
    """The session settled and its ``count`` answers' deliveries recorded (the channel has
    a message before its ``announcement:delivered`` is appended: the next message waits
    for it, so the order of the two does not race)."""
    settled(store, "session:s1")
    log_until(store, "session:s1", has(AnnouncementDelivered, count))


def _types_by_stream(store: EventStore) -> dict[str, list[str]]:
    """Each stream's event types in order; sub-agent runs (random ids) under ``run``."""
    out: dict[str, list[str]] = {}
    for record in store.read_all():
        stream = record.stream
        if stream.startswith("session:") and stream != "session:s1":
            stream = "run"
        out.setdefault(stream, []).append(record.type)
    return out


@dataclass
class Logs:
    lmdb: str  # the LMDB directory the runtime wrote
    native: str  # a PostgreSQL store the same scenario ran on
    copied: str  # a PostgreSQL store holding the LMDB log record for record
    native_types: dict[str, list[str]]
    lmdb_types: dict[str, list[str]]


@pytest.fixture(scope="module")
def logs(pg_server: PostgresServer, tmp_path_factory: pytest.TempPathFactory) -> Logs:
    directory = str(tmp_path_factory.mktemp("parity") / "store")
    lmdb = store_module.open(directory, clock=(lmdb_clock := FakeClock(start=1_800_000_000.0)))
    try:
        _scenario(lmdb, lmdb_clock)
        lmdb_types = _types_by_stream(lmdb)
        copied = _fresh_url(pg_server)
        with store_module.open(copied) as target:  # type: ignore[attr-defined]
            _copy(lmdb, target)
    finally:
        lmdb.close()
    native = _fresh_url(pg_server)
    pg_clock = FakeClock(start=1_800_000_000.0)
    with store_module.open(native, clock=pg_clock) as pg:  # type: ignore[attr-defined]
        _scenario(pg, pg_clock)
        native_types = _types_by_stream(pg)
    return Logs(directory, native, copied, native_types, lmdb_types)


# -- 3. the runtime writes the same events on either backend --------------------------------


def test_the_same_scenario_writes_the_same_event_types_per_stream_on_both(logs: Logs) -> None:
    """A provider failure retried, a tool call, a sub-agent and a scheduled wake: every
    stream but the sub-agent run's holds the same types in the same order on LMDB and on
    PostgreSQL. The run's own order (its progress report races its model call's end, and
    its internal announcement's delivery races the run's end) differs between runs of
    the same backend, so it is compared as a multiset without that delivery."""
    lmdb, pg = dict(logs.lmdb_types), dict(logs.native_types)
    runs = lmdb.pop("run"), pg.pop("run")
    assert lmdb == pg
    assert lmdb["session:s1"].count("activation:acked") == 3
    assert {"prompt:failed", "prompt:retry_scheduled", "tool:completed"} <= set(lmdb["session:s1"])
    lmdb_run, pg_run = (
        Counter(t for t in types if t != "announcement:delivered") for types in runs
    )
    assert lmdb_run == pg_run
    assert lmdb_run["subagent:completed"] == 1


# -- 1. every read command prints the same on both ------------------------------------------

_NOW = re.compile(r'"now":[0-9.]+')
_WATCH_HEADER = re.compile(r"^stalwart watch  \S+  \S+  position", re.MULTILINE)

READ_COMMANDS: list[tuple[str, ...]] = [
    ("tail",),
    ("tail", "--json"),
    ("tail", "--stream", "session:*", "--type", "activation:*"),
    ("tail", "--since", "20", "--json"),
    ("streams",),
    ("status",),
    ("status", "--json"),
    ("status", "s1"),
    ("status", "s1", "--json"),
    ("watch", "--once"),
    ("replay", "session:s1"),
    ("replay", "session:s1", "--json"),
    ("replay", "session:s1", "--until", "30"),
    ("replay", "session:s1", "--no-snapshots"),
    ("replay", "runtime"),
    ("replay", "provider:main", "--json"),
    ("replay", "session:s1", "--verify"),
    ("replay", "--all", "--verify"),
    ("replay", "--all", "--verify", "--json", "--until", "40"),
    ("session", "events", "s1"),
    ("session", "events", "s1", "--json"),
    ("activations",),
    ("activations", "--json", "--session", "s1"),
    ("incidents",),
    ("incidents", "--json", "--provider", "main"),
    ("context", "search", "s1", "shipped"),
    ("context", "search", "s1", "order", "--json"),
    ("context", "expand", "s1", "m1"),
    ("db", "check"),
    # the errors: one line each, the same words
    ("replay", "session:nope"),
    ("status", "nope"),
    ("session", "events", "nope"),
    ("context", "search", "nope", "x"),
]


def _normalised(text: str, *locations: str) -> str:
    for location in locations:
        text = text.replace(location, "LOC")
    text = _NOW.sub('"now":NOW', text)
    text = _WATCH_HEADER.sub("stalwart watch  LOC  NOW  position", text)
    # db check's LMDB format line is documented as LMDB's own
    return "\n".join(line for line in text.split("\n") if not line.startswith("  format stalwart-"))


def test_every_read_command_prints_the_same_for_the_same_log_on_both(logs: Logs) -> None:
    """The LMDB log a runtime wrote, copied record for record into PostgreSQL: each read
    command prints the same stdout and stderr and exits the same (apart from the store's
    location, the wall clock and db check's LMDB format line)."""
    pg_location = store_module.open(logs.copied, create=False, read_only=True)
    try:
        shown = pg_location.location
    finally:
        pg_location.close()
    differ = []
    for command in READ_COMMANDS:
        on_lmdb = _cli("--store", logs.lmdb, *command)
        on_pg = _cli("--store", logs.copied, *command)
        lmdb_text = [on_lmdb[0], *(_normalised(t, logs.lmdb, shown) for t in on_lmdb[1:])]
        pg_text = [on_pg[0], *(_normalised(t, logs.lmdb, shown) for t in on_pg[1:])]
        if lmdb_text != pg_text:
            differ.append((command, lmdb_text, pg_text))
    assert not differ, differ[:2]


def test_the_read_commands_say_something_about_the_scenario(logs: Logs) -> None:
    """The comparison above is not of two empty outputs."""
    code, out, _ = _cli("--store", logs.copied, "replay", "--all", "--verify")
    assert code == 0
    assert "activation:leased x3" in out
    code, out, _ = _cli("--store", logs.copied, "context", "search", "s1", "shipped")
    assert code == 0
    assert "shipped" in out
    code, out, _ = _cli("--store", logs.copied, "incidents", "--json")
    assert code == 0
    assert '"retried":1' in out


# -- 2. a wrong database: one line, exit 1, nothing changed ---------------------------------

EVERY_STORE_COMMAND: list[tuple[str, ...]] = [
    ("tail",),
    ("tail", "--follow"),
    ("streams",),
    ("status",),
    ("status", "s1"),
    ("watch", "--once"),
    ("replay", "session:s1"),
    ("replay", "--all", "--verify"),
    ("session", "events", "s1"),
    ("session", "events", "s1", "--follow"),
    ("activations",),
    ("activations", "--follow"),
    ("incidents",),
    ("context", "search", "s1", "x"),
    ("context", "expand", "s1", "x"),
    ("db", "check"),
    ("session", "confirm", "s1", "r1", "--allow"),
    ("session", "tool-result", "s1", "r1", "--output", "x"),
    ("session", "interrupt", "s1"),
]


def _one_line_error(code: int, out: str, err: str, *words: str) -> None:
    assert code == 1, (code, out, err)
    assert out == ""
    assert err.startswith("stalwart: error: "), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


def _schema_exists(pg_url: str) -> bool:
    url = PostgresUrl(pg_url)
    with psycopg.connect(url.conninfo, autocommit=True) as conn:
        row = conn.execute(
            "SELECT 1 FROM information_schema.schemata WHERE schema_name = %s", (url.schema,)
        ).fetchone()
    return row is not None


def test_a_missing_schema_is_one_line_for_every_command_and_none_creates_it(pg_url: str) -> None:
    for command in EVERY_STORE_COMMAND:
        code, out, err = _cli("--store", pg_url, *command)
        _one_line_error(code, out, err, "no stalwart store at", "stalwart db init")
        assert not _schema_exists(pg_url), command


def test_an_older_schema_is_refused_by_every_command_and_left_as_it_is(pg_url: str) -> None:
    install_old_schema(pg_url, 1)
    for command in EVERY_STORE_COMMAND:
        code, out, err = _cli("--store", pg_url, *command)
        if command[0] == "session" and command[1] != "events":
            # an operator's action opens the store for writing: it migrates, then
            # finds no such session (documented: a store opened for writing migrates)
            assert code == 1, (command, err)
            assert "Traceback" not in err, (command, err)
            continue
        _one_line_error(code, out, err, "schema version 1", "stalwart db init")
        assert installed_schema(pg_url) == 1, command


def test_a_newer_schema_is_refused_by_every_command_including_db_init(pg_url: str) -> None:
    install_old_schema(pg_url, 2)
    url = PostgresUrl(pg_url)
    with psycopg.connect(url.conninfo, autocommit=True) as conn:
        conn.execute(
            sql.SQL("INSERT INTO {}.schema_version (version) VALUES (7)").format(
                sql.Identifier(url.schema)
            )
        )
    for command in [*EVERY_STORE_COMMAND, ("db", "init"), ("session", "send", "s1", "hi")]:
        code, out, err = _cli("--store", pg_url, *command)
        _one_line_error(code, out, err, "schema version 7", "upgrade stalwart")


def test_a_wrong_password_is_one_line_without_it_for_every_command(
    pg_server: PostgresServer, pg_url: str
) -> None:
    wrong = "Wr0ng:pa@ss/REVIEW"
    encoded = "Wr0ng%3Apa%40ss%2FREVIEW"
    bad = pg_url.replace(pg_server.password, encoded)
    assert bad != pg_url
    commands = [*EVERY_STORE_COMMAND, ("db", "init"), ("session", "send", "s1", "hi")]
    for command in commands:
        code, out, err = _cli("--store", bad, "--log-level", "debug", *command)
        _one_line_error(code, out, err, "authentication failed")
        for secret in (wrong, encoded, pg_server.password):
            assert secret not in err, (command, err)


def test_a_password_in_the_url_is_never_shown_by_a_command_that_works(
    pg_server: PostgresServer, pg_url: str
) -> None:
    """``db init``, a message sent, and the read commands at debug level: the URL carries
    the password, no output line does (the recorded config included)."""
    password = pg_server.password
    assert password in pg_url
    outputs = []
    for command in [
        ("db", "init"),
        ("session", "send", "s1", "hello"),
        ("tail", "--json"),
        ("status", "s1", "--json"),
        ("watch", "--once"),
        ("db", "check", "--json"),
        ("streams",),
    ]:
        code, out, err = _cli("--store", pg_url, "--log-level", "debug", *command)
        assert code == 0, (command, err)
        outputs.append(out + err)
    assert all(password not in text for text in outputs)
    assert "created the store at postgresql://" in outputs[0]


# -- a position missing from the log --------------------------------------------------------


def _delete_position(location: str, position: int) -> None:
    if "://" not in location:
        damage(Path(location), position, None)
        return
    url = PostgresUrl(location)
    with psycopg.connect(url.conninfo, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DELETE FROM {}.events WHERE position = %s").format(sql.Identifier(url.schema)),
            (position,),
        )


@pytest.fixture
def holed(tmp_path: Path, pg_url: str) -> tuple[str, str]:
    """The same 50 messages over three sessions on LMDB and on PostgreSQL, with
    position 30 (session:s2's version 10) deleted by hand from both."""
    locations = (str(tmp_path / "store"), pg_url)
    for location in locations:
        with store_module.open(location) as store:  # type: ignore[attr-defined]
            for n in range(50):
                store.append(f"session:s{n % 3}", [_msg(n)])
        _delete_position(location, 30)
    return locations


def test_postgres_stops_tail_at_a_position_missing_from_the_log(holed: tuple[str, str]) -> None:
    """What the docs promise (scaling.md, "A hole in the log is an error, not an end";
    cli.md, ``tail`` stops at a record it cannot read after printing every one before)."""
    _, pg_url = holed
    code, out, err = _cli("--store", pg_url, "tail")
    assert code == 1
    assert len(out.splitlines()) == 29
    assert err.startswith("stalwart: error: record at position 30 is corrupt")


# A hole on LMDB: tail, replay --verify, status and incidents say nothing of it.
# Was: LMDB read_all skips a missing position silently; PostgreSQL raises naming it.
def test_a_position_missing_from_the_log_reads_the_same_on_lmdb_as_on_postgres(
    holed: tuple[str, str],
) -> None:
    lmdb_dir, pg_url = holed
    for command in (("tail",), ("replay", "--all", "--verify"), ("status",), ("incidents",)):
        on_lmdb = _cli("--store", lmdb_dir, *command)
        on_pg = _cli("--store", pg_url, *command)
        assert on_lmdb[0] == on_pg[0], (command, on_lmdb, on_pg)
        assert ("position 30" in on_lmdb[1] + on_lmdb[2]) == (
            "position 30" in on_pg[1] + on_pg[2]
        ), (command, on_lmdb, on_pg)


# LmdbEventStore.read_all(1, 40) over a log missing position 30 yields position 41.
# Was: LMDB read_all(1, to_position) reads past to_position over a hole in the log.
def test_read_all_up_to_a_position_never_yields_past_it_on_either_backend(
    holed: tuple[str, str],
) -> None:
    for location in holed:
        seen: list[int] = []
        error: CorruptRecordError | None = None
        with store_module.open(location, create=False, read_only=True) as store:  # type: ignore[attr-defined]
            try:
                seen.extend(record.position for record in store.read_all(1, 40))
            except CorruptRecordError as exc:
                error = exc
        assert max(seen, default=0) <= 40, (location, seen[-3:])
        assert seen == list(range(1, 30)), (location, seen[-3:])
        assert error is not None, location
        assert error.position == 30, (location, error)
