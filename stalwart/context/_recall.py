"""Recall from a session's lossless store: ``ctx_search``, ``ctx_inspect``, ``ctx_expand``.

Every call names the session and the caller's tenant; a session this engine does not
hold, a tenant that is not the session's, or an id that is not in that session are all
the same :class:`ContextScopeError` with static text, so one session cannot probe
another's ids.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from stalwart.config import ContextEngineSettings
from stalwart.state import SummaryNode

from ._dag import ContextScopeError, DagSession
from ._search import QUERY_TERMS
from ._tokens import DEFAULT_PROFILE, estimate_message_tokens, estimate_text_tokens
from ._types import ContextMessage

__all__ = ["Expansion", "Inspection", "Recall", "SearchHit"]

_NOT_HERE = "no summary or message with that id in this session"
_SNIPPET = 240
#: the most ids of what a summary covers that ``inspect`` lists (a leaf can cover
#: thousands of short messages: ``expand`` pages through them)
COVERS_SHOWN = 64
_JSON = msgspec.json.Encoder()


class SearchHit(msgspec.Struct, frozen=True, kw_only=True):
    """One search result. For a message, ``summary_id`` is the leaf that covers it and
    ``in_context_as`` the top-level summary shown in its place (both None while the
    message is still shown verbatim)."""

    kind: Literal["message", "summary"]
    id: str
    score: float
    snippet: str
    seq: int = 0
    role: str | None = None
    summary_id: str | None = None
    in_context_as: str | None = None


class Inspection(msgspec.Struct, frozen=True, kw_only=True):
    """What a summary covers and where it sits in the DAG: ``covers`` lists the first
    :data:`COVERS_SHOWN` of the ids it covers, ``covers_total`` counts them all."""

    summary_id: str
    depth: int
    descendant_count: int
    covers: tuple[str, ...]
    covers_total: int = 0
    parent: str | None
    first_seq: int
    last_seq: int
    earliest: float
    latest: float
    topics: tuple[str, ...]
    tokens: int
    fallback: str | None = None
    top_level: bool = False


class Expansion(msgspec.Struct, frozen=True, kw_only=True):
    """Stored messages, byte for byte, within a token grant: counted as the JSON text
    the recall tools return, so escapes and field names count too.

    The first message's content starts at character ``offset``; when the grant ran out,
    ``next_after`` / ``next_offset`` say where a further call continues. A message larger
    than the grant comes in pieces of its text (its content, then each tool call as
    ``[tool call <name> id=<id>] <arguments>``, each thinking block as
    ``[thinking signature=<signature>] <text>`` and each image as ``[image <n>] <data>``),
    each within the grant; ``offset`` counts characters of that text."""

    target: str
    messages: tuple[ContextMessage, ...]
    offset: int = 0
    tokens: int = 0
    next_after: str | None = None
    next_offset: int = 0


class Recall:
    """Search, inspect and expand for :class:`~stalwart.context.DagEngine`."""

    settings: ContextEngineSettings
    sessions: dict[str, DagSession]

    def _scoped(self, session_id: str, tenant: str | None) -> DagSession:
        session = self.sessions.get(session_id)
        if session is None or session.tenant != tenant:
            raise ContextScopeError(_NOT_HERE)
        return session

    def search(
        self, session_id: str, query: str, *, tenant: str | None = None, limit: int = 10
    ) -> tuple[SearchHit, ...]:
        """BM25 over the session's stored messages and summaries, best first."""
        session = self._scoped(session_id, tenant)
        hits: list[SearchHit] = []
        for doc, score in session.index.search(query, max(1, min(limit, 100))):
            kind, _, ident = doc.partition(":")
            if kind == "s":
                node = session.nodes[ident]
                hits.append(
                    SearchHit(
                        kind="summary",
                        id=ident,
                        score=round(score, 4),
                        snippet=_snippet(node.body, query),
                        seq=node.first_seq,
                        summary_id=ident,
                        in_context_as=session.root_of(ident),
                    )
                )
                continue
            position = session.positions[ident]
            message = session.messages[position]
            leaf = session.leaf_of(position)
            hits.append(
                SearchHit(
                    kind="message",
                    id=ident,
                    score=round(score, 4),
                    snippet=_snippet(_text(message), query),
                    seq=message.seq,
                    role=message.role,
                    summary_id=leaf,
                    in_context_as=session.root_of(leaf) if leaf else None,
                )
            )
        return tuple(hits)

    def inspect(self, session_id: str, summary_id: str, *, tenant: str | None = None) -> Inspection:
        """What ``summary_id`` covers."""
        session = self._scoped(session_id, tenant)
        node: SummaryNode | None = session.nodes.get(summary_id)
        if node is None:
            raise ContextScopeError(_NOT_HERE)
        return Inspection(
            summary_id=node.summary_id,
            depth=node.depth,
            descendant_count=node.descendant_count,
            covers=node.covers[:COVERS_SHOWN],
            covers_total=len(node.covers),
            parent=session.parents.get(summary_id),
            first_seq=node.first_seq,
            last_seq=node.last_seq,
            earliest=node.earliest,
            latest=node.latest,
            topics=node.topics,
            tokens=node.tokens,
            fallback=node.fallback,
            top_level=summary_id in session.roots,
        )

    def expand(
        self,
        session_id: str,
        target: str,
        *,
        tenant: str | None = None,
        max_tokens: int | None = None,
        after: str | None = None,
        offset: int = 0,
    ) -> Expansion:
        """The stored messages under a summary (or one message), within the grant
        (``max_tokens``, at most ``expand_max_tokens``); continue with ``after`` and
        ``offset`` from the previous answer."""
        session = self._scoped(session_id, tenant)
        if target in session.spans:
            start, end = session.spans[target]
        elif target in session.positions:
            start = session.positions[target]
            # the leading system messages are shown as one, under the first one's id
            # (cut with a marker naming it when it does not fit): that id stands for all
            end = session.pinned if start == 0 and session.pinned > 1 else start + 1
        else:
            raise ContextScopeError(_NOT_HERE)
        cap = self.settings.expand_max_tokens
        grant = cap if max_tokens is None else max(1, min(max_tokens, cap))
        if after is not None:
            position = session.positions.get(after)
            if position is None or not start <= position < end:
                raise ContextScopeError(_NOT_HERE)
            start = position
        return _expand(session, target, start, end, grant, max(0, offset))


def _expand(
    session: DagSession, target: str, start: int, end: int, grant: int, offset: int
) -> Expansion:
    out: list[ContextMessage] = []
    used = 0
    for position in range(start, end):
        message = session.messages[position]
        skip = offset if position == start else 0
        part = message if not skip else _rest(message, skip)
        tokens = _cost(part)
        if used + tokens <= grant:
            out.append(part)
            used += tokens
            continue
        if out:
            return Expansion(
                target=target,
                messages=tuple(out),
                offset=offset,
                tokens=used,
                next_after=message.message_id,
            )
        # one message larger than the grant comes in pieces of its text (the content,
        # then its tool calls, thinking and images), each within the grant
        flat = _flat(message)
        size = _piece_size(message, flat, skip, grant)
        piece = _bare(message, flat[skip : skip + size])
        later = skip + size < len(flat)
        following = session.messages[position + 1].message_id if position + 1 < end else None
        return Expansion(
            target=target,
            messages=(piece,),
            offset=skip,
            tokens=_cost(piece),
            next_after=message.message_id if later else following,
            next_offset=skip + size if later else 0,
        )
    return Expansion(target=target, messages=tuple(out), offset=offset, tokens=used)


def _cost(message: ContextMessage) -> int:
    """What ``message`` costs the model as the recall tools hand it over: the tokens of
    its JSON text, field names and escapes included (a control character is six
    characters there, an empty field a dozen), and never less than the message's own
    estimate (which counts an image at what it costs as one)."""
    text = _JSON.encode(message).decode()
    return max(estimate_text_tokens(text), estimate_message_tokens(message))


def _piece_size(message: ContextMessage, flat: str, skip: int, grant: int) -> int:
    """How many characters of ``flat`` from ``skip`` on a piece of ``message`` carries
    within ``grant`` (at least one, so paging always moves on)."""
    # a character costs at least 1 / chars_per_token as JSON: no more than this many fit
    low, high = 0, min(len(flat) - skip, int(grant * DEFAULT_PROFILE.chars_per_token) + 1)
    while low < high:  # the longest piece within the grant: the cost grows with it
        middle = (low + high + 1) // 2
        if _cost(_bare(message, flat[skip : skip + middle])) <= grant:
            low = middle
        else:
            high = middle - 1
    return max(1, low)


def _flat(message: ContextMessage) -> str:
    """The message's text as pieces page through it: its content, then its tool calls,
    its thinking blocks and its images."""
    parts = [message.content]
    parts += [
        f"\n[tool call {call.name} id={call.id}] {call.arguments}" for call in message.tool_calls
    ]
    for block in message.thinking:
        kind = "redacted thinking" if block.redacted else "thinking"
        signed = f" signature={block.signature}" if block.signature else ""
        parts.append(f"\n[{kind}{signed}] {block.text}")
    parts += [f"\n[image {n}] {image}" for n, image in enumerate(message.images, 1)]
    return "".join(parts)


def _bare(message: ContextMessage, text: str) -> ContextMessage:
    """The message with ``text`` (a piece of its :func:`_flat` text) for all it says."""
    return msgspec.structs.replace(message, content=text, tool_calls=(), thinking=(), images=())


def _rest(message: ContextMessage, skip: int) -> ContextMessage:
    """The message from character ``skip`` of its :func:`_flat` text on."""
    return _bare(message, _flat(message)[skip:])


def _text(message: ContextMessage) -> str:
    calls = " ".join(f"{call.name} {call.arguments}" for call in message.tool_calls)
    return f"{message.content} {calls}".strip()


def _snippet(text: str, query: str) -> str:
    """A window of ``text`` around the first query word it contains."""
    lowered = text.lower()
    words = query.lower().split()[:QUERY_TERMS]  # a query as long as a document: its start
    hits = [lowered.find(word) for word in words if word in lowered]
    at = min(hits) if hits else 0
    start = max(0, at - _SNIPPET // 3)
    window = " ".join(text[start : start + _SNIPPET].split())
    return ("..." if start else "") + window + ("..." if start + _SNIPPET < len(text) else "")
