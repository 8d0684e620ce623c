"""A host's summarizer that returns token counts that are not counts: a failure of that
call (``ContextSummarizerFailed``, ``TypeError``), never a crashed assembly nor a record
the log cannot read back (real LMDB store, fake clock)."""

from __future__ import annotations

import pytest

from stalwart.clock import FakeClock
from stalwart.config import ContextEngineSettings
from stalwart.context import DagEngine, SummaryRequest
from stalwart.events import ContextSummarizerFailed, ContextSummaryCreated
from stalwart.store import EventStore
from tests.test_context_assembly import FRONTIER, topical


# Was: DEFECT: a str count crashed every assembly; a float, negative, bool or NaN one was
# recorded (a float in an int field: a context record the log could not read back)
@pytest.mark.parametrize("spent_in", ["12", 1.5, -5, True, float("nan")])
def test_a_summarizer_whose_counts_are_not_counts_is_a_failed_call(
    spent_in: object, store: EventStore, clock: FakeClock
) -> None:
    def summarizer(request: SummaryRequest) -> tuple[str, int, int]:
        return "a summary", spent_in, 2  # type: ignore[return-value]

    settings = ContextEngineSettings(fresh_tail_turns=1, leaf_chunk_tokens=500)
    dag = DagEngine(settings, summarizer=summarizer, clock=clock)
    assembly = dag.assemble("s1", topical(30), 1_500, profile=FRONTIER)
    failed = [e for e in assembly.events if isinstance(e, ContextSummarizerFailed)]
    assert [e.error_class for e in failed] == ["TypeError"]
    assert not any(isinstance(e, ContextSummaryCreated) for e in assembly.events)
    store.append("context:s1", list(assembly.events))
    assert len(list(store.read_stream("context:s1"))) == len(assembly.events)
