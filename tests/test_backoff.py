"""Waiting before a retry: full-jitter backoff and Retry-After, shared by providers and channels."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from email.utils import format_datetime

import pytest

from stalwart.backoff import backoff_delay, parse_retry_after

NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("7", 7.0),
        (" 0.5 ", 0.5),
        ("-3", None),  # delta-seconds are digits
        ("soon", None),
        ("", None),
        (None, None),
        ("1e400", None),  # float() reads it as inf
        ("inf", None),
        ("nan", None),
        ("1_0", None),  # float() reads it as 10
        ("0", 0.0),
    ],
)
def test_retry_after_in_seconds(value: str | None, seconds: float | None) -> None:
    assert parse_retry_after(value, NOW) == seconds


def test_retry_after_as_an_http_date() -> None:
    later = format_datetime(datetime.fromtimestamp(NOW + 30, tz=UTC), usegmt=True)
    assert parse_retry_after(later, NOW) == pytest.approx(30.0)
    assert parse_retry_after(later, NOW + 60) == 0.0  # a date in the past means now


@pytest.mark.parametrize("attempt", [1, 2, 3, 4, 8])
def test_full_jitter_stays_under_the_capped_ceiling(attempt: int) -> None:
    rng = random.Random(attempt)
    ceiling = min(8_000, 500 * 2 ** (attempt - 1)) / 1000
    samples = [backoff_delay(attempt, 500, 8_000, rng) for _ in range(500)]
    assert all(0 <= s <= ceiling for s in samples)
    assert max(samples) > ceiling * 0.9  # it does use the whole range
    assert min(samples) < ceiling * 0.1
