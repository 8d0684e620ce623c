"""An incremental server-sent-events parser (the WHATWG event-stream rules).

Bytes arrive in arbitrary chunks; frames end at a blank line; lines end in LF, CRLF or
CR; ``:`` starts a comment; several ``data:`` lines join with newlines; one UTF-8 byte
order mark at the very start of the stream is dropped.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

_BOM = b"\xef\xbb\xbf"


class SseEvent(msgspec.Struct, frozen=True):
    event: str
    data: str


class SseParser:
    """Feed it bytes; it yields every complete event."""

    def __init__(self) -> None:
        self._buffer = b""
        self._event = ""
        self._data: list[str] = []
        self._pending_cr = False
        self._began = False  # past the stream's first bytes (and its BOM, if any)

    def feed(self, chunk: bytes) -> Iterator[SseEvent]:
        buffer = self._buffer + chunk
        if not self._began:
            if len(buffer) < len(_BOM) and _BOM.startswith(buffer):
                self._buffer = buffer  # maybe a BOM split across chunks: wait for more
                return
            self._began = True
            buffer = buffer.removeprefix(_BOM)
        if self._pending_cr and buffer.startswith(b"\n"):
            buffer = buffer[1:]  # the LF of a CRLF split across chunks
        self._pending_cr = False
        start = 0
        length = len(buffer)
        while start < length:
            cr = buffer.find(b"\r", start)
            lf = buffer.find(b"\n", start)
            ends = [i for i in (cr, lf) if i >= 0]
            if not ends:
                break
            end = min(ends)
            line = buffer[start:end]
            if buffer[end : end + 1] == b"\r":
                if end + 1 == length:
                    self._pending_cr = True
                    start = end + 1
                elif buffer[end + 1 : end + 2] == b"\n":
                    start = end + 2
                else:
                    start = end + 1
            else:
                start = end + 1
            event = self._line(line.decode("utf-8", errors="replace"))
            if event is not None:
                yield event
        self._buffer = buffer[start:]

    def _line(self, line: str) -> SseEvent | None:
        if not line:
            if not self._data:
                self._event = ""
                return None
            event = SseEvent(event=self._event or "message", data="\n".join(self._data))
            self._event, self._data = "", []
            return event
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        return None

    @property
    def pending(self) -> bool:
        """Whether a frame was begun and not finished (a stream cut mid-frame)."""
        return bool(self._buffer.strip() or self._data)
