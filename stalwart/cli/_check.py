"""``stalwart check``: a short self-check of the durable log on this machine."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable

import click

from stalwart.clock import SystemClock
from stalwart.errors import StalwartError
from stalwart.events import MessageAppended, SessionCreated, TurnCompleted, TurnStarted
from stalwart.state import SESSION, fold
from stalwart.store import NO_STREAM, EventStore, load_state
from stalwart.store import open as open_store

from ._app import cli

_clock = SystemClock()


def _step(name: str, fn: Callable[[], str]) -> None:
    started = _clock.monotonic()
    detail = fn()
    took = (_clock.monotonic() - started) * 1000
    click.echo(f"  ok  {name:<34} {detail} ({took:.0f} ms)")


def _concurrent_appends(store: EventStore, threads: int, each: int) -> str:
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(each):
                store.append(
                    f"session:check-{n}",
                    [MessageAppended(message_id=f"{n}-{i}", role="user", content="x" * 120)],
                )
        except BaseException as exc:  # reported below, not swallowed
            errors.append(exc)

    started = _clock.monotonic()
    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise StalwartError(f"concurrent append failed: {errors[0]}")
    rate = threads * each / (_clock.monotonic() - started)
    return f"{threads * each} durable appends from {threads} threads, {rate:,.0f} events/s"


def _read_back(store: EventStore, expected: int) -> str:
    positions = [r.position for r in store.read_all()]
    if positions != list(range(1, expected + 1)):
        raise StalwartError("the log has gaps or duplicates")
    return f"{len(positions)} events in order, no gaps"


def _fold(store: EventStore) -> str:
    store.append(
        "session:check",
        [
            SessionCreated(title="self-check"),
            TurnStarted(turn_id="t1"),
            MessageAppended(message_id="m1", role="user", content="hello"),
            MessageAppended(message_id="m2", role="assistant", content="hi there"),
            TurnCompleted(turn_id="t1"),
        ],
        expected_version=NO_STREAM,
    )
    state = fold(SESSION, "session:check", store.read_stream("session:check"))
    if state.status != "idle" or state.messages != 2 or state.turns != 1:
        raise StalwartError(f"unexpected session state {state}")
    again = load_state(store, "session:check", SESSION, snapshot_every=1)
    if load_state(store, "session:check", SESSION) != again:
        raise StalwartError("state rebuilt from a snapshot differs from the full fold")
    return "session folded, snapshot rebuild identical"


def _tail(store: EventStore) -> str:
    subscription = store.subscribe(store.head() + 1)
    timer = threading.Timer(
        0.05, lambda: store.append("session:check", [MessageAppended(message_id="m3", role="user")])
    )
    timer.start()
    events = subscription.poll(timeout=5)
    timer.join()
    if not events:
        raise StalwartError("a live subscriber did not see a new event within 5 s")
    return "live subscriber woke on the new event"


@cli.command()
def check() -> None:
    """Run a short self-check of the event log in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="stalwart-check-") as directory:
        click.echo(f"stalwart self-check in {directory}")
        store = open_store(directory)
        try:
            _step("group-committed durable appends", lambda: _concurrent_appends(store, 8, 125))
            _step("read back", lambda: _read_back(store, 1000))
            _step("fold and snapshot", lambda: _fold(store))
            _step("tail", lambda: _tail(store))
        finally:
            store.close()
    click.echo("all checks passed")
