"""The PostgreSQL store's tables, its append function, and their migrations.

Everything lives in one schema (``stalwart`` unless the URL says ``?schema=``):

``head``            one row: the newest committed position (the position counter)
``events``          position -> stream, version, metadata, the event's msgpack bytes
``streams``         stream -> version, last position, last ts, lease epoch
``snapshots``       (stream, fold name, version) -> position, crc32, data
``schema_version``  the migrations applied, one row each

``append(...)`` does a whole append in one statement, so it is one round trip and one
transaction on an autocommit connection. Its order is what makes positions gap-free
and skip-free: it locks the stream row (so same-stream appenders queue there, not on
the counter), checks ``expected_version`` and the fence, and only then updates the one
``head`` row. That row lock is held until commit, so appends take positions one
transaction after another: N+1 cannot be assigned before N's transaction has committed
and become visible (PostgreSQL makes a commit visible before it releases its locks),
and a rolled-back append gives its numbers back. A reader that sees N+1 therefore sees
everything before it, and ``head`` is always the end of a gap-free prefix. The append
ends with ``pg_notify``, delivered on commit: the doorbell of tailing readers.
"""

from __future__ import annotations

from typing import Any

import psycopg
import structlog
from psycopg import sql

from stalwart.errors import StoreError, StoreNotFoundError

log = structlog.get_logger(__name__)

#: The schema version this code writes; a database at a newer one is refused.
SCHEMA_VERSION = 1

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

CREATE FUNCTION {s}.append(
    p_stream text,
    p_expected bigint,
    p_fence bigint,
    p_claim boolean,
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
    v bigint;
    e bigint;
    n integer := cardinality(p_data);
    h bigint;
BEGIN
    SELECT st.version, st.lease_epoch INTO v, e
        FROM {s}.streams st WHERE st.stream = p_stream FOR UPDATE;
    IF NOT FOUND THEN
        IF p_expected IS NOT NULL AND p_expected <> 0 THEN
            RETURN QUERY SELECT 'conflict'::text, 0::bigint, 0::bigint, 0::bigint;
            RETURN;
        END IF;
        -- a concurrent creator makes this wait for its commit, then do nothing
        INSERT INTO {s}.streams (stream) VALUES (p_stream) ON CONFLICT DO NOTHING;
        SELECT st.version, st.lease_epoch INTO v, e
            FROM {s}.streams st WHERE st.stream = p_stream FOR UPDATE;
    END IF;
    IF p_expected IS NOT NULL AND p_expected <> v THEN
        RETURN QUERY SELECT 'conflict'::text, 0::bigint, v, e;
        RETURN;
    END IF;
    IF p_fence IS NOT NULL THEN
        IF (p_claim AND p_fence <= e) OR (NOT p_claim AND p_fence <> e) THEN
            RETURN QUERY SELECT 'fenced'::text, 0::bigint, v, e;
            RETURN;
        END IF;
        e := p_fence;
    END IF;
    -- the position counter: taken last, held until commit (see the module docstring)
    UPDATE {s}.head SET position = position + n RETURNING position - n INTO h;
    INSERT INTO {s}.events
        (position, stream, version, ts, id, causation_id, correlation_id, schema, type, data)
        SELECT h + u.i, p_stream, v + u.i, u.ts, u.id, u.c, u.k, u.sc, u.ty, u.d
        FROM unnest(p_ts, p_ids, p_causation, p_correlation, p_schemas, p_types, p_data)
            WITH ORDINALITY AS u(ts, id, c, k, sc, ty, d, i);
    UPDATE {s}.streams
        SET version = v + n, last_position = h + n, last_ts = p_ts[n], lease_epoch = e
        WHERE stream = p_stream;
    PERFORM pg_notify({channel}, (h + n)::text);
    RETURN QUERY SELECT 'ok'::text, h + 1, v, e;
END
$fn$;
"""

#: Migration ``i`` takes the schema from version ``i`` to ``i + 1``.
MIGRATIONS: tuple[str, ...] = (_V1,)


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


def migrate(conn: psycopg.Connection[Any], schema: str, location: str) -> int:
    """Create or upgrade the store's schema in one transaction; return the version before.

    Concurrent openers (several workers starting at once) queue on an advisory lock, so
    each migration runs once. A database at a newer version than this code is refused.
    """
    ident = sql.Identifier(schema)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"stalwart:{schema}",))
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {}.schema_version ("
                "version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            ).format(ident)
        )
        before = installed_version(conn, schema) or 0
        check_version(before, location)
        for version in range(before, SCHEMA_VERSION):
            script = MIGRATIONS[version].replace("{s}", ident.as_string(conn))
            script = script.replace("{channel}", sql.Literal(channel_name(schema)).as_string(conn))
            conn.execute(script.encode())
            conn.execute(
                sql.SQL("INSERT INTO {}.schema_version (version) VALUES (%s)").format(ident),
                (version + 1,),
            )
    if before < SCHEMA_VERSION:
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
    conn: psycopg.Connection[Any], schema: str, location: str, *, create: bool
) -> int | None:
    """Make sure the schema is there and current, creating it only when ``create``.

    Returns the version it migrated from (0: created), or None when it was current.
    """
    version = installed_version(conn, schema)
    if version is None and not create:
        raise StoreNotFoundError(
            f"no stalwart store at {location} (schema {schema!r}): "
            f"create it with `stalwart db init --store {location}`"
        )
    if version is not None:
        check_version(version, location)
        if version == SCHEMA_VERSION:
            return None
    return migrate(conn, schema, location)
