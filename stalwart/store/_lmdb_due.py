"""The LMDB store's work queue (:class:`~stalwart.store.WorkQueue`): the ``due`` sub-database.

``due``  session stream -> [due at, version that wrote it, holder or None, held until]

Every write to it is a job of the environment's one writer, so it happens in the write
transaction of the append that changes it (or of the claim), never beside it; claims
and write-backs are group-committed with the appends queued beside them. The
sub-database is made on first use; a store written before it existed gets a row "due
now" for each of its sessions, so a worker looks at every one once.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import lmdb
import msgspec

from stalwart._logs import get_logger
from stalwart.events import UNREADABLE, RecordedEvent
from stalwart.state import due_hint

from ._environment import _Append, _Environment, _Job
from ._protocol import Due, DueClaim, DueWork

SESSION_PREFIX = b"session:"

log = get_logger(__name__)

_Row = tuple[float, int, str | None, float]
_ENCODE = msgspec.msgpack.Encoder().encode
_DECODE = msgspec.msgpack.Decoder(tuple[float, int, str | None, float]).decode
_DBS: weakref.WeakKeyDictionary[_Environment, Any] = weakref.WeakKeyDictionary()
_DBS_LOCK = threading.Lock()


def _forget_after_fork() -> None:
    # a parent thread may have held the lock at the fork: the child starts with its own
    global _DBS_LOCK  # noqa: PLW0603
    _DBS_LOCK = threading.Lock()
    _DBS.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def due_db(env: _Environment) -> Any:
    """The environment's ``due`` sub-database, made (and filled) on first use."""
    db = _DBS.get(env)
    if db is None:
        with _DBS_LOCK:
            db = _DBS.get(env)
            if db is None:
                db = env.submit(_OpenDue())
                _DBS[env] = db
    return db


class _OpenDue(_Job):
    def run(self, env: _Environment, txn: Any, batch: Any) -> None:
        try:
            self.result = env.env.open_db(b"due", txn=txn, create=False)
            return
        except lmdb.NotFoundError:
            pass
        db = env.env.open_db(b"due", txn=txn)
        cursor = txn.cursor(db=env.stream_db)
        if cursor.set_range(SESSION_PREFIX):
            for key in cursor.iternext(values=False):
                if not bytes(key).startswith(SESSION_PREFIX):
                    break
                txn.put(bytes(key), _ENCODE((0.0, 0, None, 0.0)), db=db)
        self.result = db


class DueAppend(_Append):
    """An append that also writes its stream's due row (``due`` exact, else the hint)."""

    __slots__ = ("db", "due")

    def __init__(self, *args: Any, due: Due | None, db: Any) -> None:
        super().__init__(*args)
        self.due = due
        self.db = db

    def run(self, env: _Environment, txn: Any, batch: Any) -> None:
        super().run(env, txn, batch)
        records: list[RecordedEvent] | None = self.result
        if self.error is not None or not records:
            return
        key, version = self.stream_key, records[-1].version
        if self.due is not None:
            _put(txn, self.db, key, self.due.at, version, None, 0.0)
            return
        hint = due_hint((r.event, r.ts) for r in records)
        if hint is None:
            return
        row = _get(txn, self.db, key)
        if row is None:
            _put(txn, self.db, key, hint, version, None, 0.0)
        else:
            _put(txn, self.db, key, min(row[0], hint), version, row[2], row[3])


class ClaimDue(_Job):
    def __init__(self, db: Any, owner: str, now: float, limit: int, hold_s: float) -> None:
        super().__init__()
        self.args = (db, owner, now, limit, hold_s)

    def run(self, env: _Environment, txn: Any, batch: Any) -> None:
        db, owner, now, limit, hold_s = self.args
        due: list[tuple[float, bytes, _Row]] = []
        later: float | None = None
        for key, value in txn.cursor(db=db):
            row = _decoded(key, value)
            at, _, holder, until = row
            if at > now:
                later = at if later is None else min(later, at)
            elif holder is None or holder == owner or until <= now:
                due.append((at, bytes(key), row))
        due.sort(key=lambda item: item[0])
        claimed = []
        for at, key, row in due[:limit]:
            _put(txn, db, key, at, row[1], owner, now + hold_s)
            claimed.append(DueClaim(stream=key.decode(), due_at=at, version=row[1]))
        self.result = DueWork(claimed=claimed, next_at=later)


class SetDue(_Job):
    def __init__(self, db: Any, key: bytes, version: int, at: float | None, owner: str) -> None:
        super().__init__()
        self.args = (db, key, version, at, owner)

    def run(self, env: _Environment, txn: Any, batch: Any) -> None:
        db, key, version, at, owner = self.args
        row = _get(txn, db, key)
        if row is None or row[1] <= version:
            _put(txn, db, key, at, version, None, 0.0)
            self.result = True
            return
        if row[2] == owner:
            _put(txn, db, key, row[0], row[1], None, 0.0)
        self.result = False


def _get(txn: Any, db: Any, key: bytes) -> _Row | None:
    raw = txn.get(key, db=db)
    return None if raw is None else _decoded(key, raw)


#: What a due row that cannot be read counts as: due now, held by nobody, written by no
#: version (so the next write-back replaces it). The rows are derived from the log, and
#: the worker that claims the session folds it and writes the row again.
_DAMAGED: _Row = (0.0, 0, None, 0.0)


def _decoded(key: bytes, raw: bytes) -> _Row:
    """The row, or :data:`_DAMAGED` for one that cannot be read (one damaged row must
    not stop the claims, and the appends, of every other session)."""
    try:
        return _DECODE(raw)
    except UNREADABLE:  # damaged bytes
        log.warning("store.due_row_unreadable", stream=bytes(key).decode(errors="replace"))
        return _DAMAGED


def _put(
    txn: Any, db: Any, key: bytes, at: float | None, version: int, holder: str | None, until: float
) -> None:
    if at is None:
        txn.delete(key, db=db)
    else:
        txn.put(key, _ENCODE((at, version, holder, until)), db=db)
