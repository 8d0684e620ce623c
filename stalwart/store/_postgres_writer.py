"""Group commit for the PostgreSQL store: the appends waiting in a process go as one batch.

Positions are taken one commit after another (see ``_postgres_schema``), so every
transaction pays a WAL flush while holding the position counter. One writer thread per
store handle takes every append queued while the previous batch was committing and
sends them in one ``append_batch`` call: one round trip, one transaction, one flush
for all of them, each append still succeeding or failing on its own. A batch that the
server refuses as a whole (a value it cannot take) is retried one append at a time, so
one bad append fails alone; a batch whose connection was lost is recovered by the store
(``PostgresEventStore._recover``), which tells each append's outcome on its own, or
fails every append in it with that error when it cannot tell.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from stalwart.errors import (
    AppendInDoubtError,
    StoreClosedError,
    StoreError,
    StoreUnavailableError,
)

from ._protocol import Fence, NewEvent

MAX_BATCH_EVENTS = 4096
#: a batch carries at most this many bytes of records (an append larger goes alone):
#: PostgreSQL refuses a message over 1 GB, which would fail every append in the batch
MAX_BATCH_BYTES = 64 << 20
#: what ``append_batch`` returns for one append: outcome, first position, old version, epoch
Result = tuple[str, int, int, int]
#: one append's outcome as a batch's sender tells it: its result, or its own error
Outcome = Result | StoreError
_STOP = object()


class NotSentError(StoreUnavailableError):
    """No connection could be had (or the store closed): nothing of the batch was sent,
    so sending its appends one by one would only wait out the same timeout again."""


class RefusedError(StoreError):
    """The server answered and refused the connection (credentials, role, database,
    pg_hba.conf): nothing of the batch was sent, and waiting will not mend it."""


class AppendJob:
    """One append waiting for the writer; the caller waits on ``lock``."""

    __slots__ = (
        "causation",
        "correlation",
        "data",
        "due",
        "due_kind",
        "error",
        "expected",
        "fence",
        "ids",
        "lock",
        "news",
        "result",
        "schemas",
        "size",
        "stamps",
        "stream",
        "tags",
    )

    def __init__(
        self,
        stream: str,
        expected: int | None,
        fence: Fence | None,
        columns: tuple[list[float], list[str], list[Any], list[Any], list[int], list[str]],
        data: list[bytes],
        news: list[NewEvent],
    ) -> None:
        self.stream = stream
        self.expected = expected
        self.fence = fence
        self.stamps, self.ids, self.causation, self.correlation, self.schemas, self.tags = columns
        self.data = data
        #: the bytes of its records
        self.size = sum(map(len, data))
        self.news = news
        #: the work queue's row: 0 untouched, 1 set to ``due``, 2 lowered to ``due``
        self.due_kind = 0
        self.due: float | None = None
        self.result: Result | None = None
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.lock.acquire()


def batch_params(jobs: list[AppendJob]) -> tuple[list[Any], ...]:
    """The ``append_batch`` arguments of ``jobs``: per-append arrays, then per-event ones."""
    params: tuple[list[Any], ...] = tuple([] for _ in range(14))
    streams, expected, fences, claims, counts, *events, due_kinds, dues = params
    for job in jobs:
        streams.append(job.stream)
        expected.append(job.expected)
        fences.append(None if job.fence is None else job.fence.epoch)
        claims.append(False if job.fence is None else job.fence.claim)
        counts.append(len(job.data))
        due_kinds.append(job.due_kind)
        dues.append(job.due)
        per_event: tuple[list[Any], ...] = (
            job.stamps,
            job.ids,
            job.causation,
            job.correlation,
            job.schemas,
            job.tags,
            job.data,
        )
        for column, values in zip(events, per_event, strict=True):
            column.extend(values)
    return (streams, expected, fences, claims, counts, *events, due_kinds, dues)


class Writer:
    """The one thread of a store handle that sends its appends, batched."""

    def __init__(
        self,
        run: Callable[[list[AppendJob]], list[Outcome]],
        *,
        max_events: int = MAX_BATCH_EVENTS,
        max_bytes: int = MAX_BATCH_BYTES,
    ) -> None:
        self._run = run
        self._max_events = max_events
        self._max_bytes = max_bytes
        self._queue: queue.SimpleQueue[AppendJob | object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False

    def submit(self, job: AppendJob) -> Result:
        if self._thread is None:
            self._start()
        if self._closed:
            raise StoreClosedError("the store is closed")
        self._queue.put(job)
        thread = self._thread
        while not job.lock.acquire(timeout=1.0):
            if thread is None or not thread.is_alive():
                raise StoreClosedError("the store closed during the append")
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None and not self._closed:
                thread = threading.Thread(target=self._loop, name="stalwart-pg-writer")
                thread.daemon = True
                thread.start()
                self._thread = thread

    def _loop(self) -> None:
        get, get_nowait = self._queue.get, self._queue.get_nowait
        carry: AppendJob | None = None
        while True:
            item = carry if carry is not None else get()
            carry = None
            if item is _STOP:
                return
            assert isinstance(item, AppendJob)
            batch, count, size, stop = [item], len(item.data), item.size, False
            max_events, max_bytes = self._max_events, self._max_bytes
            while count < max_events and size < max_bytes:
                try:
                    more = get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stop = True
                    break
                assert isinstance(more, AppendJob)
                if count + len(more.data) > max_events or size + more.size > max_bytes:
                    carry = more
                    break
                batch.append(more)
                count += len(more.data)
                size += more.size
            self._send(batch)
            if stop:
                self._fail_rest()
                return

    def _send(self, batch: list[AppendJob]) -> None:
        try:
            results = self._run(batch)
        except (AppendInDoubtError, NotSentError, RefusedError) as exc:
            for job in batch:
                job.error = exc
        except BaseException as exc:
            if len(batch) == 1:
                batch[0].error = exc
            else:
                for job in batch:  # one bad append must not fail the others
                    self._send([job])
                return
        else:
            for job, result in zip(batch, results, strict=True):
                if isinstance(result, StoreError):
                    job.error = result
                else:
                    job.result = result
        for job in batch:
            job.lock.release()

    def _fail_rest(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, AppendJob):
                item.error = StoreClosedError("the store closed before the append was sent")
                item.lock.release()

    def close(self) -> None:
        self._closed = True
        self._queue.put(_STOP)
        thread = self._thread
        if thread is not None:
            thread.join(timeout=30)
        self._fail_rest()
