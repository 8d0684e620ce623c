"""An incremental server-sent-events parser (the WHATWG event-stream rules).

Bytes arrive in arbitrary chunks; frames end at a blank line; lines end in LF, CRLF or
CR; ``:`` starts a comment; several ``data:`` lines join with newlines; one UTF-8 byte
order mark at the very start of the stream is dropped.

Each byte is scanned once, however finely a long line is split across chunks, and a
frame larger than ``max_frame_bytes`` is refused (:class:`SseFrameTooLarge`) instead of
growing without bound. A frame's data lines are gathered as the bytes they came in and
decoded once, when the frame ends, so what a frame holds in memory is what the bound
counts (a frame of many short lines held a string per line: about twenty times its size).
Decoding them together reads as decoding each line (a line end is never part of a UTF-8
sequence), which is how the rules read them.
"""

from __future__ import annotations

import re

import msgspec

_BOM = b"\xef\xbb\xbf"
_LINE_END = re.compile(rb"\r\n?|\n")
_CR = 0x0D
_LF = 0x0A

MAX_FRAME_BYTES = 16 * 1024 * 1024
"""Default bound on one frame: its unfinished line plus the data lines gathered so far."""


class SseEvent(msgspec.Struct, frozen=True):
    event: str
    data: str


class SseFrameTooLarge(ValueError):
    """A frame grew past the parser's bound before its blank line came."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"an event-stream frame exceeds {limit} bytes")
        self.limit = limit


class SseParser:
    """Feed it bytes; it returns every event the bytes complete."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()  # the unfinished line
        self._scanned = 0  # how much of it is known to hold no line end
        self._event = ""
        self._data = bytearray()  # the frame's data lines so far, each ending in LF
        self._pending_cr = False  # the last chunk ended in CR: a LF opening the next is its pair
        self._began = False  # past the stream's first bytes (and its BOM, if any)

    def feed(self, chunk: bytes) -> list[SseEvent]:
        if self._pending_cr and chunk:
            self._pending_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        buffer = self._buffer
        buffer += chunk
        if not self._began:
            if len(buffer) < len(_BOM) and _BOM.startswith(buffer):
                return []  # maybe a BOM split across chunks: wait for more
            self._began = True
            if buffer.startswith(_BOM):
                del buffer[: len(_BOM)]
        events: list[SseEvent] = []
        start = 0
        position = self._scanned
        while (match := _LINE_END.search(buffer, position)) is not None:
            end = match.end()
            if end == len(buffer) and buffer[end - 1] == _CR:
                self._pending_cr = True
            event = self._line(buffer, start, match.start())
            if event is not None:
                events.append(event)
            start = position = end
        del buffer[:start]
        self._scanned = len(buffer)
        if len(self._data) + len(buffer) > self._max_frame_bytes:
            raise SseFrameTooLarge(self._max_frame_bytes)
        return events

    def _line(self, buffer: bytearray, start: int, stop: int) -> SseEvent | None:
        """The line ``buffer[start:stop]``: the event it completes, if any."""
        if start == stop:
            return self._dispatch()
        if buffer.startswith(b"data:", start, stop):  # nearly every line: read it first
            self._add_data(buffer, start + 5, stop)
            return None
        colon = buffer.find(b":", start, stop)
        if colon == start:
            return None  # a comment
        if colon < 0:  # a field without a value
            colon = stop
        field = buffer[start:colon]
        if field == b"data":
            self._add_data(buffer, colon + 1, stop)
        elif field == b"event":
            start = colon + 2 if buffer.startswith(b" ", colon + 1, stop) else colon + 1
            self._event = buffer[start:stop].decode("utf-8", errors="replace")
        return None

    def _add_data(self, buffer: bytearray, start: int, stop: int) -> None:
        """A data line whose value (after one optional space) starts at ``start``."""
        if buffer.startswith(b" ", start, stop):
            start += 1
        self._data += buffer[start:stop]
        self._data.append(_LF)

    def _dispatch(self) -> SseEvent | None:
        """A blank line: the frame gathered so far, if it has data."""
        data = self._data
        if not data:
            self._event = ""
            return None
        event = SseEvent(
            event=self._event or "message", data=data[:-1].decode("utf-8", errors="replace")
        )
        self._event = ""
        self._data = bytearray()
        return event

    @property
    def pending(self) -> bool:
        """Whether a frame was begun and not finished (a stream cut mid-frame)."""
        return bool(self._buffer.strip() or self._data)
