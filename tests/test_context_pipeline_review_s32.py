"""A third review of the pipeline context engine: each test states a defect that was in
the code (a summarizer outage that erased the summary made before it and truncated on
every turn, a symbolic-link loop that disabled rehydration, a knob of 0
that re-read every file, a reused call id that broke the cache fence on every call).
Each failed before its fix."""

from __future__ import annotations

import os
from itertools import pairwise
from pathlib import Path

from stalwart.clock import FakeClock
from stalwart.context import ContextMessage, SummaryRequest
from stalwart.context.pipeline import PipelineConfig, PipelineEngine, directory_reader
from stalwart.events import ContextCompacted
from tests.test_context_pipeline import Summaries, Transcript

FACT = "the customer's account id is 4411"


class Outage:
    """A summarizer that answers until ``down`` is set, then raises (its provider is
    down)."""

    def __init__(self) -> None:
        self.down = False

    def __call__(self, request: SummaryRequest) -> tuple[str, int, int]:
        if self.down:
            raise ConnectionError("the summarizer's provider is down")
        return f"Facts so far: {FACT}. " + "detail " * 300, 100, 10


def _summary(messages: tuple[ContextMessage, ...]) -> str:
    return next((m.content for m in messages if m.message_id.startswith("pipeline-summary:")), "")


def _turn(t: Transcript, n: int) -> None:
    t.user(f"question {n} " + "word " * 150)
    t.assistant("answer " * 150)


# Was: DEFECT: in a summarizer outage each emergency truncation nested the last one's body: the summary made before it was cut out, and every turn truncated  # noqa: E501
def test_a_summarizer_outage_keeps_the_summary_made_before_it() -> None:
    summarizer = Outage()
    engine = PipelineEngine(PipelineConfig(), summarizer=summarizer, clock=FakeClock())
    t = Transcript()
    for n in range(12):
        _turn(t, n)
        result = engine.assemble(t.all, 6_000, provider="anthropic")
    assert FACT in _summary(result.messages)  # a real compaction ran
    summarizer.down = True
    truncated: list[int] = []
    for n in range(12, 40):
        _turn(t, n)
        result = engine.assemble(t.all, 6_000, provider="anthropic")
        if any(isinstance(e, ContextCompacted) for e in result.events):
            truncated.append(n)
        summary = _summary(result.messages)
        # the earlier summary's text, not a stack of notices about the outage
        assert FACT in summary, (n, summary[:600])
        assert summary.count("The summarizer was unavailable") <= 1, n
        assert result.tokens_out <= 6_000
    assert len(truncated) >= 3
    # the nested notices grew the message until every turn truncated again (and broke the
    # cache fence); a truncation leaves room for a few turns, as a compaction does
    assert all(later - earlier > 1 for earlier, later in pairwise(truncated)), truncated


# Was: DEFECT: a symbolic-link loop a tool call named made directory_reader raise RuntimeError (Python < 3.13), failing and then disabling layer 9 for the session  # noqa: E501
def test_a_symlink_loop_the_model_names_reads_as_missing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "AGENTS.md").write_text("Always answer in French.")
    os.symlink(root / "b", root / "a")
    os.symlink(root / "a", root / "b")
    read = directory_reader(root)
    assert read("a") is None
    assert read("a/inside.txt") is None
    clock = FakeClock()
    engine = PipelineEngine(
        PipelineConfig(), summarizer=Summaries(), clock=clock, reader=read, session="s1"
    )
    t = Transcript()
    t.user("look at the files")
    t.pair("read", '{"path": "a"}', "contents " * 200)
    for n in range(20):
        _turn(t, n)
        result = engine.assemble(t.all, 3_000, provider="openai", caching=False)
        assert "rehydration" not in result.layers_failed, n
        clock.advance(60)
    assert engine.state.breaker("rehydration").status == "closed"
    assert "Always answer in French." in "".join(m.content for m in result.messages)


# Was: DEFECT: rehydrate_max_files = 0 (a valid knob) re-read every file any dropped tool call had named, instead of none  # noqa: E501
def test_no_referenced_file_is_read_again_when_the_knob_is_zero() -> None:
    asked: list[str] = []

    def read(path: str) -> str:
        asked.append(path)
        return f"contents of {path}"

    engine = PipelineEngine(
        PipelineConfig(rehydrate_max_files=0),
        summarizer=Summaries(),
        clock=FakeClock(),
        reader=read,
    )
    t = Transcript()
    t.user("look at the files")
    for n in range(6):
        t.pair("read", f'{{"path": "src/f{n}.py"}}', "contents " * 100)
    for n in range(20):
        _turn(t, n)
    result = engine.assemble(t.all, 3_000, provider="openai", caching=False)
    assert result.compacted
    assert asked == ["AGENTS.md"]  # the instructions file only
    assert "src/f" not in "".join(m.content for m in result.messages)


# Was: DEFECT: with call ids numbered per response (call_0 every turn), one call left unanswered made every later tool result break the cache fence as a "late result"  # noqa: E501
def test_a_reused_call_id_does_not_break_the_fence_on_every_tool_result() -> None:
    engine = PipelineEngine(PipelineConfig(), summarizer=Summaries(), clock=FakeClock())
    t = Transcript()
    t.user("start")
    t.assistant("hi")
    engine.assemble(t.all, 100_000, provider="anthropic")
    t.user("read a")
    t.assistant("", tool_calls=[{"id": "call_0", "name": "read", "arguments": '{"path": "a"}'}])
    t.user("are you still there?")  # the turn was stopped: call_0 has no result
    held = engine.assemble(t.all, 100_000, provider="anthropic")
    assert held.repairs == 1  # a placeholder result for the unanswered call
    for n in range(4):
        arguments = f'{{"path": "b{n}"}}'
        t.assistant("", tool_calls=[{"id": "call_0", "name": "read", "arguments": arguments}])
        t.add("tool", f"contents of b{n}", tool_call_id="call_0", name="read")
        result = engine.assemble(t.all, 100_000, provider="anthropic")
        assert result.cache_break is None, (n, result.cache_break)
        assert result.messages[: held.fence] == held.messages[: held.fence]
        # each result stays with its own call
        calls = {m.message_id: m for m in result.messages if m.tool_calls}
        answered = [
            (result.messages[i - 1].tool_calls[0].arguments, m.content)
            for i, m in enumerate(result.messages)
            if m.role == "tool" and result.messages[i - 1].message_id in calls
        ]
        assert (arguments, f"contents of b{n}") in answered
        held = result


def test_a_real_late_result_still_breaks_the_fence() -> None:
    """The guard of the fix above: a result that does come for the held call (the same
    position, not only the same id) still breaks the fence, so the model sees it."""
    engine = PipelineEngine(PipelineConfig(), summarizer=Summaries(), clock=FakeClock())
    t = Transcript()
    t.user("read a")
    t.assistant("", tool_calls=[{"id": "call_0", "name": "read", "arguments": '{"path": "a"}'}])
    t.user("are you still there?")
    engine.assemble(t.all, 100_000, provider="anthropic")
    t.add("tool", "contents of a", tool_call_id="call_0", name="read")
    result = engine.assemble(t.all, 100_000, provider="anthropic")
    assert result.cache_break == "late_result"
    assert "contents of a" in [m.content for m in result.messages]
