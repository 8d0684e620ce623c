"""The session folder's dispatch by type equals ``apply_session``'s ``match``, for any event."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.events import (
    Event,
    RuntimeStarted,
    SessionCreated,
    SessionRequiresAction,
    ToolCompleted,
    ToolStarted,
)
from stalwart.events._codec import EVENT_TYPES
from stalwart.state import SESSION, SessionState

from .test_state import SESSION_EVENTS, records

# every built-in type (RuntimeStarted holds an Any hypothesis cannot build)
ANY_EVENT = st.sampled_from(
    sorted(
        (cls for cls in EVENT_TYPES.values() if cls is not RuntimeStarted),
        key=lambda cls: cls.__name__,
    )
).flatmap(st.builds)


class LoudToolCompleted(ToolCompleted, frozen=True, tag="test:loud-tool-completed"):
    """A subclass of an event the session fold ignores: still ignored."""


class LoudToolStarted(ToolStarted, frozen=True, tag="test:loud-tool-started"):
    """A subclass of an event the session fold handles: handled, as ``match`` does."""


def _both(events: list[Event]) -> tuple[SessionState, SessionState]:
    state = SESSION.initial("session:s")
    folder = SESSION.folder(state)
    for record in records(events):
        state = SESSION.apply(state, record)
        folder.add(record)
    return folder.state(), state


@settings(max_examples=300, deadline=None)
@given(st.lists(ANY_EVENT | SESSION_EVENTS, max_size=30))
def test_the_folder_equals_apply_for_every_event_type(events: list[Event]) -> None:
    folded, applied = _both(events)
    assert folded == applied


@settings(max_examples=200, deadline=None)
@given(st.lists(ANY_EVENT | SESSION_EVENTS, max_size=30), st.lists(st.integers(0, 30)))
def test_adding_in_batches_equals_adding_one_by_one(events: list[Event], cuts: list[int]) -> None:
    """``add_all`` (what a replay folds a store's batch with) over any split of the
    records, empty batches included, equals ``add`` of each record in turn."""
    folded, _ = _both(events)
    batched = SESSION.folder(SESSION.initial("session:s"))
    every = records(events)
    edges = [0, *sorted(min(cut, len(every)) for cut in cuts), len(every)]
    for start, end in itertools.pairwise(edges):
        batched.add_all(every[start:end])
    assert batched.state() == folded


def test_subclasses_are_dispatched_as_match_does() -> None:
    events: list[Event] = [
        SessionCreated(title="t"),
        LoudToolCompleted(call_id="c", tool="t"),
        LoudToolStarted(call_id="c", tool="t"),
        SessionRequiresAction(request_id="r", kind="approval", tool="x"),
    ]
    folded, applied = _both(events)
    assert folded == applied
    assert (folded.tool_calls, folded.status, folded.version) == (1, "requires_action", 4)
