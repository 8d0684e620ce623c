"""What lets a turn end its model call in the log: once sealed, the call records nothing.

A turn can end while its model call is still running: the execution timeout, say, or a
deadline that the Clock passed together with the turn's. The Agent appends the turn's end
and then cancels the call on the I/O loop, and until the cancel lands the call goes on. If
it then recorded a retry's ``prompt:started`` or its own ``execution:prompt_timeout``,
those would follow the turn's end, a retry would begin after it (a request the turn no
longer wants), and replay would find an attempt nothing ends.

So the Agent seals the call before it appends the turn's end. Sealing waits for an append
of the call already under way (it lands before the turn's end), and every later one is
refused with :class:`~stalwart.errors.CallSealedError`, which stops the call: a retry
whose ``prompt:started`` is refused sends no request. And a seal knows when its turn's
time is up (``not_after``, the execution deadline): the caller begins no attempt (a
retry, a fallback) once its Clock is there, even before the Agent has had its turn to
seal.
"""

from __future__ import annotations

import threading

from stalwart.errors import CallSealedError

__all__ = ["CallSeal"]


class CallSeal:
    """One model call's permission to record; safe to use from any thread."""

    __slots__ = ("_cond", "_recording", "_sealed", "not_after")

    def __init__(self, not_after: float | None = None) -> None:
        #: when the turn's time is up (unix seconds on the caller's Clock): no attempt
        #: of the call begins then or later
        self.not_after = not_after
        self._cond = threading.Condition(threading.Lock())
        self._sealed = False
        self._recording = 0  # the call's appends under way

    @property
    def sealed(self) -> bool:
        return self._sealed

    def may_begin(self, now: float) -> bool:
        """Whether an attempt may begin at ``now``: not sealed, and the turn's time not up."""
        return not self._sealed and (self.not_after is None or now < self.not_after)

    def enter(self) -> None:
        """Before an append of the call: CallSealedError once the call is sealed."""
        with self._cond:
            if self._sealed:
                raise CallSealedError("the turn that made this model call has ended")
            self._recording += 1

    def leave(self) -> None:
        """After that append, whatever became of it."""
        with self._cond:
            self._recording -= 1
            if not self._recording:
                self._cond.notify_all()

    def seal(self, timeout: float) -> bool:
        """Refuse every later append of the call, and wait up to ``timeout`` seconds for
        those under way to end; False when one was still under way after it."""
        with self._cond:
            self._sealed = True
            return self._cond.wait_for(lambda: not self._recording, timeout)
