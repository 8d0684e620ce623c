"""What the fake provider does with each request: a script of steps.

Each step is one behaviour (``action``): a normal answer, a slow first token, a stall, a
hang, a trickle that defeats a stall budget, an error status, a reset or cut connection,
a malformed or truncated frame, a wrong content type, an error inside the stream. A
request takes the first step that matches it (``model`` and ``api``, when set) and has
uses left (``times``; 0 means for ever); when none matches it gets ``default``.

Scripts are written in Python, or in a TOML, YAML or JSON file::

    [default]
    action = "answer"
    text = "Hello from the fake provider."

    [[steps]]
    action = "stall"
    after_deltas = 2

    [[steps]]
    action = "fail"
    status = 503
    model = "gpt-4o"
    times = 3
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Literal

import msgspec

from stalwart.config import read_document
from stalwart.errors import ConfigError

__all__ = [
    "Answer",
    "Cut",
    "ErrorEvent",
    "Fail",
    "FakeToolCall",
    "Hang",
    "Malformed",
    "Reset",
    "Script",
    "Stall",
    "Step",
    "Trickle",
    "Truncated",
    "WrongContentType",
    "load_script",
    "parse_script",
]

Api = Literal["openai", "anthropic"]
Millis = Annotated[int, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]

DEFAULT_TEXT = "Hello from the fake provider."


class _Step(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="action"
):
    """Fields every step has: which requests it matches, and how many times it plays."""

    model: str | None = None
    api: Api | None = None
    times: Count = 1

    def matches(self, api: str, model: str) -> bool:
        return (self.model is None or self.model == model) and (self.api in (None, api))


class FakeToolCall(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A tool call the fake model makes; ``arguments`` is JSON text or an object."""

    name: str
    arguments: str | dict[str, Any] = "{}"
    id: str | None = None

    def arguments_text(self) -> str:
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(self.arguments, separators=(",", ":"))


class _Streaming(_Step, frozen=True, kw_only=True):
    """A step that streams some text before doing its thing."""

    text: str = DEFAULT_TEXT
    delay_ms: Millis = 0
    """Pause between deltas."""


class Answer(_Streaming, frozen=True, kw_only=True, tag="answer"):
    """A whole, well-formed reply; ``first_delay_ms`` makes a slow first token."""

    thinking: str = ""
    tool_calls: tuple[FakeToolCall, ...] = ()
    chunks: Count = 0
    """How many text deltas (0: one per word)."""
    first_delay_ms: Millis = 0
    input_tokens: Count = 12
    output_tokens: Count | None = None
    """Reported output tokens (None: one per word of text)."""
    finish_reason: str | None = None


class Stall(_Streaming, frozen=True, kw_only=True, tag="stall"):
    """``after_deltas`` text deltas, then silence until the client gives up."""

    after_deltas: Count = 1


class Hang(_Step, frozen=True, kw_only=True, tag="hang"):
    """Reads the request and never answers (not even the status line)."""


class Trickle(_Step, frozen=True, kw_only=True, tag="trickle"):
    """One delta every ``interval_ms`` for ever: only a makespan ceiling stops it."""

    interval_ms: Annotated[int, msgspec.Meta(ge=1)] = 100
    text: str = "."


class Fail(_Step, frozen=True, kw_only=True, tag="fail"):
    """An error status (429, 500, 503, 529, 400, 401, ...) with the API's error body.

    ``error_type`` goes into the body (``context_length_exceeded``, ``overloaded_error``,
    ...); ``body`` replaces the whole body verbatim.
    """

    status: Annotated[int, msgspec.Meta(ge=400, le=599)] = 503
    retry_after: str | None = None
    error_type: str | None = None
    body: str | None = None


class Reset(_Streaming, frozen=True, kw_only=True, tag="reset"):
    """``after_deltas`` deltas, then the connection is reset (TCP RST)."""

    after_deltas: Count = 1


class Cut(_Streaming, frozen=True, kw_only=True, tag="cut"):
    """``after_deltas`` deltas, then the body ends cleanly but without the final event.

    ``mid_frame`` ends it half-way through a frame instead.
    """

    after_deltas: Count = 1
    mid_frame: bool = False


class Malformed(_Streaming, frozen=True, kw_only=True, tag="malformed"):
    """``after_deltas`` deltas, then a frame whose data is not JSON."""

    after_deltas: Count = 1


class Truncated(_Streaming, frozen=True, kw_only=True, tag="truncated"):
    """``after_deltas`` deltas, then a frame with JSON cut short, then the end."""

    after_deltas: Count = 1


class WrongContentType(_Step, frozen=True, kw_only=True, tag="wrong_content_type"):
    """Status 200 with an HTML page (a captive portal, a misrouted gateway)."""

    content_type: str = "text/html; charset=utf-8"


class ErrorEvent(_Streaming, frozen=True, kw_only=True, tag="error_event"):
    """``after_deltas`` deltas, then an error inside the stream (``overloaded_error``...)."""

    after_deltas: Count = 1
    error_type: str = "overloaded_error"


Step = (
    Answer
    | Stall
    | Hang
    | Trickle
    | Fail
    | Reset
    | Cut
    | Malformed
    | Truncated
    | WrongContentType
    | ErrorEvent
)
ACTIONS = tuple(sorted(str(kind.__struct_config__.tag) for kind in Step.__args__))


class Script(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The steps in the order they are offered, and what a request gets when none match."""

    steps: tuple[Step, ...] = ()
    default: Step = msgspec.field(default_factory=Answer)


def parse_script(data: Any, *, source: str = "script") -> Script:
    """A Script from parsed TOML/YAML/JSON data; ConfigError names what is wrong."""
    if isinstance(data, list):
        data = {"steps": data}
    try:
        return msgspec.convert(data if data is not None else {}, Script)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if "Invalid value" in message and "action" in message:
            message += f" (actions: {', '.join(ACTIONS)})"
        raise ConfigError(f"{source}: {message}") from None


def load_script(path: str | os.PathLike[str]) -> Script:
    """Read a script file: ``.toml``, ``.yaml``/``.yml`` or ``.json``."""
    return parse_script(read_document(path, "script"), source=os.fspath(path))
