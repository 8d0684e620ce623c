"""Identifiers: the only module of stalwart that makes random ids."""

from __future__ import annotations

import os
import re

__all__ = ["new_id", "new_ids", "valid_session_id"]

_urandom = os.urandom

_SESSION_ID = re.compile(r"[^\s\x00-\x1f\x7f\ud800-\udfff]{1,128}")
#: At most this many UTF-8 bytes (128 four-byte characters would not fit a stream id)
SESSION_ID_MAX_BYTES = 256
#: A session id that starts like a stream name was given the wrong thing: whose is it?
_STREAM_PREFIXES = ("session:", "context:", "provider:", "runtime", "deadletter")


def new_id() -> str:
    """A new random 128-bit id as 32 lowercase hex characters, from the operating
    system's random source (ids name approvals and idempotency keys: nobody reading the
    log may predict the next one). Every event gets one, so it skips building a UUID."""
    return _urandom(16).hex()


def new_ids(count: int) -> list[str]:
    """``count`` new ids as :func:`new_id` makes them, from one read of the random source
    (the store's writer names every event of a batch at once)."""
    hexed = _urandom(16 * count).hex()
    return [hexed[at : at + 32] for at in range(0, 32 * count, 32)]


def valid_session_id(session_id: object) -> bool:
    """Whether ``session_id`` is a bare session id: 1 to 128 characters and at most
    :data:`SESSION_ID_MAX_BYTES` UTF-8 bytes, no whitespace, control characters or lone
    surrogates (bytes that were not UTF-8), and not a stream name (``session:...``,
    ``context:...``)."""
    return (
        isinstance(session_id, str)
        and _SESSION_ID.fullmatch(session_id) is not None
        and len(session_id.encode()) <= SESSION_ID_MAX_BYTES
        and not session_id.startswith(_STREAM_PREFIXES)
    )
