"""The LMDB store's work queue (:class:`~stalwart.store.WorkQueue`): the ``due`` sub-database.

``due``       session stream -> [due at, version that wrote it, holder or None, held until]
``due-times`` due at (8 bytes, ordered as the times are) + session stream -> b""

Every write to them is a job of the environment's one writer, so it happens in the write
transaction of the append that changes it (or of the claim), never beside it; claims
and write-backs are group-committed with the appends queued beside them. The
sub-databases are made on first use; a store written before ``due`` existed gets a row
"due now" for each of its sessions, so a worker looks at every one once.

``due-times`` orders the rows by due time, so a claim reads the rows due now and the
first one after, not every row: with 100,000 sessions waiting on delayed wakes, a claim
scanning ``due`` held the writer (every append of every process on the directory) for
about 65 ms once a second per worker. It is derived from ``due``: a claim rebuilds it
when the two hold different numbers of entries (a store written before it existed), and
an entry whose time is not its row's (a row damaged on disk) is put right when a claim
reaches it.
"""

from __future__ import annotations

import math
import os
import struct
import threading
import weakref
from typing import Any, NamedTuple

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
_DBS: weakref.WeakKeyDictionary[_Environment, DueDbs] = weakref.WeakKeyDictionary()
_DBS_LOCK = threading.Lock()


def _forget_after_fork() -> None:
    # a parent thread may have held the lock at the fork: the child starts with its own
    global _DBS_LOCK  # noqa: PLW0603
    _DBS_LOCK = threading.Lock()
    _DBS.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


class DueDbs(NamedTuple):
    """The work queue's two sub-databases: the rows by stream and their due times."""

    rows: Any
    times: Any


def due_db(env: _Environment) -> DueDbs:
    """The environment's ``due`` and ``due-times`` sub-databases, made (and filled) on
    first use."""
    db: DueDbs | None = _DBS.get(env)
    if db is None:
        with _DBS_LOCK:
            db = _DBS.get(env)
            if db is None:
                db = env.submit(_OpenDue())
                _DBS[env] = db
    assert db is not None
    return db


class _OpenDue(_Job):
    def run(self, env: _Environment, txn: Any, batch: Any) -> None:
        times = env.env.open_db(b"due-times", txn=txn)  # filled by the first claim
        try:
            self.result = DueDbs(env.env.open_db(b"due", txn=txn, create=False), times)
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
        self.result = DueDbs(db, times)


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
        dbs: DueDbs = self.db
        key, version = self.stream_key, records[-1].version
        if self.due is not None:
            _put(txn, dbs, key, _get(txn, dbs.rows, key), self.due.at, version, None, 0.0)
            return
        hint = due_hint((r.event, r.ts) for r in records)
        if hint is None:
            return
        row = _get(txn, dbs.rows, key)
        if row is None:
            _put(txn, dbs, key, row, hint, version, None, 0.0)
        else:
            _put(txn, dbs, key, row, min(row[0], hint), version, row[2], row[3])


class ClaimDue(_Job):
    def __init__(self, db: DueDbs, owner: str, now: float, limit: int, hold_s: float) -> None:
        super().__init__()
        self.args = (db, owner, now, limit, hold_s)

    def run(self, env: _Environment, txn: Any, batch: Any) -> None:
        dbs, owner, now, limit, hold_s = self.args
        _sync_times(txn, dbs)
        due, stale = _due_rows(txn, dbs, owner, now, limit)
        for entry, key, row in stale:  # put right before the claims write their rows
            txn.delete(entry, db=dbs.times)
            if row is not None:
                txn.put(_time_key(row[0]) + key, b"", db=dbs.times)
        claimed = []
        for key, row in due:
            at = row[0]
            _put(txn, dbs, key, row, at, row[1], owner, now + hold_s)
            claimed.append(DueClaim(stream=key.decode(), due_at=at, version=row[1]))
        self.result = DueWork(claimed=claimed, next_at=_first_after(txn, dbs, now))


_Stale = tuple[bytes, bytes, _Row | None]


def _due_rows(
    txn: Any, dbs: DueDbs, owner: str, now: float, limit: int
) -> tuple[list[tuple[bytes, _Row]], list[_Stale]]:
    """Up to ``limit`` rows due at ``now`` that no other worker holds, earliest first
    (ties in stream order), and the entries of ``due-times`` met on the way whose time
    is not their row's (the row, None when it is gone)."""
    due: list[tuple[bytes, _Row]] = []
    stale: list[_Stale] = []
    seen: set[bytes] = set()
    last = _encode_time(now)
    for raw in txn.cursor(db=dbs.times).iternext(values=False):
        entry = bytes(raw)
        if entry[:8] > last or len(due) >= limit:
            break
        key = entry[8:]
        row = _get(txn, dbs.rows, key)
        if row is None or _time_key(row[0]) != entry[:8]:
            stale.append((entry, key, row))
            if row is None or row[0] > now:
                continue  # its own entry says when it is due
        if key in seen:
            continue
        seen.add(key)
        holder, until = row[2], row[3]
        if holder is None or holder == owner or until <= now:
            due.append((key, row))
    return due, stale


def _first_after(txn: Any, dbs: DueDbs, now: float) -> float | None:
    """The earliest due time after ``now`` (None: no row is due later)."""
    after = math.nextafter(now, math.inf)
    cursor = txn.cursor(db=dbs.times)
    if not math.isfinite(after) or not cursor.set_range(_encode_time(after)):
        return None
    return _decode_time(bytes(cursor.key()[:8]))


def _sync_times(txn: Any, dbs: DueDbs) -> None:
    """Rebuild ``due-times`` from ``due`` when they hold different numbers of entries:
    a store written before it existed, or a damaged row rewritten (its entry's time was
    not known). Once, not at every claim."""
    if txn.stat(dbs.rows)["entries"] == txn.stat(dbs.times)["entries"]:
        return
    txn.drop(dbs.times, delete=False)
    for key, value in txn.cursor(db=dbs.rows):
        row = _decoded(key, value)
        txn.put(_time_key(row[0]) + bytes(key), b"", db=dbs.times)


class SetDue(_Job):
    def __init__(self, db: DueDbs, key: bytes, version: int, at: float | None, owner: str) -> None:
        super().__init__()
        self.args = (db, key, version, at, owner)

    def run(self, env: _Environment, txn: Any, batch: Any) -> None:
        dbs, key, version, at, owner = self.args
        row = _get(txn, dbs.rows, key)
        if row is None or row[1] <= version:
            _put(txn, dbs, key, row, at, version, None, 0.0)
            self.result = True
            return
        if row[2] == owner:
            _put(txn, dbs, key, row, row[0], row[1], None, 0.0)
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
    txn: Any,
    dbs: DueDbs,
    key: bytes,
    old: _Row | None,
    at: float | None,
    version: int,
    holder: str | None,
    until: float,
) -> None:
    """Write (``at`` None: delete) ``key``'s row, whose row was ``old``, and move its
    ``due-times`` entry with it. The entry of a row that could not be read is not known:
    the new one is written all the same, and the entry left over makes the next claim
    rebuild the order (one entry more than rows)."""
    was = None if old is None else _time_key(old[0])
    now = None if at is None else _time_key(at)
    if was is not None and was != now:
        txn.delete(was + key, db=dbs.times)
    if at is None:
        txn.delete(key, db=dbs.rows)
        return
    txn.put(key, _ENCODE((at, version, holder, until)), db=dbs.rows)
    if now is not None and (now != was or old is _DAMAGED):
        txn.put(now + key, b"", db=dbs.times)


_SIGN = 1 << 63
_ALL = (1 << 64) - 1


def _encode_time(at: float) -> bytes:
    """``at`` as 8 bytes whose byte order is the order of the times (IEEE 754 bits with
    the sign bit flipped, and every bit of a negative one)."""
    (bits,) = struct.unpack(">Q", struct.pack(">d", at))
    bits = bits ^ _ALL if bits & _SIGN else bits | _SIGN
    encoded: bytes = bits.to_bytes(8, "big")
    return encoded


def _decode_time(raw: bytes) -> float:
    bits = int.from_bytes(raw, "big")
    bits = bits ^ _SIGN if bits & _SIGN else bits ^ _ALL
    (at,) = struct.unpack(">d", bits.to_bytes(8, "big"))
    return float(at)


def _time_key(at: float) -> bytes:
    """The ``due-times`` prefix of a row due at ``at``: a time that is not a number (a
    row a build before the check wrote) is due now, as a row that cannot be read is;
    ``-0.0`` is ``0.0``."""
    return _encode_time(at + 0.0 if math.isfinite(at) else 0.0)
