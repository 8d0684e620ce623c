"""Review of the context engine (session 31): defects found, each with the test that
showed it."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from stalwart.channels import MemoryChannel
from stalwart.cli import cli
from stalwart.clock import FakeClock
from stalwart.config import Config, ContextEngineSettings, parse_config
from stalwart.context import ContextMessage, DagEngine, ExtractiveSummarizer
from stalwart.events import ContextAssembled, ContextCalibrated
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider
from tests._runtime_support import delivered, has, log_until, of

# -- the request's system text and tools at the calibrated factor ----------------------------

WINDOW = 4_096
REPLY = 256
SYSTEM = "Follow the house rules for every order and refund, and say which rule applies. " * 30


def _dense_config(base_url: str) -> Config:
    return parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": base_url}},
            "agents": {
                "default": {
                    "provider": "main",
                    "model": "dense",
                    "max_retries": 0,
                    "max_tokens": REPLY,
                    "context_window": WINDOW,
                    "system_prompt": SYSTEM,
                }
            },
        }
    )


# Was: DEFECT: the system text and tools counted at factor 1 in a calibrated budget: requests over the window  # noqa: E501
def test_a_long_system_prompt_at_a_dense_factor_keeps_the_request_within_the_window(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The provider counts twice what the engine estimates (its first answer says so and
    the estimator is calibrated to about 2). The Agent's budget is the window less the
    reply, the tool declarations and the system prompt, each estimated at factor 1; the
    engine fitted the messages to that budget at factor 2, but the provider counts the
    system prompt and the tools at factor 2 as well, so a long user message made a
    request of about 4,800 tokens for a 3,840-token room (the provider refuses it:
    ``context_length_exceeded``). The messages must get the room the whole request
    leaves at the calibrated factor."""
    with Runtime(
        _dense_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        session = rt.session("s1", channel="chat")
        fake.add(Answer(text="noted", input_tokens=2_400))  # about twice the estimate
        session.send("hello")
        delivered(rt, chat, 1)
        # the calibration is recorded after the reply went out: wait for it
        calibration = log_until(store, "context-calibration:openai:dense", has(ContextCalibrated))
        [calibrated] = of(ContextCalibrated, calibration)
        factor = calibrated.factor
        assert factor > 1.8, factor
        fake.add(Answer(text="done"))
        session.send("Please check this order log: " + "line item 4411 shipped late. " * 400)
        delivered(rt, chat, 2)
    last = of(ContextAssembled, list(store.read_stream("context:s1")))[-1]
    overhead = WINDOW - REPLY - last.budget  # what the Agent's budget left out at factor 1
    sent = last.tokens_out + math.ceil(overhead * factor)  # the provider's count
    assert sent <= WINDOW - REPLY, (sent, last.tokens_out, overhead, factor)


# -- a transcript of the wrong shape ---------------------------------------------------------

MALFORMED = {
    "function-as-text": (
        [{"role": "assistant", "tool_calls": [{"id": "c1", "function": "lookup"}]}],
        "a tool call's function must be an object",
    ),
    "tool-calls-as-text": ([{"role": "assistant", "tool_calls": "lookup"}], "tool_calls"),
    "numeric-tool-call-id": (
        [{"role": "tool", "content": "42", "tool_call_id": 7}],
        "$.tool_call_id",
    ),
    "numeric-signature": (
        [
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "hm", "signature": 7}],
            }
        ],
        "signature",
    ),
    "image-source-as-text": (
        [{"role": "user", "content": [{"type": "image", "source": "cat.png"}]}],
        "an image's source must be an object",
    ),
}


# Was: DEFECT: a transcript part of the wrong shape made `context simulate` an "internal error (a bug)"  # noqa: E501
@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_transcript_of_the_wrong_shape_is_one_line_naming_the_item(
    tmp_path: Path, name: str
) -> None:
    """``stalwart context simulate`` reads a transcript an operator exported by hand: a
    tool call whose ``function`` is a string, a numeric ``tool_call_id`` or signature, an
    image source that is a URL string. Each was an internal error (AttributeError,
    TypeError, or a message stored with an integer id that failed later), "a bug"; it is
    a malformed input, one line that names the item and what is wrong."""
    items, expected = MALFORMED[name]
    transcript = tmp_path / "chat.json"
    transcript.write_text(json.dumps([{"role": "user", "content": "hello"}, *items]))
    result = CliRunner().invoke(
        cli, ["context", "simulate", "--transcript", str(transcript), "--budget", "1000"]
    )
    assert result.exit_code == 1, result.output
    assert result.output.startswith("stalwart: error: "), result.output
    assert result.output.count("\n") == 1, result.output
    assert "item 1" in result.output, result.output
    assert expected in result.output, result.output


# -- a search query the size of a document ----------------------------------------------------


# Was: DEFECT: ctx_search scored every document once per query word: a 190 KB query held the store's lock for 5 s  # noqa: E501
def test_a_search_query_the_size_of_a_document_is_answered_at_once(clock: FakeClock) -> None:
    """A model's runaway ``ctx_search`` (a pasted log as the query) scored every document
    for each of its 30,000 words and looked for each word in each hit's text: seconds of
    work under the ContextStore's lock, so every session's assembly waited behind it
    (and the tool's own 10 s ask timed out while the work went on). The rarest terms of a
    query are scored (64): a query that long is answered about as fast as a long one."""
    rng = random.Random(31)
    vocabulary = [f"w{n}" for n in range(20_000)]
    messages = [
        ContextMessage(
            message_id=f"m{n}",
            seq=n,
            role="user" if n % 2 == 0 else "assistant",
            content=" ".join(rng.choice(vocabulary) for _ in range(1_500)),
        )
        for n in range(300)
    ]
    dag = DagEngine(ContextEngineSettings(), summarizer=ExtractiveSummarizer(), clock=clock)
    dag.assemble("s1", messages, 10**9)
    dag.search("s1", "w1")  # the index is built on the first search
    query = " ".join(rng.choice(vocabulary) for _ in range(30_000))
    started = time.perf_counter()
    hits = dag.search("s1", query, limit=10)
    took = time.perf_counter() - started
    assert len(hits) == 10
    assert took < 1.0, f"a {len(query):,}-character query took {took:.2f} s"
