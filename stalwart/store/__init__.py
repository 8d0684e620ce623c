"""The durable event log: the EventStore protocol, its LMDB and PostgreSQL implementations.

``PostgresEventStore`` is imported on first use, so psycopg (the ``stalwart[postgres]``
extra) is needed only by those who use it.
"""

import typing

from ._check import Problem, StoreCheck, check_store
from ._lmdb import LmdbEventStore
from ._open import open, open_configured
from ._projection import (
    DEFAULT_SNAPSHOT_EVERY,
    Passed,
    load_state,
    read_all_passing,
    read_all_readable,
    read_readable,
    save_snapshot,
    snapshot_name,
)
from ._protocol import (
    NO_STREAM,
    Due,
    DueClaim,
    DueWork,
    EventStore,
    Fence,
    NewEvent,
    Snapshot,
    StreamInfo,
    WorkQueue,
    check_stream,
)
from ._subscription import Subscription

if typing.TYPE_CHECKING:
    from ._postgres import PostgresEventStore

__all__ = [
    "DEFAULT_SNAPSHOT_EVERY",
    "NO_STREAM",
    "Due",
    "DueClaim",
    "DueWork",
    "EventStore",
    "Fence",
    "LmdbEventStore",
    "NewEvent",
    "Passed",
    "PostgresEventStore",
    "Problem",
    "Snapshot",
    "StoreCheck",
    "StreamInfo",
    "Subscription",
    "WorkQueue",
    "check_store",
    "check_stream",
    "load_state",
    "open",
    "open_configured",
    "read_all_passing",
    "read_all_readable",
    "read_readable",
    "save_snapshot",
    "snapshot_name",
]


def __getattr__(name: str) -> typing.Any:
    if name == "PostgresEventStore":
        from ._postgres import PostgresEventStore  # noqa: PLC0415 (psycopg is optional)

        return PostgresEventStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
