"""The writer's inbox: many threads put jobs, one taker takes them all at once.

Real threads only. Nothing sleeps to wait for an outcome: the few short sleeps are marked
and only shape *when* a producer acts; timeouts are small and their bounds generous.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TypeVar

from stalwart.store._inbox import Inbox

J = TypeVar("J")

SHORT = 0.05  # a take's timeout that is meant to pass
RACE = 0.001  # a timeout as short as the writer's linger
SOON = 2.0  # a bound no correct take comes near: the test fails rather than flakes
JOIN = 10.0  # seconds any thread may take before the test fails rather than hangs


def _timed_take(inbox: Inbox[J], want: int, timeout: float | None) -> tuple[list[J], float]:
    started = time.monotonic()
    jobs = inbox.take(want, timeout)
    return jobs, time.monotonic() - started


def _start(target: Callable[..., object], *args: object) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def test_jobs_put_are_taken_together_in_the_order_they_were_put() -> None:
    inbox: Inbox[int] = Inbox()
    assert len(inbox) == 0
    assert not inbox.closed
    assert all(inbox.put(n) for n in range(5))
    assert len(inbox) == 5
    assert inbox.take() == [0, 1, 2, 3, 4]
    assert len(inbox) == 0
    assert inbox.put(5)
    assert inbox.take() == [5]


def test_a_take_with_enough_jobs_waiting_returns_at_once_with_every_one() -> None:
    inbox: Inbox[int] = Inbox()
    for n in range(10):
        inbox.put(n)
    jobs, took = _timed_take(inbox, 3, 5.0)
    assert jobs == list(range(10))
    assert took < SOON


def test_a_take_on_an_empty_inbox_returns_nothing_after_its_timeout() -> None:
    inbox: Inbox[int] = Inbox()
    jobs, took = _timed_take(inbox, 1, SHORT)
    assert jobs == []
    assert SHORT * 0.9 <= took < SOON


def test_a_take_wanting_three_returns_as_soon_as_the_third_is_in() -> None:
    inbox: Inbox[int] = Inbox()

    def produce() -> None:
        for n in range(3):
            time.sleep(0.002)  # real-time: the jobs arrive one by one while the taker waits
            inbox.put(n)

    producer = _start(produce)
    jobs, took = _timed_take(inbox, 3, 5.0)
    producer.join(JOIN)
    jobs += inbox.take(1, 0)  # none should be left behind
    assert jobs == [0, 1, 2]
    assert took < SOON  # well before its 5 s timeout


def test_a_take_wanting_three_returns_the_one_job_in_at_its_timeout() -> None:
    inbox: Inbox[str] = Inbox()
    inbox.put("only")
    jobs, took = _timed_take(inbox, 3, SHORT)
    assert jobs == ["only"]
    assert SHORT * 0.9 <= took < SOON


def test_a_take_wanting_three_is_not_woken_by_two() -> None:
    inbox: Inbox[int] = Inbox()
    inbox.put(1)
    inbox.put(2)
    jobs, took = _timed_take(inbox, 3, SHORT)
    assert jobs == [1, 2]
    assert took >= SHORT * 0.9


def test_close_wakes_a_taker_blocked_without_a_timeout() -> None:
    inbox: Inbox[int] = Inbox()
    taken: list[list[int]] = []
    started = threading.Event()

    def take() -> None:
        started.set()
        taken.append(inbox.take())

    taker = _start(take)
    started.wait(JOIN)
    time.sleep(0.02)  # real-time: the taker blocks in take() before the close (no event)
    inbox.close()
    taker.join(JOIN)
    assert not taker.is_alive()
    assert taken == [[]]
    assert inbox.closed


def test_close_hands_a_blocked_taker_the_fewer_jobs_it_has() -> None:
    inbox: Inbox[int] = Inbox()
    inbox.put(1)
    inbox.put(2)
    taken: list[list[int]] = []
    started = threading.Event()

    def take() -> None:
        started.set()
        taken.append(inbox.take(3))

    taker = _start(take)
    started.wait(JOIN)
    time.sleep(0.02)  # real-time: the taker blocks in take() before the close (no event)
    inbox.close()
    taker.join(JOIN)
    assert taken == [[1, 2]]


def test_jobs_put_before_close_are_taken_after_it_and_puts_after_it_are_refused() -> None:
    inbox: Inbox[str] = Inbox()
    assert inbox.put("a")
    assert inbox.put("b")
    inbox.close()
    assert inbox.closed
    assert not inbox.put("c")
    assert len(inbox) == 2
    jobs, took = _timed_take(inbox, 5, None)
    assert jobs == ["a", "b"]
    assert took < SOON
    # closed and empty: every take returns nothing at once, whatever it wants
    assert _timed_take(inbox, 1, None)[0] == []
    jobs, took = _timed_take(inbox, 3, 5.0)
    assert jobs == []
    assert took < SOON
    assert not inbox.put("d")
    assert len(inbox) == 0
    inbox.close()  # closing twice is harmless
    assert inbox.closed


def test_many_producers_hand_every_job_once_in_each_producers_order() -> None:
    producers, per_producer = 8, 2000
    total = producers * per_producer
    inbox: Inbox[tuple[int, int]] = Inbox()
    go = threading.Barrier(producers + 1)
    refused: list[tuple[int, int]] = []

    def produce(p: int) -> None:
        go.wait(JOIN)
        for n in range(per_producer):
            if not inbox.put((p, n)):
                refused.append((p, n))

    threads = [_start(produce, p) for p in range(producers)]
    go.wait(JOIN)
    taken: list[tuple[int, int]] = []
    takes = 0
    deadline = time.monotonic() + JOIN * 3
    while len(taken) < total and time.monotonic() < deadline:
        # alternate the ways the writer takes: one at least, a batch, a batch or its timeout
        want, timeout = ((1, None), (64, None), (256, 0.01))[takes % 3]
        if want > total - len(taken):
            want, timeout = 1, None
        taken += inbox.take(want, timeout)
        takes += 1
    for thread in threads:
        thread.join(JOIN)
    assert refused == []
    assert len(taken) == total
    assert len(set(taken)) == total
    by_producer: dict[int, list[int]] = defaultdict(list)
    for p, n in taken:
        by_producer[p].append(n)
    assert by_producer == {p: list(range(per_producer)) for p in range(producers)}
    assert len(inbox) == 0
    assert takes < total  # the taker took batches, not one job per take


def test_a_ring_that_comes_as_a_wait_times_out_does_not_end_the_next_wait() -> None:
    rounds = 200
    inbox: Inbox[tuple[int, int]] = Inbox()
    go = threading.Barrier(2)
    failures: list[BaseException] = []

    def produce() -> None:
        try:
            for r in range(rounds):
                go.wait(JOIN)
                inbox.put((r, 0))
                for _ in range((r % 20) * 8000):
                    pass  # shaping only: the second job comes before, at or after the timeout
                inbox.put((r, 1))
        except BaseException as exc:
            failures.append(exc)

    producer = _start(produce)
    taken: list[tuple[int, int]] = []
    for _ in range(rounds):
        go.wait(JOIN)
        got, took = _timed_take(inbox, 2, RACE)  # often times out just as the producer rings
        if len(got) < 2:
            # fewer than it wanted only once its timeout passed: a ring left over from the
            # last round (rung after that wait timed out) must not end this one early
            assert took >= RACE * 0.9, f"took {got} after {took * 1000:.3f} ms"
        while len(got) < 2:
            # nor end a wait without a timeout
            more = inbox.take(2 - len(got), JOIN)
            assert len(more) == 2 - len(got), f"took {more} after {got}"
            got += more
        assert len(got) == 2
        taken += got
    producer.join(JOIN)
    assert failures == []
    assert taken == [(r, k) for r in range(rounds) for k in (0, 1)]
    # and the bell is quiet afterwards: an empty take still waits out its timeout
    jobs, took = _timed_take(inbox, 1, SHORT)
    assert jobs == []
    assert took >= SHORT * 0.9
