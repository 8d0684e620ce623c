"""The Agent's model call through the context engine.

Before every provider call the conversation goes through the ContextStore (a
:class:`ContextGate`): the engine fits the session's stored messages into the budget
(the model's window less the reply and the tool declarations, and the system text the
Agent adds), and the request carries what it assembled, with the agent's own system text
in front and the engine's ``cache_control`` breakpoints marked. The assembly runs on the
portal's worker thread inside the same future as the call, so the Agent's mailbox never
waits for it, and cancelling the turn cancels both.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from stalwart._aio import wait_on_own_thread
from stalwart.context import ModelProfile, declared_tokens, estimate_text_tokens, request_budget
from stalwart.providers import CallSeal, Message, ModelCaller, ProviderRequest, ProviderResponse

from ._context import Assemble, Assembled, Calibrate

__all__ = [
    "ContextGate",
    "call_through_context",
    "context_budget",
    "with_system",
]


class ContextGate(Protocol):
    """How an Agent reaches the ContextStore (the runtime gives one)."""

    def assemble(self, request: Assemble) -> Assembled:
        """The assembled context (ContextScopeError when the engine refuses the write)."""
        ...

    def calibrate(self, request: Calibrate) -> None:
        """Feed the estimator what the provider reported (fire and forget)."""
        ...


def with_system(system: str | None, assembled: Assembled) -> tuple[Message, ...]:
    """The agent's system text in front of what the engine assembled (merged with the
    engine's own system message), and the breakpoints marked ``cache``."""
    messages = list(assembled.messages)
    shift = 0
    if system:
        if messages and messages[0].role == "system":
            merged = f"{system}\n\n{messages[0].content}" if messages[0].content else system
            messages[0] = msgspec.structs.replace(messages[0], content=merged)
        else:
            messages.insert(0, Message(role="system", content=system))
            shift = 1
    for index in assembled.breakpoints:
        at = index + shift
        if 0 <= at < len(messages):
            messages[at] = msgspec.structs.replace(messages[at], cache=True)
    return tuple(messages)


def context_budget(
    window: int, request: ProviderRequest, system: str | None, profile: ModelProfile
) -> int:
    """What the engine may use: the window less the reply, the tools and the system text."""
    budget = request_budget(window, max_output_tokens=request.max_tokens, tools=request.tools)
    return max(1, budget - (estimate_text_tokens(system) if system else 0))


async def call_through_context(
    caller: ModelCaller,
    stream: str,
    request: ProviderRequest,
    gate: ContextGate,
    assemble: Assemble,
    system: str | None,
    seal: CallSeal | None = None,
) -> ProviderResponse:
    """Assemble, call, and calibrate the estimator with the usage the provider reported
    when the agent's model answered (not a fallback model: its tokenizer is another's),
    compared at the factor the assembly was counted at (``seal``: the call's, see
    :meth:`ModelCaller.call`)."""
    # the system text and the tools, which the provider counts as densely as the rest
    overhead = declared_tokens(request.tools) + (estimate_text_tokens(system) if system else 0)
    assemble = msgspec.structs.replace(assemble, overhead=overhead)
    assembled = await wait_on_own_thread(gate.assemble, assemble)  # summaries included
    messages = with_system(system, assembled)
    response = await caller.call(
        stream, msgspec.structs.replace(request, messages=messages), seal=seal
    )
    reported = response.input_tokens
    # a fallback model's tokenizer says nothing of this model's: its count is left out
    if reported > 0 and response.model == assemble.profile.model:
        # the provider counted the system text and the tools as well
        calibrate = Calibrate(
            profile=assemble.profile,
            estimated=assembled.tokens,
            reported=reported,
            overhead=overhead,
            factor=assembled.factor,
        )
        gate.calibrate(calibrate)
    return response
