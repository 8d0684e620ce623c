"""The PostgreSQL store's group commit caps a batch by bytes as well as by events:
PostgreSQL refuses a message over 1 GB, and a batch that size failed every append in it
(in doubt) although each alone would have been taken."""

from __future__ import annotations

import threading

from stalwart.store._postgres_writer import MAX_BATCH_BYTES, AppendJob, Outcome, Writer


def _job(size: int, events: int = 1) -> AppendJob:
    n = events
    columns = ([0.0] * n, ["id"] * n, [None] * n, [None] * n, [1] * n, ["t"] * n)
    data = [b"x" * (size // n)] * n
    return AppendJob("s", None, None, columns, data, [])  # type: ignore[arg-type]


class _Sender:
    """The writer's ``run``: holds the first batch until every job is queued, and notes
    what each batch carried."""

    def __init__(self) -> None:
        self.batches: list[list[AppendJob]] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, batch: list[AppendJob]) -> list[Outcome]:
        if not self.batches:
            self.started.set()
            self.release.wait(10.0)  # real-time: the test queues the rest meanwhile
        self.batches.append(batch)
        return [("ok", 1, 0, 0)] * len(batch)


def _send_all(writer: Writer, sender: _Sender, jobs: list[AppendJob]) -> None:
    first = threading.Thread(target=writer.submit, args=(jobs[0],))
    first.start()
    assert sender.started.wait(10.0)  # real-time: the first batch is being sent
    threads = []
    for queued, job in enumerate(jobs[1:], start=1):  # queued in this order
        thread = threading.Thread(target=writer.submit, args=(job,))
        thread.start()
        threads.append(thread)
        while writer._queue.qsize() < queued:
            threading.Event().wait(0.001)  # real-time: until this append is queued
    sender.release.set()
    for thread in (first, *threads):
        thread.join(10.0)  # real-time: a bounded join


# Was: DEFECT: the writer capped a batch at 4,096 events only: appends of large records
# queued together went as one batch of any size (over 1 GB PostgreSQL refuses it whole).
def test_a_batch_never_carries_more_than_its_bytes() -> None:
    sender = _Sender()
    writer = Writer(sender, max_bytes=1_000)
    try:
        _send_all(writer, sender, [_job(300) for _ in range(10)])
    finally:
        writer.close()
    assert [len(batch) for batch in sender.batches] == [1, 3, 3, 3]
    assert all(sum(job.size for job in batch) <= 1_000 for batch in sender.batches)
    assert all(job.result == ("ok", 1, 0, 0) for batch in sender.batches for job in batch)


def test_an_append_larger_than_the_cap_goes_alone() -> None:
    sender = _Sender()
    writer = Writer(sender, max_bytes=1_000)
    try:
        _send_all(writer, sender, [_job(100), _job(100), _job(5_000), _job(100), _job(100)])
    finally:
        writer.close()
    assert [[job.size for job in batch] for batch in sender.batches] == [
        [100],
        [100],
        [5_000],
        [100, 100],
    ]


def test_the_event_cap_still_holds_and_the_default_cap_is_far_below_a_gigabyte() -> None:
    assert MAX_BATCH_BYTES <= 256 << 20
    sender = _Sender()
    writer = Writer(sender, max_events=8)
    try:
        _send_all(writer, sender, [_job(10, events=3) for _ in range(7)])
    finally:
        writer.close()
    assert [sum(len(job.data) for job in batch) for batch in sender.batches] == [3, 6, 6, 6]
