"""The injected clock."""

from __future__ import annotations

import pytest

from stalwart.clock import Clock, FakeClock, SystemClock
from stalwart.ids import new_id


def test_fake_clock_moves_only_when_told() -> None:
    clock = FakeClock(start=100.0)
    assert (clock.now(), clock.monotonic()) == (100.0, 0.0)
    assert clock.advance(600.0) == 700.0
    assert (clock.now(), clock.monotonic()) == (700.0, 600.0)
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1)


# Was: DEFECT: advance(nan) made every later now() nan (and every schedule then raised)
@pytest.mark.parametrize("seconds", [float("nan"), float("inf")])
def test_fake_clock_refuses_an_advance_that_is_not_finite(seconds: float) -> None:
    clock = FakeClock(start=100.0)
    with pytest.raises(ValueError, match="finite"):
        clock.advance(seconds)
    with pytest.raises(ValueError, match="finite"):
        clock.set(seconds)
    assert clock.now() == 100.0


def test_fake_clock_tells_listeners() -> None:
    clock = FakeClock(start=0.0)
    seen: list[float] = []
    clock.on_advance(seen.append)
    clock.advance(1.5)
    clock.set(10.0)
    assert seen == [1.5, 10.0]


def test_both_clocks_satisfy_the_protocol() -> None:
    assert isinstance(SystemClock(), Clock)
    assert isinstance(FakeClock(), Clock)
    system = SystemClock()
    assert system.monotonic() <= system.monotonic()


def test_ids_are_unique_hex() -> None:
    ids = {new_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_ids_made_together_are_unique_hex_like_single_ones() -> None:
    from stalwart.ids import new_ids

    made = new_ids(500)
    assert len(made) == len(set(made)) == 500
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in made)
    assert new_ids(0) == []
