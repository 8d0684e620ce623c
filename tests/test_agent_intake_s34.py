"""Review s34 of the Agent's message intake and its snapshots: defects proven by tests
that failed before their fix (each carries a ``# Was: DEFECT:`` line).

Real parts throughout: an LMDB store in ``tmp_path``, the fake provider over loopback
HTTP, the runtime on a ``FakeClock`` that no test advances unless it says so.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pykka

from stalwart import store as store_module
from stalwart.actors import AGENT_VIEW
from stalwart.actors._supervised import Supervised
from stalwart.channels import MemoryChannel
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.events import ActivationAcked, MessageAppended, ToolCall, TurnStarted
from stalwart.runtime import Runtime
from stalwart.state import MESSAGES_KEPT
from stalwart.store import EventStore, NewEvent, load_state, snapshot_name
from stalwart.testing import FakeProvider
from tests._runtime_support import GUARD, delivered, of, runtime_config, settled


# Was: DEFECT: a message redelivered after the newest 256 ids forgot it was answered a second time
def test_a_message_redelivered_long_after_it_was_answered_runs_no_turn(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    # send_message remembers only the newest 256 message ids, so a webhook redelivered
    # later got a new activation; its wake found the message in the conversation, left
    # it out, and still called the model: the user got a second reply to one message
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        session = rt.session("s1", channel="chat")
        session.send("first", message_id="m0")
        delivered(rt, chat, 1)
        for index in range(1, MESSAGES_KEPT + 1):  # m0 leaves the ids remembered
            session.send(f"more {index}", message_id=f"m{index}")
        settled(store, "s1")
        calls = len(fake.requests)
        turns = len(of(TurnStarted, list(store.read_stream("session:s1"))))
        session.send("first", message_id="m0")  # the platform redelivers it
        settled(store, "s1")
        session.send("something new", message_id="fresh")
        settled(store, "s1")
        assert len(fake.requests) == calls + 1  # the new message's turn, nothing else
    records = list(store.read_stream("session:s1"))
    assert len(of(TurnStarted, records)) == turns + 1
    users = [e.message_id for e in of(MessageAppended, records) if e.role == "user"]
    assert users.count("m0") == 1
    assert [e.outcome for e in of(ActivationAcked, records)][-2:] == [
        "already_answered",
        "answered",
    ]
    report = verify_store(store, None)  # replay --verify: every decision follows
    assert report.findings == (), [f"{f.kind} {f.tag}: {f.message}" for f in report.findings]


class HeldCheck(threading.Event):
    """pykka's stopped flag, shared by an actor and its ref, whose check on ``sender``'s
    thread answers "alive" and then holds that thread until ``drained`` is set: a tell
    that checked the actor before it died and puts its message after it took its inbox
    (on a loaded machine the thread is simply preempted between the two)."""

    def __init__(self, drained: threading.Event) -> None:
        super().__init__()
        self.sender: threading.Thread | None = None
        self.checked = threading.Event()
        self._drained = drained

    def is_set(self) -> bool:
        answer = super().is_set()
        if threading.current_thread() is self.sender and not self.checked.is_set():
            self.checked.set()
            assert self._drained.wait(GUARD)
        return answer


class Successor(Supervised):
    """Crashes on its first message; its ``on_failure`` takes its inbox into ``handed``
    (for a successor), then sets the flag's ``drained``."""

    def __init__(self, flag: HeldCheck, drained: threading.Event, handed: list[Any]) -> None:
        super().__init__()
        self.actor_stopped = self.actor_ref.actor_stopped = flag
        self._drained = drained
        self._handed = handed

    def on_receive(self, message: Any) -> Any:
        raise RuntimeError("the actor crashes")

    def on_failure(self, *exc_info: object) -> None:
        self._handed.extend(self.take_inbox())
        self._drained.set()


# Was: DEFECT: a tell that passed pykka's alive check as the actor took its inbox was lost
def test_a_tell_racing_the_inbox_handover_is_handed_over_or_refused() -> None:
    # take_inbox drained the inbox and the actor died; a tell that had checked the actor
    # alive just before put its message after the drain: no ActorDeadError (so the sender
    # did not keep it for the successor) and nobody ever read it (a supervisor's Crashed
    # lost that way leaves the crashed actor down for good)
    drained = threading.Event()
    flag = HeldCheck(drained)
    handed: list[Any] = []
    refused: list[pykka.ActorDeadError] = []
    ref = Successor.start(flag, drained, handed)

    def tell_late() -> None:
        try:
            ref.tell("a crash to restart")
        except pykka.ActorDeadError as exc:  # the sender keeps it for the successor
            refused.append(exc)

    sender = threading.Thread(target=tell_late)
    flag.sender = sender
    sender.start()
    assert flag.checked.wait(GUARD)  # the tell saw the actor alive
    ref.tell("boom")  # and now it dies, taking its inbox
    sender.join(GUARD)
    assert not sender.is_alive()
    assert drained.is_set()
    assert (handed, len(refused)) == ([], 1)  # refused, so its sender still has it


def long_conversation(turns: int) -> list[MessageAppended]:
    """``turns`` turns of a user message, a tool call, its result and the answer."""
    events: list[MessageAppended] = []
    for turn in range(turns):
        call = ToolCall(id=f"c{turn}", name="lookup", arguments='{"order": 7}')
        events += [
            MessageAppended(message_id=f"u{turn}", role="user", content="where is it?"),
            MessageAppended(message_id=f"a{turn}", role="assistant", tool_calls=(call,)),
            MessageAppended(
                message_id=f"t{turn}", role="tool", content="shipped", tool_call_id=call.id
            ),
            MessageAppended(message_id=f"r{turn}", role="assistant", content="It shipped."),
        ]
    return events


# Was: DEFECT: an Agent's snapshot of a long session spent half its load in garbage collection
def test_a_long_conversation_restored_from_its_snapshot_is_not_walked_by_the_collector(
    tmp_path: Path, clock: FakeClock
) -> None:
    # every stored message that held a tool call (a tuple the collector tracks) was a
    # tracked object: loading a 50,000-message Agent snapshot ran about 80 collections
    # that walked the growing conversation, half of the 0.2 s the load took, and every
    # later full collection of the process walked them all again
    stream = "session:long"
    with store_module.open(tmp_path / "log", clock=clock) as log:  # type: ignore[attr-defined]
        news = [NewEvent(event=event, ts=clock.now()) for event in long_conversation(500)]
        log.append(stream, news)
        whole = load_state(log, stream, AGENT_VIEW, snapshot_every=1)  # saves the snapshot
        assert next(iter(log.snapshots(stream, snapshot_name(AGENT_VIEW)))).version == 2_000
        restored = load_state(log, stream, AGENT_VIEW)  # decoded from the snapshot
    assert restored == whole
    assert len(restored.messages) == 2_000
    assert not any(gc.is_tracked(message) for message in restored.messages)
    assert not any(gc.is_tracked(message) for message in whole.messages)
