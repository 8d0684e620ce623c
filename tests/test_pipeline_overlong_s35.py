"""The pipeline engine when the newest turn is longer than the window even cut.

What the review found: last session the newest turn's longest tool results learned to be
cut to one length, down to the engine's line alone. A turn of very many steps (150
calls of a tool in one user turn) is over a 16k budget with every result cut to its
line: the request still went out over the window, which a provider refuses. Now the
oldest steps of the turn are left out (an assistant message with the results of its
calls, always together), the user's message that opened the turn and the newest steps
stay, and the engine's line right after the user's message says how many steps and
calls are left out. And compaction decided on the uncut size of the newest turn: right
after a compaction (in its cooldown), a step over the budget called the summarizer
again, and with the summarizer down an emergency truncation dropped older turns, when
cutting the newest turn's results alone made the request fit.
"""

from __future__ import annotations

from typing import Any

import pytest

from stalwart.channels import MemoryChannel
from stalwart.cli._replay import default_knobs
from stalwart.clock import FakeClock
from stalwart.config import Config, parse_config
from stalwart.context import SummaryRequest, validity_violations
from stalwart.context.pipeline import PipelineConfig, PipelineEngine
from stalwart.context.pipeline._wrap import MARKER
from stalwart.events import ContextAssembled, ContextCompacted
from stalwart.runtime import Runtime
from stalwart.state import VERIFIERS, verify
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, FakeToolCall
from tests._runtime_support import delivered, of
from tests._support_s35 import sent_tokens
from tests.test_context_pipeline import Summaries, Transcript

BUDGET = 16_384
ROW = "row of data 0123456789\n"  # 23 characters
LEFT_OUT = f"{MARKER}left_out tool_steps] "


def _page(n: int) -> str:
    return f"page {n}\n" + ROW * 30  # about 700 characters: cut to its line, still there


def _many_steps(steps: int) -> Transcript:
    t = Transcript()
    t.user("read every page of the export")
    for n in range(steps):
        t.pair("read_page", f'{{"page": {n}, "path": "exports/q3/report.csv"}}', _page(n))
    return t


def _engine(summarizer: Any = None) -> PipelineEngine:
    return PipelineEngine(PipelineConfig(), summarizer=summarizer or Summaries(), clock=FakeClock())


def _steps_sent(messages: tuple[Any, ...]) -> list[int]:
    """The page numbers of the calls in ``messages``, in order."""
    return [
        int(call.arguments.split(",")[0].split(":")[1])
        for message in messages
        for call in message.tool_calls
    ]


# Was: DEFECT: 150 tool steps in one user turn went out over a 16k budget even with every result cut to its line: the provider refuses it  # noqa: E501
@pytest.mark.parametrize(("provider", "caching"), [("openai", False), ("anthropic", True)])
def test_a_turn_of_many_steps_leaves_its_oldest_steps_out_to_fit_and_says_so(
    provider: str, caching: bool
) -> None:
    t = _many_steps(150)
    engine = _engine()
    result = engine.assemble(t.all, BUDGET, provider=provider, caching=caching)
    assert result.tokens_out <= result.budget == BUDGET, result.tokens_out
    assert validity_violations(result.messages) == []
    left_out = result.steps_left_out
    assert 0 < left_out < 150
    # the user's message that opened the turn, then the engine's line, then the newest
    # steps in order, each call with its result
    contents = [m.content for m in result.messages]
    opener = contents.index("read every page of the export")
    line = result.messages[opener + 1]
    assert line.role == "user"
    assert line.content.startswith(LEFT_OUT)
    assert f"The {left_out:,} oldest tool steps of this turn ({left_out:,} tool calls" in (
        line.content
    )
    assert "read_page x" in line.content
    assert [m for m in contents if m.startswith(MARKER + "left_out")] == [line.content]
    assert _steps_sent(result.messages[opener + 2 :]) == list(range(left_out, 150))
    # recorded: the cut is in context:assembled (with the steps left out)
    assembled = [e for e in result.events if isinstance(e, ContextAssembled)][-1]
    assert assembled.tail_clipped
    assert assembled.layers_fired[-2:] == ("clip", "omit_steps")
    assert assembled.steps_left_out == left_out
    assert assembled.tokens_out <= assembled.budget
    # a rebuilt engine shapes the same request
    rebuilt = PipelineEngine.from_events(
        result.events, PipelineConfig(), summarizer=Summaries(), clock=FakeClock()
    )
    again = rebuilt.assemble(t.all, BUDGET, provider=provider, caching=caching)
    assert again.messages == result.messages


# Was: DEFECT: in a long tool loop behind the cache fence, every step past the window with results cut to lines went out over it  # noqa: E501
def test_a_long_tool_loop_stays_within_the_budget_on_every_step() -> None:
    t = _many_steps(40)
    engine = _engine()
    seen: list[tuple[int, int]] = []
    for n in range(40, 100):
        t.pair("read_page", f'{{"page": {n}, "path": "exports/q3/report.csv"}}', _page(n))
        result = engine.assemble(t.all, 6_000, provider="anthropic")
        assert result.tokens_out <= result.budget, (n, result.tokens_out)
        assert validity_violations(result.messages) == [], n
        pages = _steps_sent(result.messages)
        assert pages[-1] == n  # the newest step is always there
        assert pages == list(range(pages[0], n + 1))  # and a run of the newest ones
        seen.append((result.steps_left_out, result.clipped))
    assert seen[0][0] == 0, seen
    assert seen[-1][0] > 0, seen  # from where lines alone do not fit


def _window_config(base_url: str) -> Config:
    return parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": base_url}},
            "agents": {
                "default": {
                    "provider": "main",
                    "model": "m1",
                    "max_retries": 0,
                    "max_steps": STEPS + 5,
                    "context_window": 4_096,
                }
            },
            "context_engine": {"version": "pipeline"},
        }
    )


def read_page(n: int) -> str:
    """Read one page of the export."""
    return _page(n)


STEPS = 45


# Was: DEFECT: a turn of many tool steps in a runtime sent requests over the window once every result was cut to its line  # noqa: E501
def test_a_runtime_turn_of_many_steps_sends_every_request_within_the_window(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    # input_tokens=0: no usage reported, so the estimate is not calibrated away from 1
    fake.add(
        *(
            Answer(
                text="",
                tool_calls=(FakeToolCall(id=f"c{n}", name="read_page", arguments={"n": n}),),
                input_tokens=0,
            )
            for n in range(STEPS)
        ),
        Answer(text="Read every page.", input_tokens=0),
    )
    with Runtime(
        _window_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        rt.tool(read_page)
        session = rt.session("s1", channel="chat")
        session.send("read every page of the export")
        assert delivered(rt, chat, 1)[-1].text == "Read every page."
    assembled = of(ContextAssembled, list(store.read_stream("context:s1")))
    assert len(assembled) == len(fake.requests) == STEPS + 1
    for event, request in zip(assembled, fake.requests, strict=True):
        assert event.tokens_out <= event.budget, (event.tokens_out, event.budget)
        assert sent_tokens(request.body["messages"]) <= event.budget
    assert any("omit_steps" in event.layers_fired for event in assembled)
    assert all(
        (event.steps_left_out > 0) == ("omit_steps" in event.layers_fired) for event in assembled
    )
    last = fake.requests[-1].body["messages"]
    assert last[0]["content"] == "read every page of the export"
    assert last[1]["role"] == "user"
    assert last[1]["content"].startswith(LEFT_OUT)
    # every call the provider received has its result right after it
    assert last[2]["role"] == "assistant"
    assert last[-1]["role"] == "tool"
    assert last[-1]["tool_call_id"] == f"c{STEPS - 1}"
    report = verify(store.read_all(), VERIFIERS, defaults=default_knobs())
    assert report.clean, report.findings


def _compacted_session(summarizer: Any) -> tuple[PipelineEngine, Transcript]:
    """A session compacted at its newest turn (so within the compaction's cooldown)."""
    engine = _engine(summarizer)
    t = Transcript()
    for turn in range(8):
        t.user(f"question {turn}")
        t.assistant("answer " + "words and more words " * 120)
        engine.assemble(t.all, 4_000, provider="openai", caching=False)
    assert engine.state.summary is not None
    assert engine.state.summary.turn == 8
    return engine, t


# Was: DEFECT: right after a compaction, a step whose results only the cut made fit called the summarizer again (cooldown bypassed as 'over the budget')  # noqa: E501
def test_in_the_cooldown_a_step_that_fits_once_cut_calls_no_summarizer() -> None:
    summarizer = Summaries()
    engine, t = _compacted_session(summarizer)
    calls = len(summarizer.requests)
    t.pair("read_part", '{"n": 0}', "part 0\n" + ROW * 200)
    t.pair("read_part", '{"n": 1}', "part 1\n" + ROW * 200)
    result = engine.assemble(t.all, 4_000, provider="openai", caching=False)
    assert result.tokens_in > result.budget  # uncut, the request is over the budget
    assert result.tokens_out <= result.budget
    assert result.clipped == 2
    assert not result.compacted
    assert len(summarizer.requests) == calls
    assert "question 0" in [m.content for m in result.messages]  # the anchors stay


class Down:
    """A summarizer whose provider is down."""

    def __call__(self, request: SummaryRequest) -> tuple[str, int, int]:
        raise ConnectionError("summarizer down")


# Was: DEFECT: with the summarizer down, a newest turn that fits once cut made an emergency truncation drop the older turns  # noqa: E501
def test_with_the_summarizer_down_a_turn_that_fits_once_cut_drops_no_older_turn() -> None:
    engine = _engine(Down())
    t = Transcript()
    t.user("set up the export job")
    t.assistant("the job is set up")
    t.user("now read every part of it")
    for n in range(24):
        t.pair("read_part", f'{{"n": {n}}}', f"part {n}\n" + ROW * 1_200)
    result = engine.assemble(t.all, BUDGET, provider="openai", caching=False)
    assert result.tokens_out <= result.budget
    assert not result.compacted  # no emergency truncation
    assert not any(isinstance(e, ContextCompacted) for e in result.events)
    contents = [m.content for m in result.messages]
    assert contents[1:3] == ["set up the export job", "the job is set up"]
    assert result.clipped == 24


# Was: DEFECT: a newest turn alone past the threshold had the summarizer called on the turns before it, though cutting its results made the request fit with them  # noqa: E501
def test_a_newest_turn_past_the_threshold_that_fits_once_cut_calls_no_summarizer() -> None:
    summarizer = Summaries()
    engine = _engine(summarizer)
    t = Transcript()
    t.user("set up the export job")
    t.assistant("the job is set up")
    t.user("now read every part of it")
    for n in range(24):
        t.pair("read_part", f'{{"n": {n}}}', f"part {n}\n" + ROW * 1_200)
    result = engine.assemble(t.all, BUDGET, provider="openai", caching=False)
    assert result.tokens_out <= result.budget
    assert summarizer.requests == []
    assert not result.compacted
    contents = [m.content for m in result.messages]
    assert contents[1:4] == [
        "set up the export job",
        "the job is set up",
        "now read every part of it",
    ]
    assert result.clipped == 24
