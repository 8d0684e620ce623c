"""``stalwart demo``: a guided tour of the failure layers, with no key and no network.

It starts the fault-injecting fake provider on 127.0.0.1 and a runtime with short
budgets, then plays scenes against them, each narrated from the event log as it grows.
Everything it does lands in a store the newcomer can inspect afterwards.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import FrameType

import anyio
import click
from click.core import ParameterSource

from stalwart._text import escaped
from stalwart.actors import RunReport
from stalwart.channels import Delivery, OutboundMessage
from stalwart.clock import SystemClock
from stalwart.config import Config, parse_config
from stalwart.errors import ChannelError, StalwartError
from stalwart.events import (
    ProviderCallFailed,
    RecordedEvent,
    SubagentCompleted,
    SubagentRecoveryDecided,
    SubagentSpawned,
)
from stalwart.ids import new_id
from stalwart.runtime import Runtime
from stalwart.testing import Answer, Fail, FakeProvider, Stall

from ._app import _State, cli
from ._demo_durable import crash_scene, pause_scene
from ._demo_narrator import Narrator, Output
from ._logging import configure_logging

DEFAULT_DIR = "stalwart-demo"
#: the demo's health window (60 s by default), so that recovery comes within the tour
HEALTH_WINDOW_MS = 3_000

CONFIG = """
[providers.main]
kind = "openai"
base_url = "{base_url}"

[providers.backup]
kind = "anthropic"
base_url = "{base_url}"

[agents.support]
provider = "main"
model = "gpt-demo"
fallback_models = ["backup:claude-demo"]
prompt_timeout_ms = 1000
retry_prompt_timeout_ms = 3000
activity_interval_ms = 100
max_retries = 0

[agents.billing]
provider = "main"
model = "gpt-demo"
prompt_timeout_ms = 1000
activity_interval_ms = 100
max_retries = 0

[health]
window_ms = {health_window_ms}

[dead_letters]
announce_timeout_ms = 2000
retry_base_ms = 60000

[activations]
backoff_base_ms = 500

[subagents]
ghost_grace_ms = 1000
ghost_sweep_interval_ms = 500
heartbeat_interval_ms = 1000
announce_debounce_ms = 200
announce_max_wait_ms = 1000
"""

#: A process that starts a sub-agent run and dies with SIGKILL before finishing it.
CRASHING_PROCESS = """
import os, signal, sys
from stalwart import store
from stalwart.events import SubagentProgress, SubagentSpawned
run = sys.argv[2]
with store.open(sys.argv[1]) as log:
    log.append(f"session:{run}", [
        SubagentSpawned(parent="alice", task="Reconcile last month's invoices",
                        task_class="custom", timeout_ms=1000, timeout_reason="demo",
                        channel="chat", conversation="erin"),
        SubagentProgress(tokens=120, step=1),
    ])
os.kill(os.getpid(), signal.SIGKILL)
"""


class Screen:
    """What the user sees: each message printed, unless the chat bridge is down."""

    def __init__(self, name: str = "chat", *, output: Output | None = None) -> None:
        self.name = name
        self.output = output or Output()
        self.down = False
        self.shown: list[OutboundMessage] = []
        self._changed = threading.Condition()

    async def send(self, message: OutboundMessage) -> Delivery:
        if self.down:
            raise ChannelError(
                "the chat bridge is down", kind="connect", retryable=True, channel=self.name
            )
        text = message.text.replace("\n", "\n      ")
        self.output.say(f"    user sees ({message.conversation}): {text}", fg="green")
        with self._changed:
            self.shown.append(message)
            self._changed.notify_all()
        return Delivery(channel=self.name)

    def wait_text(self, part: str, timeout: float = 20.0) -> None:
        """Wait until the user has seen a message containing ``part``."""
        with self._changed:
            if not self._changed.wait_for(lambda: any(part in m.text for m in self.shown), timeout):
                raise StalwartError(f"demo: the user never saw {part!r}")

    def wait_count(self, count: int, timeout: float = 20.0) -> None:
        """Wait until the user has seen ``count`` messages in all."""
        with self._changed:
            if not self._changed.wait_for(lambda: len(self.shown) >= count, timeout):
                raise StalwartError(f"demo: the user did not see {count} messages in time")

    def wait_for(self, *conversations: str, timeout: float = 20.0) -> None:
        """Wait until each conversation has seen a message (one more than ``seen_before``)."""

        def arrived() -> bool:
            seen = {m.conversation for m in self.shown}
            return all(c in seen for c in conversations)

        with self._changed:
            if not self._changed.wait_for(arrived, timeout):
                missing = ", ".join(conversations)
                raise StalwartError(f"demo: no message reached {missing} within {timeout:.0f} s")

    async def aclose(self) -> None:
        return None


def _wait(narrator: Narrator, event_type: str, count: int = 1, timeout: float = 20.0) -> None:
    if not narrator.wait_for(event_type, count, timeout):
        raise StalwartError(f"demo: expected {event_type} within {timeout:.0f} s; it never came")


Scene = Callable[[Runtime, FakeProvider, Screen, Narrator], None]


def _normal(rt: Runtime, fake: FakeProvider, screen: Screen, narrator: Narrator) -> None:
    narrator.scene(
        1, "A normal answer", "A customer asks; the model answers; every step is an event."
    )
    fake.add(Answer(model="gpt-demo", text="Your refund was issued on Monday."))
    rt.session("alice", agent="support", channel="chat").send("Where is my refund?")
    screen.wait_for("alice")


def _stall(rt: Runtime, fake: FakeProvider, screen: Screen, narrator: Narrator) -> None:
    narrator.scene(
        2,
        "A stalled stream",
        "The model sends three words and goes silent. The stall budget (1 s here, 3 min by "
        "default) aborts it, closes the socket, and the fallback model answers.",
    )
    fake.add(Stall(model="gpt-demo", after_deltas=3, text="Let me check"))
    fake.add(Answer(model="claude-demo", text="Your order ships tomorrow."))
    rt.session("alice", agent="support", channel="chat").send("And my order?")
    _wait(narrator, "execution:prompt_timeout")
    _wait(narrator, "announcement:delivered", 2)


def _outage(rt: Runtime, fake: FakeProvider, screen: Screen, narrator: Narrator) -> None:
    narrator.scene(
        3,
        "A provider outage",
        "Two agents get 503s within the health window (3 s here, 60 s by default): the "
        "provider is marked degraded. Billing has no fallback and says so plainly; support "
        "falls back to its second model.",
    )
    _outlive_the_health_window(rt)
    fake.add(Fail(model="gpt-demo", status=503, times=2))
    rt.session("bob", agent="billing", channel="chat").send("Why was I charged twice?")
    rt.session("carol", agent="support", channel="chat").send("Can I change my address?")
    _wait(narrator, "provider:degraded")
    screen.wait_for("bob", "carol")
    narrator.say(
        "   While it is degraded a new message gets a static reply at once, with no model "
        "call. The chat bridge is down too, so that reply waits in the dead-letter queue."
    )
    screen.down = True
    rt.session("dave", agent="billing", channel="chat").send("Is anyone there?")
    _wait(narrator, "announcement:dead_lettered")
    screen.down = False
    narrator.say("   The bridge is back. No failure for a whole health window: recovery ...")
    _wait(narrator, "provider:recovered", timeout=30)
    _wait(narrator, "announcement:dead_letter_delivered")
    screen.wait_for("dave")


def _outlive_the_health_window(rt: Runtime) -> None:
    """Wait until scene 2's stall has left the health window: otherwise it counts as one
    of the two agents' failures, and billing's 503 alone degrades the provider."""
    failed = [
        record.ts
        for record in rt.store.read_stream("provider:main")
        if isinstance(record.event, ProviderCallFailed)
    ]
    if failed:
        wait = max(failed) + HEALTH_WINDOW_MS / 1000 - SystemClock().now()
        if wait > 0:
            time.sleep(wait + 0.1)  # real time: the demo's runtime runs on the system clock


async def _hang(report: RunReport) -> str:
    """A sub-agent's work that never returns (the watchdog must end it)."""
    report.progress(tokens=40, step=1)
    await anyio.sleep_forever()
    return ""  # never reached


class _HalfDone:
    """A job that saves part of its work and hangs the first time, and finishes from
    where it stopped the second time (as a respawn told to continue would)."""

    def __init__(self) -> None:
        self.attempts = 0

    async def __call__(self, report: RunReport) -> str:
        self.attempts += 1
        if self.attempts == 1:
            report.progress(tokens=300, step=1)
            report.artifact("notes/summary-part-1.md", hashlib.sha256(b"part 1").hexdigest())
            await anyio.sleep_forever()
        report.progress(tokens=520, step=2)
        return "Incident summary: written (part 1 reused, part 2 added)."


def _watchdog(rt: Runtime, fake: FakeProvider, screen: Screen, narrator: Narrator) -> None:
    narrator.scene(
        4,
        "A sub-agent that never returns",
        "Every spawn has a timeout, no exceptions (here a custom 2 s, with its reason). "
        "The watchdog force-fails the run at its deadline and the user gets a static notice. "
        "The recovery protocol respawns it once with what it recorded; when the second "
        "attempt hangs too, it escalates instead of looping.",
    )
    seen = len(screen.shown)
    rt.spawn(
        "alice",
        "Summarize ticket #88 for the team",
        custom_timeout_ms=2000,
        reason="demo: a short budget",
        work=_hang,
        channel="chat",
        conversation="alice",
    )
    _wait(narrator, "subagent:watchdog_timeout")
    screen.wait_count(seen + 1)
    if not narrator.wait_where(_escalated, timeout=20):
        raise StalwartError("demo: the hung sub-agent was not escalated after two attempts")
    screen.wait_count(seen + 2)


def _escalated(record: RecordedEvent) -> bool:
    event = record.event
    return isinstance(event, SubagentRecoveryDecided) and event.action == "escalate"


def _ghost(rt: Runtime, fake: FakeProvider, screen: Screen, narrator: Narrator) -> None:
    narrator.scene(
        5,
        "A run left behind by a crash",
        "Another process starts a sub-agent run and is killed with SIGKILL. Nobody is left "
        "to time it out, but the ghost sweep reads every run from the log and force-fails "
        "it after its limit plus the grace (1 s + 1 s here; limit + 120 s by default). "
        "The recovery protocol then respawns it, model-driven, told where it stopped.",
    )
    fake.add(Answer(model="gpt-demo", text="Invoices reconciled: two duplicate charges found."))
    argv = [sys.executable, "-c", CRASHING_PROCESS, rt.store.location, new_id()]
    crashed = subprocess.run(argv, capture_output=True, check=False, timeout=30)
    if crashed.returncode != -signal.SIGKILL:
        raise StalwartError("demo: the crashing process did not die as planned")
    narrator.say("   (the process that owned the run was killed with SIGKILL)")
    _wait(narrator, "subagent:ghost_swept")
    screen.wait_for("erin")
    if not narrator.wait_where(_settled(narrator, "Reconcile"), timeout=30):
        raise StalwartError("demo: the swept run's recovery did not settle")
    screen.wait_text("Invoices reconciled")


def _settled(narrator: Narrator, task: str) -> Callable[[RecordedEvent], bool]:
    """Whether the runs of ``task`` have settled: one succeeded, or they were escalated."""

    def settled(record: RecordedEvent) -> bool:
        runs = {
            r.stream
            for r in narrator.seen
            if isinstance(r.event, SubagentSpawned) and r.event.task.startswith(task)
        }
        if record.stream not in runs:
            return False
        event = record.event
        if isinstance(event, SubagentCompleted):
            return event.outcome == "succeeded"
        return isinstance(event, SubagentRecoveryDecided) and event.action == "escalate"

    return settled


def _recovery(rt: Runtime, fake: FakeProvider, screen: Screen, narrator: Narrator) -> None:
    narrator.scene(
        6,
        "Recovery: resume, do not restart",
        "A sub-agent saves part of its work and then hangs. After the watchdog, the "
        "recovery protocol reads what the run recorded and respawns it with continuation "
        "context instead of starting over.",
    )
    rt.spawn(
        "alice",
        "Write the incident summary",
        custom_timeout_ms=2000,
        reason="demo: a short budget",
        work=_HalfDone(),
        channel="chat",
        conversation="alice",
    )

    def resumed(record: RecordedEvent) -> bool:
        event = record.event
        return isinstance(event, SubagentRecoveryDecided) and event.action == "respawn_continue"

    if not narrator.wait_where(resumed, timeout=20):
        raise StalwartError("demo: the recovery protocol did not resume the run")
    screen.wait_text("Incident summary", timeout=30)


def _pause(rt: Runtime, fake: FakeProvider, screen: Screen, narrator: Narrator) -> None:
    pause_scene(7, rt, fake, narrator)
    screen.wait_text("12.50 is back")


def _crash(rt: Runtime, fake: FakeProvider, screen: Screen, narrator: Narrator) -> None:
    crash_scene(8, rt, fake, narrator)
    screen.wait_for("heidi")


SCENES: tuple[Scene, ...] = (
    _normal,
    _stall,
    _outage,
    _watchdog,
    _ghost,
    _recovery,
    _pause,
    _crash,
)


#: The file that marks a store directory as the demo's own (only such a one is replaced).
MARKER = "stalwart-demo"


def _prepare(directory: Path) -> None:
    """A fresh store directory, marked as the demo's: a previous demo's (marked) is
    emptied, an empty one used, anything else refused (a real store looks like a demo's
    but for the mark). One that cannot be made (under a file, on a read-only mount, a
    dangling link) is a StalwartError naming the directory."""
    try:
        _make_fresh(directory)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise StalwartError(f"cannot make the demo's store at {directory}: {why}") from None


#: what a previous demo leaves in its directory, and nothing else
DEMO_FILES = frozenset({MARKER, "data.mdb", "lock.mdb"})


def _make_fresh(directory: Path) -> None:
    if directory.exists() and not directory.is_dir():
        raise StalwartError(f"{directory} is not a directory; pass --store DIR")
    if directory.exists():
        found = {p.name for p in directory.iterdir()}
        if found and (MARKER not in found or found - DEMO_FILES):
            raise StalwartError(
                f"{directory} exists and is not a previous demo's store; pass --store DIR "
                "naming a new directory"
            )
        # emptied in place, not removed and made again: a directory reached through a
        # link (or whose mode the user chose) stays where and what it is; the marker is
        # kept, so a run stopped halfway still leaves the demo's own directory
        for name in sorted(found - {MARKER}):
            (directory / name).unlink()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).write_text("made by `stalwart demo`, which may replace it\n")


def _config(base_url: str) -> Config:
    return parse_config(
        tomllib.loads(CONFIG.format(base_url=base_url, health_window_ms=HEALTH_WINDOW_MS)),
        source="demo",
    )


def play(directory: Path, output: Output | None = None) -> None:
    """Run every scene against a fresh store in ``directory`` (made by :func:`_prepare`);
    the ones after the reader of ``output`` went away are not played."""
    output = output or Output()
    screen = Screen(output=output)
    with FakeProvider() as fake:
        fake.set_default(Answer(text="I am here to help."))
        config = _config(fake.base_url)
        with Runtime(config, store=os.fspath(directory), channels={"chat": screen}) as rt:
            narrator = Narrator(rt.store, output=output).start()
            try:
                for scene in SCENES:
                    if output.gone.is_set():  # `stalwart demo | head`: nobody reads on
                        break
                    scene(rt, fake, screen, narrator)
            finally:
                narrator.stop()


@cli.command()
@click.pass_obj
def demo(state: _State) -> None:
    """A guided tour of every failure layer, against a local fake provider (15-20 s)."""
    parent = click.get_current_context().parent
    if parent is not None and parent.params.get("log_level") == "warning":
        configure_logging("critical")  # the narration tells the story; logs would repeat it
    location = _demo_location(state)
    if "://" in location:
        raise StalwartError("the demo writes a directory of its own; pass --store DIR")
    directory = Path(location)
    _prepare(directory)  # before the banner: a directory it cannot make is one error line
    output = Output()
    say = output.say
    say("stalwart demo: the failure layers, live, with no key and no network", bold=True)
    say(f"The event log goes to {escaped(str(directory))}/.")
    terminated: list[int] = []
    previous = signal.signal(signal.SIGTERM, partial(_as_interrupt, terminated))
    try:
        play(directory, output)
    except KeyboardInterrupt:
        if terminated:  # the runtime closed and recorded its stop, as for Ctrl-C
            sys.exit(128 + signal.SIGTERM)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    say()
    say("Every step above is an event in the log. Inspect it:", bold=True)
    for line in inspect_lines(directory):
        say(line)


def _demo_location(state: _State) -> str:
    """``--store DIR`` from the command line, else ``./stalwart-demo``; never
    ``STALWART_STORE``, which names the user's own store: the demo would make its
    throwaway store there (one the next demo empties, whatever was written to it since),
    or refuse it, asking for a --store nobody gave."""
    context = click.get_current_context().parent
    source = context.get_parameter_source("location") if context is not None else None
    if source is ParameterSource.ENVIRONMENT:
        return DEFAULT_DIR
    return state.location or DEFAULT_DIR


def _as_interrupt(terminated: list[int], signum: int, frame: FrameType | None) -> None:
    """SIGTERM (``timeout``, a supervisor) stops the tour as Ctrl-C does: the runtime
    closes and records ``runtime:stopped``, rather than dying with its log left open."""
    terminated.append(signum)
    raise KeyboardInterrupt


def inspect_lines(directory: Path) -> list[str]:
    """The commands that inspect the demo's log, each one to copy as it is: the store's
    path quoted for the shell (a space in it), its control characters shown escaped."""
    store = f"--store {escaped(shlex.quote(str(directory)))}"
    return [
        f"  stalwart {store} tail                        # everything, in order",
        f"  stalwart {store} tail --type 'provider:*'    # the outage",
        f"  stalwart {store} replay session:alice        # one conversation's state",
        f"  stalwart {store} incidents                   # failures per provider/model",
        f"  stalwart {store} status grace                # a session's leases and pauses",
        f"  stalwart {store} replay --all --verify       # every decision re-derived",
    ]
