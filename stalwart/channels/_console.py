"""A channel that writes lines to a text stream: a terminal, a log file, a test buffer."""

from __future__ import annotations

import sys
import threading
from typing import TextIO

from stalwart._text import escaped
from stalwart.errors import ChannelError

from ._types import Delivery, OutboundMessage, closed_error

__all__ = ["ConsoleChannel"]


class ConsoleChannel:
    """Writes ``[conversation] text``, one such line per line of text, then flushes.

    The text is untrusted (model output): control characters other than its line breaks
    and tabs are written escaped (``\u001b``), so a reply cannot move the cursor, erase
    the prefix or forge a line of another conversation.

    The stream defaults to whatever ``sys.stdout`` is at send time. Writes from several
    threads or tasks never interleave within a message. The stream is not closed by
    :meth:`aclose` (it is not ours).
    """

    def __init__(self, name: str = "console", *, stream: TextIO | None = None) -> None:
        self.name = name
        self._stream = stream
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"ConsoleChannel({self.name!r})"

    async def send(self, message: OutboundMessage) -> Delivery:
        prefix = f"[{escaped(message.conversation)}] "
        lines = message.text.splitlines() or [""]
        block = "".join(f"{prefix}{escaped(line, tabs=True)}\n" for line in lines)
        with self._lock:
            if self._closed:
                raise closed_error(self.name)
            stream = self._stream or sys.stdout
            try:
                stream.write(block)
                stream.flush()
            except (OSError, ValueError) as exc:  # a closed or broken stream
                raise ChannelError(
                    f"console channel {self.name!r}: cannot write ({type(exc).__name__})",
                    kind="transport",
                    retryable=False,
                    channel=self.name,
                ) from exc
        return Delivery(channel=self.name)

    async def aclose(self) -> None:
        with self._lock:
            self._closed = True
