"""The one exception tree of stalwart.

Every error stalwart raises on purpose derives from :class:`StalwartError`, so a host
can catch them all in one place. Errors from dependencies (lmdb, msgspec, OS) never
escape raw: they are wrapped with ``raise ... from exc``. Messages say what was
expected, what was found and where; they never contain secrets or payload content.

::

    StalwartError
    ├── CallSealedError          a model call recording after its turn ended (it stops there)
    ├── ChannelError             a message could not be delivered to a channel (retryable, kind)
    ├── ConfigError              malformed or out-of-range configuration
    ├── EventError               the event vocabulary
    │   └── UnknownEventTypeError   encoding a tag this version does not know
    ├── ProviderError            an LLM provider call failed (retryable, status, kind)
    │   ├── ContextOverflowError    the prompt does not fit the model's window
    │   ├── BreakerOpenError        the provider's circuit breaker refused the call
    │   └── PromptTimeoutError      a stall, makespan or retry deadline aborted the call
    ├── SessionActionError       a confirmation, tool result, interrupt or wake refused
    ├── SessionsStoppedError     recorded, but this runtime runs no session's work any more
    ├── SpawnRefusedError        a sub-agent spawn with no valid timeout (class or custom)
    ├── SummaryFailedError       a summary that failed after some of its requests were billed
    ├── StoreError               the durable log
    │   ├── StoreNotFoundError      no store at the location (and create=False)
    │   ├── StoreClosedError        the store was closed
    │   ├── StoreUnavailableError   the store could not be reached (try again later)
    │   ├── AppendInDoubtError      an append that may or may not be in the log (read first)
    │   ├── StoreReadOnlyError      a write through a handle opened read-only
    │   ├── ConcurrencyError        expected_version did not match the stream
    │   ├── FencedError             the append's lease epoch is not the stream's (a lost lease)
    │   ├── InvalidStreamError      a stream id (or snapshot name) that cannot be stored
    │   └── CorruptRecordError      a stored record that cannot be decoded
    ├── ToolError                raised by a tool on purpose: a message meant for the model
    └── ToolRegistrationError    a bad tool name, a duplicate, a signature with no schema
"""

from __future__ import annotations


class StalwartError(Exception):
    """Base class of every error stalwart raises on purpose."""


#: Ends the recorded class of a channel failure that is final (``rejected:final``): a
#: :class:`ChannelError` that is not ``retryable`` (but for ``closed``: the next
#: runtime's channel is open). ``stalwart.channels.send_within`` writes it; the
#: dead-letter queue expires such an entry at once instead of retrying it.
FINAL_FAILURE = ":final"


class ChannelError(StalwartError):
    """A delivery to a channel (console, webhook, ...) that failed.

    ``kind`` is a stable, content-free class name (``timeout``, ``connect``,
    ``transport``, ``rate_limited``, ``server_error``, ``rejected``, ``closed``, ...);
    ``retryable`` says whether sending again later may help; ``status`` is the HTTP status
    if there was one; ``attempts`` how many sends were made; ``retry_after`` the receiver's
    hint in seconds. The message never holds the text sent, a URL or a header value.
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        retryable: bool,
        channel: str,
        status: int | None = None,
        attempts: int = 1,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable
        self.channel = channel
        self.status = status
        self.attempts = attempts
        self.retry_after = retry_after


class ConfigError(StalwartError):
    """Configuration that is malformed, unknown or out of range."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class EventError(StalwartError):
    """A problem with the event vocabulary itself."""


class UnknownEventTypeError(EventError):
    """An attempt to encode an object that is not a registered event."""


class ProviderError(StalwartError):
    """A provider call that failed.

    ``kind`` is a stable, content-free class name (``rate_limited``, ``overloaded``,
    ``server_error``, ``connect``, ``read``, ``stream_cut``, ``malformed``, ``auth``,
    ``bad_request``, ``not_found``, ``content_policy``, ``context_overflow``, ...) that
    events and incident reports use; ``retryable`` says whether trying again may help;
    ``retry_after`` is the server's hint in seconds. The message never holds a secret
    or the provider's raw response body.
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        retryable: bool,
        status: int | None = None,
        retry_after: float | None = None,
        provider: str | None = None,
        model: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable
        self.status = status
        self.retry_after = retry_after
        self.provider = provider
        self.model = model
        self.call_id: str | None = None  # the prompt:started call it ended, once known


class ContextOverflowError(ProviderError):
    """The prompt is longer than the model's context window: shrink it, do not retry it."""


class BreakerOpenError(ProviderError):
    """The provider's circuit breaker is open (or half-open with its probe in flight)."""


class PromptTimeoutError(ProviderError):
    """A prompt deadline fired: ``limit`` is ``stall``, ``makespan`` or ``retry_deadline``."""

    def __init__(
        self, message: str, *, limit: str, provider: str | None = None, model: str | None = None
    ) -> None:
        super().__init__(
            message, kind=f"timeout_{limit}", retryable=True, provider=provider, model=model
        )
        self.limit = limit


class SessionActionError(StalwartError):
    """An operator or host action on a session that cannot be taken; nothing was appended.

    ``reason`` is stable: ``no_session``, ``not_pending`` (no such request is waiting:
    a wrong id, a second answer, or one after an interrupt), ``wrong_kind`` (a tool result
    for an approval or the reverse), ``wake_refused`` (a delayed wake over its caps),
    ``invalid_session`` (an id no session can have: empty, with whitespace or control
    characters, over 128 characters or 256 UTF-8 bytes, or a stream name; ``session``
    is then empty), ``empty_message`` (a user message whose text is empty or blank).
    """

    def __init__(self, message: str, *, reason: str, session: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.session = session


class SessionsStoppedError(StalwartError):
    """This runtime runs no session's work any more: supervision gave up on its
    activation worker (``part``: ``activations``) or its context engine (``context``)
    after repeated crashes (``supervisor:gave_up`` in the ``runtime`` stream).

    Raised by the calls that give a session work (a message, a confirmation, a tool
    result, a delayed wake) *after* they recorded it: what was recorded is durable, and
    another worker on the store, or the next runtime the host starts on it, runs it.
    ``session`` is the session's stream. A host that sees it restarts its runtime.
    """

    def __init__(self, message: str, *, part: str, session: str) -> None:
        super().__init__(message)
        self.part = part
        self.session = session


class SummaryFailedError(StalwartError):
    """A summarizer that failed after the provider answered (and billed) some of its
    requests: a summary too long for one request is written in parts, and a later part
    timed out or failed. ``error_class`` names the failure; ``input_tokens`` and
    ``output_tokens`` are what the answered parts cost, so the spend caps count them."""

    def __init__(self, error_class: str, *, input_tokens: int, output_tokens: int) -> None:
        super().__init__(
            f"the summary failed ({error_class}) after parts of it were answered "
            f"({input_tokens} input and {output_tokens} output tokens)"
        )
        self.error_class = error_class
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens


class CallSealedError(StalwartError):
    """A model call tried to record after the turn that made it ended (it sealed the
    call): the call stops there, and nothing of it follows the turn's end in the log."""


class SpawnRefusedError(StalwartError):
    """A sub-agent spawn refused because it has no valid timeout.

    Every spawn has a timeout, no exceptions: a known task class, or a custom timeout up
    to the configured maximum with a stated reason. ``field`` names what was wrong
    (``task_class``, ``custom_timeout_ms`` or ``reason``).
    """

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class StoreError(StalwartError):
    """A problem with the durable event log."""


class StoreNotFoundError(StoreError):
    """There is no store at the given location."""


class StoreClosedError(StoreError):
    """The store handle was closed."""


class StoreUnavailableError(StoreError):
    """The store could not be reached: no connection could be had, or the connection
    broke. A read may succeed when tried again later; what an append did is said by the
    error that names it."""


class AppendInDoubtError(StoreError):
    """An append whose outcome is unknown: the connection to the store broke while it was
    sent and the store could not find out whether it was committed (PostgreSQL, when the
    server stays unreachable, or the old session lingers and could still commit). It may
    or may not be in the log: read the stream before appending it again. Not a
    :class:`StoreUnavailableError`, whose retry cannot write twice."""


class StoreReadOnlyError(StoreError):
    """A write (an append, a snapshot, a work-queue change) through a handle opened with
    ``read_only=True``, as the CLI's read commands open the store."""


class InvalidStreamError(StoreError):
    """A stream id or snapshot name that cannot be stored (empty, too long, or with a NUL
    byte)."""


class ConcurrencyError(StoreError):
    """An append's ``expected_version`` did not match the stream's version."""

    def __init__(self, stream: str, expected: int, actual: int) -> None:
        super().__init__(
            f"stream {stream!r} is at version {actual}, the append expected version {expected}"
        )
        self.stream = stream
        self.expected = expected
        self.actual = actual


class FencedError(StoreError):
    """An append fenced by a lease epoch that is no longer the stream's.

    ``held`` is the epoch the appender holds (or claims), ``current`` the stream's lease
    epoch. The appender has lost its lease: it must stop writing and never ack its wake.
    """

    def __init__(self, stream: str, held: int, current: int, *, claim: bool = False) -> None:
        what = "claim" if claim else "hold"
        super().__init__(
            f"stream {stream!r} is at lease epoch {current}, the append tried to {what} "
            f"epoch {held}"
        )
        self.stream = stream
        self.held = held
        self.current = current
        self.claim = claim


class CorruptRecordError(StoreError):
    """A stored record that cannot be decoded; nothing is dropped silently.

    ``through``: the last position of a run of missing records that starts at
    ``position`` (the record after a hole is at ``through + 1``); ``position`` itself
    for one record."""

    def __init__(self, position: int, reason: str, *, through: int | None = None) -> None:
        through = position if through is None or through < position else through
        where = f"record at position {position} is"
        if through > position:
            where = f"records at positions {position}..{through} are"
        super().__init__(f"{where} corrupt: {reason}")
        self.position = position
        self.reason = reason
        self.through = through


class ToolError(StalwartError):
    """Raise it from a tool to tell the model plainly what went wrong.

    Any other exception a tool raises reaches the model only as a static sentence naming
    its class of error (an exception's text may hold a path, a secret or a traceback);
    a ``ToolError``'s message is written for the model and is passed on as it is.
    ``error_class`` is a stable, content-free name (``permission_denied``, ``not_found``,
    ``rate_limited``, ...) that events and the tool retry breaker use; ``retryable`` says
    whether calling again with the same arguments may help (it decides the action for a
    class the breaker does not know).
    """

    def __init__(
        self, message: str, *, error_class: str = "tool_error", retryable: bool = False
    ) -> None:
        super().__init__(message)
        self.error_class = error_class
        self.retryable = retryable


class ToolRegistrationError(StalwartError):
    """A tool that cannot be registered: ``field`` names what was wrong.

    ``name`` (not provider-safe, or already taken), ``parameters`` (an explicit schema that
    is not a JSON object schema, or a signature with no JSON schema), ``signature``
    (positional-only or ``*args`` parameters), ``timeout_ms`` (not a positive integer).
    """

    def __init__(self, message: str, *, field: str, tool: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.tool = tool
