"""Actions on a session from outside its wake: a user message, a confirmation, a custom
tool's result, an interrupt, a delayed wake.

Each one folds the session from the log, checks the action against that state, and
appends with ``expected_version`` (trying again on a race), so it is decided on the state
it is appended after. A refused action raises :class:`SessionActionError` and appends
nothing. They work from any process on the store: the ``stalwart session`` commands call
them too, and a running worker picks the resulting ``activation:ready`` up.
"""

from __future__ import annotations

from collections.abc import Callable
from math import isfinite
from types import UnionType

from stalwart.errors import ConcurrencyError, FencedError, SessionActionError
from stalwart.events import (
    ActivationReady,
    Event,
    SessionCreated,
    UserCustomToolResult,
    UserInterrupt,
    UserToolConfirmation,
)
from stalwart.ids import new_id, valid_session_id
from stalwart.state import (
    ACTIVATIONS,
    RECENT_MESSAGES,
    SESSION,
    Activation,
    ActivationPolicy,
    ActivationsState,
    SessionState,
    WakeRefused,
    decide_interrupt,
    decide_message,
    decide_wake,
)
from stalwart.store import NO_STREAM, EventStore, Fence, NewEvent, load_state

__all__ = [
    "INVALID_SESSION_TEXT",
    "check_session_id",
    "confirm",
    "interrupt",
    "load_session",
    "schedule_wake",
    "send_message",
    "submit_tool_result",
]

ATTEMPTS = 20
INVALID_SESSION_TEXT = (
    "not a session id: it must be 1 to 128 characters (at most 256 UTF-8 bytes) with no"
    " spaces or control characters, and not a stream name"
)

#: (session, activations) -> the events to append and their fence, or SessionActionError
Decision = Callable[[SessionState, ActivationsState], tuple[list[Event], Fence | None]]


def load_session(store: EventStore, session_id: str) -> tuple[SessionState, ActivationsState]:
    """The session and its activations as the log says now: each from its snapshot, then
    the events since (a long session is not read from its start on every action)."""
    stream = _stream(session_id)
    session = load_state(store, stream, SESSION)
    activations = load_state(store, stream, ACTIVATIONS)
    return _caught_up(store, stream, session, activations)


def _caught_up(
    store: EventStore, stream: str, session: SessionState, activations: ActivationsState
) -> tuple[SessionState, ActivationsState]:
    """Both folds carried to the stream's head (one read, from the older of the two)."""
    folder = SESSION.folder(session)
    for record in store.read_stream(stream, min(session.version, activations.version) + 1):
        if record.version > session.version:
            folder.add(record)
        if record.version > activations.version:
            activations = ACTIVATIONS.apply(activations, record)
    return folder.state(), activations


def check_session_id(session_id: str) -> str:
    """``session_id``, or SessionActionError (``invalid_session``, static text) for an id
    no session can have: the context engine would refuse every turn of it."""
    if not valid_session_id(session_id):
        raise SessionActionError(INVALID_SESSION_TEXT, reason="invalid_session", session="")
    return session_id


def _stream(session_id: str) -> str:
    """The session's stream (``session_id`` bare or as its stream name), checked."""
    bare = session_id.removeprefix("session:") if isinstance(session_id, str) else session_id
    return f"session:{check_session_id(bare)}"


def _act(store: EventStore, session_id: str, decide: Decision, ts: float | None) -> list[Event]:
    """Decide on the current state and append, again on a race; the events appended."""
    stream = _stream(session_id)
    session, activations = load_session(store, session_id)
    for attempt in range(ATTEMPTS):
        if attempt:  # raced: fold on from where the last attempt's state stood
            session, activations = _caught_up(store, stream, session, activations)
        events, fence = decide(session, activations)
        if not events:
            return []
        try:
            store.append(
                stream,
                [NewEvent(event=e, ts=ts) for e in events],
                expected_version=session.version,
                fence=fence,
            )
        except (ConcurrencyError, FencedError):
            continue
        return events
    raise _contended(stream)


def _contended(stream: str) -> SessionActionError:
    return SessionActionError(
        f"session {stream!r} kept changing: the action was not taken after {ATTEMPTS} tries",
        reason="contended",
        session=stream,
    )


def _existing(session: SessionState) -> None:
    if session.version == 0:
        raise SessionActionError(
            f"no session {session.stream!r} in the store",
            reason="no_session",
            session=session.stream,
        )


def send_message(
    store: EventStore,
    session_id: str,
    text: str,
    *,
    message_id: str | None = None,
    agent: str = "default",
    channel: str = "console",
    ts: float | None = None,
) -> str:
    """Record a user message as an ``activation:ready`` (durable when this returns);
    creates the session when it has no events. Returns the activation id.

    A ``message_id`` the session was already given (among its newest ``MESSAGES_KEPT``
    messages) is not recorded again: the activation that carries it is returned, so a
    message delivered twice (a chat platform redelivering its webhook) is answered once.

    TypeError for a ``text`` that is not a str; SessionActionError ``empty_message`` for
    an empty or blank one (nothing is recorded: a turn with nothing to answer is one the
    providers refuse, and the turn would fail after the message was acknowledged).
    """
    _typed("text", text, str)
    if not text.strip():
        stream = _stream(session_id)
        raise SessionActionError(
            f"message refused for {stream!r}: the text is empty",
            reason="empty_message",
            session=stream,
        )
    activation_id = new_id()
    if not message_id:  # a new id (an empty one is none): nothing to compare, one append
        ready = ActivationReady(
            activation_id=activation_id, kind="message", message_id=new_id(), text=text
        )
        _created_then(store, session_id, ready, agent, channel, ts)
        return activation_id
    stream = _stream(session_id)
    recent = load_state(store, stream, RECENT_MESSAGES)  # from its snapshot and tail
    for _ in range(ATTEMPTS):
        folder = RECENT_MESSAGES.folder(recent)
        for record in store.read_stream(stream, recent.version + 1):  # what came since
            folder.add(record)
        recent = folder.state()
        version = recent.version
        decision = decide_message(recent.messages, activation_id, message_id, text)
        if isinstance(decision, str):
            return decision
        events: list[Event] = [decision]
        if version == 0:
            events.insert(0, SessionCreated(agent=agent, channel=channel))
        try:
            store.append(
                stream, [NewEvent(event=e, ts=ts) for e in events], expected_version=version
            )
        except ConcurrencyError:
            continue
        return activation_id
    raise _contended(stream)


def _created_then(
    store: EventStore, session_id: str, event: Event, agent: str, channel: str, ts: float | None
) -> None:
    """Append ``event``, after a ``session:created`` when the session has no events."""
    stream = _stream(session_id)
    if store.stream_version(stream) == 0:
        try:
            created = SessionCreated(agent=agent, channel=channel)
            store.append(
                stream,
                [NewEvent(event=created, ts=ts), NewEvent(event=event, ts=ts)],
                expected_version=NO_STREAM,
            )
            return
        except ConcurrencyError:
            pass  # created meanwhile: append as to any session
    store.append(stream, [NewEvent(event=event, ts=ts)])


def _typed(name: str, value: object, kind: type | UnionType) -> None:
    """TypeError for a host's value of the wrong type, before it reaches the log's
    encoder (which would call the record it cannot read back corrupt)."""
    if not isinstance(value, kind):
        expected = getattr(kind, "__name__", str(kind))
        raise TypeError(f"{name} is a {expected}, not {type(value).__name__}")


#: how an error names a pending request's kind
_KINDS = {"approval": "an approval request", "custom_tool": "a custom tool's call"}


def _answer(
    store: EventStore,
    session_id: str,
    request_id: str,
    kind: str,
    answer: Event,
    ts: float | None,
) -> str:
    activation_id = new_id()

    def decide(
        session: SessionState, activations: ActivationsState
    ) -> tuple[list[Event], Fence | None]:
        _existing(session)
        pending = session.pending
        if pending is None or pending.request_id != request_id:
            waiting = f"it waits for {pending.request_id!r}" if pending else "nothing is pending"
            raise SessionActionError(
                f"session {session.stream!r} has no pending request {request_id!r} "
                f"({waiting}): a wrong id, an answered request, or one an interrupt cleared",
                reason="not_pending",
                session=session.stream,
            )
        if pending.kind != kind:
            raise SessionActionError(
                f"request {request_id!r} of session {session.stream!r} is {_KINDS[pending.kind]}"
                f", not {_KINDS[kind]}",
                reason="wrong_kind",
                session=session.stream,
            )
        return [answer, ActivationReady(activation_id=activation_id, kind="resume")], None

    _act(store, session_id, decide, ts)
    return activation_id


def confirm(
    store: EventStore, session_id: str, request_id: str, *, allow: bool, ts: float | None = None
) -> str:
    """Answer the pending approval: allowed runs the tool once with its stored input,
    denied records the refusal; the session resumes. Returns the resume activation id.
    TypeError, before anything is recorded, for an ``allow`` that is not a bool."""
    _typed("allow", allow, bool)
    answer = UserToolConfirmation(request_id=request_id, allow=allow)
    return _answer(store, session_id, request_id, "approval", answer, ts)


def submit_tool_result(
    store: EventStore, session_id: str, request_id: str, output: str, *, ts: float | None = None
) -> str:
    """Give the pending custom tool call its output; the session resumes with it.
    TypeError, before anything is recorded, for an ``output`` that is not a str."""
    _typed("output", output, str)
    answer = UserCustomToolResult(request_id=request_id, output=output)
    return _answer(store, session_id, request_id, "custom_tool", answer, ts)


def interrupt(
    store: EventStore, session_id: str, reason: str = "", *, ts: float | None = None
) -> list[str]:
    """Clear the pending request and cancel every unsettled activation; a wake still
    running is fenced out (the interrupt claims the next lease epoch). Returns the
    cancelled activation ids. TypeError for a ``reason`` that is not a str."""
    _typed("reason", reason, str)

    def decide(
        session: SessionState, activations: ActivationsState
    ) -> tuple[list[Event], Fence | None]:
        _existing(session)
        events = decide_interrupt(activations, reason)
        first = events[0]
        assert isinstance(first, UserInterrupt)
        return events, Fence(first.epoch, claim=True)

    events = _act(store, session_id, decide, ts)
    return [e.activation_id for e in events if hasattr(e, "activation_id")]


def schedule_wake(
    store: EventStore,
    session_id: str,
    wake_at: float,
    *,
    now: float,
    policy: ActivationPolicy,
    text: str = "",
    dedupe_key: str | None = None,
    owner: str | None = None,
) -> str:
    """Schedule work for ``wake_at`` (a dedupe key returns the pending wake's id instead
    of adding one); SessionActionError ``wake_refused`` over the caps. TypeError for a
    ``text`` or ``dedupe_key`` that is not a str. ``owner``: the calling runtime's worker
    (the wake of a lease it holds is running, even with its renewal overdue)."""
    _typed("text", text, str)
    _typed("dedupe_key", dedupe_key, str | None)
    if isinstance(wake_at, bool) or not isinstance(wake_at, int | float) or not isfinite(wake_at):
        stream = _stream(session_id)
        raise SessionActionError(
            f"wake refused for {stream!r}: wake_at must be a finite unix time, got {wake_at!r}",
            reason="wake_refused",
            session=stream,
        )
    activation_id = new_id()
    chosen: list[str] = []

    def decide(
        session: SessionState, activations: ActivationsState
    ) -> tuple[list[Event], Fence | None]:
        _existing(session)
        decision = decide_wake(
            activations, activation_id, wake_at, dedupe_key, text, now, policy, owner
        )
        chosen.clear()
        if isinstance(decision, WakeRefused):
            limit = "pending wakes" if decision.reason == "too_many" else "ms ahead"
            raise SessionActionError(
                f"wake refused for {session.stream!r}: {decision.reason} "
                f"(the limit is {decision.limit} {limit})",
                reason="wake_refused",
                session=session.stream,
            )
        if isinstance(decision, Activation):
            chosen.append(decision.activation_id)
            return [], None
        chosen.append(decision.activation_id)
        return [decision], None

    _act(store, session_id, decide, now)
    return chosen[0]
