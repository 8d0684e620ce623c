"""How long to wait before trying again: full-jitter backoff and ``Retry-After``.

Shared by every part that retries over HTTP (provider calls, webhook channels), so they
wait by the same rules. Nothing here reads the clock: ``now`` is passed in.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

__all__ = ["backoff_delay", "parse_retry_after"]


def backoff_delay(attempt: int, base_ms: int, cap_ms: int, rng: random.Random) -> float:
    """Full jitter: seconds uniform in [0, min(cap, base x 2^(attempt-1))]."""
    ceiling = min(cap_ms, base_ms * 2 ** max(attempt - 1, 0)) / 1000
    return rng.uniform(0, ceiling)


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delta-seconds or an HTTP date.

    None when the header is missing or unreadable; never negative (a date in the past
    means "now").
    """
    if not value:
        return None
    text = value.strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - datetime.fromtimestamp(now, tz=UTC).timestamp())
