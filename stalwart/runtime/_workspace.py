"""A session's workspace: the built-in draft tools (seed 003's staged drafts).

Edits to shared resources do not happen in place. The model stages a draft
(``draft_write``: the full content, as a ``draft:staged`` event with its sha256), reads
it back or revises it, and only ``draft_commit`` hands it to the host's committer, which
writes the shared resource; ``draft:committed`` records that. ``draft_discard`` drops a
draft it no longer needs (``draft:discarded``), and ``draft_list`` pages through the open
ones (a path prefix, an offset), however many a long session left. A wake that is
interrupted leaves its drafts in the log: the next wake lists them in its system prompt
and continues them instead of starting over. The events are appended through the lease's fence, like
everything else a wake writes.

The committer is the host's: ``committer(session_id, path, content, content_hash)``. A
crash between the committer's write and ``draft:committed`` commits again on the next
attempt, so a committer should be idempotent for the same ``content_hash``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import partial

import anyio.to_thread

from stalwart._text import escaped
from stalwart.actors import drafts_note
from stalwart.clock import Clock
from stalwart.errors import ToolError
from stalwart.events import DraftCommitted, DraftDiscarded, DraftStaged, Event
from stalwart.state import DRAFTS, Draft, DraftsState
from stalwart.store import EventStore, load_state
from stalwart.tools import Tool, build_tool

from ._layer import StoreSink

__all__ = ["Committer", "draft_tools"]

#: ``committer(session_id, path, content, content_hash)`` writes a draft out.
Committer = Callable[[str, str, str, str], object]

MAX_PATH = 300
#: The most open drafts one ``draft_list`` call shows (its ``limit``): an answer stays
#: small however many drafts a long session left open; the rest is paged with ``offset``.
LIST_PAGE = 100


def draft_tools(
    store: EventStore,
    sink: StoreSink,
    clock: Clock,
    session_id: str,
    committer: Committer,
    *,
    max_bytes: int,
) -> tuple[Tool, ...]:
    """``draft_write``, ``draft_read``, ``draft_list``, ``draft_commit`` and
    ``draft_discard`` of one session."""
    space = Workspace(store, sink, clock, session_id, committer, max_bytes=max_bytes)
    tools = (
        space.draft_write,
        space.draft_read,
        space.draft_list,
        space.draft_commit,
        space.draft_discard,
    )
    return tuple(build_tool(fn) for fn in tools)


class Workspace:
    """One session's drafts; each public method is a tool the model calls."""

    def __init__(
        self,
        store: EventStore,
        sink: StoreSink,
        clock: Clock,
        session_id: str,
        committer: Committer,
        *,
        max_bytes: int,
    ) -> None:
        self._store = store
        self._sink = sink
        self._clock = clock
        self._session_id = session_id
        self._stream = f"session:{session_id}"
        self._committer = committer
        self._max_bytes = max_bytes

    def _state(self) -> DraftsState:
        # from the fold's snapshot and the events since: a tool call on a long session
        # does not fold its whole stream again (73 ms at 50,000 events)
        return load_state(self._store, self._stream, DRAFTS)

    def _content_of(self, draft: Draft) -> str:
        [record] = list(self._store.read_stream(self._stream, draft.version, draft.version))
        event = record.event
        assert isinstance(event, DraftStaged)
        return event.content

    async def _emit(self, event: Event) -> None:
        await self._sink.emit(self._stream, [event], self._clock.now())

    def _find(self, path: str) -> Draft:
        draft = self._state().drafts.get(path)
        if draft is None or draft.status != "staged":
            raise ToolError(f"there is no open draft at {path!r}; draft_list shows the open ones")
        return draft

    async def draft_write(self, path: str, content: str) -> str:
        """Stage the full new content of a file or document (nothing is written out until
        draft_commit). Writing the same path again makes a new revision."""
        if not path or len(path) > MAX_PATH:
            raise ToolError(f"a draft path is 1 to {MAX_PATH} characters")
        if escaped(path) != path:  # a line break would write into the system prompt's note
            raise ToolError("a draft path cannot hold control characters or line breaks")
        size = len(content.encode("utf-8"))
        if size > self._max_bytes:
            raise ToolError(f"a draft holds at most {self._max_bytes} bytes; this one is {size}")
        previous = await anyio.to_thread.run_sync(self._state)
        held = previous.drafts.get(path)
        revision = held.revision + 1 if held is not None and held.status == "staged" else 1
        digest = hashlib.sha256(content.encode("utf-8")).hexdigest()
        staged = DraftStaged(
            path=path, content=content, content_hash=digest, size=size, revision=revision
        )
        await self._emit(staged)
        return f"staged revision {revision} of {path} ({size} bytes, sha256 {digest[:12]})"

    async def draft_read(self, path: str) -> str:
        """The content of the open draft at ``path``."""
        draft = await anyio.to_thread.run_sync(self._find, path)
        return await anyio.to_thread.run_sync(self._content_of, draft)

    async def draft_list(self, prefix: str = "", offset: int = 0, limit: int = LIST_PAGE) -> str:
        """The drafts staged and not committed yet, by path: at most ``limit`` (1 to 100)
        from the ``offset``-th (0: the first), only those whose path starts with
        ``prefix`` when one is given."""
        if offset < 0:
            raise ToolError("offset is 0 or more")
        if not 1 <= limit <= LIST_PAGE:
            raise ToolError(f"limit is 1 to {LIST_PAGE}")
        held = (await anyio.to_thread.run_sync(self._state)).open()
        return listed([d for d in held if d.path.startswith(prefix)], prefix, offset, limit)

    async def draft_commit(self, path: str) -> str:
        """Write the open draft at ``path`` to the shared resource."""
        draft = await anyio.to_thread.run_sync(self._find, path)
        content = await anyio.to_thread.run_sync(self._content_of, draft)
        write = partial(self._committer, self._session_id, path, content, draft.content_hash)
        await anyio.to_thread.run_sync(write)
        await self._emit(
            DraftCommitted(path=path, content_hash=draft.content_hash, revision=draft.revision)
        )
        return f"committed revision {draft.revision} of {path}"

    async def draft_discard(self, path: str) -> str:
        """Drop the open draft at ``path``: nothing is written out, and it is no longer
        listed. Discarding it again changes nothing."""
        draft = (await anyio.to_thread.run_sync(self._state)).drafts.get(path)
        if draft is None:
            raise ToolError(f"there is no draft at {path!r}; draft_list shows the open ones")
        if draft.status == "committed":
            raise ToolError(f"the draft at {path!r} is committed: it cannot be discarded")
        if draft.status == "discarded":
            return f"the draft at {path} is discarded already"
        await self._emit(DraftDiscarded(path=path, reason="discarded by the model"))
        return f"discarded revision {draft.revision} of {path}"


def listed(drafts: list[Draft], prefix: str, offset: int, limit: int) -> str:
    """What ``draft_list`` answers: the ``limit`` open drafts of ``drafts`` (those whose
    path starts with ``prefix``, by path) from ``offset``, and where the next page starts
    when there is one; all of them as the system prompt's note lists them when they fit."""
    which = " whose path starts with that prefix" if prefix else ""
    page = drafts[offset : offset + limit]
    if not drafts:
        return f"There are no open drafts{which}."
    if not page:
        return f"There are {len(drafts)} open drafts{which}: offset {offset} is past the last."
    note = drafts_note(page, as_written=True)
    assert note is not None
    after = len(drafts) - offset - len(page)
    if offset == 0 and after == 0:
        return note
    shown = f"drafts {offset + 1} to {offset + len(page)} of {len(drafts)}{which} shown"
    if after == 0:
        return f"{note}\n- ({shown})"
    return f"{note}\n- ({shown}; call draft_list with offset={offset + len(page)} for the next)"
