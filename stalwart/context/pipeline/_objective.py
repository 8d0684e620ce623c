"""Layer 10 (objective reinforcement), and what it will add, which layers 8 and 9 count."""

from __future__ import annotations

from stalwart._text import scrub_surrogates
from stalwart.context._types import ContextMessage

from ._run import Outcome, Run
from ._wrap import MARKER

__all__ = ["OBJECTIVE_ID", "objective_tokens", "reinforce_objective"]

OBJECTIVE_ID = "pipeline-objective"


def _missing_objective(messages: tuple[ContextMessage, ...], run: Run) -> ContextMessage | None:
    """The session's first user message when it is no longer in ``messages``."""
    objective = next((m for m in run.original if m.role == "user"), None)
    if objective is None or any(m.message_id == objective.message_id for m in messages):
        return None
    return objective


def _restated(objective: ContextMessage, anchor: ContextMessage) -> ContextMessage:
    return ContextMessage(
        message_id=OBJECTIVE_ID,
        seq=anchor.seq,
        role="user",
        content=(
            f"{MARKER}objective] The original objective of this session, restated because "
            # the message as given: written after the surrogate guard ran
            f"earlier turns were summarized or dropped:\n{scrub_surrogates(objective.content)}"
        ),
        turn=anchor.turn,
    )


def objective_tokens(messages: tuple[ContextMessage, ...] | None, run: Run) -> int:
    """The tokens layer 10 will add to ``messages`` (0 when the objective is there), or
    would add at most (``messages`` None: the session's objective restated)."""
    if messages is None:
        objective = next((m for m in run.original if m.role == "user"), None)
    else:
        objective = _missing_objective(messages, run)
    if objective is None:
        return 0
    return run.estimator.message(_restated(objective, objective))


def reinforce_objective(messages: tuple[ContextMessage, ...], run: Run) -> Outcome:
    """Layer 10: when the session's first user message (its objective) is no longer in
    the transcript (summarized by compaction or dropped by the history window), it is
    restated as a user message just before the newest user message, which stays last."""
    objective = _missing_objective(messages, run)
    if objective is None:
        return Outcome(messages)
    at = next(
        (
            i
            for i in range(len(messages) - 1, -1, -1)
            if messages[i].role == "user" and not messages[i].message_id.startswith("pipeline-")
        ),
        None,
    )
    if at is None:
        at = 0
        while at < len(messages) and messages[at].role == "system":
            at += 1
    anchor = messages[at] if at < len(messages) else objective
    return Outcome((*messages[:at], _restated(objective, anchor), *messages[at:]))
