"""What the runtime tests share: a config on one fake provider, waiting on a channel and
on the log, picking events, crashing a runtime part until supervision gives up on it."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pykka

from stalwart.actors import RESEND_GRACE_S, IoPortal
from stalwart.channels import MemoryChannel, OutboundMessage
from stalwart.clock import FakeClock
from stalwart.config import Config, parse_config
from stalwart.events import (
    ActivationRequeued,
    RecordedEvent,
    SupervisorGaveUp,
    SupervisorRestarted,
)
from stalwart.runtime import Runtime, SessionHandle, load_session
from stalwart.store import EventStore
from stalwart.testing import FakeProvider, Hang

#: The longest any wait in these tests takes before it fails.
GUARD = 10.0


def in_flight_s(config: Config) -> float:
    """How long after it was queued an unsent announcement is left to its sender (whose
    send may still be under way) before another Agent sends it again."""
    return config.dead_letters.announce_timeout_ms / 1000 + RESEND_GRACE_S


def agent_settings(prompt_timeout_ms: int = 5_000, **fields: Any) -> dict[str, Any]:
    """An agent on provider ``main``, model ``m1``, with no provider retries."""
    return {
        "provider": "main",
        "model": "m1",
        "prompt_timeout_ms": prompt_timeout_ms,
        "retry_prompt_timeout_ms": prompt_timeout_ms,
        "max_retries": 0,
        **fields,
    }


#: :func:`agent_settings` fields for the default ``max_retries`` (2) with a millisecond
#: backoff, so a call's attempts follow each other at once
RETRYING: dict[str, Any] = {"max_retries": 2, "retry_base_ms": 1, "retry_cap_ms": 2}


def runtime_config(base_url: str, *, prompt_timeout_ms: int = 5_000, **sections: Any) -> Config:
    """One OpenAI-wire provider ``main`` at ``base_url`` and a ``default`` agent on it
    (:func:`agent_settings`); ``sections`` add or replace top-level sections."""
    data: dict[str, Any] = {
        "providers": {"main": {"kind": "openai", "base_url": base_url}},
        "agents": {"default": agent_settings(prompt_timeout_ms)},
    }
    return parse_config(data | sections)


Kind = type | tuple[type, ...]


def delivered(
    rt: Runtime, channel: MemoryChannel, count: int, *, attempted: bool = False
) -> list[OutboundMessage]:
    """The channel's messages once ``count`` arrived (waited for on the runtime's loop)."""

    async def wait() -> list[OutboundMessage]:
        with anyio.fail_after(GUARD):
            return await channel.wait_for(count, attempted=attempted)

    return rt.portal.submit(wait).result(GUARD + 1)


def log_until(
    store: EventStore, stream: str, until: Callable[[list[RecordedEvent]], bool]
) -> list[RecordedEvent]:
    """The stream once ``until`` holds (woken by appends)."""
    give_up = time.monotonic() + GUARD
    while True:
        head = store.head()
        records = list(store.read_stream(stream))
        if until(records):
            return records
        left = give_up - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the log never got there: {[r.type for r in records]}")
        store.wait_for(head + 1, left)


def has(kind: Kind, count: int = 1) -> Callable[[list[RecordedEvent]], bool]:
    return lambda records: sum(isinstance(r.event, kind) for r in records) >= count


def of(kind: Kind, records: list[RecordedEvent]) -> list[Any]:
    return [r.event for r in records if isinstance(r.event, kind)]


def crashed_mid_wake(
    rt: Runtime, fake: FakeProvider, store: EventStore, **send: Any
) -> tuple[SessionHandle, list[RecordedEvent]]:
    """Session ``s1`` (on ``chat``) whose Agent dies of an exception while its wake's model
    call hangs: its handle, and its records once the worker requeued the wake."""
    fake.add(Hang())
    session = rt.session("s1", channel="chat")
    session.send("hello", **send)
    fake.wait_for(lambda requests: len(requests) == 1, GUARD)
    session.ref.tell(object())  # the Agent dies of an exception mid-wake
    return session, log_until(store, "session:s1", has(ActivationRequeued))


def only(kind: type[pykka.Actor]) -> pykka.ActorRef[Any]:
    """The one running actor of ``kind`` (pykka's registry: no runtime internals)."""
    [ref] = pykka.ActorRegistry.get_by_class(kind)
    return ref


def crash_decided(rt: Runtime, store: EventStore, kind: type[pykka.Actor], count: int) -> Any:
    """Crash the running ``kind`` actor for real; the ``count``-th decision on it, once
    the runtime has acted on it."""
    only(kind).tell(object())  # it does not understand it: an unhandled exception
    decided = (SupervisorRestarted, SupervisorGaveUp)
    records = log_until(store, "runtime", has(decided, count))
    with rt._restarts_lock:  # the decision is appended and acted on under it
        pass
    return of(decided, records)[-1]


def give_up_on(rt: Runtime, store: EventStore, clock: FakeClock, kind: type[pykka.Actor]) -> None:
    """Crash the runtime's ``kind`` part until supervision gives up on it (three restarts
    on the default settings, ``clock`` moved past each backoff, then a give-up)."""
    for count, backoff_ms in enumerate([100, 200, 400], 1):
        assert isinstance(crash_decided(rt, store, kind, count), SupervisorRestarted)
        clock.advance(backoff_ms / 1000 + 0.005)
        only(kind)
    assert isinstance(crash_decided(rt, store, kind, 4), SupervisorGaveUp)
    assert not pykka.ActorRegistry.get_by_class(kind)


def window_config(base_url: str, *, window: int, engine: str) -> Config:
    """One OpenAI-wire provider ``main`` at ``base_url`` and a ``default`` agent on it (no
    provider retries, the other agent settings their defaults) with a ``window``-token
    context, assembled by context engine ``engine``."""
    return parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": base_url}},
            "agents": {
                "default": {
                    "provider": "main",
                    "model": "m1",
                    "max_retries": 0,
                    "context_window": window,
                }
            },
            "context_engine": {"version": engine},
        }
    )


def until(check: Callable[[], Any], timeout: float = GUARD, *, what: str | None = None) -> Any:
    """Poll ``check()`` until it gives something true, and give it; fail after
    ``timeout`` real seconds (for state another thread changes with no event to wait on),
    naming ``what`` never happened when given."""
    give_up = time.monotonic() + timeout
    failure = "the awaited outcome never came" if what is None else f"never happened: {what}"
    while not (found := check()):
        assert time.monotonic() < give_up, failure
        time.sleep(0.01)  # real-time: the outcome is handled on other threads
    return found


def advance_until(clock: FakeClock, check: Callable[[], Any], step_s: float) -> Any:
    """Advance ``clock`` by ``step_s`` until ``check()`` gives something true, and give it.

    For a deadline armed by another thread at a moment the test cannot see (a send's
    Clock timeout is armed when the send starts): each step moves time a little past
    wherever the timer landed. Fails after :data:`GUARD` real seconds."""
    give_up = time.monotonic() + GUARD
    while not (found := check()):
        assert time.monotonic() < give_up, "the awaited outcome never came"
        clock.advance(step_s)
        time.sleep(0.01)  # real-time: the outcome is handled on other threads
    return found


def delivered_by_clock(
    clock: FakeClock, channel: MemoryChannel, count: int, step_s: float = 0.002
) -> list[OutboundMessage]:
    """The channel's messages once ``count`` arrived, ``clock`` moved on by ``step_s``
    while they have not: for turns whose retries wait out their backoff on the Clock."""
    return advance_until(
        clock, lambda: len(channel.messages) >= count and list(channel.messages), step_s
    )


def flush(portal: IoPortal) -> None:
    """Let an I/O loop run what was submitted to it before this call (a send it began
    reaches its channel)."""

    async def yield_a_few() -> None:
        for _ in range(50):
            await anyio.sleep(0)

    portal.submit(yield_a_few).result(GUARD)


def settled(store: EventStore, session_id: str) -> None:
    """Wait until the session has no unsettled activation and no lease (woken by appends)."""
    give_up = time.monotonic() + GUARD
    while True:
        head = store.head()
        _, activations = load_session(store, session_id)
        if activations.backlog == 0 and activations.lease is None:
            return
        left = give_up - time.monotonic()
        assert left > 0, "the session never settled its work"
        store.wait_for(head + 1, left)


def attempted_on(portal: IoPortal, channel: MemoryChannel, count: int) -> None:
    """Wait (on the channel's loop, ``portal``) until ``count`` sends reached ``channel``."""

    async def wait() -> None:
        with anyio.fail_after(GUARD):
            await channel.wait_for(count, attempted=True)

    portal.submit(wait).result(GUARD + 1)


def sigkill(proc: subprocess.Popen[str], wait: float = GUARD) -> None:
    """Kill ``proc`` with SIGKILL and check that it died of it."""
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(wait) == -signal.SIGKILL


def reap(proc: subprocess.Popen[str], wait: float = GUARD) -> None:
    """However a test ended: ``proc`` killed if still running, waited for, its pipes
    closed (a pipe left open warns in whichever test runs next)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(wait)
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


class CountingStore:
    """Passes every call to the store it wraps; counts the records each ``read_stream``
    (per stream) and ``read_all`` (as ``"*"``) yields. A test double of what the store's
    callers read, not of stalwart."""

    def __init__(self, inner: EventStore) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.records: Counter[str] = Counter()

    def read_stream(self, stream: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for record in self._inner.read_stream(stream, *args, **kwargs):
            with self._lock:
                self.records[stream] += 1
            yield record

    def read_all(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for record in self._inner.read_all(*args, **kwargs):
            with self._lock:
                self.records["*"] += 1
            yield record

    def taken(self) -> Counter[str]:
        """The counts since the last call, and start again."""
        with self._lock:
            taken, self.records = self.records, Counter()
        return taken

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class LineProcess:
    """A child Python process that says ``ready``, then takes one JSON line of work at a
    time on stdin and answers each with one line on stdout; ``what`` names it in
    failures, ``wait`` bounds each answer and its exit."""

    def __init__(self, argv: list[str], cwd: Any, what: str, wait: float = GUARD) -> None:
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=cwd
        )
        self._what = what
        self._wait = wait
        assert self.line() == "ready"

    def line(self) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self._wait)
        assert ready, f"{self._what} said nothing"
        line = self.proc.stdout.readline()
        assert line, f"{self._what} ended: {self.proc.wait(self._wait)}"
        return line.strip()

    def send(self, command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> Any:
        return json.loads(self.line())

    def close(self) -> None:
        """End its input and wait for a clean exit (killed if it does not come)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            assert self.proc.wait(self._wait) == 0
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(self._wait)
            if self.proc.stdout is not None:
                self.proc.stdout.close()


class CollectedProcess:
    """A subprocess whose stdout and stderr lines are collected by threads (``out``,
    ``err``); ``wait`` bounds a wait for what it prints, ``stop`` sends SIGINT."""

    def __init__(self, argv: list[str], cwd: Any = None, wait: float = GUARD) -> None:
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
        )
        self._wait = wait
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(pipe: Any, into: list[str]) -> None:
        for line in iter(pipe.readline, ""):
            into.append(line)

    def wait(self, check: Callable[[], bool], what: str) -> None:
        def done() -> bool:
            assert self.proc.poll() is None, f"exited while waiting for {what}: {self.err}"
            return check()

        until(done, self._wait, what=what)

    def stop(self, within: float | None = None) -> int:
        """SIGINT, then its exit code (killed if it does not end ``within`` seconds)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout=self._wait if within is None else within)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        for reader in self._readers:
            reader.join(10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        return code
