"""A stored conversation long enough to make the context engine summarize."""

from __future__ import annotations

from stalwart.context import ContextMessage


def conversation(session: str, turns: int, *, planted: str = "") -> tuple[ContextMessage, ...]:
    """A system prompt, then ``turns`` user/assistant turns of about 150 tokens each, as
    a session's stored messages. Only the ids (``<session>-u<n>``) name the session, so
    two sessions cost the same; ``planted`` goes into turn 2's user message."""
    out = [ContextMessage(message_id=f"{session}-sys", seq=0, role="system", content="Brief.")]
    for n in range(turns):
        extra = f" {planted}" if planted and n == 2 else ""
        out += [
            ContextMessage(
                message_id=f"{session}-u{n}",
                seq=len(out),
                role="user",
                content=f"Turn {n}.{extra} " + "w " * 150,
            ),
            ContextMessage(
                message_id=f"{session}-b{n}",
                seq=len(out) + 1,
                role="assistant",
                content=f"Reply {n}. " + "r " * 150,
            ),
        ]
    return tuple(out)
