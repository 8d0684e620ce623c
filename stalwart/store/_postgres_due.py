"""The PostgreSQL store's work queue (:class:`~stalwart.store.WorkQueue`): the ``due`` table.

``due``  stream -> due_at, version (of the append or fold that wrote it), held_by,
held_until; rows only for session streams with work (a row whose fold found none is
deleted).

Appends write their row inside ``append_batch`` (``_postgres_schema``), so a row never
disagrees with a committed append. A claim is one ``UPDATE ... RETURNING`` over a
``SELECT ... ORDER BY due_at LIMIT n FOR UPDATE SKIP LOCKED``: concurrent workers each
lock different due rows and never wait on each other's (nor on a row an append is
writing: that one is picked up at the next poll). A worker's write-back of what its
fold found is conditional on the row's version, in the same statement, so it never
overwrites the mark of an append it has not folded.

A row whose time is not a number (``NaN``: a ``set_due`` or ``Due`` given one, a row
edited by hand) is due now and held by nobody, as LMDB reads a row it cannot decode;
the claim rewrites it to 0 and the worker's fold writes it again. PostgreSQL sorts
``NaN`` above every number, so such a row was never due, its session never claimed
again, and ``next_at`` came back ``nan``.

Claims and write-backs commit with ``synchronous_commit = off``: they are hints, so one
lost in a crash costs a worker a fold at most (the rows fall back to an earlier, never a
later, due time), and a worker does not wait for a WAL flush to hand out work. Appends,
and the due rows written with them, stay fully durable.
"""

from __future__ import annotations

from typing import Any

from psycopg import sql

from ._postgres_connect import Connections
from ._protocol import DueClaim, DueWork


class DueStatements:
    def __init__(self, schema: sql.Identifier) -> None:
        def q(text: str) -> sql.Composed:
            return sql.SQL(text).format(s=schema)

        # each write of hints turns off waiting for its own WAL flush, in the statement
        hint = "(SELECT set_config('synchronous_commit', 'off', true)) AS hint"
        # a NaN due_at or held_until is a damaged row: due now, held by nobody (docstring)
        self.claim = q(
            "WITH c AS (SELECT stream FROM {s}.due WHERE (due_at <= %s OR due_at = 'NaN') "
            "AND (held_by IS NULL OR held_by = %s OR held_until <= %s "
            "OR held_until = 'NaN') ORDER BY due_at LIMIT %s FOR UPDATE SKIP LOCKED) "
            f"UPDATE {{s}}.due d SET held_by = %s, held_until = %s, "
            "due_at = CASE WHEN d.due_at = 'NaN' THEN 0 ELSE d.due_at END "
            f"FROM c, {hint} WHERE d.stream = c.stream RETURNING d.stream, d.due_at, d.version"
        )
        self.next_at = q("SELECT min(due_at) FROM {s}.due WHERE due_at > %s AND due_at <> 'NaN'")
        self.set = q(
            "INSERT INTO {s}.due AS d (stream, due_at, version) "
            f"SELECT %s, %s::float8, %s::int8 FROM {hint} "
            "ON CONFLICT (stream) DO UPDATE SET due_at = EXCLUDED.due_at, "
            "version = EXCLUDED.version, held_by = NULL, held_until = 0 "
            "WHERE d.version <= EXCLUDED.version RETURNING 1"
        )
        self.clear = q(
            f"DELETE FROM {{s}}.due USING {hint} WHERE stream = %s AND version <= %s RETURNING 1"
        )
        self.exists = q("SELECT 1 FROM {s}.due WHERE stream = %s")
        self.release = q(
            f"UPDATE {{s}}.due SET held_by = NULL, held_until = 0 FROM {hint} "
            "WHERE stream = %s AND held_by = %s RETURNING 1"
        )


def _hint(db: Connections, doing: str, query: Any, params: tuple[Any, ...]) -> list[Any]:
    """Run a write of hints (its statement sets ``synchronous_commit`` off for itself)."""
    return db.fetch(doing, query, params)


def claim_due(
    db: Connections, q: DueStatements, owner: str, now: float, limit: int, hold_s: float
) -> DueWork:
    params = (now, owner, now, limit, owner, now + hold_s)
    rows = _hint(db, "claim due sessions", q.claim, params)
    rows.sort(key=lambda row: row[1])
    later = db.fetch("read the next due time", q.next_at, (now,))
    return DueWork(
        claimed=[DueClaim(stream=s, due_at=at, version=v) for s, at, v in rows],
        next_at=later[0][0] if later else None,
    )


def set_due(
    db: Connections, q: DueStatements, stream: str, version: int, at: float | None, owner: str
) -> bool:
    if at is None:
        done = _hint(db, "clear a due time", q.clear, (stream, version))
    else:
        done = _hint(db, "set a due time", q.set, (stream, at, version))
    if done:
        return True
    if at is None and not db.fetch("read a due row", q.exists, (stream,)):
        return True  # no row is what "no work" writes: as on LMDB, that is written
    _hint(db, "release a due row", q.release, (stream, owner))
    return False
