"""Activations (the durable-sessions issue): how many wakes a worker runs per second.

- **trivial wakes**: the real :class:`~stalwart.actors.ActivationWorker` over a real LMDB
  store; ``S`` sessions each hold ``W`` ready activations. A wake does nothing but settle:
  the wake callback appends ``activation:acked`` under the lease's fence and tells the
  worker ``WakeEnded``. Each wake costs two durable appends (the lease claim and the ack),
  so the limit is one thread making the same appends to the same streams in a loop, in
  the same run: ``vs_append_limit`` = ours / that.
- **end to end**: a :class:`~stalwart.runtime.Runtime` with the fake provider over
  loopback HTTP: user messages answered per second across ``S`` sessions (each answer is
  a model call, a turn and an announcement; the activations add their appends).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from stalwart import store as store_module
from stalwart.actors import ActivationWorker, Scheduler, Wake, WakeEnded
from stalwart.channels import MemoryChannel
from stalwart.clock import SystemClock
from stalwart.config import ActivationSettings, parse_config
from stalwart.events import ActivationAcked, ActivationLeased, ActivationReady
from stalwart.runtime import Runtime, policy_of
from stalwart.state import ACTIVATIONS, fold
from stalwart.store import EventStore, Fence, NewEvent
from stalwart.testing import Answer, FakeProvider

from ._machine import quiet_logs, scratch
from ._registry import Result, benchmark


def _ready(store: EventStore, sessions: int, per_session: int) -> None:
    for s in range(sessions):
        events = [
            ActivationReady(activation_id=f"a{s}.{w}", kind="wake", text="tick")
            for w in range(per_session)
        ]
        store.append(f"session:b{s}", events)


def _trivial_wakes(store: EventStore, sessions: int, per_session: int) -> float:
    """Seconds for the worker to lease, run and ack every activation."""
    _ready(store, sessions, per_session)
    clock = SystemClock()
    scheduler = Scheduler(clock).start()
    total = sessions * per_session
    done = threading.Event()
    acked = [0]
    holder: list[Any] = []

    def wake(w: Wake) -> bool:
        ack = ActivationAcked(activation_id=w.activation_id, epoch=w.epoch)
        store.append(w.stream, [NewEvent(event=ack, ts=clock.now())], fence=Fence(w.epoch))
        acked[0] += 1
        holder[0].tell(WakeEnded(w.stream, w.epoch))
        if acked[0] == total:
            done.set()
        return True

    policy = policy_of(ActivationSettings(poll_ms=50))
    began = time.perf_counter()
    worker = ActivationWorker.start(
        store, clock, scheduler, policy, owner="bench", wake=wake, lost=lambda _l: None
    )
    holder.append(worker)
    try:
        if not done.wait(600):
            raise RuntimeError(f"only {acked[0]} of {total} wakes ran")
        return time.perf_counter() - began
    finally:
        worker.stop()
        scheduler.stop(5.0)


def _append_limit(store: EventStore, sessions: int, per_session: int) -> float:
    """Seconds for one thread to make the same durable appends (claim, then ack)."""
    clock = SystemClock()
    began = time.perf_counter()
    for w in range(per_session):
        epoch = w + 1
        for s in range(sessions):
            stream = f"session:limit{s}"
            leased = ActivationLeased(
                activation_id=f"a{s}.{w}", owner="limit", epoch=epoch, expires_at=clock.now()
            )
            store.append(stream, [leased], fence=Fence(epoch, claim=True))
            ack = ActivationAcked(activation_id=f"a{s}.{w}", epoch=epoch)
            store.append(stream, [ack], fence=Fence(epoch))
    return time.perf_counter() - began


def _settled(store: EventStore, streams: list[str]) -> bool:
    for stream in streams:
        state = fold(ACTIVATIONS, stream, store.read_stream(stream))
        if state.queue or state.lease is not None:
            return False
    return True


def _end_to_end(sessions: int, messages: int) -> float:
    """Seconds until ``sessions x messages`` user messages are answered (messages sent
    while a wake runs are answered together by the next one, as in a real chat)."""
    with FakeProvider() as fake, scratch() as directory:
        fake.set_default(Answer(text="ok"))
        config = parse_config(
            {
                "providers": {"main": {"kind": "openai", "base_url": fake.base_url}},
                "agents": {"default": {"provider": "main", "model": "m"}},
            }
        )
        chat = MemoryChannel("chat")
        with Runtime(config, store=os.path.join(directory, "store"), channels={"chat": chat}) as rt:
            handles = [rt.session(f"e{s}", channel="chat") for s in range(sessions)]
            streams = [handle.stream for handle in handles]
            began = time.perf_counter()
            for m in range(messages):
                for handle in handles:
                    handle.send(f"m{m}")
            give_up = time.monotonic() + 600
            while not _settled(rt.store, streams):
                if time.monotonic() > give_up:
                    raise RuntimeError("the end-to-end messages were not all answered")
                rt.store.wait_for(rt.store.head() + 1, 0.2)
            return time.perf_counter() - began


@benchmark("activations")
def run(quick: bool) -> Result:
    result = Result("activations")
    sessions, per_session = (16, 4) if quick else (200, 10)
    with quiet_logs(logging.WARNING), scratch() as directory:
        store = store_module.open(os.path.join(directory, "store"))
        try:
            ours = _trivial_wakes(store, sessions, per_session)
            limit = _append_limit(store, sessions, per_session)
        finally:
            store.close()
    wakes = sessions * per_session
    result.figures["sessions"] = sessions
    result.figures["wakes"] = wakes
    result.figures["wakes_per_s"] = wakes / ours
    result.figures["append_limit_wakes_per_s"] = wakes / limit
    result.ratios["vs_append_limit"] = limit / ours
    e2e_sessions, e2e_messages = (4, 3) if quick else (32, 10)
    with quiet_logs(logging.WARNING):
        seconds = _end_to_end(e2e_sessions, e2e_messages)
    result.figures["end_to_end_messages_per_s"] = e2e_sessions * e2e_messages / seconds
    result.figures["end_to_end_sessions"] = e2e_sessions
    result.goal("vs_append_limit", ">=", 0.5)
    return result
