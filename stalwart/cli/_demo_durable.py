"""``stalwart demo``'s durable-session scenes: a pause for a human, and an Agent that
dies in the middle of a wake."""

from __future__ import annotations

from collections.abc import Callable

from stalwart.errors import StalwartError
from stalwart.events import RecordedEvent, SessionRequiresAction
from stalwart.runtime import Runtime
from stalwart.testing import Answer, FakeProvider, FakeToolCall, Hang

from ._demo_narrator import Narrator

__all__ = ["crash_scene", "pause_scene"]


def _wait(narrator: Narrator, matches: Callable[[RecordedEvent], bool], what: str) -> None:
    if not narrator.wait_where(matches, 20.0):
        raise StalwartError(f"demo: expected {what} within 20 s; it never came")


def _type(event_type: str, stream: str) -> Callable[[RecordedEvent], bool]:
    return lambda r: r.type == event_type and r.stream == stream


def pause_scene(number: int, rt: Runtime, fake: FakeProvider, narrator: Narrator) -> None:
    narrator.scene(
        number,
        "A pause for a human",
        "A refund needs an operator's yes. The session stops with the request and its input "
        "in the log; the approval resumes it and the tool runs once, with the stored input.",
    )
    runs: list[str] = []

    def refund(order: int, amount: float) -> str:
        """Refund an order."""
        runs.append(f"{order}:{amount}")
        return f"refunded {amount:.2f} on order {order}"

    if "refund" not in rt.tools:
        rt.tool(refund, needs_confirmation=True)
    call = FakeToolCall(id="r1", name="refund", arguments={"order": 7, "amount": 12.5})
    fake.add(Answer(model="gpt-demo", text="", tool_calls=(call,)))
    fake.add(Answer(model="gpt-demo", text="Done: 12.50 is back on your card."))
    rt.session("grace", agent="support", channel="chat").send("Please refund order 7.")
    _wait(narrator, _type("session:requires_action", "session:grace"), "the pause")
    request = next(
        r.event
        for r in reversed(narrator.seen)
        if r.stream == "session:grace" and isinstance(r.event, SessionRequiresAction)
    )
    narrator.say(f"    operator: stalwart session confirm grace {request.request_id} --allow")
    rt.confirm("grace", request.request_id, allow=True)
    _wait(narrator, _type("activation:acked", "session:grace"), "the answer")
    if runs != ["7:12.5"]:
        raise StalwartError(f"demo: the refund ran {len(runs)} times")


def crash_scene(number: int, rt: Runtime, fake: FakeProvider, narrator: Narrator) -> None:
    narrator.scene(
        number,
        "An agent dies mid-answer",
        "The session's Agent crashes while its model call runs. The wake is not lost: it is "
        "requeued with backoff (0.5 s here, 2 s by default), the Agent restarts from the log, "
        "and the retry answers, at a new lease epoch.",
    )
    fake.add(Hang())
    fake.add(Answer(model="gpt-demo", text="Your balance is 42.00."))
    before = len(fake.requests)
    session = rt.session("heidi", agent="support", channel="chat")
    session.send("What is my balance?")
    fake.wait_for(lambda requests: len(requests) > before, 20.0)  # the call is in flight
    session.ref.tell(object())  # an actor told what it does not understand dies of it
    _wait(narrator, _type("activation:requeued", "session:heidi"), "the requeue")
    _wait(narrator, _type("activation:acked", "session:heidi"), "the retried answer")
