"""The PostgreSQL event store: the shared contract, plus what only PostgreSQL does."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import msgspec
import psycopg
import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.clock import FakeClock
from stalwart.errors import CorruptRecordError, EventError, StoreError, StoreNotFoundError
from stalwart.events import MessageAppended, SessionCreated, UnknownEvent
from stalwart.store import EventStore, NewEvent, PostgresEventStore, Snapshot
from stalwart.testing import PostgresServer

from ._relay import CuttingRelay, schema_of
from .store_contract import EventStoreContract


class TestPostgresContract(EventStoreContract):
    @pytest.fixture
    def store(self, pg_url: str, clock: FakeClock) -> Iterator[EventStore]:
        self.reopen = lambda: store_module.open(pg_url, clock=clock)
        opened = store_module.open(pg_url, clock=clock)
        try:
            yield opened
        finally:
            opened.close()


# -- what only PostgreSQL does --------------------------------------------------------------


def _msg(n: int) -> MessageAppended:
    return MessageAppended(message_id=str(n), role="user", content="x")


def test_location_and_repr_hide_the_password(pg_server: PostgresServer, pg_url: str) -> None:
    with PostgresEventStore(pg_url + "&application_name=t") as store:
        assert pg_server.password not in store.location
        assert pg_server.password not in repr(store)
        assert store.location.startswith(f"postgresql://{pg_server.user}@127.0.0.1:")
        assert "schema=" in store.location
        assert "application_name=t" in store.location
    with PostgresEventStore(
        pg_server.url("stalwart_test", password=False) + f"?password={pg_server.password}&schema=pw"
    ) as store:
        assert pg_server.password not in store.location
    short = pg_url.replace("postgresql://", "postgres://", 1)
    with store_module.open(short) as store:  # type: ignore[attr-defined]
        assert isinstance(store, PostgresEventStore)
        assert store.location.startswith("postgres://")
        assert pg_server.password not in store.location


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ("pg_x", "cannot start with pg_"),
        ("a%00b", "NUL"),
        ("", "1 to 50 bytes"),
        ("s" * 51, "1 to 50 bytes"),
    ],
)
def test_a_schema_name_postgresql_refuses_is_a_plain_error(
    pg_server: PostgresServer, schema: str, says: str
) -> None:
    """Checked before connecting, in words: the server's own refusal of such a name was
    only its class (``ReservedName (42939)``, ``DataError``). On the command line, one
    line on stderr and exit 1."""
    url = pg_server.url("stalwart_test") + f"?schema={schema}"
    with pytest.raises(StoreError, match=says):
        store_module.open(url)
    done = CliRunner().invoke(cli, ["--store", url, "db", "init"])
    assert done.exit_code == 1
    assert says in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert pg_server.password not in done.stderr


def test_a_schema_name_that_only_looks_reserved_is_a_schema_like_any_other(
    pg_server: PostgresServer,
) -> None:
    for schema in ("pgx-Ünï code", "PG_Mine"):  # quoted: taken as it is
        url = pg_server.url("stalwart_test") + f"?schema={schema}"
        with store_module.open(url) as store:  # type: ignore[attr-defined]
            store.append("session:s", [_msg(1)], expected_version=0)
            assert [r.version for r in store.read_stream("session:s")] == [1]


def _assert_clean(error: BaseException, password: str) -> None:
    text = str(error)
    assert password not in text
    assert "127.0.0.1" in text  # it says where


def test_a_wrong_password_is_a_clear_error_without_the_password(
    pg_server: PostgresServer,
) -> None:
    wrong = "wrong-Pa55word"
    url = pg_server.url("stalwart_test").replace(pg_server.password, wrong)
    with pytest.raises(StoreError, match="authentication failed") as caught:
        store_module.open(url)
    _assert_clean(caught.value, wrong)


def test_a_missing_database_is_store_not_found(pg_server: PostgresServer) -> None:
    with pytest.raises(StoreNotFoundError, match="database does not exist") as caught:
        store_module.open(pg_server.url("no_such_db"))
    _assert_clean(caught.value, pg_server.password)


def test_nothing_listening_is_a_clear_error(pg_server: PostgresServer) -> None:
    url = pg_server.url().replace(f":{pg_server.port}/", f":{_closed_port()}/")
    with pytest.raises(StoreError, match="nothing is listening") as caught:
        PostgresEventStore(url, connect_timeout=2)
    _assert_clean(caught.value, pg_server.password)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_read_only_open_refuses_a_database_without_a_store(pg_url: str) -> None:
    with pytest.raises(StoreNotFoundError, match="stalwart db init"):
        store_module.open(pg_url, create=False)


def test_a_newer_schema_is_refused(pg_server: PostgresServer, pg_url: str) -> None:
    with PostgresEventStore(pg_url) as store:
        schema = pg_url.rsplit("schema=", 1)[1]
        assert store.migrated_from == 0
    with psycopg.connect(pg_server.url("stalwart_test"), autocommit=True) as conn:
        conn.execute(f'INSERT INTO "{schema}".schema_version (version) VALUES (99)')
    with pytest.raises(StoreError, match="schema version 99"):
        PostgresEventStore(pg_url)


def test_a_killed_listener_loses_no_event(pg_server: PostgresServer, pg_url: str) -> None:
    reader = PostgresEventStore(pg_url, poll_interval=0.05)
    writer = PostgresEventStore(pg_url)  # another handle: its appends ring no bell here
    try:
        with reader.subscribe(1) as subscription:
            writer.append("s:1", [_msg(1)])
            assert [r.position for r in subscription.poll(5)] == [1]
            assert subscription.poll(0.1) == []  # waiting starts the listener
            with psycopg.connect(pg_server.url(), autocommit=True) as admin:
                killed = admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = 'stalwart-listener'"
                ).fetchall()
            assert killed  # the listener was there, and is gone
            writer.append("s:1", [_msg(2)])  # nobody listens: this NOTIFY is lost
            assert [r.position for r in subscription.poll(5)] == [2]
            for n in range(3, 6):
                writer.append("s:1", [_msg(n)])
                assert [r.position for r in subscription.poll(5)] == [n]
            assert _listeners(pg_server) == 1  # and the listener came back
    finally:
        writer.close()
        reader.close()


def _listeners(server: PostgresServer) -> int:
    with psycopg.connect(server.url(), autocommit=True) as admin:
        for _ in range(100):
            row = admin.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE application_name = 'stalwart-listener' AND query LIKE 'LISTEN%%'"
            ).fetchone()
            if row and row[0]:
                return int(row[0])
            time.sleep(0.05)  # real-time: polls the server's pg_stat_activity (no event)
    return 0


def test_stream_ids_sort_by_code_point(pg_url: str) -> None:
    names = ["s:b", "S:a", "s:a", "s:é", "s:a-", "s:aa", "s:Z"]
    with PostgresEventStore(pg_url) as store:
        for name in names:
            store.append(name, [_msg(1)])
        assert [info.stream for info in store.streams()] == sorted(names)


# -- the command line -------------------------------------------------------------------------


def test_db_init_creates_then_finds_the_schema_current(pg_url: str) -> None:
    runner = CliRunner()
    first = runner.invoke(cli, ["--store", pg_url, "db", "init"])
    assert first.exit_code == 0, first.output
    assert "created the store" in first.output
    assert "schema version 2" in first.output
    again = runner.invoke(cli, ["--store", pg_url, "db", "init"])
    assert again.exit_code == 0, again.output
    assert "up to date" in again.output


def test_cli_tail_and_streams_on_postgres(pg_server: PostgresServer, pg_url: str) -> None:
    runner = CliRunner()
    missing = runner.invoke(cli, ["--store", pg_url, "streams"])
    assert missing.exit_code == 1
    assert "stalwart db init" in missing.output
    assert pg_server.password not in missing.output
    with PostgresEventStore(pg_url) as store:
        store.append("session:cli", [SessionCreated(), _msg(1)])
    listed = runner.invoke(cli, ["--store", pg_url, "streams"])
    assert listed.exit_code == 0, listed.output
    assert "session:cli" in listed.output
    tailed = runner.invoke(cli, ["--store", pg_url, "tail", "--json"])
    assert tailed.exit_code == 0, tailed.output
    lines = [json.loads(line) for line in tailed.output.splitlines()]
    assert [line["position"] for line in lines] == [1, 2]


def test_unstorable_ids_fail_alone_and_a_batch_goes_on(pg_url: str) -> None:
    bad = NewEvent(event=_msg(0), id="\ud800")
    errors: list[BaseException] = []
    with PostgresEventStore(pg_url) as store:
        barrier = threading.Barrier(8)

        def append(n: int) -> None:
            barrier.wait()
            try:
                store.append(f"s:{n}", [bad if n == 3 else _msg(n)])
            except EventError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=append, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(errors) == 1
        assert store.head() == 7
        with pytest.raises(EventError):
            store.append("s:x", [NewEvent(event=_msg(1), causation_id="a\x00b")])


def _kill_sessions(server: PostgresServer, database: str) -> int:
    with psycopg.connect(server.url(), autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (database,),
        ).fetchall()
    return len(rows)


def test_killed_connections_cost_no_append_and_no_read(
    pg_server: PostgresServer, pg_url: str
) -> None:
    with PostgresEventStore(pg_url) as store:
        store.append("s:1", [_msg(1)])
        assert _kill_sessions(pg_server, "stalwart_test") >= 1  # as a restart or failover would
        [record] = store.append("s:1", [_msg(2)], expected_version=1)
        assert (record.position, record.version) == (2, 2)
        assert [r.version for r in store.read_stream("s:1")] == [1, 2]
        _kill_sessions(pg_server, "stalwart_test")
        assert store.head() == 2
        assert [r.position for r in store.read_all()] == [1, 2]


def test_an_append_cut_off_mid_transaction_is_written_once(
    pg_server: PostgresServer, pg_url: str
) -> None:
    schema = pg_url.rsplit("schema=", 1)[1]
    with PostgresEventStore(pg_url) as store:
        store.append("s:1", [_msg(1)])
        with psycopg.connect(pg_server.url("stalwart_test"), autocommit=True) as admin:
            admin.execute(  # every insert into the log now takes 0.3 s
                f"CREATE FUNCTION {schema}.slow() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN PERFORM pg_sleep(0.3); RETURN NULL; END $$; "
                f"CREATE TRIGGER slow AFTER INSERT ON {schema}.events "
                f"FOR EACH STATEMENT EXECUTE FUNCTION {schema}.slow()"
            )
            done: list[object] = []
            appender = threading.Thread(
                target=lambda: done.append(store.append("s:1", [_msg(2)], expected_version=1))
            )
            appender.start()
            killed: list[object] = []
            for _ in range(100):
                killed = admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE query LIKE '%%append_batch%%' AND state = 'active' "
                    "AND pid <> pg_backend_pid()"
                ).fetchall()
                if killed:
                    break
                time.sleep(0.02)  # real-time: polls pg_stat_activity for the append
            appender.join(30)
        assert killed  # the append was cut off inside its transaction
        assert len(done) == 1  # and still went through, once
        assert [r.version for r in store.read_stream("s:1")] == [1, 2]
        assert store.head() == 2


def _sql(server: PostgresServer, statement: str, params: tuple[object, ...] = ()) -> None:
    with psycopg.connect(server.url("stalwart_test"), autocommit=True) as admin:
        admin.execute(statement.encode(), params)


def test_a_corrupt_record_is_a_typed_error_naming_its_position(
    pg_server: PostgresServer, pg_url: str
) -> None:
    schema = pg_url.rsplit("schema=", 1)[1]
    with PostgresEventStore(pg_url) as store:
        store.append("s:1", [_msg(1), _msg(2), _msg(3)])
        _sql(pg_server, f"UPDATE {schema}.events SET data = %s WHERE position = 2", (b"\xc1",))
        got: list[int] = []
        with pytest.raises(CorruptRecordError) as caught:
            got.extend(r.position for r in store.read_all())
        assert caught.value.position == 2
        assert got == [1]  # every good record before it first
        assert [r.position for r in store.read_all(3)] == [3]


def test_an_unknown_event_type_is_kept_as_raw_bytes(pg_server: PostgresServer, pg_url: str) -> None:
    schema = pg_url.rsplit("schema=", 1)[1]
    payload = msgspec.msgpack.encode({"type": "future:thing", "size": 3})
    with PostgresEventStore(pg_url) as store:
        store.append("s:1", [_msg(1)])
        _sql(
            pg_server,
            f"UPDATE {schema}.events SET data = %s, type = 'future:thing' WHERE position = 1",
            (payload,),
        )
        [record] = store.read_all()
        assert isinstance(record.event, UnknownEvent)
        assert (record.type, record.event.raw) == ("future:thing", payload)


def test_a_corrupt_snapshot_is_skipped(pg_server: PostgresServer, pg_url: str) -> None:
    schema = pg_url.rsplit("schema=", 1)[1]
    with PostgresEventStore(pg_url) as store:
        for version in (1, 2):
            store.put_snapshot(
                Snapshot(stream="s:1", name="f", version=version, position=version, data=b"ok")
            )
        _sql(pg_server, f"UPDATE {schema}.snapshots SET data = 'bad' WHERE version = 2")
        assert [s.version for s in store.snapshots("s:1", "f")] == [1]


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:s3cret@host:abc/x",
        "postgresql://u:s3cret@host:99999/x",
        "postgresql://u:s3cret@[bad/x",
    ],
)
def test_a_malformed_url_is_one_line_without_the_url(url: str) -> None:
    with pytest.raises(StoreError, match="host or port cannot be read") as caught:
        store_module.open(url)
    assert "s3cret" not in str(caught.value)
    result = CliRunner().invoke(cli, ["--store", url, "streams"])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert "s3cret" not in result.output


def test_a_subscription_waits_out_a_database_it_cannot_reach(
    pg_url: str, relay: CuttingRelay, relayed_store: PostgresEventStore
) -> None:
    """docs/scaling.md: tailing loses nothing across a failover. While its store cannot be
    reached, a subscription returns nothing and raises nothing (it raised the first
    StoreError, which ended ``tail --follow`` with exit 1 when the cut came at a read);
    once the store is back it carries on from where it was, every event once."""
    with store_module.open(pg_url) as log:  # type: ignore[attr-defined]
        log.append("session:a", [_msg(n) for n in range(3)])
        feed = relayed_store.subscribe(1)
        assert [r.version for r in feed.poll(30.0)] == [1, 2, 3]
        relay.cut_now()
        log.append("session:a", [_msg(n) for n in range(3, 7)])
        for _ in range(3):
            assert feed.poll(0.3) == []
        relay.restore()
        got: list[int] = []
        give_up = time.monotonic() + 30.0
        while len(got) < 4 and time.monotonic() < give_up:
            got += [r.version for r in feed.poll(1.0)]
    assert got == [4, 5, 6, 7]


@pytest.mark.timeout(60)
def test_the_store_is_back_soon_after_the_database_is_whatever_the_outage_lasted(
    relay: CuttingRelay, relayed_store: PostgresEventStore
) -> None:
    """docs/scaling.md: a worker "keeps running and loses no wake" while its database is
    away. Once the database is back, the handle's reads work again within about a second,
    however long it was away. The pool kept replacing its broken connections with a
    doubling backoff for five minutes (psycopg_pool's default), so after 8 s away the
    store stayed out of reach until the try at 15 s: 7 s longer than the database."""
    for _ in range(4):  # the pool holds a few connections
        relayed_store.head()
    relay.cut_now()
    away = time.monotonic() + 8.0
    while time.monotonic() < away:  # used meanwhile, as a worker's polls would
        with contextlib.suppress(StoreError):
            relayed_store.head()
        time.sleep(0.2)  # real-time: the outage lasts real seconds
    relay.restore()
    back = time.monotonic()
    while True:
        try:
            relayed_store.head()
            break
        except StoreError:
            assert time.monotonic() - back < 30.0, "the store never came back"
    waited = time.monotonic() - back
    assert waited < 4.0, f"the store was back {waited:.1f} s after the database"


@pytest.mark.timeout(60)
def test_a_read_waiting_through_an_outage_gets_a_connection_once_the_database_is_back(
    pg_server: PostgresServer, pg_url: str, relay: CuttingRelay
) -> None:
    """A read that waits for a connection (a worker's only thread) while the database is
    away longer than the pool's tries at one (``RECONNECT_S``) gets one within about a
    second of the database's return. Once the pool gave up, it used to try again only
    for a *new* request: the one waiting sat out its whole wait (10 s here), and a
    worker's lease renewal landed long after the lease had expired."""
    url = pg_server.url("stalwart_test").replace(f":{pg_server.port}/", f":{relay.port}/")
    with PostgresEventStore(f"{url}?schema={schema_of(pg_url)}", connect_timeout=10.0) as db:
        db.head()
        relay.cut_now()
        answered: list[int] = []
        reader = threading.Thread(target=lambda: answered.append(db.head()), daemon=True)
        reader.start()  # finds its connection broken, then waits for another
        time.sleep(4.0)  # real-time: away for longer than the pool's 2 s of tries
        relay.restore()
        back = time.monotonic()
        reader.join(30.0)
        waited = time.monotonic() - back
    assert answered, "the waiting read never got a connection"
    assert waited < 4.0, f"the waiting read got a connection {waited:.1f} s after the database"
