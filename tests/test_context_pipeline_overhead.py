"""The pipeline engine leaves room for what a request carries besides its messages (the
system text and the tool declarations) at the calibrated factor, without breaking its
cache fence every time the factor moves."""

from __future__ import annotations

import math

import msgspec

from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import Config, ContextEngineSettings
from stalwart.context import TokenEstimator
from stalwart.context.pipeline import PipelineConfig, PipelineEngine
from stalwart.events import ContextAssembled, ContextCalibrated
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider
from tests._runtime_support import delivered, has, log_until, of
from tests.test_context_pipeline import Summaries, Transcript
from tests.test_context_review_s31 import REPLY, WINDOW, _dense_config


def _dense_pipeline_config(base_url: str) -> Config:
    """The DAG review's dense-model config (a long system prompt), on the pipeline engine."""
    config = _dense_config(base_url)
    return msgspec.structs.replace(config, context_engine=ContextEngineSettings(version="pipeline"))


# Was: DEFECT: the pipeline engine counted the system text at factor 1 in a calibrated budget: requests over the window  # noqa: E501
def test_a_long_system_prompt_at_a_dense_factor_keeps_a_pipeline_request_within_the_window(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The provider counts about twice what the engine estimates. The Agent's budget
    leaves out the system prompt estimated at factor 1, but the provider counts it at
    factor 2 too: the pipeline engine let the history grow to its compaction threshold
    of that budget at factor 2, and the requests went over the window by up to the
    system prompt's size (about 4,500 tokens for a 3,840-token room)."""
    with Runtime(
        _dense_pipeline_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        session = rt.session("s1", channel="chat")
        fake.add(Answer(text="noted", input_tokens=1_500))  # about twice the estimate
        session.send("hello")
        delivered(rt, chat, 1)
        calibration = log_until(store, "context-calibration:openai:dense", has(ContextCalibrated))
        [calibrated] = of(ContextCalibrated, calibration)
        factor = calibrated.factor
        assert factor > 1.8, factor
        for sent in range(2, 7):  # the history grows past the compaction threshold
            fake.add(Answer(text="done"))
            session.send(f"Order log {sent}: " + "line item 4411 shipped late. " * 60)
            delivered(rt, chat, sent)
    assemblies = of(ContextAssembled, list(store.read_stream("context:s1")))
    for assembled in assemblies[1:]:
        assert assembled.engine == "pipeline"
        overhead = WINDOW - REPLY - assembled.budget  # what the budget left out at factor 1
        sent = assembled.tokens_out + math.ceil(overhead * factor)  # the provider's count
        assert sent <= WINDOW - REPLY, (sent, assembled.tokens_out, overhead, factor)
    assert any("compaction" in assembled.layers_fired for assembled in assemblies)


def _turns(count: int) -> Transcript:
    transcript = Transcript("be brief")
    for turn in range(count):
        transcript.user(f"question {turn} " * 20)
        transcript.assistant(f"answer {turn} " * 20)
    return transcript


def test_the_cache_fence_holds_when_only_the_factor_moves() -> None:
    """The room the overhead takes moves with the factor, the budget does not: a factor
    that moves between two calls of a small transcript keeps the fence (the prefix the
    provider cached), and both requests stay within the window."""
    estimator = TokenEstimator("anthropic")
    engine = PipelineEngine(
        PipelineConfig(), summarizer=Summaries(), clock=FakeClock(), session="s1"
    )
    transcript = _turns(3)
    first = engine.assemble(
        transcript.all, 8_000, provider="anthropic", estimator=estimator, overhead=1_000
    )
    assert first.fence > 0
    estimator.factor = 1.3
    transcript.user("one more")
    second = engine.assemble(
        transcript.all, 8_000, provider="anthropic", estimator=estimator, overhead=1_000
    )
    assert second.cache_break is None
    assert second.budget == 8_000


def test_the_overhead_at_the_factor_takes_room_from_the_messages() -> None:
    """With a factor of 2 and an overhead of 3,000 tokens (6,000 as the provider counts
    them), a 10,000-token budget leaves the messages 7,000, not 10,000: a transcript
    the engine fitted to the whole budget went over the window."""
    estimator = TokenEstimator("openai")
    estimator.factor = 2.0
    engine = PipelineEngine(
        PipelineConfig(), summarizer=Summaries(), clock=FakeClock(), session="s1"
    )
    result = engine.assemble(
        _turns(60).all,
        10_000,
        provider="openai",
        caching=False,
        estimator=estimator,
        overhead=3_000,
    )
    assert result.tokens_out + math.ceil(3_000 * 2.0) - 3_000 <= 10_000, result.tokens_out
