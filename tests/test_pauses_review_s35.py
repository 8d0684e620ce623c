"""Pauses for a human, interrupts and staged drafts: defects a review found, each test
failing on the code before its fix.

Real parts: a real LMDB store in tmp_path, the fake provider over loopback HTTP, the fake
clock and a MemoryChannel.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable

from stalwart.actors import LeaseLost
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.context import estimate_text_tokens
from stalwart.events import (
    ActivationAcked,
    ActivationBlocked,
    DraftStaged,
    LeaseExpired,
    RecordedEvent,
    SessionCreated,
    ToolStarted,
)
from stalwart.runtime import Runtime, interrupt
from stalwart.store import EventStore, NewEvent
from stalwart.testing import Answer, FakeProvider, FakeToolCall
from tests._runtime_support import (
    GUARD,
    delivered,
    has,
    log_until,
    of,
    runtime_config,
    window_config,
)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# -- interrupts -----------------------------------------------------------------------------


# Was: DEFECT: an interrupt's notice reaching the Agent after the next message's wake began dropped that wake  # noqa: E501
def test_an_interrupts_late_notice_does_not_stop_the_wake_of_the_next_message(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """``rt.interrupt`` records the interrupt, then tells the session's Agent
    ``LeaseLost(stream, None)``. When a message is sent from another thread as the
    session is interrupted, its wake may be leased and handed to the Agent before that
    notice lands. The Agent dropped whatever wake it held: the new message's turn was
    stopped mid-step, nothing was appended, and its lease was left to expire
    (``lease:expired``, a failure) before anyone answered it. Here the interrupt is
    recorded as ``rt.interrupt`` records it, and its notice is delivered while the next
    message's wake runs its tool."""
    release = threading.Event()
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:

        @rt.tool(needs_confirmation=True)
        def refund(order: int) -> str:
            """Refund an order."""
            return f"refunded {order}"

        @rt.tool
        def lookup(order: int) -> str:
            """Look an order up."""
            release.wait(GUARD)
            return f"order {order}: shipped"

        first = FakeToolCall(id="c1", name="refund", arguments={"order": 7})
        second = FakeToolCall(id="c2", name="lookup", arguments={"order": 8})
        fake.add(
            Answer(text="", tool_calls=(first,)),
            Answer(text="", tool_calls=(second,)),
            Answer(text="Order 8 has shipped."),
        )
        session = rt.session("s1", channel="chat")
        session.send("refund order 7")
        log_until(store, "session:s1", has(ActivationBlocked))
        interrupt(store, "s1", "wrong order", ts=clock.now())  # what rt.interrupt records
        session.send("no: where is order 8?")
        fake.wait_for(lambda requests: len(requests) == 2, GUARD)
        log_until(store, "session:s1", _started("c2"))  # its tool runs now
        session.ref.tell(LeaseLost("session:s1", None))  # the interrupt's notice, late
        release.set()
        # no clock moves: only the running wake itself can answer
        replies = delivered(rt, chat, 2)
    assert replies[-1].text == "Order 8 has shipped."
    records = list(store.read_stream("session:s1"))
    assert len(of(ActivationAcked, records)) == 1
    assert not of(LeaseExpired, records)


def _started(call_id: str) -> Callable[[list[RecordedEvent]], bool]:
    return lambda records: any(
        isinstance(r.event, ToolStarted) and r.event.call_id == call_id for r in records
    )


# -- staged drafts ----------------------------------------------------------------------------


# Was: DEFECT: every open draft a session ever staged was listed in every request's system prompt, past the window  # noqa: E501
def test_the_open_drafts_note_stays_small_however_many_drafts_are_open(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """A long-lived session whose model staged drafts it never committed (nothing
    discards one) carried a line per open draft in the system prompt of every model call
    of every wake: 600 of them made a 39 KB system prompt, over an 8,192-token window
    before the conversation itself. Now the note lists the newest ones and counts the
    rest (``draft_list`` shows them all)."""
    drafts = [
        NewEvent(
            event=DraftStaged(
                path=f"notes/draft-{n:04}.md",
                content="hello",
                content_hash=_sha("hello"),
                size=5,
                revision=1,
            ),
            ts=clock.now() - 600 + n,  # one a second, the newest last
        )
        for n in range(600)
    ]
    created = NewEvent(event=SessionCreated(agent="default", channel="chat"), ts=clock.now() - 601)
    store.append("session:s1", [created, *drafts])
    window = 8_192
    config = window_config(fake.base_url, window=window, engine="dag")
    with Runtime(
        config, store=store, clock=clock, channels={"chat": chat}, committer=_ignore
    ) as rt:
        rt.session("s1", channel="chat").send("hi")
        [reply] = delivered(rt, chat, 1)
    assert reply.text == "default answer"
    body = fake.requests[0].body
    assert estimate_text_tokens(json.dumps(body["messages"])) < window
    system = body["messages"][0]["content"]
    listed = [f"notes/draft-{n:04}.md" in system for n in range(600)]
    assert listed == [False] * 580 + [True] * 20  # the newest ones, which it works on
    assert "and 580 older ones (draft_list shows them all)" in system


def _ignore(session_id: str, path: str, content: str, content_hash: str) -> None:
    return None
