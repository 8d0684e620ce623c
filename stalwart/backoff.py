"""How long to wait before trying again: full-jitter backoff and ``Retry-After``.

Shared by every part that retries over HTTP (provider calls, webhook channels), so they
wait by the same rules. Nothing here reads the clock: ``now`` is passed in.
"""

from __future__ import annotations

import random
import re
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

__all__ = ["backoff_ceiling_ms", "backoff_delay", "parse_retry_after", "retry_delay"]


def backoff_ceiling_ms(attempt: int, base_ms: int, cap_ms: int) -> int:
    """The exponential step of attempt ``attempt`` (from 1): min(cap, base x 2^(attempt-1))."""
    return min(cap_ms, base_ms * (1 << max(attempt - 1, 0)))


def backoff_delay(attempt: int, base_ms: int, cap_ms: int, rng: random.Random) -> float:
    """Full jitter: seconds uniform in [0, min(cap, base x 2^(attempt-1))]."""
    return rng.uniform(0, backoff_ceiling_ms(attempt, base_ms, cap_ms) / 1000)


def retry_delay(
    attempt: int,
    status: int | None,
    retry_after_s: float | None,
    rate_limited_before: bool,
    jitter: float,
    *,
    max_retries: int,
    retry_base_ms: int,
    retry_cap_ms: int,
    max_retry_after_ms: int,
    rate_limited: bool = False,
) -> float | None:
    """Seconds to wait before a model call's attempt ``attempt`` + 1 on the same model,
    or None to move down the model chain (seed 002's retry rules).

    A ``Retry-After`` longer than ``max_retry_after_ms`` goes down the chain. A 429 (or a
    rate-limit error inside a stream: ``rate_limited``) is retried once per model, after
    its ``Retry-After`` (none: down the chain). Any other
    retryable failure is retried ``max_retries`` times with full-jitter backoff: ``jitter``
    (uniform in [0, 1), recorded so replay can re-derive it) of the backoff ceiling, and
    never sooner than the server's ``Retry-After``.
    """
    if retry_after_s is not None and retry_after_s > max_retry_after_ms / 1000:
        return None
    if status == 429 or rate_limited:
        if rate_limited_before or retry_after_s is None:
            return None
        return retry_after_s
    if attempt > max_retries:
        return None
    ceiling = backoff_ceiling_ms(attempt, retry_base_ms, retry_cap_ms) / 1000
    return max(ceiling * jitter, retry_after_s or 0.0)


#: ``Retry-After``'s delta-seconds (RFC 9110: digits; a fraction is taken too)
_DELTA_SECONDS = re.compile(r"[0-9]{1,15}(?:\.[0-9]{1,9})?")


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delta-seconds or an HTTP date.

    None when the header is missing or unreadable; never negative (a date in the past
    means "now"). Delta-seconds are digits, with a fraction some servers add: ``inf``,
    ``1e400``, ``nan`` or ``1_0`` (which Python's ``float`` reads) are unreadable, and so
    is a date no calendar holds (a year of twenty digits).
    """
    if not value:
        return None
    text = value.strip()
    if _DELTA_SECONDS.fullmatch(text):
        return float(text)
    try:
        when = parsedate_to_datetime(text)
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = when.timestamp() - datetime.fromtimestamp(now, tz=UTC).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        # OverflowError: a year of twenty digits, which the date parser turns into a C long
        return None
    return max(0.0, seconds)
