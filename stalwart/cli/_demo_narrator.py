"""The demo's narrator: it reads the event log as it grows and says what each step means.

Everything the demo shows comes from the log (the same events ``stalwart tail`` prints),
so what the newcomer reads is what an operator would see.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import click

from stalwart.events import RecordedEvent
from stalwart.store import EventStore

from ._render import counted

Say = Callable[[Any], str]


def _excerpt(text: str, size: int = 48) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= size else flat[: size - 3] + "..."


#: The events worth a sentence, and the sentence.
SENTENCES: dict[str, Say] = {
    "execution:prompt_timeout": lambda e: (
        f"the call was aborted: its {e.limit} limit ({e.knob} = {e.limit_ms} ms) passed "
        f"after {e.elapsed_ms} ms; the HTTP request is closed"
    ),
    "prompt:retry_scheduled": lambda e: (
        f"retrying the same model in {e.delay_ms} ms, now with a whole-call limit"
    ),
    "model:fallback_attempt": lambda e: f"falling back from {e.from_model} to {e.to_model}",
    "model:fallback_exhausted": lambda e: "every model of the chain failed",
    "provider:call_failed": lambda e: (
        f"{e.provider}/{e.model} failed for agent '{e.agent}' ({e.error_class})"
    ),
    "provider:degraded": lambda e: (
        f"provider '{e.provider}' is DEGRADED (rule: {e.rule}; "
        f"{e.failures} failures within {e.window_ms // 1000} s)"
    ),
    "provider:recovered": lambda e: f"provider '{e.provider}' recovered (rule: {e.rule})",
    "announcement:dead_lettered": lambda e: (
        "the message could not be delivered: it waits in the dead-letter queue"
    ),
    "announcement:dead_letter_retried": lambda e: (
        f"sending the dead letter again (attempt {e.attempt}: "
        + (f"provider '{e.provider}' recovered)" if e.reason == "drain" else "its backoff came)")
    ),
    "announcement:dead_letter_delivered": lambda e: (
        f"the dead letter was delivered (after {counted(e.attempts, 'earlier attempt')})"
    ),
    "execution:aborted": lambda e: f"the turn was aborted ({e.reason})",
    "subagent:spawned": lambda e: (
        f"sub-agent spawned for '{_excerpt(e.task)}' with a {e.timeout_ms // 1000} s timeout"
        f" (attempt {e.attempt})"
    ),
    "subagent:artifact": lambda e: f"the sub-agent saved {e.path}",
    "subagent:watchdog_timeout": lambda e: (
        f"watchdog: the sub-agent ran past its {e.limit_ms} ms limit ({e.knob}); force-failed"
    ),
    "subagent:ghost_swept": lambda e: (
        f"ghost sweep: a run left 'running' for {e.elapsed_ms // 1000} s "
        f"(limit + {e.grace_ms} ms grace) was force-failed"
    ),
    "subagent:suspicious": lambda e: f"heartbeat: the run's tokens stopped at {e.tokens}",
    "subagent:recovery_decided": lambda e: (
        f"recovery: {e.action} ({e.reason})" + (f': "{e.context}"' if e.context else "")
    ),
    "subagent:completed": lambda e: f"sub-agent finished: {e.outcome}",
    "session:requires_action": lambda e: (
        f"the session PAUSED: '{e.tool}' needs an approval (request {e.request_id[:8]}, "
        f"input {_excerpt(e.arguments)} stored)"
        if e.kind == "approval"
        else f"the session PAUSED for the host's tool '{e.tool}'"
    ),
    "user:tool_confirmation": lambda e: (
        f"the operator {'ALLOWED' if e.allow else 'DENIED'} the request; the session resumes"
    ),
    "tool:completed": lambda e: f"the tool '{e.tool}' ran once: {_excerpt(e.output)}",
    "activation:requeued": lambda e: (
        f"the wake failed ({e.error_class}): requeued, retry {e.streak} in {e.delay_ms} ms"
    ),
    "activation:leased": lambda e: (
        f"leased by this worker at lease epoch {e.epoch}" if e.epoch > 1 else ""
    ),
    "activation:abandoned": lambda e: (
        f"the wake was given up after {counted(e.attempts, 'attempt')}"
    ),
}


class Output:
    """The demo's stdout, written by three threads: the tour's, the narrator's and the
    runtime's event loop (what the user's chat shows). A reader that goes away
    (``stalwart demo | head``) ends the writing quietly, on whichever thread meets it
    first; the tour then stops before its next scene, its log closed as usual."""

    def __init__(self) -> None:
        self.gone = threading.Event()
        self._leaving = threading.Lock()

    def say(self, text: str = "", **style: Any) -> None:
        """Write one line (``click.secho``'s styles), unless the reader has gone."""
        if self.gone.is_set():
            return
        try:
            click.secho(text, **style)
        except BrokenPipeError:
            with self._leaving:  # two threads may meet the broken pipe at once
                if not self.gone.is_set():
                    # what Python would flush at exit goes nowhere, quietly
                    sys.stdout = open(os.devnull, "w")  # noqa: SIM115
                    self.gone.set()


class Narrator:
    """Follows the log from a position on, printing a line for each event worth one."""

    def __init__(
        self, store: EventStore, *, indent: str = "    ", output: Output | None = None
    ) -> None:
        self._store = store
        self._indent = indent
        self.output = output or Output()
        self._subscription = store.subscribe(store.head() + 1)
        self._thread = threading.Thread(target=self._run, name="stalwart-demo-narrator")
        self._thread.daemon = True
        self._changed = threading.Condition()
        self.seen: list[RecordedEvent] = []

    def scene(self, number: int, title: str, what: str) -> None:
        """A scene's heading and what it shows."""
        self.output.say()
        self.output.say(f"{number}. {title}", bold=True)
        self.output.say(f"   {what}")

    def say(self, text: str) -> None:
        """A line of the tour's own, between the log's."""
        self.output.say(text)

    def start(self) -> Narrator:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._subscription.closed:
            for record in self._subscription.poll(timeout=0.1):
                say = SENTENCES.get(record.type)
                line = say(record.event) if say is not None else ""
                if line:  # said before it counts as seen: waits see it printed
                    self.output.say(f"{self._indent}[log] {line}", fg="cyan")
                with self._changed:
                    self.seen.append(record)
                    self._changed.notify_all()

    def wait_where(self, matches: Callable[[RecordedEvent], bool], timeout: float = 15.0) -> bool:
        """Wait until an event that ``matches`` was seen; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: any(map(matches, self.seen)), timeout)

    def wait_for(self, event_type: str, count: int = 1, timeout: float = 15.0) -> bool:
        """Wait until ``count`` events of ``event_type`` were seen; False on timeout."""
        with self._changed:
            return self._changed.wait_for(
                lambda: sum(r.type == event_type for r in self.seen) >= count, timeout
            )

    def stop(self) -> None:
        self._subscription.close()
        self._thread.join(timeout=2)
