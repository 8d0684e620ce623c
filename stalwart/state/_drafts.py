"""The drafts fold: what a session has staged in its workspace, and what it committed."""

from __future__ import annotations

from typing import Literal

import msgspec

from stalwart.events import DraftCommitted, DraftDiscarded, DraftStaged, RecordedEvent

from ._aggregate import ApplyFolder

__all__ = ["DRAFTS", "Draft", "DraftsAggregate", "DraftsState", "apply_drafts"]

DraftStatus = Literal["staged", "committed", "discarded"]


class Draft(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A draft's newest revision. ``version`` is the stream version of the
    ``draft:staged`` that holds its content (read it back from there)."""

    path: str
    status: DraftStatus
    content_hash: str
    size: int
    revision: int
    version: int
    staged_at: float
    updated_at: float


class DraftsState(msgspec.Struct, frozen=True, kw_only=True):
    stream: str
    drafts: dict[str, Draft] = msgspec.field(default_factory=dict)

    def open(self) -> list[Draft]:
        """Drafts staged and not committed nor discarded, by path."""
        return sorted(
            (d for d in self.drafts.values() if d.status == "staged"), key=lambda d: d.path
        )


def apply_drafts(state: DraftsState, record: RecordedEvent) -> DraftsState:
    event = record.event
    match event:
        case DraftStaged():
            previous = state.drafts.get(event.path)
            draft = Draft(
                path=event.path,
                status="staged",
                content_hash=event.content_hash,
                size=event.size,
                revision=event.revision,
                version=record.version,
                staged_at=previous.staged_at if previous is not None else record.ts,
                updated_at=record.ts,
            )
        case DraftCommitted() | DraftDiscarded():
            previous = state.drafts.get(event.path)
            if previous is None:
                return state
            if isinstance(event, DraftCommitted) and event.content_hash != previous.content_hash:
                # an older revision's commit (a draft_write ran beside the draft_commit):
                # the newest revision was not written out, so it stays open
                return state
            status: DraftStatus = "committed" if isinstance(event, DraftCommitted) else "discarded"
            draft = msgspec.structs.replace(previous, status=status, updated_at=record.ts)
        case _:
            return state
    return msgspec.structs.replace(state, drafts={**state.drafts, event.path: draft})


class DraftsAggregate:
    name = "drafts"
    #: 2: a commit of an older revision leaves the newest one open
    version = 2
    state_type = DraftsState

    def initial(self, stream: str) -> DraftsState:
        return DraftsState(stream=stream)

    def apply(self, state: DraftsState, record: RecordedEvent) -> DraftsState:
        return apply_drafts(state, record)

    def folder(self, state: DraftsState) -> ApplyFolder[DraftsState]:
        return ApplyFolder(apply_drafts, state)


DRAFTS = DraftsAggregate()
