"""The one exception tree of stalwart.

Every error stalwart raises on purpose derives from :class:`StalwartError`, so a host
can catch them all in one place. Errors from dependencies (lmdb, msgspec, OS) never
escape raw: they are wrapped with ``raise ... from exc``. Messages say what was
expected, what was found and where; they never contain secrets or payload content.

::

    StalwartError
    ├── ConfigError              malformed or out-of-range configuration
    ├── EventError               the event vocabulary
    │   └── UnknownEventTypeError   encoding a tag this version does not know
    └── StoreError               the durable log
        ├── StoreNotFoundError      no store at the location (and create=False)
        ├── StoreClosedError        the store was closed
        ├── ConcurrencyError        expected_version did not match the stream
        ├── InvalidStreamError      a stream id that cannot be stored
        └── CorruptRecordError      a stored record that cannot be decoded
"""

from __future__ import annotations


class StalwartError(Exception):
    """Base class of every error stalwart raises on purpose."""


class ConfigError(StalwartError):
    """Configuration that is malformed, unknown or out of range."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class EventError(StalwartError):
    """A problem with the event vocabulary itself."""


class UnknownEventTypeError(EventError):
    """An attempt to encode an object that is not a registered event."""


class StoreError(StalwartError):
    """A problem with the durable event log."""


class StoreNotFoundError(StoreError):
    """There is no store at the given location."""


class StoreClosedError(StoreError):
    """The store handle was closed."""


class InvalidStreamError(StoreError):
    """A stream id that cannot be stored (empty, too long, or with a NUL byte)."""


class ConcurrencyError(StoreError):
    """An append's ``expected_version`` did not match the stream's version."""

    def __init__(self, stream: str, expected: int, actual: int) -> None:
        super().__init__(
            f"stream {stream!r} is at version {actual}, the append expected version {expected}"
        )
        self.stream = stream
        self.expected = expected
        self.actual = actual


class CorruptRecordError(StoreError):
    """A stored record that cannot be decoded; nothing is dropped silently."""

    def __init__(self, position: int, reason: str) -> None:
        super().__init__(f"record at position {position} is corrupt: {reason}")
        self.position = position
        self.reason = reason
