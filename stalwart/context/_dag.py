"""One session's lossless store and summary DAG, kept incrementally in memory.

Messages are kept verbatim in arrival order (``position`` 0, 1, 2 ...), never merged or
deduplicated by content; a message id seen before is skipped (re-ingest is idempotent).
Per-message token estimates are cached with prefix sums, so the size of any range is two
lookups. Summaries cover contiguous ranges from the start: positions below ``covered``
belong to a leaf (or to the pinned system prompt before them), and ``roots`` are the
summaries not yet folded into a deeper one, oldest first. Each node records the position
span it stands for, so expanding one is a slice of the stored messages.

This class does no I/O, reads no clock and calls no summarizer: the engine decides, and
tells it what was created (from the same events a restore folds).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from stalwart.errors import StalwartError
from stalwart.events import Event
from stalwart.ids import valid_session_id
from stalwart.state import ContextDagState, SummaryNode

from ._render import render_summary
from ._search import Bm25Index
from ._types import ContextMessage

__all__ = ["ContextScopeError", "DagSession", "Unit", "valid_session_id"]


class ContextScopeError(StalwartError):
    """A write or read whose session scope is ambiguous, malformed or not the caller's.
    Its message is static text: it never echoes an id or content. ``events`` holds the
    ``context:dag_degraded`` (``fail_closed_rollover``) a refused write records."""

    events: tuple[Event, ...] = ()


class Unit:
    """A piece of history that is kept or dropped whole: a summary, or one message with
    the tool results that answer it. ``start``/``end`` are positions (a summary's span)."""

    __slots__ = ("end", "start", "summary_id", "tokens")

    def __init__(self, start: int, end: int, tokens: int, summary_id: str | None = None) -> None:
        self.start = start
        self.end = end
        self.tokens = tokens
        self.summary_id = summary_id


def searchable_text(message: ContextMessage) -> str:
    """What full-text search sees of a message: text, calls and their arguments, thinking."""
    parts = [message.content]
    parts += [f"{call.name} {call.arguments}" for call in message.tool_calls]
    parts += [block.text for block in message.thinking if not block.redacted]
    return "\n".join(part for part in parts if part)


class DagSession:
    """The store, token sums, DAG and search index of one session."""

    def __init__(
        self, session_id: str, tenant: str | None, count: Callable[[ContextMessage], int]
    ) -> None:
        self.session_id = session_id
        self.tenant = tenant
        self.bound = False
        self._count = count
        self.messages: list[ContextMessage] = []
        self.positions: dict[str, int] = {}
        self.tokens: list[int] = []
        self.cum: list[int] = [0]
        self.user_positions: list[int] = []
        self.pinned = 0  # leading system messages
        self.nodes: dict[str, SummaryNode] = {}
        self.spans: dict[str, tuple[int, int]] = {}
        self.parents: dict[str, str] = {}
        self.roots: list[str] = []
        self.covered = 0
        self._leaf_starts: list[int] = []
        self._leaf_ids: list[str] = []
        self._rendered: dict[str, tuple[ContextMessage, int]] = {}
        self._index: Bm25Index | None = None  # built when first searched (see index)
        self.tail_degraded = False
        self.system_clipped = False  # the system prompt is cut to fit (logged once)
        self.degraded: str | None = None
        self.system: tuple[int, ContextMessage] | None = None

    # -- storing ----------------------------------------------------------------------

    def ingest(self, messages: Sequence[ContextMessage]) -> int:
        """Store the messages not seen before, in order; returns how many were new.

        ContextScopeError (nothing stored) when the input would rewrite history: a known
        id whose role or content differs, or a new message older than the newest stored.
        An input that extends the stored history (same first message, same newest stored
        message at the same place) is checked from there on only.
        """
        known = len(self.messages)
        start = 0
        if known and len(messages) >= known:
            # the session stream is append-only: when the input starts and reaches the
            # stored history at the same messages, only what follows is new (O(new))
            last, first = messages[known - 1], messages[0]
            if (last is self.messages[-1] or last == self.messages[-1]) and (
                first.message_id == self.messages[0].message_id
            ):
                start = known
        fresh: list[ContextMessage] = []
        seen: set[str] = set()
        newest = self.messages[-1].seq if self.messages else None
        for message in messages[start:] if start else messages:
            stored = self.positions.get(message.message_id)
            if stored is not None:
                old = self.messages[stored]
                if _said(old) != _said(message):
                    raise ContextScopeError("a message id was reused with different content")
                continue
            if message.message_id in seen:
                continue
            if newest is not None and message.seq < newest:
                raise ContextScopeError("a new message is older than the stored history")
            seen.add(message.message_id)
            fresh.append(message)
        for message in fresh:
            self._append(message)
        return len(fresh)

    def _append(self, message: ContextMessage) -> None:
        position = len(self.messages)
        self.messages.append(message)
        self.positions[message.message_id] = position
        tokens = self._count(message)
        self.tokens.append(tokens)
        self.cum.append(self.cum[-1] + tokens)
        if message.role == "user":
            self.user_positions.append(position)
        if message.role == "system" and self.pinned == position:
            self.pinned += 1
            self.covered = max(self.covered, self.pinned)
        if self._index is not None:
            self._index.add(f"m:{message.message_id}", searchable_text(message))

    @property
    def index(self) -> Bm25Index:
        """The session's full-text index (its messages and summaries), built when first
        searched (a recall search, a relevance-first assembly) and kept up to date from
        then on: a session rebuilt from the log does not index its whole history for
        assemblies that never search it. BM25 does not depend on the order documents
        are added in, so building it late ranks as building it as they came."""
        index = self._index
        if index is None:
            index = self.build_index()
            self.take_index(index)
        return index

    @property
    def indexed(self) -> bool:
        """Whether the full-text index is built (see :attr:`index`)."""
        return self._index is not None

    def build_index(self) -> Bm25Index:
        """A full-text index of the messages and summaries held now, for
        :meth:`take_index`. It only reads the session (about 90 µs a message: 9 s for
        100,000), so an owner whose other sessions must not wait that long builds it
        outside its lock while no one else changes this session."""
        index = Bm25Index()
        for message in self.messages:
            index.add(f"m:{message.message_id}", searchable_text(message))
        for node in list(self.nodes.values()):
            index.add(f"s:{node.summary_id}", node.body)
        return index

    def take_index(self, index: Bm25Index) -> None:
        """Keep ``index`` (from :meth:`build_index`) as the session's, with whatever
        was stored after it was built; an index already kept stays."""
        if self._index is not None:
            return
        for message in reversed(self.messages):  # the newest first: what came since
            doc = f"m:{message.message_id}"
            if doc in index:
                break
            index.add(doc, searchable_text(message))
        for node in self.nodes.values():
            if f"s:{node.summary_id}" not in index:
                index.add(f"s:{node.summary_id}", node.body)
        self._index = index

    # -- sizes and ranges ---------------------------------------------------------------

    def range_tokens(self, start: int, end: int) -> int:
        return self.cum[end] - self.cum[start]

    def tail_start(self, turns: int) -> int:
        """Where the fresh tail begins: the ``turns``-th newest user message (everything
        after the pinned system messages when there are fewer)."""
        if len(self.user_positions) >= turns:
            return max(self.user_positions[-turns], self.covered, self.pinned)
        return max(self.covered, self.pinned)

    def later_tail_starts(self, start: int) -> list[int]:
        """User positions after ``start``, oldest first: where a shrunk tail may begin."""
        index = bisect.bisect_right(self.user_positions, start)
        return self.user_positions[index:]

    def chunk(self, end_limit: int, max_tokens: int) -> tuple[int, int]:
        """The oldest unsummarized range ``[covered, end)`` below ``end_limit`` of at most
        ``max_tokens`` (at least one message), ending where no tool pair is split."""
        start = self.covered
        end = start
        while end < end_limit and (end == start or self.range_tokens(start, end + 1) <= max_tokens):
            end += 1
        while end < end_limit and self.messages[end].role == "tool":
            end += 1
        return start, end

    def units(self, start: int, end: int) -> list[Unit]:
        """Messages ``[start, end)`` as keep-or-drop-together units, oldest first."""
        units: list[Unit] = []
        for position in range(start, end):
            tokens = self.tokens[position]
            if units and self.messages[position].role == "tool":
                last = units[-1]
                last.end = position + 1
                last.tokens += tokens
            else:
                units.append(Unit(position, position + 1, tokens))
        return units

    # -- the DAG ------------------------------------------------------------------------

    def rendered(self, summary_id: str) -> tuple[ContextMessage, int]:
        """A summary's rendered message and its token estimate (cached)."""
        cached = self._rendered.get(summary_id)
        if cached is None:
            message = render_summary(self.nodes[summary_id])
            cached = (message, self._count(message))
            self._rendered[summary_id] = cached
        return cached

    def roots_tokens(self) -> int:
        return sum(self.rendered(root)[1] for root in self.roots)

    def add_node(self, node: SummaryNode) -> None:
        """Record a summary the engine created (or a restore folded)."""
        self.nodes[node.summary_id] = node
        if node.depth == 0:
            first = self.positions[node.covers[0]]
            last = self.positions[node.covers[-1]]
            self.spans[node.summary_id] = (first, last + 1)
            self.covered = max(self.covered, last + 1)
            self.roots.append(node.summary_id)
            self._leaf_starts.append(first)
            self._leaf_ids.append(node.summary_id)
        else:
            first_span = self.spans[node.covers[0]]
            last_span = self.spans[node.covers[-1]]
            self.spans[node.summary_id] = (first_span[0], last_span[1])
            covered = set(node.covers)
            for child in node.covers:
                self.parents[child] = node.summary_id
            index = min(i for i, root in enumerate(self.roots) if root in covered)
            self.roots = [root for root in self.roots if root not in covered]
            self.roots.insert(index, node.summary_id)
        if self._index is not None:
            self._index.add(f"s:{node.summary_id}", node.body)

    def condensable(self, fanout: int) -> list[str] | None:
        """The oldest ``fanout`` consecutive roots of one depth, if there are that many."""
        run: list[str] = []
        for root in self.roots:
            if run and self.nodes[run[-1]].depth != self.nodes[root].depth:
                run = []
            run.append(root)
            if len(run) == fanout:
                return run
        return None

    def leaf_of(self, position: int) -> str | None:
        """The leaf summary covering a position, if any."""
        if position >= self.covered:
            return None
        index = bisect.bisect_right(self._leaf_starts, position) - 1
        return self._leaf_ids[index] if index >= 0 else None

    def root_of(self, summary_id: str) -> str:
        """The top-level summary that (transitively) holds ``summary_id``."""
        while summary_id in self.parents:
            summary_id = self.parents[summary_id]
        return summary_id

    def restore(self, state: ContextDagState) -> None:
        """Rebuild the DAG from its fold (messages must be ingested first).

        ContextScopeError when a summary covers a message this session does not hold, or
        when the fold lacks a summary that the others build on: one this version could not
        read (a newer stalwart's, an ``UnknownEvent``). Leaves cover the history from its
        start without a gap, so a leaf that does not begin where the last one ended, or a
        condensed summary over one the fold never saw, means the messages in between
        would silently leave the prompt; the session is refused instead, fail closed."""
        self.bound = state.bound
        self.tenant = state.tenant if state.bound else self.tenant
        self.degraded = state.degraded
        self.tail_degraded = state.tail_clipped
        for node in state.summaries.values():
            if node.depth == 0:
                if any(m not in self.positions for m in node.covers):
                    raise ContextScopeError("the context stream covers messages of another history")
                gap = self.positions[node.covers[0]] != self.covered
            else:
                gap = any(child not in self.nodes for child in node.covers)
            if gap:
                raise ContextScopeError(
                    "the context stream holds a summary this version cannot read "
                    "(written by a newer stalwart)"
                )
            self.add_node(node)
        if self.roots != list(state.roots):
            raise ContextScopeError("the context stream's summaries do not fold consistently")


def _said(message: ContextMessage) -> tuple[object, ...]:
    """What a message says (not where it sits): a known id must say the same again."""
    return (
        message.role,
        message.content,
        message.tool_calls,
        message.tool_call_id,
        message.name,
        message.thinking,
        message.images,
    )
