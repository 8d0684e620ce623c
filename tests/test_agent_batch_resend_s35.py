"""An Agent never sends a completion batch's textless record again (session 35).

Since a batch of completions records its text once (in its first run's
``announcement:queued``; the others name that run in ``text_run`` and carry no text),
an Agent opened on such a run's stream would have resent an empty message for a record
whose send a crash cut short. The supervisor resends the batch from the run that holds
its text; the Agent leaves those records alone. A real LMDB store in ``tmp_path``."""

from __future__ import annotations

from stalwart.actors import left_unsaid
from stalwart.actors._agent import yours_to_say
from stalwart.events import AnnouncementQueued, SessionCreated
from stalwart.store import EventStore, NewEvent


def _queued(**fields: object) -> AnnouncementQueued:
    return AnnouncementQueued(announcement_id="a1", channel="chat", **fields)  # type: ignore[arg-type]


# Was: DEFECT: a batch member's record (no text, `text_run` naming the holder) was the
# Agent's to send again: after a crash cut the batch's send, an Agent on that stream
# would have sent its user an empty message
def test_a_batch_members_textless_record_is_not_the_agents_to_send_again() -> None:
    assert yours_to_say(_queued(text="done: 42"), "chat")
    assert yours_to_say(_queued(text="done: 42", text_run=None), "chat")
    assert not yours_to_say(_queued(text="", text_run="r1"), "chat")


def test_a_stream_whose_only_unsent_record_is_a_batch_members_has_nothing_left_unsaid(
    store: EventStore,
) -> None:
    now = store_now = 1_700_000_000.0
    for stream, queued in (
        ("session:holder", _queued(text="done: 42")),
        ("session:member", _queued(text="", text_run="holder")),
    ):
        store.append(
            stream,
            [
                NewEvent(event=SessionCreated(agent="default", channel="chat"), ts=store_now),
                NewEvent(event=queued, ts=store_now),
            ],
        )
    assert left_unsaid(store, "session:holder", now + 60)
    assert not left_unsaid(store, "session:member", now + 60)
