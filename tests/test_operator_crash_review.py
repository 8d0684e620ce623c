"""An operator after a crash: the agent's process is SIGKILLed at a bad moment (a model
stream flowing, a retry's backoff, a tool call running, a pause for an approval, a
sub-agent running, an answer in the dead letters), then the operator reads the store with
every read command and restarts a runtime on it.

What must hold (docs/resilience.md, docs/sessions.md, docs/replay.md, seeds 000/002/003):
what the read commands show is true (no false ``running``, no lost or doubled event, no
traceback, no API key), and the restart resumes or closes the turn, tells the user once,
fences the dead holder out, and leaves a log that ``replay --verify`` finds clean.

The dead process is a real child (``tests/_operator_crash_child.py``) on a FakeClock,
talking to a real loopback FakeProvider with an API key; the restart is a Runtime in
this process on a FakeClock that starts where the log ends (or later: the operator came
back after a while).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.actors import ABANDONED_TEXT, APPROVAL_TEXT, SWEPT_SENTENCE
from stalwart.channels import MemoryChannel
from stalwart.cli import cli
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.events import (
    ActivationAcked,
    ActivationLeased,
    AnnouncementQueued,
    LeaseExpired,
    MessageAppended,
    SubagentGhostSwept,
    SubagentRecoveryDecided,
    SubagentSpawned,
    ToolFailed,
    ToolStarted,
    TurnCompleted,
)
from stalwart.runtime import Runtime
from stalwart.testing import Answer, Fail, FakeProvider, FakeToolCall, Hang, Trickle

from . import _operator_crash_child as child
from ._runtime_support import advance_until, flush, reap, settled, sigkill

KEY = "sk-operator-crash-SECRET-7f3a9c"
WAIT = 30.0
ROOT = Path(__file__).resolve().parent.parent
ANSWER = "the answer after the restart"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeProvider]:
    monkeypatch.setenv(child.KEY_ENV, KEY)
    with FakeProvider(api_key=KEY) as provider:
        provider.set_default(Answer(text=ANSWER))
        yield provider


def crash(
    tmp_path: Path, fake: FakeProvider, scenario: str, *, ago_s: float = 0.0, deltas: int = 0
) -> str:
    """Run the child to ``scenario``'s crash point, SIGKILL it; its ``ready`` value.

    ``ago_s``: the child's clock starts that long before now (the crash happened a while
    before the operator looks). ``deltas``: wait for that many streamed deltas first."""
    env = {**os.environ, child.KEY_ENV: KEY, "MARKER": str(tmp_path / "marker")}
    store_dir = tmp_path / "store"
    t0 = time.time() - ago_s
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests._operator_crash_child", str(store_dir), fake.base_url,
         scenario, repr(t0)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(WAIT), "the child never reached its crash point"
        said = json.loads(proc.stdout.readline() or "{}")
        assert "ready" in said, (said, proc.stderr and proc.stderr.read())
        if deltas:
            fake.wait_for(lambda rs: bool(rs) and rs[0].deltas_sent >= deltas, WAIT)
        sigkill(proc, WAIT)
    finally:
        reap(proc, WAIT)
    return str(said["ready"])


def read(store_dir: Path, *args: str, exit_code: int = 0) -> str:
    """One read command, checked the way an operator would want every one: one exit
    code, no traceback, no API key, nothing written to the store."""
    with store_module.open(store_dir, read_only=True) as store:
        head = store.head()
    result = CliRunner().invoke(cli, ["--store", str(store_dir), *args])
    shown = result.output + result.stderr
    assert "Traceback" not in shown, shown
    assert result.exception is None or isinstance(result.exception, SystemExit), shown
    assert KEY not in shown
    assert result.exit_code == exit_code, (args, shown)
    with store_module.open(store_dir, read_only=True) as store:
        assert store.head() == head  # reading wrote nothing
    return result.output


def read_everything(store_dir: Path, *, clean: bool = True) -> dict[str, str]:
    """Every read command, over the whole store and over session s1."""
    verify_exit = 0 if clean else 1
    for path in store_dir.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), f"the API key is in {path}"
    return {
        "status": read(store_dir, "status"),
        "status_json": read(store_dir, "status", "--json"),
        "status_s1": read(store_dir, "status", "s1"),
        "status_s1_json": read(store_dir, "status", "s1", "--json"),
        "activations": read(store_dir, "activations", "--json"),
        "tail": read(store_dir, "tail"),
        "tail_json": read(store_dir, "tail", "--json"),
        "replay": read(store_dir, "replay", "session:s1", "--json"),
        "verify": read(store_dir, "replay", "--all", "--verify", exit_code=verify_exit),
        "verify_s1": read(store_dir, "replay", "session:s1", "--verify", exit_code=verify_exit),
        "incidents": read(store_dir, "incidents"),
        "streams": read(store_dir, "streams", "--json"),
    }


def last_ts(store_dir: Path) -> float:
    with store_module.open(store_dir, read_only=True) as store:
        return max(record.ts for record in store.read_all())


def restart(
    store_dir: Path,
    fake: FakeProvider,
    *,
    after_s: float = 1.0,
    messages: int = 1,
    retrying: bool = False,
    tools: bool = True,
    then: Any = None,
    activations: dict[str, Any] | None = None,
    step_s: float = 0.5,
) -> tuple[list[Any], list[str]]:
    """A new runtime on the store, its clock ``after_s`` past the log's last event, moved
    on until ``messages`` reached the user, then ``then(rt, clock)`` while it still runs;
    (what the user got, tool runs)."""  # fmt: skip
    clock = FakeClock(start=last_ts(store_dir) + after_s)
    chat = MemoryChannel("chat")
    runs: list[str] = []
    config = child.config(fake.base_url, retrying=retrying, activations=activations)
    with Runtime(config, store=str(store_dir), clock=clock, channels={"chat": chat}) as rt:
        if tools:

            @rt.tool
            def charge(order: int) -> str:
                """Charge an order."""
                runs.append(f"charge {order}")
                return "charged"

            @rt.tool(needs_confirmation=True)
            def refund(order: int) -> str:
                """Refund an order."""
                runs.append(f"refund {order}")
                return f"refunded {order}"

        advance_until(clock, lambda: len(chat.attempted) >= messages, step_s)
        settled(rt.store, "s1")
        if then is not None:
            then(rt, clock)
    return list(chat.attempted), runs


def session_log(store_dir: Path, stream: str = "session:s1") -> list[Any]:
    with store_module.open(store_dir, read_only=True) as store:
        return list(store.read_stream(stream))


def of(kind: type, records: list[Any]) -> list[Any]:
    return [r.event for r in records if isinstance(r.event, kind)]


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# -- a model stream flowing -------------------------------------------------------------------


def test_a_kill_mid_stream_is_shown_as_it_is_and_answered_once_after_a_restart(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """SIGKILL while the model's reply trickles in. The operator sees the turn running
    under the dead worker's lease (until the TTL, then EXPIRED), every event once, a clean
    verify; the restart takes the lease over at the next epoch, closes the dead turn as
    ``interrupted``, answers once and fences the old holder out."""
    fake.add(Trickle(interval_ms=20, text="partial "))
    crash(tmp_path, fake, "stream", deltas=3)
    store_dir = tmp_path / "store"
    views = read_everything(store_dir)
    status = json.loads(views["status_s1_json"])
    assert status["status"] == "running"
    assert status["lease"]["epoch"] == 1
    assert status["lease"]["expired"] is False
    tail = json_lines(views["tail_json"])
    assert [r["position"] for r in tail] == list(range(1, len(tail) + 1))  # no gap, no double
    assert [r["type"] for r in tail].count("prompt:started") == 1

    attempted, _ = restart(store_dir, fake, after_s=31)
    assert [(m.kind, m.text) for m in attempted] == [("reply", ANSWER)]  # once, the answer
    records = session_log(store_dir)
    assert [e.epoch for e in of(ActivationLeased, records)] == [1, 2]
    [expired] = of(LeaseExpired, records)
    assert expired.epoch == 1
    [acked] = of(ActivationAcked, records)
    assert acked.epoch == 2
    outcomes = [(e.outcome, e.reason) for e in of(TurnCompleted, records)]
    assert outcomes == [("interrupted", "restart"), ("answered", None)]
    users = [e for e in of(MessageAppended, records) if e.role == "user"]
    assert len(users) == 1  # the user message joined the conversation once

    views = read_everything(store_dir)
    status = json.loads(views["status_s1_json"])
    assert (status["status"], status["lease"], status["backlog"]) == ("idle", None, [])
    assert "lease_expired" in views["activations"]


def test_a_kill_that_uses_up_the_attempts_closes_the_turn_and_tells_the_user_once(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """SIGKILL mid-stream, and the restart's ``max_attempts`` is 1: the expiry is the last
    failure, so the wake is abandoned, not run again. The user is told once, in static
    text (``ABANDONED_TEXT``), with no model call; ``status`` shows it in the dead letters
    with its error class; the log verifies clean."""
    fake.add(Trickle(interval_ms=20, text="partial "))
    crash(tmp_path, fake, "stream", deltas=2)
    store_dir = tmp_path / "store"
    requests = len(fake.requests)

    def linger(rt: Runtime, clock: FakeClock) -> None:
        for _ in range(5):  # past a resend's wait: nothing more is said
            clock.advance(10)
            flush(rt.portal)

    attempted, _ = restart(
        store_dir, fake, after_s=31, activations={"max_attempts": 1}, then=linger
    )
    assert [(m.kind, m.text) for m in attempted] == [("failure_notice", ABANDONED_TEXT)]
    assert len(fake.requests) == requests  # a static text: no model call
    records = session_log(store_dir)
    outcomes = [(e.outcome, e.reason) for e in of(TurnCompleted, records)]
    assert outcomes == [("failed", "abandoned")]
    views = read_everything(store_dir)
    status = json.loads(views["status_s1_json"])
    assert (status["status"], status["lease"], status["backlog"]) == ("idle", None, [])
    assert status["last_outcome"]["status"] == "abandoned"
    [dead] = json.loads(views["status_json"])["dead_letters"]["activations"]
    assert (dead["session"], dead["error_class"]) == ("session:s1", "lease_expired")


def test_a_restart_long_after_a_kill_mid_turn_verifies_clean(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """The same kill, but the operator restarts the worker 12 minutes later. The dead
    process's timers (the call's prompt timeout, the turn's execution timeout) went with
    it: docs/replay.md says a ``runtime:started`` drops them and such a deadline is "never
    flagged" ("a miss is never invented"). The recovered log is flagged for ever instead:
    ``replay --verify`` exits 1 with two MISSED DEADLINEs whose proof is the restart's own
    ``runtime:started``."""
    fake.add(Trickle(interval_ms=20, text="partial "))
    crash(tmp_path, fake, "stream", deltas=2)
    store_dir = tmp_path / "store"
    read_everything(store_dir)  # clean before the restart: the log's end cuts them off
    attempted, _ = restart(store_dir, fake, after_s=720)
    assert [m.text for m in attempted] == [ANSWER]
    with store_module.open(store_dir, read_only=True) as store:
        report = verify_store(store, None)
    missed = [(f.kind, f.tag, f.message) for f in report.findings]
    assert missed == [], missed


# -- a provider retry waiting out its backoff -------------------------------------------------


def test_a_kill_during_a_retry_backoff_counts_one_failed_call_and_is_answered_once(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """SIGKILL while a 503's retry waits out its backoff: the operator sees one failed call
    (not zero, not one per attempt), a healthy provider with its last failure, and the
    retry decision verified; the restart answers once with one more call."""
    fake.add(Fail(status=503))
    crash(tmp_path, fake, "backoff")
    store_dir = tmp_path / "store"
    views = read_everything(store_dir)
    assert "1 call, 1 failed" in views["incidents"]
    assert "prompt:retry_scheduled x1" in views["verify"]
    [provider] = json.loads(views["status_json"])["providers"]
    assert (provider["health"], provider["breaker"]) == ("healthy", "closed")
    assert provider["last_failure_at"] is not None

    attempted, _ = restart(store_dir, fake, after_s=31, retrying=True)
    assert [m.text for m in attempted] == [ANSWER]
    assert len(fake.requests) == 2  # the failed attempt, then the restart's one call
    views = read_everything(store_dir)
    assert "2 calls, 1 failed" in views["incidents"]


# -- a tool call running ----------------------------------------------------------------------


def test_a_kill_while_a_tool_runs_never_runs_it_again(tmp_path: Path, fake: FakeProvider) -> None:
    """SIGKILL after the tool made its effect and before it returned (a real process, not
    a log written by hand): the restart surfaces the call as ``unreconciled`` to the model
    and answers once; the effect happened exactly once."""
    charge = FakeToolCall(id="c1", name="charge", arguments={"order": 7})
    fake.add(Answer(text="", tool_calls=(charge,)))
    crash(tmp_path, fake, "tool")
    store_dir = tmp_path / "store"
    views = read_everything(store_dir)
    assert json.loads(views["status_s1_json"])["status"] == "running"
    assert [r["type"] for r in json_lines(views["tail_json"])].count("tool:started") == 1

    attempted, runs = restart(store_dir, fake, after_s=31)
    assert [m.text for m in attempted] == [ANSWER]
    assert runs == []  # no check registered: surfaced, not re-run
    assert (tmp_path / "marker").read_text() == "charged 7\n"  # the effect, once
    records = session_log(store_dir)
    assert len(of(ToolStarted, records)) == 1
    [failed] = of(ToolFailed, records)
    assert (failed.call_id, failed.error_class) == ("c1", "unreconciled")
    read_everything(store_dir)


# -- a pause for an approval -------------------------------------------------------------------


def test_a_kill_while_paused_for_approval_then_a_cli_confirm_runs_the_tool_once(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """SIGKILL while the session waits for a human: nothing is in flight, so the operator
    sees ``requires_action`` with the stored input and no lease (not ``running``). The
    operator allows it from the CLI with no process up; the restart runs the tool once with
    the stored input, does not ask again, and answers once."""
    refund = FakeToolCall(id="c1", name="refund", arguments={"order": 7})
    fake.add(Answer(text="", tool_calls=(refund,)))
    crash(tmp_path, fake, "approval", ago_s=600)
    store_dir = tmp_path / "store"
    views = read_everything(store_dir)
    status = json.loads(views["status_s1_json"])
    assert status["status"] == "requires_action"
    assert status["lease"] is None
    pending = status["pending"]
    assert (pending["kind"], pending["tool"], json.loads(pending["input"])) == (
        "approval", "refund", {"order": 7},
    )  # fmt: skip
    confirm = CliRunner().invoke(
        cli, ["--store", str(store_dir), "session", "confirm", "s1", pending["request_id"],
              "--allow"],
    )  # fmt: skip
    assert confirm.exit_code == 0, confirm.output

    attempted, runs = restart(store_dir, fake, after_s=1)
    assert runs == ["refund 7"]
    assert [m.text for m in attempted] == [ANSWER]  # no second approval request
    texts = [e.text for e in of(AnnouncementQueued, session_log(store_dir))]
    assert texts == [APPROVAL_TEXT, ANSWER]
    views = read_everything(store_dir)
    assert json.loads(views["status_s1_json"])["status"] == "idle"


# -- a sub-agent running -------------------------------------------------------------------------


def _run_streams(store_dir: Path) -> list[str]:
    with store_module.open(store_dir, read_only=True) as store:
        return [
            info.stream
            for info in store.streams()
            if info.stream.startswith("session:")
            and isinstance(next(iter(store.read_stream(info.stream))).event, SubagentSpawned)
        ]


def test_a_model_driven_run_swept_after_a_kill_is_not_shown_running(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """SIGKILL while a model-driven sub-agent's call hangs. The restart's ghost sweep ends
    the run and tells the user it was ended; ``replay`` says ``swept``. ``status`` still
    lists that run as ``running`` (its sub-session's turn is open), and the respawned run
    that succeeded as an ``idle`` session; cli.md/sessions.md: a run's stream (it starts
    with ``subagent:spawned``) shows as ``run``."""
    fake.add(Hang())
    run_id = crash(tmp_path, fake, "subagent_model")
    store_dir = tmp_path / "store"
    read_everything(store_dir)
    attempted, _ = restart(store_dir, fake, messages=2, tools=False, step_s=5.0)
    assert attempted[0].kind == "failure_notice"
    assert SWEPT_SENTENCE in attempted[0].text
    assert len(of(SubagentGhostSwept, session_log(store_dir, f"session:{run_id}"))) == 1
    replayed = json.loads(read(store_dir, "replay", f"session:{run_id}", "--json"))
    assert replayed["status"] == "swept"
    shown = {
        row["session"]: row["status"]
        for row in json.loads(read(store_dir, "status", "--json"))["sessions"]
    }
    runs = _run_streams(store_dir)
    assert len(runs) == 2  # the swept run and its respawn
    assert {stream: shown[stream] for stream in runs} == dict.fromkeys(runs, "run")


def test_a_run_with_host_work_is_not_handed_to_the_model_after_a_restart(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """SIGKILL while a sub-agent run executes the host's own ``work`` (code, not a model).
    After the restart the ghost sweep ends it. The new process does not hold that code,
    so the recovery escalates (``work_unavailable``) instead of respawning the run: it
    used to start attempt 2 model-driven, sending the host's task to the LLM and telling
    the user "Sub-agent task completed:" with the model's text for a task never run."""
    crash(tmp_path, fake, "subagent")
    store_dir = tmp_path / "store"
    read_everything(store_dir)
    decided: list[Any] = []

    def recovery_settles(rt: Runtime, clock: FakeClock) -> None:
        def recovered() -> bool:
            decided[:] = [
                r.event
                for stream in _run_streams(store_dir)
                for r in session_log(store_dir, stream)
                if isinstance(r.event, SubagentRecoveryDecided)
            ]
            return bool(decided)

        advance_until(clock, recovered, 0.5)
        for _ in range(6):  # a respawn, had one been started, calls the model at once
            clock.advance(0.5)
            flush(rt.portal)

    attempted, _ = restart(
        store_dir, fake, messages=1, tools=False, then=recovery_settles, step_s=5.0
    )
    assert SWEPT_SENTENCE in attempted[0].text
    assert [(d.action, d.reason) for d in decided] == [("escalate", "work_unavailable")]
    assert len(_run_streams(store_dir)) == 1  # no attempt 2
    asked = [r.body["messages"][-1]["content"] for r in fake.requests]
    assert asked == [], f"the host's task was sent to the model: {asked}"
    read(store_dir, "replay", "--all", "--verify")  # exit 0: the escalation follows


def test_a_respawn_of_a_run_spawned_with_announce_false_is_not_announced(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """The recovery path a crashed run takes, in one process: a run spawned with
    ``announce=False`` (as the ``spawn_subagent`` tool's are: "its answer goes back to the
    parent's model") fails and is respawned. Its failure notice is sent (failure notices
    always are); the respawned attempt's success must not be announced to the channel
    either, but it is: ``subagent:spawned`` of attempt 2 records ``announce=true`` and the
    user gets "Sub-agent task completed: ..."."""
    attempts: list[int] = []

    async def work(report: Any) -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("the first attempt fails")
        return "the second attempt's result"

    clock = FakeClock(start=1_800_000_000.0)
    chat = MemoryChannel("chat")
    config = child.config(fake.base_url)
    with Runtime(config, store=str(tmp_path / "store"), clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat")
        rt.spawn("s1", "refund order 7", task_class="code", work=work, announce=False)
        advance_until(clock, lambda: len(attempts) >= 2 and len(chat.attempted) >= 1, 0.5)
        for _ in range(12):  # past the announcer's debounce and maximum wait
            clock.advance(1)
            flush(rt.portal)
        with store_module.open(tmp_path / "store", read_only=True) as store:
            spawned = [
                (r.event.attempt, r.event.announce)
                for r in store.read_all()
                if isinstance(r.event, SubagentSpawned)
            ]
        sent = [(m.kind, m.text) for m in chat.attempted]
    assert [kind for kind, _ in sent] == ["failure_notice"], sent
    assert spawned == [(1, False), (2, False)]


# -- an answer in the dead letters -------------------------------------------------------------


def test_a_kill_with_an_answer_in_the_dead_letters_delivers_it_once_after_a_restart(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """SIGKILL with the answer queued in the dead letters (its send failed). The operator
    sees the undelivered entry; the restart retries it when its backoff is due and the
    user gets it once, with the announcement's id as the idempotency key, and the session's
    Agent does not send it a second time."""
    crash(tmp_path, fake, "deadletter")
    store_dir = tmp_path / "store"
    views = read_everything(store_dir)
    assert "1 undelivered announcement" in views["status"]
    dead = json.loads(views["status_s1_json"])["dead_letters"]
    assert len(dead["announcements"]) == 1
    [queued] = of(AnnouncementQueued, session_log(store_dir))

    def linger(rt: Runtime, clock: FakeClock) -> None:
        # past any resend wait (announce timeout + grace) and the next retry's backoff
        for _ in range(10):
            clock.advance(10)
            flush(rt.portal)

    attempted, _ = restart(store_dir, fake, after_s=1, then=linger)
    assert [(m.text, m.idempotency_key) for m in attempted] == [
        (queued.text, queued.announcement_id)
    ]
    views = read_everything(store_dir)
    assert "0 undelivered announcements" in views["status"]
