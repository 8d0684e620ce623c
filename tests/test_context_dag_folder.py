"""The context DAG's accumulator equals the pure fold, event by event, and is linear.

The pure :func:`~stalwart.state.apply_context` copies a session's summaries and their
parents at every summary, so folding ``context:<session>`` was quadratic in its
summaries (16,000 summaries: 2 s). :class:`~stalwart.state.ContextDagFolder` is what
``load_state`` and ``replay`` fold with now.
"""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.events import (
    ContextAssembled,
    ContextBound,
    ContextDagDegraded,
    ContextSummaryCreated,
    Event,
    MessageAppended,
)
from stalwart.state import CONTEXT_DAG, ContextDagFolder, apply_context
from tests._log import recorded

STREAM = "context:s1"
_IDS = st.sampled_from(["a", "b", "c", "d", "e", "f"])


def _summary(made: str, depth: int, covers: list[str], fallback: bool) -> ContextSummaryCreated:
    return ContextSummaryCreated(
        summary_id=made,
        depth=depth,
        covers=tuple(covers),
        descendant_count=len(covers),
        fallback="emergency-truncation" if fallback else None,
        body=f"summary {made}",
    )


_EVENTS = st.one_of(
    st.builds(ContextBound, session=st.just("s1"), tenant=st.none() | st.just("t")),
    st.builds(
        _summary,
        _IDS,
        st.integers(0, 2),
        st.lists(_IDS | st.sampled_from(["m1", "m2", "m3"]), max_size=4),
        st.booleans(),
    ),
    st.builds(
        ContextDagDegraded,
        reason=st.sampled_from(
            ["spend_cap", "breaker_open", "fail_closed_rollover", "tail_over_budget"]
        ),
    ),
    st.builds(
        ContextAssembled,
        tokens_in=st.just(1),
        tokens_out=st.just(1),
        budget=st.just(2),
        tail_clipped=st.booleans(),
    ),
    st.builds(MessageAppended, message_id=st.just("m"), role=st.just("user")),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_EVENTS, max_size=40), st.integers(0, 40))
def test_the_folder_equals_the_pure_fold_event_by_event(events: list[Event], cut: int) -> None:
    """Also from a state the folder made part-way (as from a snapshot)."""
    pure = CONTEXT_DAG.initial(STREAM)
    folder = ContextDagFolder(pure)
    for version, event in enumerate(events, 1):
        record = recorded(event, 1_000.0 + version, version, STREAM)
        pure = apply_context(pure, record)
        folder.add(record)
        assert folder.state() == pure
        if version == cut:
            folder = CONTEXT_DAG.folder(folder.state())


def test_a_long_sessions_dag_folds_in_linear_time() -> None:
    """40,000 summaries (leaves of 8 messages, every 4 newest roots condensed): about
    0.26 s here, 9.9 s for the pure fold (2.2 s at half as many). The bound is 8x above
    the one and 5x below the other."""
    folder = CONTEXT_DAG.folder(CONTEXT_DAG.initial(STREAM))
    roots: list[str] = []
    started = time.perf_counter()
    for n in range(1, 40_001):
        if len(roots) >= 4:
            covers, roots = roots[-4:], roots[:-4]
            event = _summary(f"c{n}", 1, covers, False)
        else:
            event = _summary(f"l{n}", 0, [f"m{n}.{k}" for k in range(8)], False)
        roots.append(event.summary_id)
        folder.add(recorded(event, float(n), n, STREAM))
    state = folder.state()
    elapsed = time.perf_counter() - started
    assert len(state.summaries) == 40_000
    assert list(state.roots) == roots
    assert elapsed < 2.0, f"{elapsed:.2f} s"
