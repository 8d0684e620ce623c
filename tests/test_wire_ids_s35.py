"""Tool-call ids a wire would refuse are sent as stable stand-ins (session 35).

A session keeps the ids its models gave; after a fallback to a provider of another kind
they go to a wire with other rules: Anthropic takes only letters, digits, ``_`` and
``-``, OpenAI at most 40 characters. Real HTTP to the fake provider on 127.0.0.1."""

from __future__ import annotations

import re
from typing import Any

import pytest

from stalwart.events import ToolCall
from stalwart.providers import Message, ProviderRequest
from stalwart.providers._wire_ids import anthropic_id, openai_id
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider
from tests.test_provider_loopback import APIS, call, config, provider_layer

pytestmark = pytest.mark.anyio

#: ids as other servers give them: a Kimi-style function id, an over-long one, a plain one
ODD = "functions.search:0"
LONG = "call_" + "x" * 60
PLAIN = "toolu_01A09q90qw90lq917835lq9"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _history(*ids: str) -> ProviderRequest:
    calls = tuple(ToolCall(id=i, name="search", arguments="{}") for i in ids)
    results = tuple(Message(role="tool", content="found", tool_call_id=i) for i in ids)
    return ProviderRequest(
        messages=(
            Message(role="user", content="look it up"),
            Message(role="assistant", tool_calls=calls),
            *results,
        )
    )


def _sent_ids(api: str, body: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The call ids and the result ids of a request body, as the wire carries them."""
    if api == "openai":
        calls = [c["id"] for m in body["messages"] for c in m.get("tool_calls") or ()]
        results = [m["tool_call_id"] for m in body["messages"] if m["role"] == "tool"]
        return calls, results
    blocks = [b for m in body["messages"] if isinstance(m["content"], list) for b in m["content"]]
    calls = [b["id"] for b in blocks if b["type"] == "tool_use"]
    results = [b["tool_use_id"] for b in blocks if b["type"] == "tool_result"]
    return calls, results


# Was: DEFECT: a call id another provider gave (`functions.search:0`, or one over 40
# characters) went to Anthropic / OpenAI as it was, and the provider refused the request
# with a 400 on every later turn of the session (after a fallback between kinds)
@pytest.mark.parametrize("api", APIS)
async def test_ids_a_wire_refuses_go_as_stable_stand_ins_paired_with_their_results(
    api: str, fake: FakeProvider, store: EventStore
) -> None:
    fake.set_default(Answer(text="ok"))
    request = _history(ODD, LONG, PLAIN)
    async with provider_layer(config(fake.base_url, api), store) as layer:
        await call(layer, request)
        await call(layer, request)
    first, second = (_sent_ids(api, r.body) for r in fake.requests)
    calls, results = first
    assert calls == results  # each result still names its call
    assert first == second  # the same stand-ins on the next request: a cached prefix holds
    assert calls[2] == PLAIN  # an id the wire takes goes as it is
    if api == "anthropic":
        assert all(re.fullmatch(r"[A-Za-z0-9_-]{1,64}", i) for i in calls), calls
    else:
        assert calls[0] == ODD
        assert all(len(i) <= 40 for i in calls), calls
    assert len(set(calls)) == 3


def test_stand_ins_of_different_ids_differ() -> None:
    # ids that clean to the same text keep apart (a digest of the whole id is kept)
    assert anthropic_id("a.b") != anthropic_id("a:b")
    assert anthropic_id("...") != anthropic_id(":::")
    assert openai_id("c" * 41) != openai_id("c" * 42)
    assert len(openai_id("c" * 500)) == 40
