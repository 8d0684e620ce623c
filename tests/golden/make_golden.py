"""Writes the golden logs in this folder. Run once when a log is added; never to "fix" a test.

Each ``*.log`` is a msgpack array of stored record bytes exactly as the LMDB ``log``
database holds them; ``*.expected.json`` is the state the session fold must give.
A change that cannot read these logs any more breaks old stores: it needs an upcaster.

    python tests/golden/make_golden.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from stalwart.events import (
    DEFAULT_CODEC,
    Event,
    ExecutionAborted,
    MessageAppended,
    PromptStarted,
    PromptTimeout,
    RecordedEvent,
    SessionCreated,
    SessionRequiresAction,
    ToolCall,
    ToolCompleted,
    ToolStarted,
    TurnCompleted,
    TurnStarted,
    UserToolConfirmation,
)
from stalwart.state import SESSION, fold

HERE = Path(__file__).parent
STREAM = "session:golden-1"


def _records(events: list[Event]) -> list[RecordedEvent]:
    return [
        RecordedEvent(
            position=i,
            stream=STREAM,
            version=i,
            ts=1_790_000_000.0 + i * 1.5,
            id=f"{i:032x}",
            causation_id=None if i == 1 else f"{i - 1:032x}",
            correlation_id="turn-1",
            schema=1,
            event=event,
        )
        for i, event in enumerate(events, start=1)
    ]


SESSION_V1: list[Event] = [
    SessionCreated(agent="support", channel="chat:42", tenant="acme", title="refund"),
    TurnStarted(turn_id="t1"),
    MessageAppended(message_id="m1", role="user", content="I want a refund for order 17"),
    PromptStarted(call_id="c1", provider="openai", model="gpt-4o-mini", timeout_ms=180000),
    PromptTimeout(
        call_id="c1", limit="stall", knob="prompt_timeout_ms", limit_ms=180000, elapsed_ms=180004
    ),
    MessageAppended(
        message_id="m2",
        role="assistant",
        content="",
        tool_calls=(ToolCall(id="call_1", name="refund", arguments='{"order": 17}'),),
    ),
    SessionRequiresAction(
        request_id="r1", kind="approval", tool="refund", arguments='{"order": 17}'
    ),
    UserToolConfirmation(request_id="r1", allow=True),
    ToolStarted(call_id="call_1", tool="refund", arguments='{"order": 17}', idempotency_key="k1"),
    ToolCompleted(call_id="call_1", tool="refund", output="refunded", duration_ms=12),
    MessageAppended(message_id="m3", role="tool", content="refunded", tool_call_id="call_1"),
    MessageAppended(message_id="m4", role="assistant", content="Done: order 17 is refunded."),
    TurnCompleted(turn_id="t1"),
    TurnStarted(turn_id="t2"),
    ExecutionAborted(reason="pipeline_timeout", turn_id="t2", limit_ms=600000, elapsed_ms=600001),
]


def main() -> int:
    records = _records(SESSION_V1)
    encoded = [DEFAULT_CODEC.encode(r) for r in records]
    (HERE / "session-v1.log").write_bytes(msgspec.msgpack.encode(encoded))
    state = fold(SESSION, STREAM, records)
    (HERE / "session-v1.expected.json").write_bytes(
        msgspec.json.format(msgspec.json.encode(state)) + b"\n"
    )

    # a log from "the future": one record of a type this version does not know
    payload = {"type": "session:sentiment_scored", "score": 0.8, "model": "x"}
    position = len(encoded) + 1
    unknown = [position, STREAM, position, 1_790_000_100.0, "f" * 32, None, None, 3, payload]
    future = [*encoded, msgspec.msgpack.encode(unknown)]
    (HERE / "session-future.log").write_bytes(msgspec.msgpack.encode(future))

    # a log that must fail: record 3's payload has the wrong shape for its type
    broken = list(encoded)
    broken[2] = msgspec.msgpack.encode(
        [3, STREAM, 3, 1.0, "b" * 32, None, None, 1, {"type": "message:appended", "role": 7}]
    )
    (HERE / "session-broken.log").write_bytes(msgspec.msgpack.encode(broken))
    return 0


if __name__ == "__main__":
    sys.exit(main())
