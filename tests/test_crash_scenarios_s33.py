"""End-to-end crash scenarios (session 33 review): a worker process SIGKILLed at many
points of a turn that calls a tool and spawns a sub-agent, then restarted; checked from
the log alone after each restart.

The promise (docs/resilience.md, docs/sessions.md): nothing acknowledged is lost; every
accepted user message gets its answer once or one plain static failure text; no reply is
delivered twice by a process (a send a kill cut short before its outcome was recorded is
sent again by the next one, with the same idempotency key); no session is left silently
stuck (a held lease, a running turn); a tool's effect happens at most once;
``replay --verify`` finds no mismatch.

The worker is this module run as a child (``python -m tests.test_crash_scenarios_s33
STORE BASE_URL DIR CLOCK SECTIONS``): a Runtime on the LMDB store at STORE, on the real
clock or on a FakeClock at CLOCK, with the config sections SECTIONS (JSON), its channel
appending every delivery to ``DIR/said.log`` and its tool's effects to
``DIR/effects.log``, so the parent sees what every process did. The restart that
finishes the work is a Runtime in this process on a FakeClock past the dead worker's
lease.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pykka
import pytest
import structlog

from stalwart import store as store_module
from stalwart.actors import GAVE_UP_TEXT
from stalwart.channels import Delivery, OutboundMessage
from stalwart.cli._replay import verify_store
from stalwart.clock import Clock, FakeClock, SystemClock
from stalwart.config import Config, parse_config
from stalwart.errors import ChannelError
from stalwart.events import (
    ActivationAbandoned,
    ActivationAcked,
    ActivationCancelled,
    ActivationReady,
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementSendFailed,
    MessageAppended,
    RecordedEvent,
    SubagentSpawned,
)
from stalwart.runtime import Runtime, send_message
from stalwart.state import ACTIVATIONS, DEADLETTER, RUN, SESSION, fold
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, FakeToolCall
from stalwart.tools import ToolRegistry, current_call

from ._runtime_support import flush, reap, sigkill

ROOT = Path(__file__).resolve().parent.parent
WAIT = 30.0  # real seconds a child may take to reach a point, or a restart to settle
pytestmark = pytest.mark.slow  # worker processes started, killed and restarted

ANSWER = "the answer after all"
SUB_ANSWER = "the formatted report"
ASK = "please charge order 7 and format the report"


# -- the worker process -------------------------------------------------------------------------


class SaidChannel:
    """Every delivery, appended to ``said.log`` (one line, one ``write``): pid, kind,
    conversation, idempotency key, text. Scripted from files beside it: ``fail_sends``
    (how many sends still fail), ``send_hold`` (how many seconds a send waits before it
    is made: the process can be killed meanwhile)."""

    def __init__(self, name: str, directory: Path) -> None:
        self.name = name
        self._directory = directory

    async def send(self, message: OutboundMessage) -> Delivery:
        failing = self._directory / "fail_sends"
        left = int(failing.read_text()) if failing.exists() else 0
        if left:
            failing.write_text(str(left - 1))
            raise ChannelError(
                "scripted failure", kind="server_error", retryable=True, channel=self.name
            )
        hold = self._directory / "send_hold"
        if hold.exists():
            await anyio.sleep(float(hold.read_text()))  # real-time: a kill lands meanwhile
        fields = (os.getpid(), message.kind, message.conversation, message.idempotency_key)
        line = "\t".join(map(str, fields)) + "\t" + message.text.replace("\n", " ") + "\n"
        with open(self._directory / "said.log", "a") as out:
            out.write(line)
        return Delivery(channel=self.name)

    async def aclose(self) -> None:
        return None


def tools_of(directory: Path) -> ToolRegistry:
    """``charge(order)``: its effect (a line in ``effects.log``) with the call's key."""
    tools = ToolRegistry()

    @tools.register
    def charge(order: int) -> str:
        """Charge an order."""
        key = current_call().idempotency_key
        with open(directory / "effects.log", "a") as out:
            out.write(f"charge\t{key}\n")
        return f"charged {order}"

    return tools


def config(base_url: str, **sections: Any) -> Config:
    agent = {
        "provider": "main",
        "model": "m1",
        "max_retries": 0,
        "prompt_timeout_ms": 60_000,
        "retry_prompt_timeout_ms": 60_000,
        "subagents": True,
    }
    return parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": base_url}},
            "agents": {"default": agent},
            **sections,
        }
    )


def runtime(
    store: str, base_url: str, directory: Path, clock: Clock, sections: dict[str, Any]
) -> Runtime:
    chat = SaidChannel("chat", directory)
    return Runtime(
        config(base_url, **sections),
        store=store,
        clock=clock,
        channels={"chat": chat},  # type: ignore[dict-item]
        tools=tools_of(directory),
    )


def child_main(store: str, base_url: str, directory: Path, start: str, sections: str) -> None:
    """Run a worker until SIGKILL; say ``ready`` once it runs."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    clock: Clock = SystemClock() if start == "real" else FakeClock(start=float(start))
    with runtime(store, base_url, directory, clock, json.loads(sections)) as rt:
        os.write(1, b"ready\n")
        if (directory / "crash_agent").exists():
            crash_until_given_up(rt)
        threading.Event().wait()  # until SIGKILL


def crash_until_given_up(rt: Runtime) -> None:
    """Crash session ``s1``'s Agent (a message it does not understand) each time it runs
    again, until supervision gives up on it."""
    session = rt.session("s1", channel="chat")
    give_up = time.monotonic() + WAIT
    while not any(r.type == "supervisor:gave_up" for r in rt.store.read_stream("runtime")):
        assert time.monotonic() < give_up
        with contextlib.suppress(pykka.ActorDeadError):
            session.ref.tell(object())
        time.sleep(0.02)  # real-time: the restart's backoff runs on the real clock


# -- driving it from the test -------------------------------------------------------------------


class Worker:
    """One worker child process."""

    def __init__(
        self,
        store: Path,
        fake: FakeProvider,
        directory: Path,
        start: str = "real",
        sections: dict[str, Any] | None = None,
    ) -> None:
        args = [str(store), fake.base_url, str(directory), start, json.dumps(sections or {})]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.test_crash_scenarios_s33", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            assert sel.select(WAIT), "the worker never started"
        line = self.proc.stdout.readline()
        assert line == "ready\n", (line, self.proc.stderr and self.proc.stderr.read())

    def kill(self) -> None:
        sigkill(self.proc, WAIT)

    def reap(self) -> None:
        reap(self.proc, WAIT)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.reap()


def kill_when(
    store_dir: Path, worker: Worker, reached: Callable[[list[RecordedEvent]], bool]
) -> int:
    """SIGKILL ``worker`` as soon as the log (all of it) satisfies ``reached``; the
    head the kill was decided at."""
    give_up = time.monotonic() + WAIT
    with store_module.open(store_dir, read_only=True) as reader:
        while True:
            head = reader.head()
            records = list(reader.read_all()) if head else []
            if reached(records):
                worker.kill()
                return head
            assert worker.proc.poll() is None, "the worker died by itself"
            assert time.monotonic() < give_up, f"never reached: {[r.type for r in records]}"
            reader.wait_for(head + 1, 0.05)


def count(
    kind: str, n: int = 1, stream: str | None = None
) -> Callable[[list[RecordedEvent]], bool]:
    """At least ``n`` events of type ``kind`` (in ``stream``, or a run's stream when it
    is ``"run"``)."""

    def reached(records: list[RecordedEvent]) -> bool:
        runs = {r.stream for r in records if isinstance(r.event, SubagentSpawned)}
        found = [
            r
            for r in records
            if r.type == kind
            and (stream is None or r.stream == stream or (stream == "run" and r.stream in runs))
        ]
        return len(found) >= n

    return reached


def last_ts(store_dir: Path) -> float:
    with store_module.open(store_dir, read_only=True) as store:
        return max(record.ts for record in store.read_all())


def settled_everywhere(store: EventStore) -> bool:
    """No session with work queued or a lease, no turn running, no run running, every
    announcement with an outcome (a give-up notice of the ``runtime`` stream too),
    nothing left in the dead letters."""
    if fold(DEADLETTER, "deadletter", store.read_stream("deadletter")).entries:
        return False
    if unsent(list(store.read_stream("runtime"))):
        return False
    for info in store.streams():
        if not info.stream.startswith("session:"):
            continue
        records = list(store.read_stream(info.stream))
        if isinstance(records[0].event, SubagentSpawned):
            run = fold(RUN, info.stream, records)
            if run.status == "running":
                return False
        else:
            activations = fold(ACTIVATIONS, info.stream, records)
            if activations.queue or activations.lease is not None:
                return False
            if fold(SESSION, info.stream, records).status == "running":
                return False
        if unsent(records):
            return False
    return True


def unsent(records: list[RecordedEvent]) -> set[str]:
    queued = {r.event.announcement_id for r in records if isinstance(r.event, AnnouncementQueued)}
    ended = {
        r.event.announcement_id
        for r in records
        if isinstance(r.event, AnnouncementDelivered | AnnouncementSendFailed)
    }
    return queued - ended


def restart(
    store_dir: Path,
    fake: FakeProvider,
    directory: Path,
    *,
    after_s: float = 31.0,
    sections: dict[str, Any] | None = None,
) -> None:
    """A runtime in this process on a FakeClock ``after_s`` past the log's end, its clock
    moved on (a second a step) until everything has stayed settled for a minute of it,
    including a run the kill orphaned (the ghost sweep ends it: its limit and grace are
    minutes of fake time) and the attempt its recovery respawns."""
    clock = FakeClock(start=last_ts(store_dir) + after_s)
    with runtime(str(store_dir), fake.base_url, directory, clock, sections or {}) as rt:
        give_up = time.monotonic() + WAIT
        quiet = 0
        while quiet < 60:
            assert time.monotonic() < give_up, "the restart never settled the work"  # real-time
            clock.advance(1.0)
            flush(rt.portal)
            time.sleep(0.005)  # real-time: the outcome is handled on other threads
            quiet = quiet + 1 if settled_everywhere(rt.store) else 0


def said(directory: Path) -> list[list[str]]:
    path = directory / "said.log"
    if not path.exists():
        return []
    return [line.split("\t", 4) for line in path.read_text().splitlines()]


def check_invariants(store_dir: Path, directory: Path, acknowledged: list[str]) -> None:
    """The promise, read from the log and from what the channel and the tool saw."""
    with store_module.open(store_dir, read_only=True) as store:
        assert settled_everywhere(store)
        ready: dict[str, ActivationReady] = {}
        settled: Counter[str] = Counter()
        users: Counter[str] = Counter()
        asked: Counter[str] = Counter()  # user messages, by session
        for info in store.streams():
            for record in store.read_stream(info.stream):
                event = record.event
                if isinstance(event, ActivationReady):
                    ready[event.activation_id] = event
                    asked[info.stream.removeprefix("session:")] += event.kind == "message"
                elif isinstance(event, ActivationAcked | ActivationAbandoned | ActivationCancelled):
                    settled[event.activation_id] += 1
                elif isinstance(event, MessageAppended) and event.role == "user":
                    users[event.message_id] += 1
        assert set(acknowledged) <= set(ready), "an acknowledged message is missing"
        assert settled == Counter(dict.fromkeys(ready, 1)), "a wake was settled twice or never"
        assert all(n == 1 for n in users.values()), users
        report = verify_store(store, None)
        assert report.findings == (), [f"{f.kind} {f.tag}: {f.message}" for f in report.findings]
    lines = said(directory)
    # a message is sent once by each process at most; a send a kill cut short before its
    # outcome was recorded is sent again by the next process with the same key and text
    # (at least once across a crash: a receiver drops the copy by its key)
    keys = Counter((pid, key) for pid, _, _, key, _ in lines)
    assert all(n == 1 for n in keys.values()), f"a message was delivered twice: {lines}"
    texts = {key: text for _, _, _, key, text in lines}
    assert all(texts[key] == text for _, _, _, key, text in lines), lines
    lines = list({key: line for line in lines for key in [line[3]]}.values())
    answered = Counter(
        conversation
        for _, kind, conversation, _, text in lines
        if kind in ("reply", "failure_notice") and not text.startswith("Sub-agent")
    )
    assert answered == +asked, f"not one answer per message: {lines}"
    effects = directory / "effects.log"
    charged = effects.read_text().splitlines() if effects.exists() else []
    assert len(charged) == len(set(charged)), f"a tool's effect happened twice: {charged}"


# -- the sweep: a kill at many points of a turn with a tool and a sub-agent -------------------

#: the kill points, named by what the log holds when the worker is killed
KILL_POINTS: dict[str, Callable[[list[RecordedEvent]], bool]] = {
    "leased": count("activation:leased", stream="session:s1"),
    "first_call": count("prompt:started", stream="session:s1"),
    "tool_started": count("tool:started", stream="session:s1"),
    "spawned": count("subagent:spawned"),
    "run_calls_its_model": count("prompt:started", stream="run"),
    "run_answered": count("subagent:completed"),
    "second_call": count("prompt:started", 2, stream="session:s1"),
}


def script(fake: FakeProvider) -> None:
    """The parent's model calls ``charge`` and ``spawn_subagent`` together; the run's
    model answers; every call after that answers with :data:`ANSWER`. A small delay on
    each call leaves room for a kill between the steps."""
    calls = (
        FakeToolCall(id="c1", name="charge", arguments={"order": 7}),
        FakeToolCall(
            id="c2",
            name="spawn_subagent",
            arguments={"task": "format the report", "task_class": "formatting"},
        ),
    )
    fake.add(Answer(text="", tool_calls=calls, first_delay_ms=150))
    fake.add(Answer(text=SUB_ANSWER, first_delay_ms=150))
    fake.set_default(Answer(text=ANSWER, first_delay_ms=150))


@pytest.mark.parametrize("point", sorted(KILL_POINTS))
def test_a_kill_at_any_point_of_a_turn_with_a_tool_and_a_run_keeps_the_promise(
    point: str, tmp_path: Path, workers: list[Worker]
) -> None:
    store_dir = tmp_path / "store"
    with FakeProvider() as fake:
        script(fake)
        worker = Worker(store_dir, fake, tmp_path)
        workers.append(worker)
        with store_module.open(store_dir) as store:
            acknowledged = [send_message(store, "s1", ASK, channel="chat")]
        kill_when(store_dir, worker, KILL_POINTS[point])
        fake.set_default(Answer(text=ANSWER))
        restart(store_dir, fake, tmp_path)
    check_invariants(store_dir, tmp_path, acknowledged)


# -- a kill while the answer is being sent, or while the dead letters send it ----------------


def test_a_kill_while_the_answer_is_sent_delivers_it_once_after_the_restart(
    tmp_path: Path, workers: list[Worker]
) -> None:
    """The answer is queued and acked with its turn; its send is under way (the channel
    holds it) when the worker dies. The restart sends it again once that send could no
    longer be under way, with the same idempotency key: the user gets it once."""
    store_dir = tmp_path / "store"
    with FakeProvider() as fake:
        fake.set_default(Answer(text=ANSWER))
        (tmp_path / "send_hold").write_text("60")
        worker = Worker(store_dir, fake, tmp_path)
        workers.append(worker)
        with store_module.open(store_dir) as store:
            acknowledged = [send_message(store, "s1", ASK, channel="chat")]
        kill_when(store_dir, worker, count("announcement:queued", stream="session:s1"))
        (tmp_path / "send_hold").unlink()
        restart(store_dir, fake, tmp_path)
    check_invariants(store_dir, tmp_path, acknowledged)


def test_a_kill_while_the_dead_letters_retry_the_answer_delivers_it_once_after_the_restart(
    tmp_path: Path, workers: list[Worker]
) -> None:
    """The answer's send fails, so it is dead-lettered; the queue's retry is under way
    (the channel holds it) when the worker dies. The restart's queue leaves the dead
    runtime's send alone for its timeout and grace, then retries it: the user gets the
    answer once, and the queue is empty."""
    store_dir = tmp_path / "store"
    sections = {"dead_letters": {"retry_base_ms": 200, "retry_cap_ms": 400}}
    with FakeProvider() as fake:
        fake.set_default(Answer(text=ANSWER))
        (tmp_path / "fail_sends").write_text("1")
        (tmp_path / "send_hold").write_text("60")
        worker = Worker(store_dir, fake, tmp_path, sections=sections)
        workers.append(worker)
        with store_module.open(store_dir) as store:
            acknowledged = [send_message(store, "s1", ASK, channel="chat")]
        kill_when(store_dir, worker, count("announcement:dead_letter_retried"))
        (tmp_path / "send_hold").unlink()
        restart(store_dir, fake, tmp_path, sections=sections)
    check_invariants(store_dir, tmp_path, acknowledged)


# -- two kills in a row, and fewer processes after the crash ---------------------------------


@pytest.mark.parametrize(
    "second",
    ["leased_again", "model_again", "answer_queued_again"],
)
def test_a_kill_during_the_recovery_of_a_kill_still_keeps_the_promise(
    second: str, tmp_path: Path, workers: list[Worker]
) -> None:
    """The worker dies with the tool and the run started; the worker that takes the
    wake over dies too, at one of several points of its recovery; a third one finishes."""
    store_dir = tmp_path / "store"
    points = {
        "leased_again": count("activation:leased", 2, stream="session:s1"),
        "model_again": count("prompt:started", 2, stream="session:s1"),
        "answer_queued_again": count("announcement:queued", stream="session:s1"),
    }
    with FakeProvider() as fake:
        script(fake)
        first = Worker(store_dir, fake, tmp_path)
        workers.append(first)
        with store_module.open(store_dir) as store:
            acknowledged = [send_message(store, "s1", ASK, channel="chat")]
        kill_when(store_dir, first, KILL_POINTS["run_calls_its_model"])
        if second == "answer_queued_again":
            (tmp_path / "send_hold").write_text("60")
        # on a FakeClock past the first worker's lease and past the orphaned run's limit
        # and ghost grace: it takes the wake over at once, and its supervisor's first
        # sweep ends that run and respawns it, which the turn's reconciled
        # ``spawn_subagent`` call waits for (its clock does not move on its own)
        then = Worker(store_dir, fake, tmp_path, repr(last_ts(store_dir) + 600))
        workers.append(then)
        kill_when(store_dir, then, points[second])
        (tmp_path / "send_hold").unlink(missing_ok=True)
        fake.set_default(Answer(text=ANSWER))
        restart(store_dir, fake, tmp_path)
    check_invariants(store_dir, tmp_path, acknowledged)


def test_two_workers_killed_mid_turns_then_one_finishes_every_session(
    tmp_path: Path, workers: list[Worker]
) -> None:
    """Two worker processes share six sessions and both die with turns in flight (tools
    and runs started); a single process restarted on the log answers each message once."""
    store_dir = tmp_path / "store"
    with FakeProvider() as fake:
        script(fake)
        fake.add(*[Answer(text="", tool_calls=(
            FakeToolCall(id="c1", name="charge", arguments={"order": n}),
        ), first_delay_ms=150) for n in range(5)])  # fmt: skip
        pair = [Worker(store_dir, fake, tmp_path), Worker(store_dir, fake, tmp_path)]
        workers.extend(pair)
        with store_module.open(store_dir) as store:
            acknowledged = [
                send_message(store, f"s{n}", f"{ASK} ({n})", channel="chat") for n in range(6)
            ]
        kill_when(store_dir, pair[0], count("tool:started", 4))
        pair[1].kill()
        fake.set_default(Answer(text=ANSWER))
        restart(store_dir, fake, tmp_path)
    check_invariants(store_dir, tmp_path, acknowledged)


# -- a kill while supervision's give-up notice is sent -----------------------------------------


# Was: DEFECT: a give-up notice cut short by a crash was never resent
def test_a_kill_while_the_give_up_notice_is_sent_sends_it_after_the_restart(
    tmp_path: Path, workers: list[Worker]
) -> None:
    """Session ``s1``'s Agent keeps crashing and supervision gives up on it: the static
    ``GAVE_UP_TEXT`` is queued in the ``runtime`` stream and its send is under way (the
    channel holds it) when the process dies. The next runtime on the log sends it, once."""
    store_dir = tmp_path / "store"
    with FakeProvider() as fake:
        (tmp_path / "crash_agent").touch()
        (tmp_path / "send_hold").write_text("60")
        worker = Worker(store_dir, fake, tmp_path)
        workers.append(worker)
        kill_when(store_dir, worker, count("announcement:queued", stream="runtime"))
        (tmp_path / "send_hold").unlink()
        (tmp_path / "crash_agent").unlink()
        restart(store_dir, fake, tmp_path)
    with store_module.open(store_dir, read_only=True) as store:
        left = unsent(list(store.read_stream("runtime")))
    assert [text for *_, text in said(tmp_path)] == [GAVE_UP_TEXT]
    assert left == set()


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4], sys.argv[5])
