"""An EventStore without the optional work queue, for tests and benchmarks."""

from __future__ import annotations

from stalwart.store import EventStore


class PlainStore:
    """``store``'s EventStore methods and nothing else: not a ``WorkQueue``, as a
    third-party store may be, so a worker on it folds every session from ``read_all``
    (how every worker found its work before the queue)."""

    def __init__(self, store: EventStore) -> None:
        self.inner = store
        self.append = store.append
        self.read_all = store.read_all
        self.read_stream = store.read_stream
        self.head = store.head
        self.wait_for = store.wait_for
        self.subscribe = store.subscribe
        self.stream_version = store.stream_version
        self.lease_epoch = store.lease_epoch
        self.streams = store.streams
        self.put_snapshot = store.put_snapshot
        self.snapshots = store.snapshots
        self.close = store.close

    @property
    def location(self) -> str:
        return self.inner.location
