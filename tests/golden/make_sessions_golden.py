"""Writes the durable-session golden logs (``python tests/golden/make_sessions_golden.py``).

A real :class:`~stalwart.runtime.Runtime` on a FakeClock and the loopback fake provider
plays three sessions, and the whole log is kept:

* ``approve``: a refund needs confirmation; the session pauses, the operator allows it,
  the tool runs once with the stored input, the answer is acked;
* ``crash``: the Agent dies in the middle of its model call; the wake is requeued 2 s
  later, leased again at epoch 2 and answered;
* ``later``: a delayed wake runs when due.

``sessions-clean.log`` is that log: ``replay --verify`` finds nothing. In
``sessions-doctored.log`` two decisions are changed the way bugs would change them: the
crash's requeue waits 0.5 s instead of the 2 s backoff (a hot loop), and the delayed
wake's lease is moved 10 s before it was due. Run once when a log is added; never to
"fix" a test.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import msgspec

from stalwart import store as store_module
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import parse_config
from stalwart.events import (
    DEFAULT_CODEC,
    ActivationAcked,
    ActivationBlocked,
    ActivationLeased,
    ActivationRequeued,
    RecordedEvent,
    SessionRequiresAction,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, FakeToolCall, Hang

HERE = Path(__file__).resolve().parent
START = 1_800_000_000.0
GUARD = 10.0


def _until(store: EventStore, stream: str, kind: type, count: int = 1) -> list[RecordedEvent]:
    give_up = time.monotonic() + GUARD
    while True:
        records = list(store.read_stream(stream))
        if sum(isinstance(r.event, kind) for r in records) >= count:
            return records
        if time.monotonic() > give_up:
            raise RuntimeError(f"{stream} never got {kind.__name__}")
        store.wait_for(store.head() + 1, 0.2)


def play(store: EventStore, clock: FakeClock) -> None:
    """The three sessions, through the runtime."""
    with FakeProvider() as fake:
        fake.set_default(Answer(text="ok"))
        config = parse_config(
            {
                "providers": {"main": {"kind": "openai", "base_url": fake.base_url}},
                "agents": {"default": {"provider": "main", "model": "m1", "max_retries": 0}},
            }
        )
        chat = MemoryChannel("chat")
        with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:

            @rt.tool(needs_confirmation=True)
            def refund(order: int) -> str:
                """Refund an order."""
                return f"refunded {order}"

            call = FakeToolCall(id="c1", name="refund", arguments={"order": 7})
            fake.add(Answer(text="", tool_calls=(call,)), Answer(text="Refunded."))
            rt.session("approve", channel="chat").send("refund 7")
            records = _until(store, "session:approve", ActivationBlocked)
            request = next(r.event for r in records if isinstance(r.event, SessionRequiresAction))
            clock.advance(5.0)
            rt.confirm("approve", request.request_id, allow=True)
            _until(store, "session:approve", ActivationAcked)

            fake.add(Hang())
            crash = rt.session("crash", channel="chat")
            crash.send("hello")
            fake.wait_for(lambda requests: len(requests) == 3, GUARD)
            crash.ref.tell(object())
            _until(store, "session:crash", ActivationRequeued)
            clock.advance(2.0)
            _until(store, "session:crash", ActivationAcked)

            rt.session("later", channel="chat")
            rt.wake_at("later", clock.now() + 60, "check the refund")
            clock.advance(60.0)
            _until(store, "session:later", ActivationAcked)


def doctor(record: RecordedEvent) -> RecordedEvent:
    """The two bugs of ``sessions-doctored.log`` (see the module docstring)."""
    event = record.event
    if isinstance(event, ActivationRequeued) and record.stream == "session:crash":
        early = msgspec.structs.replace(event, delay_ms=500, run_at=record.ts + 0.5)
        return msgspec.structs.replace(record, event=early)
    if isinstance(event, ActivationLeased) and record.stream == "session:later":
        return msgspec.structs.replace(record, ts=record.ts - 10.0)
    return record


def _write(name: str, records: list[RecordedEvent]) -> None:
    encoded = [DEFAULT_CODEC.encode(record) for record in records]
    (HERE / name).write_bytes(msgspec.msgpack.encode(encoded))


def main() -> int:
    clock = FakeClock(start=START)
    with tempfile.TemporaryDirectory() as scratch:
        store = store_module.open(Path(scratch) / "store", clock=clock)
        try:
            play(store, clock)
            records = list(store.read_all())
        finally:
            store.close()
    _write("sessions-clean.log", records)
    _write("sessions-doctored.log", [doctor(record) for record in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
