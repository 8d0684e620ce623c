"""What every layer is given besides the messages: one run's inputs, frozen."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stalwart.context._tokens import TokenEstimator
from stalwart.context._types import ContextMessage, Summarizer
from stalwart.events import Event
from stalwart.state import PipelineState

from ._config import PipelineConfig

__all__ = ["FileReader", "Outcome", "Run"]

#: Reads a file for rehydration by path; ``None`` when it is missing or unreadable.
FileReader = Callable[[str], str | None]


@dataclass(frozen=True, slots=True)
class Run:
    """One assembly's inputs. ``original`` is the transcript as given (layers 9 and 10
    look back into it); ``turn`` its newest user turn; ``replay`` whether the signature
    scrubber must act (decided by the engine from ``state``, see the package docs)."""

    config: PipelineConfig
    original: tuple[ContextMessage, ...]
    provider: str
    budget: int
    now: float
    turn: int
    replay: bool
    state: PipelineState
    estimator: TokenEstimator
    summarizer: Summarizer
    reader: FileReader | None


@dataclass(frozen=True, slots=True)
class Outcome:
    """A layer's answer: the messages it passes on and the events it decided."""

    messages: tuple[ContextMessage, ...]
    events: tuple[Event, ...] = ()
