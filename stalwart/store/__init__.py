"""The durable event log: the EventStore protocol and its LMDB implementation."""

from ._lmdb import LmdbEventStore
from ._open import open
from ._projection import DEFAULT_SNAPSHOT_EVERY, load_state, snapshot_name
from ._protocol import NO_STREAM, EventStore, Fence, NewEvent, Snapshot, StreamInfo
from ._subscription import Subscription

__all__ = [
    "DEFAULT_SNAPSHOT_EVERY",
    "NO_STREAM",
    "EventStore",
    "Fence",
    "LmdbEventStore",
    "NewEvent",
    "Snapshot",
    "StreamInfo",
    "Subscription",
    "load_state",
    "open",
    "snapshot_name",
]
