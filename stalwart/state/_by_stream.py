"""Which fold a stream is replayed with."""

from __future__ import annotations

from typing import Any

from stalwart.events import Event, SubagentSpawned

from ._aggregate import Aggregate
from ._breaker import BREAKER
from ._context import CONTEXT_DAG, SUMMARIZER_LEDGER
from ._deadletter import DEADLETTER
from ._session import SESSION
from ._subagent import RUN
from ._summary import SUMMARY


def aggregate_for(stream: str, first: Event | None = None) -> Aggregate[Any]:
    """The fold ``replay`` uses for a stream: by its name, else the summary fold.

    A sub-agent run is a ``session:`` stream whose ``first`` event is its
    ``subagent:spawned``: it replays with the run fold (``RUN``: its status, task,
    deadline, outcome). A provider's health fold (``HEALTH``) is applied by name. A
    ``context:`` stream replays with the DAG engine's fold (its summaries and
    degradations); the pipeline engine's layer breakers are ``CONTEXT_PIPELINE``. A tenant's
    summarizer ledger (``context-ledger...``) replays with its governor
    (``SUMMARIZER_LEDGER``: spend, breaker counts, calls still running).
    """
    if stream.startswith("session:"):
        return RUN if isinstance(first, SubagentSpawned) else SESSION
    if stream.startswith("provider:"):
        return BREAKER
    if stream == "deadletter":
        return DEADLETTER
    if stream.startswith("context:"):
        return CONTEXT_DAG
    if stream.startswith("context-ledger"):
        return SUMMARIZER_LEDGER
    return SUMMARY
