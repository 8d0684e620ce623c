"""Review of the agent's recall tools and transcripts (session 33): what ``ctx_expand``
and ``ctx_inspect`` hand the model is bounded as the model receives it, a search with a
rare word among common ones does not read every document, and JSON Lines keep line
breaks that JSON strings may hold."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from typing import Any

import pykka
import pytest

from stalwart.actors import Assemble, ContextStoreActor, ask_context, context_tools
from stalwart.clock import FakeClock
from stalwart.config import ContextEngineSettings
from stalwart.context import (
    Bm25Index,
    ContextMessage,
    ExtractiveSummarizer,
    estimate_text_tokens,
    read_transcript,
)
from stalwart.store import EventStore
from stalwart.tools import ToolRegistry

ASK = 10.0
#: what an answer adds around its messages (target, offsets, next ids)
ENVELOPE = 100


@pytest.fixture
def start(store: EventStore, clock: FakeClock) -> Iterator[Any]:
    refs: list[pykka.ActorRef[Any]] = []

    def started(settings: ContextEngineSettings) -> pykka.ActorRef[Any]:
        ref = ContextStoreActor.start(
            store=store, clock=clock, summarizer=ExtractiveSummarizer(), settings=settings
        )
        refs.append(ref)
        return ref

    yield started
    for ref in refs:
        ref.stop()


def _call(tools: ToolRegistry, name: str, **arguments: Any) -> str:
    tool = tools.get(name)
    assert tool is not None
    text = tool.fn(**arguments)
    assert isinstance(text, str)
    return text


def _chatter(count: int, content: str = "ok") -> tuple[ContextMessage, ...]:
    """A system prompt, then ``count`` short messages: a chatty loop."""
    out = [ContextMessage(message_id="sys", seq=0, role="system", content="Be brief.")]
    for n in range(1, count + 1):
        role = "user" if n % 2 else "assistant"
        out.append(ContextMessage(message_id=f"m{n:05d}", seq=n, role=role, content=content))
    return tuple(out)


def _tools(start: Any, messages: tuple[ContextMessage, ...], budget: int) -> ToolRegistry:
    settings = ContextEngineSettings(fresh_tail_turns=2, expand_max_tokens=8_000)
    ref = start(settings)
    ask_context(
        ref, Assemble(session_id="s1", messages=messages, budget=budget, tenant="acme"), ASK
    )
    return context_tools(ref, "s1", "acme", settings=settings)


def _a_leaf(tools: ToolRegistry) -> str:
    """The leaf that covers the first message (found as the model finds it)."""
    hits = json.loads(_call(tools, "ctx_search", query="ok", limit=100))
    leaves = [hit["summary_id"] for hit in hits if hit["id"] == "m00001"]
    assert leaves
    assert leaves[0] is not None
    return str(leaves[0])


# -- ctx_expand: the grant bounds what the model receives ---------------------------------


# Was: DEFECT: ctx_expand counted each message's text, not the JSON it returns: 2,000 granted, 16,000 sent  # noqa: E501
def test_an_expansion_of_many_short_messages_is_within_its_grant_as_the_model_gets_it(
    start: Any,
) -> None:
    """A message's JSON (its id, seq, role and empty fields) is about 40 tokens; the
    grant counted the 6 of its text, so a leaf of short messages came back eight times
    the grant: an expansion meant to fit the window pushed the turn over it."""
    messages = _chatter(600)
    tools = _tools(start, messages, budget=1_500)
    leaf = _a_leaf(tools)
    stored = {m.message_id: m.content for m in messages}
    seen: dict[str, str] = {}
    after: str | None = None
    offset = 0
    for _ in range(100):
        text = _call(tools, "ctx_expand", id=leaf, max_tokens=1_000, after=after, offset=offset)
        assert estimate_text_tokens(text) <= 1_000 + ENVELOPE
        part = json.loads(text)
        for message in part["messages"]:
            seen[message["message_id"]] = message["content"]
        if part["next_after"] is None:
            break
        after, offset = part["next_after"], part["next_offset"]
    assert all(stored[key] == value for key, value in seen.items())
    covered = json.loads(_call(tools, "ctx_inspect", summary_id=leaf))["covers_total"]
    assert len(seen) == covered > 100  # the whole leaf came through, page by page


# Was: DEFECT: a message of control characters came back from ctx_expand at six times its grant
def test_a_message_of_control_characters_comes_back_in_pieces_within_the_grant(
    start: Any,
) -> None:
    """JSON writes a control character as six (``\\u0001``); a piece counted as one
    character in four ran to six times the grant."""
    content = "\x01\x1b[2J" * 5_000
    messages = (
        ContextMessage(message_id="sys", seq=0, role="system", content="Be brief."),
        ContextMessage(message_id="u1", seq=1, role="user", content=content),
    )
    tools = _tools(start, messages, budget=100_000)
    pieces: list[str] = []
    after: str | None = None
    offset = 0
    for _ in range(500):
        text = _call(tools, "ctx_expand", id="u1", max_tokens=1_000, after=after, offset=offset)
        assert estimate_text_tokens(text) <= 1_000 + ENVELOPE
        part = json.loads(text)
        pieces.append(part["messages"][0]["content"])
        if part["next_after"] is None:
            break
        after, offset = part["next_after"], part["next_offset"]
    assert "".join(pieces) == content  # byte for byte, however many pieces


# -- ctx_inspect: a leaf over thousands of messages ----------------------------------------


# Was: DEFECT: ctx_inspect of a leaf over 3,333 short messages listed every id: 36,000 tokens
def test_inspecting_a_leaf_of_thousands_of_messages_lists_a_bounded_part(start: Any) -> None:
    messages = _chatter(40_000)
    tools = _tools(start, messages, budget=200_000)
    leaf = _a_leaf(tools)
    text = _call(tools, "ctx_inspect", summary_id=leaf)
    info = json.loads(text)
    assert info["covers_total"] > 1_000
    assert info["covers"] == [f"m{n:05d}" for n in range(1, 65)]  # the first ones, in order
    assert estimate_text_tokens(text) < 2_000


# -- ctx_search: a rare word among common ones ---------------------------------------------


# Was: DEFECT: a search with common words scored every document holding one: 1 s per call on 100k messages  # noqa: E501
def test_a_rare_word_among_common_ones_is_found_without_reading_every_document() -> None:
    """Every document of a long session holds "the", "and" ...: each one was scored for
    every query term, under the ContextStore's lock, for the one word that decides. The
    rarer terms' documents are scored first, and the common terms' are not read once
    nothing they could add reaches the results. The results are the same."""
    rng = random.Random(33)
    common = [f"c{n}" for n in range(30)]
    vocabulary = [f"w{n}" for n in range(5_000)]
    index = Bm25Index()
    for n in range(50_000):
        index.add(f"m:{n}", " ".join(common + rng.choices(vocabulary, k=3)))
    query = "w17 " + " ".join(common)
    alone = {doc for doc, _ in index.search("w17", 100)}
    started = time.perf_counter()
    hits = index.search(query, 10)
    took = time.perf_counter() - started
    assert hits
    assert {doc for doc, _ in hits} <= alone
    assert hits == sorted(hits, key=lambda hit: (-hit[1], hit[0]))
    assert took < 0.2, f"took {took:.2f} s"  # real-time: the cost is the defect


# -- JSON Lines transcripts ----------------------------------------------------------------


# Was: DEFECT: a JSON Lines transcript with U+2028 or U+0085 in a message was "not JSON"
def test_a_json_lines_transcript_keeps_line_breaks_json_strings_may_hold() -> None:
    """``json.dumps(..., ensure_ascii=False)`` writes U+2028, U+2029 and U+0085 raw;
    splitting the lines where ``str.splitlines`` does cut such a line in two."""
    said = ["first\u2028second", "ok\x85done\u2029\x1c\x1d\x1e"]
    text = "\r\n".join(
        json.dumps({"role": role, "content": content}, ensure_ascii=False)
        for role, content in zip(("user", "assistant"), said, strict=True)
    )
    messages = read_transcript(text)
    assert [m.content for m in messages] == said
