"""A session's workspace: the built-in draft tools (seed 003's staged drafts).

Edits to shared resources do not happen in place. The model stages a draft
(``draft_write``: the full content, as a ``draft:staged`` event with its sha256), reads
it back or revises it, and only ``draft_commit`` hands it to the host's committer, which
writes the shared resource; ``draft:committed`` records that. A wake that is interrupted
leaves its drafts in the log: the next wake lists them in its system prompt and continues
them instead of starting over. The events are appended through the lease's fence, like
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
from stalwart.events import DraftCommitted, DraftStaged, Event
from stalwart.state import DRAFTS, Draft, DraftsState
from stalwart.store import EventStore, load_state
from stalwart.tools import Tool, build_tool

from ._layer import StoreSink

__all__ = ["Committer", "draft_tools"]

#: ``committer(session_id, path, content, content_hash)`` writes a draft out.
Committer = Callable[[str, str, str, str], object]

MAX_PATH = 300


def draft_tools(
    store: EventStore,
    sink: StoreSink,
    clock: Clock,
    session_id: str,
    committer: Committer,
    *,
    max_bytes: int,
) -> tuple[Tool, ...]:
    """``draft_write``, ``draft_read``, ``draft_list`` and ``draft_commit`` of one session."""
    stream = f"session:{session_id}"

    def state() -> DraftsState:
        # from the fold's snapshot and the events since: a tool call on a long session
        # does not fold its whole stream again (73 ms at 50,000 events)
        return load_state(store, stream, DRAFTS)

    def content_of(draft: Draft) -> str:
        [record] = list(store.read_stream(stream, draft.version, draft.version))
        event = record.event
        assert isinstance(event, DraftStaged)
        return event.content

    async def emit(event: Event) -> None:
        await sink.emit(stream, [event], clock.now())

    def find(path: str) -> Draft:
        draft = state().drafts.get(path)
        if draft is None or draft.status != "staged":
            raise ToolError(f"there is no open draft at {path!r}; draft_list shows the open ones")
        return draft

    async def draft_write(path: str, content: str) -> str:
        """Stage the full new content of a file or document (nothing is written out until
        draft_commit). Writing the same path again makes a new revision."""
        if not path or len(path) > MAX_PATH:
            raise ToolError(f"a draft path is 1 to {MAX_PATH} characters")
        if escaped(path) != path:  # a line break would write into the system prompt's note
            raise ToolError("a draft path cannot hold control characters or line breaks")
        size = len(content.encode("utf-8"))
        if size > max_bytes:
            raise ToolError(f"a draft holds at most {max_bytes} bytes; this one is {size}")
        previous = await anyio.to_thread.run_sync(state)
        held = previous.drafts.get(path)
        revision = held.revision + 1 if held is not None and held.status == "staged" else 1
        digest = hashlib.sha256(content.encode("utf-8")).hexdigest()
        staged = DraftStaged(
            path=path, content=content, content_hash=digest, size=size, revision=revision
        )
        await emit(staged)
        return f"staged revision {revision} of {path} ({size} bytes, sha256 {digest[:12]})"

    async def draft_read(path: str) -> str:
        """The content of the open draft at ``path``."""
        draft = await anyio.to_thread.run_sync(find, path)
        return await anyio.to_thread.run_sync(content_of, draft)

    async def draft_list() -> str:
        """The drafts staged and not committed yet."""
        drafts = (await anyio.to_thread.run_sync(state)).open()
        return drafts_note(drafts) or "There are no open drafts."

    async def draft_commit(path: str) -> str:
        """Write the open draft at ``path`` to the shared resource."""
        draft = await anyio.to_thread.run_sync(find, path)
        content = await anyio.to_thread.run_sync(content_of, draft)
        write = partial(committer, session_id, path, content, draft.content_hash)
        await anyio.to_thread.run_sync(write)
        await emit(
            DraftCommitted(path=path, content_hash=draft.content_hash, revision=draft.revision)
        )
        return f"committed revision {draft.revision} of {path}"

    return tuple(build_tool(fn) for fn in (draft_write, draft_read, draft_list, draft_commit))
