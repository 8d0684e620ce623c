"""The PostgreSQL store's tables, its append function, and their migrations.

Everything lives in one schema (``stalwart`` unless the URL says ``?schema=``):

``head``            one row: the newest committed position (the position counter)
``events``          position -> stream, version, metadata, the event's msgpack bytes
``streams``         stream -> version, last position, last ts, lease epoch
``snapshots``       (stream, fold name, version) -> position, crc32, data
``due``             session stream -> due time, the version that wrote it, a hold:
                    the work queue (``_postgres_due``), kept by ``append_batch``
``schema_version``  the migrations applied, one row each

``append_batch(...)`` does a batch of appends in one statement, so it is one round trip
and one transaction on an autocommit connection; each append in it succeeds or fails
(a version conflict, a fence) on its own. Its order is what makes positions gap-free
and skip-free: it locks the batch's stream rows (sorted, so two batches never
deadlock; same-stream appenders queue there, not on the counter), checks each append's
``expected_version`` and fence, and only then locks the one ``head`` row. That row lock
is held until commit, so appends take positions one transaction after another: N+1
cannot be assigned before N's transaction has committed and become visible (PostgreSQL
makes a commit visible before it releases its locks), and a rolled-back append gives
its numbers back. A reader that sees N+1 therefore sees everything before it, and
``head`` is always the end of a gap-free prefix. The batch ends with ``pg_notify``,
delivered on commit: the doorbell of tailing readers.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from stalwart._logs import get_logger
from stalwart.errors import StoreError, StoreNotFoundError

log = get_logger(__name__)

#: The schema version this code writes; a database at a newer one is refused.
SCHEMA_VERSION = 2

_V1 = """
CREATE TABLE {s}.head (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    position bigint NOT NULL
);
INSERT INTO {s}.head (singleton, position) VALUES (true, 0);

CREATE TABLE {s}.events (
    position bigint PRIMARY KEY,
    stream text COLLATE "C" NOT NULL,
    version bigint NOT NULL,
    ts double precision NOT NULL,
    id text NOT NULL,
    causation_id text,
    correlation_id text,
    schema integer NOT NULL,
    type text NOT NULL,
    data bytea NOT NULL,
    UNIQUE (stream, version)
);

CREATE TABLE {s}.streams (
    stream text COLLATE "C" PRIMARY KEY,
    version bigint NOT NULL DEFAULT 0,
    last_position bigint NOT NULL DEFAULT 0,
    last_ts double precision NOT NULL DEFAULT 0,
    lease_epoch bigint NOT NULL DEFAULT 0
);

CREATE TABLE {s}.snapshots (
    stream text COLLATE "C" NOT NULL,
    name text COLLATE "C" NOT NULL,
    version bigint NOT NULL,
    position bigint NOT NULL,
    crc bigint NOT NULL,
    data bytea NOT NULL,
    PRIMARY KEY (stream, name, version)
);

CREATE FUNCTION {s}.append_batch(
    p_streams text[],
    p_expected bigint[],
    p_fence bigint[],
    p_claim boolean[],
    p_counts integer[],
    p_ts double precision[],
    p_ids text[],
    p_causation text[],
    p_correlation text[],
    p_schemas integer[],
    p_types text[],
    p_data bytea[]
) RETURNS TABLE (outcome text, first_position bigint, old_version bigint, epoch bigint)
LANGUAGE plpgsql AS $fn$
#variable_conflict use_column
DECLARE
    sname text;
    a integer;
    v bigint;
    e bigint;
    n integer;
    head_before bigint;
    h bigint;
    lo integer := 1;
    hi integer;
BEGIN
    -- 1. every stream row of the batch, locked in one order for everyone (no deadlock);
    --    a concurrent creator makes the insert wait for its commit, then do nothing
    FOR sname IN SELECT DISTINCT x FROM unnest(p_streams) AS x ORDER BY x LOOP
        PERFORM 1 FROM {s}.streams st WHERE st.stream = sname FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO {s}.streams (stream) VALUES (sname) ON CONFLICT DO NOTHING;
            PERFORM 1 FROM {s}.streams st WHERE st.stream = sname FOR UPDATE;
        END IF;
    END LOOP;
    -- 2. each append in order: its checks, then its events
    FOR a IN 1 .. cardinality(p_streams) LOOP
        n := p_counts[a];
        hi := lo + n - 1;
        SELECT st.version, st.lease_epoch INTO v, e
            FROM {s}.streams st WHERE st.stream = p_streams[a];
        outcome := 'ok';
        IF p_expected[a] IS NOT NULL AND p_expected[a] <> v THEN
            outcome := 'conflict';
        ELSIF p_fence[a] IS NOT NULL THEN
            IF (p_claim[a] AND p_fence[a] <= e) OR (NOT p_claim[a] AND p_fence[a] <> e) THEN
                outcome := 'fenced';
            ELSE
                e := p_fence[a];
            END IF;
        END IF;
        IF outcome = 'ok' THEN
            IF h IS NULL THEN
                -- the position counter: taken last, held until commit (module docstring)
                SELECT hd.position INTO h FROM {s}.head hd FOR UPDATE;
                head_before := h;
            END IF;
            INSERT INTO {s}.events
                (position, stream, version, ts, id, causation_id, correlation_id, schema,
                 type, data)
                SELECT h + u.i, p_streams[a], v + u.i, u.ts, u.id, u.c, u.k, u.sc, u.ty, u.d
                FROM unnest(p_ts[lo:hi], p_ids[lo:hi], p_causation[lo:hi],
                            p_correlation[lo:hi], p_schemas[lo:hi],
                            p_types[lo:hi], p_data[lo:hi])
                    WITH ORDINALITY AS u(ts, id, c, k, sc, ty, d, i);
            UPDATE {s}.streams
                SET version = v + n, last_position = h + n, last_ts = p_ts[hi],
                    lease_epoch = e
                WHERE stream = p_streams[a];
            first_position := h + 1;
            h := h + n;
        ELSE
            first_position := 0;
        END IF;
        old_version := v;
        epoch := e;
        RETURN NEXT;
        lo := hi + 1;
    END LOOP;
    IF h IS NOT NULL AND h > head_before THEN
        UPDATE {s}.head SET position = h;
        PERFORM pg_notify({channel}, h::text);
    END IF;
END
$fn$;
"""

#: Version 2: the work queue (``due``), written by ``append_batch`` in the append's
#: transaction. Sessions already in the log are due at once, so a worker looks at each.
_V2 = """
CREATE TABLE {s}.due (
    stream text COLLATE "C" PRIMARY KEY,
    due_at double precision NOT NULL,
    version bigint NOT NULL,
    held_by text,
    held_until double precision NOT NULL DEFAULT 0
);
CREATE INDEX due_at_idx ON {s}.due (due_at);
INSERT INTO {s}.due (stream, due_at, version)
    SELECT stream, 0, 0 FROM {s}.streams WHERE stream LIKE 'session:%' AND version > 0;

DROP FUNCTION {s}.append_batch(text[], bigint[], bigint[], boolean[], integer[],
    double precision[], text[], text[], text[], integer[], text[], bytea[]);

CREATE FUNCTION {s}.append_batch(
    p_streams text[],
    p_expected bigint[],
    p_fence bigint[],
    p_claim boolean[],
    p_counts integer[],
    p_ts double precision[],
    p_ids text[],
    p_causation text[],
    p_correlation text[],
    p_schemas integer[],
    p_types text[],
    p_data bytea[],
    p_due_kind smallint[],
    p_due double precision[]
) RETURNS TABLE (outcome text, first_position bigint, old_version bigint, epoch bigint)
LANGUAGE plpgsql AS $fn$
#variable_conflict use_column
DECLARE
    sname text;
    a integer;
    v bigint;
    e bigint;
    n integer;
    head_before bigint;
    h bigint;
    lo integer := 1;
    hi integer;
BEGIN
    -- 1. every stream row of the batch, locked in one order for everyone (no deadlock);
    --    a concurrent creator makes the insert wait for its commit, then do nothing
    FOR sname IN SELECT DISTINCT x FROM unnest(p_streams) AS x ORDER BY x LOOP
        PERFORM 1 FROM {s}.streams st WHERE st.stream = sname FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO {s}.streams (stream) VALUES (sname) ON CONFLICT DO NOTHING;
            PERFORM 1 FROM {s}.streams st WHERE st.stream = sname FOR UPDATE;
        END IF;
    END LOOP;
    -- 2. each append in order: its checks, then its events
    FOR a IN 1 .. cardinality(p_streams) LOOP
        n := p_counts[a];
        hi := lo + n - 1;
        SELECT st.version, st.lease_epoch INTO v, e
            FROM {s}.streams st WHERE st.stream = p_streams[a];
        outcome := 'ok';
        IF p_expected[a] IS NOT NULL AND p_expected[a] <> v THEN
            outcome := 'conflict';
        ELSIF p_fence[a] IS NOT NULL THEN
            IF (p_claim[a] AND p_fence[a] <= e) OR (NOT p_claim[a] AND p_fence[a] <> e) THEN
                outcome := 'fenced';
            ELSE
                e := p_fence[a];
            END IF;
        END IF;
        IF outcome = 'ok' THEN
            IF h IS NULL THEN
                -- the position counter: taken last, held until commit (module docstring)
                SELECT hd.position INTO h FROM {s}.head hd FOR UPDATE;
                head_before := h;
            END IF;
            INSERT INTO {s}.events
                (position, stream, version, ts, id, causation_id, correlation_id, schema,
                 type, data)
                SELECT h + u.i, p_streams[a], v + u.i, u.ts, u.id, u.c, u.k, u.sc, u.ty, u.d
                FROM unnest(p_ts[lo:hi], p_ids[lo:hi], p_causation[lo:hi],
                            p_correlation[lo:hi], p_schemas[lo:hi],
                            p_types[lo:hi], p_data[lo:hi])
                    WITH ORDINALITY AS u(ts, id, c, k, sc, ty, d, i);
            UPDATE {s}.streams
                SET version = v + n, last_position = h + n, last_ts = p_ts[hi],
                    lease_epoch = e
                WHERE stream = p_streams[a];
            -- the work queue's row, in the same transaction (module docstring)
            IF p_due_kind[a] = 1 AND p_due[a] IS NULL THEN
                DELETE FROM {s}.due WHERE stream = p_streams[a];
            ELSIF p_due_kind[a] = 1 THEN
                INSERT INTO {s}.due AS d (stream, due_at, version)
                    VALUES (p_streams[a], p_due[a], v + n)
                    ON CONFLICT (stream) DO UPDATE SET due_at = EXCLUDED.due_at,
                        version = EXCLUDED.version, held_by = NULL, held_until = 0;
            ELSIF p_due_kind[a] = 2 THEN
                INSERT INTO {s}.due AS d (stream, due_at, version)
                    VALUES (p_streams[a], p_due[a], v + n)
                    ON CONFLICT (stream) DO UPDATE SET
                        due_at = LEAST(d.due_at, EXCLUDED.due_at), version = EXCLUDED.version;
            END IF;
            first_position := h + 1;
            h := h + n;
        ELSE
            first_position := 0;
        END IF;
        old_version := v;
        epoch := e;
        RETURN NEXT;
        lo := hi + 1;
    END LOOP;
    IF h IS NOT NULL AND h > head_before THEN
        UPDATE {s}.head SET position = h;
        PERFORM pg_notify({channel}, h::text);
    END IF;
END
$fn$;
"""

#: Migration ``i`` takes the schema from version ``i`` to ``i + 1``.
MIGRATIONS: tuple[str, ...] = (_V1, _V2)


def channel_name(schema: str) -> str:
    """The LISTEN/NOTIFY channel of a store's schema (at most 63 bytes)."""
    return f"stalwart:{schema}"[:63]


def installed_version(conn: psycopg.Connection[Any], schema: str) -> int | None:
    """The schema version in the database, or None when there is no stalwart store."""
    table = f"{sql.Identifier(schema).as_string(conn)}.schema_version"
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()
    if row is None or not row[0]:
        return None
    query = sql.SQL("SELECT coalesce(max(version), 0) FROM {}.schema_version").format(
        sql.Identifier(schema)
    )
    found = conn.execute(query).fetchone()
    return int(found[0]) if found else 0


_SCHEMA_EXISTS = "SELECT 1 FROM pg_namespace WHERE nspname = %s"


def migrate(conn: psycopg.Connection[Any], schema: str, location: str) -> int | None:
    """Create or upgrade the store's schema in one transaction; return the version before
    (0: created it), or None when it was current by the time the lock was had.

    Concurrent openers (several workers starting at once) queue on an advisory lock, so
    each migration runs once; those that waited find it done, and say so (they said
    "upgraded from version 2 to 2"). A database at a newer version than this code is
    refused.

    The schema, and the table of migrations, are created only when they are not there:
    PostgreSQL checks the right to create a schema in the database before it looks
    whether one exists, so ``CREATE SCHEMA IF NOT EXISTS`` refused a role whose schema an
    administrator made for it (``CREATE SCHEMA ... AUTHORIZATION role``).
    """
    ident = sql.Identifier(schema)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"stalwart:{schema}",))
        if conn.execute(_SCHEMA_EXISTS, (schema,)).fetchone() is None:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(ident))
        found = installed_version(conn, schema)
        if found is None:
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {}.schema_version (version integer PRIMARY KEY, "
                    "applied_at timestamptz NOT NULL DEFAULT now())"
                ).format(ident)
            )
        before = found or 0
        check_version(before, location)
        for version in range(before, SCHEMA_VERSION):
            script = MIGRATIONS[version].replace("{s}", ident.as_string(conn))
            script = script.replace("{channel}", sql.Literal(channel_name(schema)).as_string(conn))
            conn.execute(script.encode())
            conn.execute(
                sql.SQL("INSERT INTO {}.schema_version (version) VALUES (%s)").format(ident),
                (version + 1,),
            )
    if before == SCHEMA_VERSION:
        return None  # another opener made it current while this one waited for the lock
    log.info(
        "store.schema_migrated",
        location=location,
        schema=schema,
        from_version=before,
        to_version=SCHEMA_VERSION,
    )
    return before


def check_version(version: int, location: str) -> None:
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"the store at {location} has schema version {version}; this version of "
            f"stalwart reads up to {SCHEMA_VERSION}: upgrade stalwart"
        )


def ensure_schema(
    conn: psycopg.Connection[Any],
    schema: str,
    location: str,
    *,
    create: bool,
    read_only: bool = False,
) -> int | None:
    """Make sure the schema is there and current, creating it only when ``create``.

    Returns the version it migrated from (0: created), or None when it was current.
    ``read_only`` changes nothing: an older schema is refused, not migrated.
    """
    version = installed_version(conn, schema)
    if version is None and (read_only or not create):
        raise StoreNotFoundError(
            f"no stalwart store at {location} (schema {schema!r}): "
            f"create it with `stalwart db init --store {location}`"
        )
    if version is not None:
        check_version(version, location)
        if version == SCHEMA_VERSION:
            return None
        if read_only:
            raise StoreError(
                f"the store at {location} has schema version {version}; this version of "
                f"stalwart reads {SCHEMA_VERSION}, and a read changes nothing: migrate it "
                f"with `stalwart db init --store {location}`"
            )
    return migrate(conn, schema, location)


COLUMNS = "position, stream, version, ts, id, causation_id, correlation_id, schema, data"
EVENT_COLUMNS = ", ".join(f"e.{column}" for column in COLUMNS.split(", "))


class Statements:
    """The store's SQL, with its schema name filled in once."""

    def __init__(self, schema: sql.Identifier) -> None:
        def q(text: str) -> sql.Composed:
            return sql.SQL(text).format(s=schema)

        self.append_batch = q(
            "SELECT outcome, first_position, old_version, epoch FROM {s}.append_batch("
            "%s::text[], %s::int8[], %s::int8[], %s::bool[], %s::int4[], %s::float8[], "
            "%s::text[], %s::text[], %s::text[], %s::int4[], %s::text[], %s::bytea[], "
            "%s::int2[], %s::float8[])"
        )
        # A read's rows, each with the key the read must reach (the head; the stream's
        # version), read in the same snapshot, so a key missing before it is a hole, not
        # the end of what is committed; one row of NULLs and that key when none is found.
        self.read_all = q(
            f"SELECT {EVENT_COLUMNS}, h.position FROM (SELECT position FROM {{s}}.head LIMIT 1) h "
            "LEFT JOIN {s}.events e ON e.position BETWEEN %s AND %s ORDER BY e.position"
        )
        self.read_stream = q(
            f"SELECT {EVENT_COLUMNS}, st.version FROM "
            "(SELECT coalesce(max(version), 0) AS version FROM {s}.streams "
            "WHERE stream = %s) st "
            "LEFT JOIN {s}.events e ON e.stream = %s AND e.version BETWEEN %s AND %s "
            "ORDER BY e.version"
        )
        # where a hole in a stream's versions is: the position of its first record after
        # the hole (NULL: none), and the stream's last position and version
        self.stream_hole = q(
            "SELECT (SELECT position FROM {s}.events WHERE stream = %s AND version > %s "
            "ORDER BY version LIMIT 1), last_position, version FROM {s}.streams "
            "WHERE stream = %s"
        )
        # where a hole in the log ends: the position of its first record after the hole
        # (NULL: none), and the head
        self.log_hole = q(
            "SELECT (SELECT min(position) FROM {s}.events WHERE position > %s), "
            "(SELECT position FROM {s}.head LIMIT 1)"
        )
        self.head = q("SELECT position FROM {s}.head")
        self.stream_row = q(
            "SELECT version, lease_epoch FROM {s}.streams WHERE stream = %s AND version > 0"
        )
        self.streams = q(
            "SELECT stream, version, last_position, last_ts, lease_epoch FROM {s}.streams "
            "WHERE version > 0 ORDER BY stream"
        )
        self.put_snapshot = q(
            "INSERT INTO {s}.snapshots (stream, name, version, position, crc, data) "
            "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (stream, name, version) "
            "DO UPDATE SET position = EXCLUDED.position, crc = EXCLUDED.crc, data = EXCLUDED.data"
        )
        # the names of a stream's snapshots of every version of one fold (``f@v%``)
        self.fold_versions = q(
            "SELECT DISTINCT name FROM {s}.snapshots WHERE stream = %s AND left(name, %s) = %s"
        )
        self.drop_snapshots = q("DELETE FROM {s}.snapshots WHERE stream = %s AND name = ANY(%s)")
        self.prune_snapshots = q(
            "DELETE FROM {s}.snapshots WHERE stream = %s AND name = %s AND version NOT IN "
            "(SELECT version FROM {s}.snapshots WHERE stream = %s AND name = %s "
            "ORDER BY version DESC LIMIT %s)"
        )
        # the session of a lost append, gone before we look (waits up to 5 s for it);
        # run as the login role (``as_login_role``): sessions are the login role's
        self.as_login_role = q("SET LOCAL ROLE NONE")
        self.end_session = q(
            "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE pid = %s "
            "AND usename = session_user AND datname = current_database()"
        )
        self.session_alive = q("SELECT 1 FROM pg_stat_activity WHERE pid = %s")
        self.find_event = q(
            "SELECT position, version FROM {s}.events WHERE stream = %s AND id = %s "
            "ORDER BY version DESC LIMIT 1"
        )
        self.snapshots = q(
            "SELECT version, position, crc, data FROM {s}.snapshots "
            "WHERE stream = %s AND name = %s ORDER BY version DESC"
        )
