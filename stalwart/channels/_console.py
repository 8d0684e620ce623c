"""A channel that writes lines to a text stream: a terminal, a log file, a test buffer."""

from __future__ import annotations

import codecs
import sys
import threading
from typing import TextIO

import anyio
import anyio.to_thread

from stalwart._aio import wait_on_own_thread
from stalwart._text import escaped
from stalwart.errors import ChannelError

from ._types import Delivery, OutboundMessage, closed_error

__all__ = ["ConsoleChannel"]


class ConsoleChannel:
    """Writes ``[conversation] text``, one such line per line of text, then flushes.

    The text is untrusted (model output): control characters other than its line breaks
    and tabs are written escaped (``\u001b``), so a reply cannot move the cursor, erase
    the prefix or forge a line of another conversation. So is what the stream's encoding
    cannot hold (``\\xe9`` on an ASCII stream, a lone surrogate on any).

    The stream defaults to whatever ``sys.stdout`` is at send time. The write and flush
    run on a thread of their own, never on the event loop: a stream that blocks (a full
    pipe, a terminal paused with Ctrl-S) holds its own sends, not the loop. Sends are
    written whole and in the order they were made, from any number of threads or loops.
    A send cut while it waits for its turn is not written at all; one whose write has
    begun ends when the write does (half a message would be worse), and is recorded as
    what it did. The stream is not closed by :meth:`aclose` (it is not ours).
    """

    def __init__(self, name: str = "console", *, stream: TextIO | None = None) -> None:
        self.name = name
        self._stream = stream
        self._turns = threading.Condition()
        self._issued = 0  # the sends made so far: the next one's place in line
        self._serving = 0  # the place whose turn it is to write
        self._withdrawn: set[int] = set()  # places cut before their turn came
        self._closed = False

    def __repr__(self) -> str:
        return f"ConsoleChannel({self.name!r})"

    async def send(self, message: OutboundMessage) -> Delivery:
        stream = self._stream or sys.stdout
        if stream is None:  # a process started with its stdout closed
            raise self._unwritable("no stream to write to")
        block = _lines(message, getattr(stream, "encoding", None))
        with self._turns:
            if self._closed:
                raise closed_error(self.name)
            place, self._issued = self._issued, self._issued + 1
            waits = self._serving != place
        try:
            if waits:  # behind another send's write: a cut here ends the send, unwritten
                await wait_on_own_thread(self._wait_turn, place)
            # this send's turn: the write runs to its end whatever cuts the send
            own = anyio.CapacityLimiter(1)  # not one of the loop's shared threads
            await anyio.to_thread.run_sync(self._write, stream, block, limiter=own)
        finally:
            self._leave(place)
        return Delivery(channel=self.name)

    async def aclose(self) -> None:
        with self._turns:
            self._closed = True

    def _wait_turn(self, place: int) -> None:
        with self._turns:
            self._turns.wait_for(lambda: self._serving >= place)

    def _write(self, stream: TextIO, block: str) -> None:
        try:
            stream.write(block)
            stream.flush()
        except (OSError, ValueError) as exc:  # a closed or broken stream
            raise self._unwritable(f"cannot write ({type(exc).__name__})") from exc

    def _leave(self, place: int) -> None:
        """The send at ``place`` ended (written, failed or cut): its turn, when it has
        it, passes on; one cut before its turn came is skipped when that comes."""
        with self._turns:
            if place > self._serving:
                self._withdrawn.add(place)
                return
            if place < self._serving:
                return
            self._serving += 1
            while self._serving in self._withdrawn:
                self._withdrawn.discard(self._serving)
                self._serving += 1
            self._turns.notify_all()

    def _unwritable(self, why: str) -> ChannelError:
        return ChannelError(
            f"console channel {self.name!r}: {why}",
            kind="transport",
            retryable=False,
            channel=self.name,
        )


def _lines(message: OutboundMessage, encoding: str | None) -> str:
    """The message as the console writes it: one prefixed line per line of text, control
    characters escaped, and what ``encoding`` cannot hold escaped (UTF-8 when the stream
    names none: a lone surrogate is never written as it is)."""
    prefix = f"[{escaped(message.conversation)}] "
    lines = message.text.splitlines() or [""]
    block = "".join(f"{prefix}{escaped(line, tabs=True)}\n" for line in lines)
    try:
        codec = codecs.lookup(encoding or "utf-8")
    except LookupError:  # a stream naming a codec Python does not know
        codec = codecs.lookup("utf-8")
    try:
        block.encode(codec.name)
    except UnicodeEncodeError:
        return block.encode(codec.name, "backslashreplace").decode(codec.name)
    return block
