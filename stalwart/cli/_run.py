"""``stalwart run``: one user turn through the provider layer, every step in the log."""

from __future__ import annotations

import os
import signal
import sys
from functools import partial
from types import FrameType

import anyio
import click

from stalwart._text import escaped
from stalwart.actors import request_messages
from stalwart.clock import SystemClock
from stalwart.config import Config, load_config
from stalwart.errors import ConcurrencyError, ContextOverflowError, ProviderError, StalwartError
from stalwart.events import (
    MessageAppended,
    PromptStarted,
    RuntimeStopped,
    SessionCreated,
    TurnCompleted,
    TurnStarted,
)
from stalwart.ids import new_id
from stalwart.providers import Message, ProviderRequest, StreamEvent, TextDelta
from stalwart.runtime import ProviderLayer, check_session_id, load_session, runtime_started
from stalwart.state import Activation, SessionState
from stalwart.store import EventStore, NewEvent

from ._app import _State, cli, message_text

FAILED = "the model did not answer: every configured model failed or timed out"
TOO_LONG = "the conversation is too long for the model's context window"


def _history(store: EventStore, stream: str) -> list[Message]:
    """The session's conversation as the log holds it."""
    messages = []
    for record in store.read_stream(stream):
        event = record.event
        if isinstance(event, MessageAppended):
            messages.append(
                Message(
                    role=event.role,
                    content=event.content,
                    tool_calls=event.tool_calls,
                    tool_call_id=event.tool_call_id,
                )
            )
    return messages


class _Printer:
    """Prints the reply as it streams; says so when an attempt is retried or replaced."""

    def __init__(self) -> None:
        self.printed = False
        #: the reader of stdout went away (``stalwart run ... | head``): nothing more is
        #: printed, and the turn goes on (its answer is still recorded)
        self.gone = False

    def __call__(self, event: StreamEvent | PromptStarted) -> None:
        if isinstance(event, PromptStarted):
            if self.printed:
                self.write("\n")
                click.secho(
                    f"[stalwart: that answer broke off; trying again with {event.model}]",
                    err=True,
                    dim=True,
                )
                self.printed = False
        elif isinstance(event, TextDelta):
            # the model's text is untrusted: its line breaks stay, no other control
            # character reaches the terminal (ESC could clear it or set the clipboard)
            self.write("\n".join(escaped(part, tabs=True) for part in event.text.split("\n")))
            self.printed = True

    def write(self, text: str) -> None:
        if self.gone:
            return
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            self.gone = True
            # what Python would flush at exit goes nowhere, quietly
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115


def _free_session(store: EventStore, session: str, now: float) -> SessionState:
    """The session when nothing else has a turn of it in hand: StalwartError
    when a worker's lease on it is live, a turn is under way (a runtime runs it, or one
    stopped without closing it), it waits for an operator's answer, or it is closed. A
    turn appended beside another would interleave two conversations in one stream."""
    state, activations = load_session(store, session)
    stream = state.stream
    lease = activations.lease
    if lease is not None and now < lease.expires_at:
        raise StalwartError(
            f"session {stream!r} is held by a worker (its lease runs until "
            f"{lease.expires_at:.0f}): send the message through the runtime that serves it"
        )
    if state.status == "running":
        raise StalwartError(
            f"session {stream!r} has a turn under way: a runtime is running it, or one "
            f"stopped with it open (`stalwart session interrupt {session}` ends it)"
        )
    if state.status == "requires_action":
        raise StalwartError(
            f"session {stream!r} waits for an answer to a pending request "
            f"(`stalwart session confirm`, `tool-result` or `interrupt`)"
        )
    if state.status == "closed":
        raise StalwartError(f"session {stream!r} is closed")
    waiting = _claimable(activations.queue, now)
    if waiting:
        raise StalwartError(
            f"session {stream!r} has {waiting} queued activation(s) a worker would run "
            f"beside this turn: send the message with `stalwart session send` (it is "
            f"answered after them), or drop them with `stalwart session interrupt {session}`"
        )
    return state


def _claimable(queue: tuple[Activation, ...], now: float) -> int:
    """How many queued activations a worker may lease while ``run``'s turn goes on (it
    holds no lease): every message and resume (due, or due after a failure's backoff,
    which a turn may outlast) and each wake already due; a wake set for later is left."""
    return sum(1 for a in queue if a.kind != "wake" or a.run_at <= now)


def _agent_for(config: Config, state: SessionState, given: str | None) -> str:
    """The agent that answers: the session's own (a session goes on with the agent, the
    system prompt and the models it was made for), ``--agent`` for a new session, else
    ``default``. ``--agent`` naming another agent than an existing session's is refused."""
    agent = given or state.agent or "default"
    if state.agent and agent != state.agent:
        raise StalwartError(
            f"session {state.stream!r} belongs to agent {state.agent!r}, not {agent!r}"
        )
    config.agent(agent)  # one that is not configured: named, with the configured ones
    return agent


async def _turn(
    layer: ProviderLayer,
    store: EventStore,
    agent: str,
    session: str,
    version: int,
    prompt: str,
    printer: _Printer,
) -> str:
    stream = f"session:{session}"
    sink, clock = layer.sink, layer.clock
    turn = new_id()
    opening = [
        *([SessionCreated(agent=agent)] if version == 0 else []),
        TurnStarted(turn_id=turn),
        MessageAppended(message_id=new_id(), role="user", content=prompt, turn_id=turn),
    ]
    try:  # expecting the version checked: nothing took the session since
        await anyio.to_thread.run_sync(
            partial(store.append, expected_version=version),
            stream,
            [NewEvent(event=event, ts=clock.now()) for event in opening],
        )
    except ConcurrencyError:
        raise StalwartError(
            f"session {stream!r} changed while the turn was being started: try again"
        ) from None
    settings = layer.config.agent(agent)
    # as an Agent sends it: the agent's system prompt first, and a tool call a runtime's
    # stopped turn left without a result answered (a provider rejects the request else)
    messages = request_messages(tuple(_history(store, stream)), settings.system_prompt)
    request = ProviderRequest(messages=messages, max_tokens=settings.max_tokens)
    try:
        reply = await layer.caller(agent).call(stream, request, on_event=printer)
    except ProviderError:
        failed = TurnCompleted(turn_id=turn, outcome="failed", steps=1)
        await sink.emit(stream, [failed], clock.now())
        raise
    except BaseException as exc:
        # Ctrl-C (the call is cancelled) or a bug: the turn still ends in the log, or the
        # session would show as running for ever with nothing running it
        cut = isinstance(exc, KeyboardInterrupt | anyio.get_cancelled_exc_class())
        reason = "cancelled" if cut else "internal"
        stopped = TurnCompleted(turn_id=turn, outcome="interrupted", reason=reason, steps=1)
        with anyio.CancelScope(shield=True):
            await sink.emit(stream, [stopped], clock.now())
        raise
    await sink.emit(
        stream,
        [
            MessageAppended(
                message_id=new_id(),
                role="assistant",
                content=reply.text,
                tool_calls=reply.tool_calls,
                turn_id=turn,
            ),
            TurnCompleted(turn_id=turn, steps=1),
        ],
        clock.now(),
    )
    return reply.text


async def _main(
    config: Config,
    store: EventStore,
    agent: str,
    session: str,
    version: int,
    prompt: str,
    printer: _Printer,
) -> None:
    layer = ProviderLayer(config, store, clock=SystemClock())
    started = runtime_started(config, store, new_id())
    await layer.sink.emit("runtime", [started], layer.clock.now())
    try:
        await _turn(layer, store, agent, session, version, prompt, printer)
    finally:
        await layer.sink.emit("runtime", [RuntimeStopped(reason="run finished")], layer.clock.now())
        await layer.aclose()


@cli.command()
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="The config (TOML, YAML or JSON) with providers and agents.",
)
@click.option(
    "--agent",
    default=None,
    help="Which configured agent [default: the session's; for a new session, default].",
)
@click.option(
    "--session",
    help="Continue this session, by its id or its stream (a new one when omitted).",
)
@click.argument("prompt")
@click.pass_obj
def run(
    state: _State, config_path: str, agent: str | None, session: str | None, prompt: str
) -> None:
    """Send PROMPT as one user turn and print the reply as it streams (PROMPT `-`:
    read it from standard input)."""
    if session is not None:  # `abc` or, as `stalwart status` lists it, `session:abc`
        session = check_session_id(session.removeprefix("session:"))
    prompt = message_text(prompt, "PROMPT")
    config = load_config(config_path)
    if agent is not None:
        config.agent(agent)  # fail early, naming the configured agents
    store = state.store_for(config, create=True)
    session = session or new_id()
    printer = _Printer()
    terminated: list[int] = []
    previous = signal.signal(signal.SIGTERM, partial(_as_interrupt, terminated))
    try:
        found = _free_session(store, session, SystemClock().now())
        chosen = _agent_for(config, found, agent)
        anyio.run(_main, config, store, chosen, session, found.version, prompt, printer)
    except ContextOverflowError:
        raise StalwartError(TOO_LONG) from None
    except ProviderError:
        raise StalwartError(FAILED) from None
    except KeyboardInterrupt:
        if terminated:  # the turn was closed as cancelled, as for Ctrl-C
            sys.exit(128 + signal.SIGTERM)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        store.close()
        if printer.printed:  # an answer that broke off still ends its line
            printer.write("\n")
    click.echo(f"session {session}", err=True)


def _as_interrupt(terminated: list[int], signum: int, frame: FrameType | None) -> None:
    """SIGTERM (``timeout``, a supervisor) stops ``run`` as Ctrl-C does: the turn in
    flight is cancelled and closed in the log, not cut off with it open."""
    terminated.append(signum)
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):  # asyncio's, while the loop runs: it cancels the main task
        handler(signal.SIGINT, frame)
    else:
        raise KeyboardInterrupt
