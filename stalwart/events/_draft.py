"""Staged drafts: edits a session makes to shared resources, kept in its workspace (its
stream) until an explicit commit writes them out."""

from __future__ import annotations

from ._base import Event


class DraftStaged(Event, frozen=True, tag="draft:staged"):
    """A new revision of the draft at ``path``: its full ``content``, its sha256 and size."""

    path: str
    content: str
    content_hash: str
    size: int
    revision: int = 1


class DraftCommitted(Event, frozen=True, tag="draft:committed"):
    """The revision with ``content_hash`` was written to the shared resource."""

    path: str
    content_hash: str
    revision: int = 1


class DraftDiscarded(Event, frozen=True, tag="draft:discarded"):
    path: str
    reason: str = ""
