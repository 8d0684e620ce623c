"""Layer 10 (objective reinforcement), and what it will add, which layers 8 and 9 count.

The restatement takes at most a share of the budget (:func:`objective_share`): a first
message larger than that (a pasted document, a log) is restated as its head, after the
engine's line saying how much of it is shown, so it cannot keep every later request
over the budget. The session's log keeps the message whole.
"""

from __future__ import annotations

from stalwart._text import scrub_surrogates
from stalwart.context._types import ContextMessage

from ._fit import head_on_line
from ._run import Outcome, Run
from ._wrap import MARKER

__all__ = [
    "OBJECTIVE_CUT_PREFIX",
    "OBJECTIVE_ID",
    "objective_share",
    "objective_tokens",
    "reinforce_objective",
]

OBJECTIVE_ID = "pipeline-objective"

_HEADER = (
    f"{MARKER}objective] The original objective of this session, restated because "
    "earlier turns were summarized or dropped:\n"
)

#: How the engine's line begins when the restatement shows only the objective's head.
OBJECTIVE_CUT_PREFIX = f"{MARKER}cut objective]"

_CUT_LINE = (
    OBJECTIVE_CUT_PREFIX + " {shown:,} of the {total:,} characters of the objective are "
    "shown (its head), {cut:,} are cut to fit the context budget; the session's log "
    "keeps it whole.\n"
)


def objective_share(run: Run) -> int:
    """The most the restated objective may cost: a quarter of the compaction threshold
    (as much as a summary may take), so the two together leave half of it to the
    newest turns."""
    return max(1, int(run.budget * run.config.compaction_threshold / 4))


def _missing_objective(messages: tuple[ContextMessage, ...], run: Run) -> ContextMessage | None:
    """The session's first user message when it is no longer in ``messages``."""
    objective = next((m for m in run.original if m.role == "user"), None)
    if objective is None or any(m.message_id == objective.message_id for m in messages):
        return None
    return objective


def _message(content: str, anchor: ContextMessage) -> ContextMessage:
    return ContextMessage(
        message_id=OBJECTIVE_ID, seq=anchor.seq, role="user", content=content, turn=anchor.turn
    )


def _cut(text: str, keep: int, anchor: ContextMessage) -> ContextMessage:
    """The restatement of the head of ``text`` :func:`head_on_line` keeps of ``keep``
    characters, after the line saying how much of it is shown."""
    head = head_on_line(text, keep)
    line = _CUT_LINE.format(shown=len(head), total=len(text), cut=len(text) - len(head))
    return _message(_HEADER + line + head, anchor)


def _restated(objective: ContextMessage, anchor: ContextMessage, run: Run) -> ContextMessage:
    """The objective restated whole, or its longest head that keeps the restatement
    within :func:`objective_share` (the engine's lines alone when none does)."""
    # the message as given: written after the surrogate guard ran
    text = scrub_surrogates(objective.content)
    whole = _message(_HEADER + text, anchor)
    share = objective_share(run)
    cost = run.estimator.message
    if cost(whole) <= share:
        return whole
    low, high = 0, len(text)
    while low < high:  # the longest head within the share (a longer one costs no less)
        middle = (low + high + 1) // 2
        if cost(_cut(text, middle, anchor)) <= share:
            low = middle
        else:
            high = middle - 1
    return _cut(text, low, anchor)


def objective_tokens(messages: tuple[ContextMessage, ...] | None, run: Run) -> int:
    """The tokens layer 10 will add to ``messages`` (0 when the objective is there), or
    would add at most (``messages`` None: the session's objective restated)."""
    if messages is None:
        objective = next((m for m in run.original if m.role == "user"), None)
    else:
        objective = _missing_objective(messages, run)
    if objective is None:
        return 0
    return run.estimator.message(_restated(objective, objective, run))


def reinforce_objective(messages: tuple[ContextMessage, ...], run: Run) -> Outcome:
    """Layer 10: when the session's first user message (its objective) is no longer in
    the transcript (summarized by compaction or dropped by the history window), it is
    restated as a user message just before the newest user message, which stays last,
    cut to its head when it would take more than its share of the budget."""
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
    return Outcome((*messages[:at], _restated(objective, anchor, run), *messages[at:]))
