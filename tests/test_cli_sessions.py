"""The operator's session commands: status, session events/confirm/tool-result/interrupt,
activations and watch, on a real LMDB log built from real events."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.cli._views import fmt_rel
from stalwart.clock import FakeClock
from stalwart.events import (
    ActivationAbandoned,
    ActivationLeased,
    ActivationReady,
    ActivationRequeued,
    AnnouncementDeadLettered,
    DraftCommitted,
    DraftStaged,
    LeaseExpired,
    LeaseRenewed,
    PromptStarted,
    ProviderDegraded,
    SessionCreated,
    SessionRequiresAction,
    SubagentSpawned,
    ToolCompleted,
    ToolStarted,
    TurnCompleted,
    TurnStarted,
)
from stalwart.runtime import interrupt, send_message

T0 = 1_800_000_000.0


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def log(store_dir: Path, clock: FakeClock) -> dict[str, str]:
    """s1 retrying (an expired lease, then a requeue) and now leased again by w3;
    s2 waiting for approval r1; s3 waiting for custom tool result r2 with a wake queued;
    s4 with an abandoned activation; an undelivered announcement; a degraded provider."""
    with store_module.open(store_dir, clock=clock) as store:  # type: ignore[attr-defined]
        a1 = send_message(store, "s1", "first")
        store.append(
            "session:s1",
            [ActivationLeased(activation_id=a1, owner="w1", epoch=1, expires_at=T0 + 30)],
        )
        clock.advance(40)
        store.append(
            "session:s1",
            [
                LeaseExpired(activation_id=a1, owner="w1", epoch=1, expired_at=T0 + 30, streak=1),
                ActivationLeased(activation_id=a1, owner="w2", epoch=2, expires_at=T0 + 70),
            ],
        )
        clock.advance(1)
        store.append(
            "session:s1",
            [
                ActivationRequeued(
                    activation_id=a1,
                    epoch=2,
                    delay_ms=4000,
                    streak=2,
                    run_at=T0 + 45,
                    error_class="provider_timeout",
                )
            ],
        )
        clock.advance(4)
        store.append(
            "session:s1",
            [ActivationLeased(activation_id=a1, owner="w3", epoch=3, expires_at=T0 + 75)],
        )
        store.append(
            "session:s1", [LeaseRenewed(activation_id=a1, owner="w3", epoch=3, expires_at=T0 + 80)]
        )
        store.append(
            "session:s2",
            [
                SessionCreated(agent="ops"),
                SessionRequiresAction(
                    request_id="r1", kind="approval", tool="rm", arguments='{"path": "/tmp/x"}'
                ),
            ],
        )
        store.append(
            "session:s3",
            [
                SessionCreated(),
                SessionRequiresAction(
                    request_id="r2", kind="custom_tool", tool="lookup", arguments="{}"
                ),
                ActivationReady(
                    activation_id="w1", kind="wake", wake_at=T0 + 600, text="check back"
                ),
            ],
        )
        store.append(
            "session:s4",
            [
                SessionCreated(),
                ActivationReady(activation_id="x1", kind="message", text="boom"),
                ActivationAbandoned(
                    activation_id="x1", attempts=1, error_class="bad_request", retryable=False
                ),
            ],
        )
        store.append(
            "deadletter",
            [
                AnnouncementDeadLettered(
                    entry_id="e1",
                    announcement_id="n1",
                    channel="chat",
                    text="done",
                    reason="timeout",
                    conversation="s4",
                )
            ],
        )
        store.append(
            "provider:openai", [ProviderDegraded(provider="openai", rule="consecutive", failures=3)]
        )
        clock.advance(10)  # now = T0 + 55: w3's lease (to T0 + 80) is live
        store.append(
            "session:s2", [ActivationReady(activation_id="later", kind="wake", wake_at=T0 + 3600)]
        )
    return {"a1": a1}


def _head(store_dir: Path) -> int:
    with store_module.open(store_dir, create=False) as store:  # type: ignore[attr-defined]
        return store.head()


# -- status -----------------------------------------------------------------------------------


def test_status_overview_table(store_dir: Path, log: dict[str, str]) -> None:
    code, out, err = run("--store", str(store_dir), "status")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "4 sessions: 2 idle, 2 requires_action"
    rows = {line.split()[0]: line for line in lines if line.startswith("session:")}
    assert set(rows) == {"session:s1", "session:s2", "session:s3", "session:s4"}
    s1 = rows["session:s1"].split()
    # session, status, queued, lease owner#epoch, expiry, retry attempt/streak ...
    assert s1[2:5] == ["1", "w3#3", "in"]
    assert "3/2" in s1
    assert "provider_timeout" in s1
    assert "approval rm (r1)" in rows["session:s2"]
    assert "custom_tool lookup (r2)" in rows["session:s3"]
    assert "abandoned" in rows["session:s4"]
    assert "dead letters: 1 undelivered announcement, 1 abandoned activation" in out
    assert "activation x1  session:s4  message  attempts 1  error bad_request" in out
    assert any(line.split()[:5] == ["openai", "degraded", "10s", "ago", "closed"] for line in lines)


def test_status_json_keys_are_stable(store_dir: Path, log: dict[str, str]) -> None:
    code, out, _ = run("--store", str(store_dir), "status", "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"now", "position", "counts", "sessions", "dead_letters", "providers"}
    assert data["now"] == T0 + 55  # the newest event: the log is ahead of the real clock
    assert data["counts"] == {
        "new": 0,
        "idle": 2,
        "running": 0,
        "requires_action": 2,
        "closed": 0,
        "run": 0,
    }
    assert {s["session"] for s in data["sessions"]} == {f"session:s{i}" for i in range(1, 5)}
    s1 = next(s for s in data["sessions"] if s["session"] == "session:s1")
    assert set(s1) == {
        "session",
        "status",
        "agent",
        "queued",
        "lease",
        "retry",
        "last_outcome",
        "pending",
        "updated_at",
    }
    assert s1["lease"] == {
        "activation_id": log["a1"],
        "owner": "w3",
        "epoch": 3,
        "leased_at": T0 + 45,
        "expires_at": T0 + 80,
        "expired": False,
    }
    assert s1["retry"] == {
        "attempt": 3,
        "streak": 2,
        "next_run_at": T0 + 45,
        "last_error": "provider_timeout",
        "retrying": log["a1"],
    }
    assert s1["last_outcome"]["status"] == "requeued"
    s2 = next(s for s in data["sessions"] if s["session"] == "session:s2")
    assert s2["pending"] == {
        "request_id": "r1",
        "kind": "approval",
        "tool": "rm",
        "input": '{"path": "/tmp/x"}',
    }
    dead = data["dead_letters"]
    assert set(dead) == {"announcements", "activations", "activations_total"}
    assert [e["entry_id"] for e in dead["announcements"]] == ["e1"]
    assert [(a["session"], a["activation_id"]) for a in dead["activations"]] == [
        ("session:s4", "x1")
    ]
    assert data["providers"][0]["health"] == "degraded"


def test_status_of_one_session_in_full(store_dir: Path, log: dict[str, str]) -> None:
    code, out, _ = run("--store", str(store_dir), "status", "s1")
    assert code == 0
    assert out.startswith("session:s1  idle")
    assert "retry         attempt 3  streak 2  next run 10s ago" in out
    assert f"lease         live  owner w3  epoch 3  activation {log['a1']}  expires in 25s" in out
    assert "last outcome  requeued" in out
    assert "counters      acked 0  requeued 1  abandoned 0  lease_expired 1" in out
    claims = [line.split() for line in out.splitlines() if line.startswith("  20")]
    assert [(c[2], c[3], c[4]) for c in claims] == [
        ("w1", "1", "expired"),
        ("w2", "2", "requeued"),
        ("w3", "3", "holding"),
    ]


def test_status_of_one_session_names_the_calls_under_way(store_dir: Path, clock: FakeClock) -> None:
    """An operator looking at a session whose process died mid-turn sees what it was
    doing: the model call and the tool call started with no outcome (the tool that
    completed is not listed); once the turn ends, nothing is under way."""
    with store_module.open(store_dir, clock=clock) as store:  # type: ignore[attr-defined]
        stream = "session:s9"
        store.append(stream, [SessionCreated(), TurnStarted(turn_id="t1")])
        store.append(
            stream,
            [
                ToolStarted(call_id="c1", tool="lookup"),
                ToolCompleted(call_id="c1", tool="lookup", output="ok"),
                ToolStarted(call_id="c2", tool="charge"),
                PromptStarted(call_id="p1", provider="openai", model="gpt-4o", attempt=2),
            ],
        )
        clock.advance(90)
        store.append("session:other", [SessionCreated()])
        code, out, _ = run("--store", str(store_dir), "status", "s9")
        assert code == 0
        [line] = [line for line in out.splitlines() if line.startswith("under way")]
        assert line.startswith("under way     tool charge (call c2) since 1m30s ago")
        assert "; model openai:gpt-4o attempt 2 (call p1) since 1m30s ago" in line
        data = json.loads(run("--store", str(store_dir), "status", "s9", "--json")[1])
        assert [(c["kind"], c["name"], c["attempt"]) for c in data["under_way"]] == [
            ("tool", "charge", None),
            ("model", "openai:gpt-4o", 2),
        ]
        store.append(stream, [TurnCompleted(turn_id="t1", outcome="interrupted")])
        out = run("--store", str(store_dir), "status", "s9")[1]
        assert "under way     -" in out.splitlines()


def test_status_of_one_session_as_json(store_dir: Path, log: dict[str, str]) -> None:
    code, out, _ = run("--store", str(store_dir), "status", "session:s3", "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data) == {
        "now",
        "session",
        "status",
        "agent",
        "parent",
        "turns",
        "messages",
        "updated_at",
        "pending",
        "under_way",
        "retry",
        "backlog",
        "lease",
        "epoch",
        "blocked_on",
        "last_outcome",
        "history",
        "counters",
        "dead_letters",
        "drafts",
    }
    assert data["drafts"] == []
    assert data["status"] == "requires_action"
    assert data["pending"]["kind"] == "custom_tool"
    assert data["blocked_on"] == "r2"
    assert data["backlog"] == [
        {
            "activation_id": "w1",
            "kind": "wake",
            "ready_at": T0 + 45,
            "run_at": T0 + 600,
            "streak": 0,
            "last_error": None,
        }
    ]
    assert data["lease"] is None
    s4 = json.loads(run("--store", str(store_dir), "status", "s4", "--json")[1])
    assert [a["activation_id"] for a in s4["dead_letters"]["activations"]] == ["x1"]
    assert [e["entry_id"] for e in s4["dead_letters"]["announcements"]] == ["e1"]


def test_an_expired_lease_says_so(store_dir: Path, log: dict[str, str], clock: FakeClock) -> None:
    with store_module.open(store_dir, clock=clock) as store:  # type: ignore[attr-defined]
        clock.advance(60)  # T0 + 115: w3's lease ran out at T0 + 80 and nobody took over
        store.append("provider:openai", [ProviderDegraded(provider="openai", rule="agents")])
    code, out, _ = run("--store", str(store_dir), "status", "s1")
    assert code == 0
    assert "lease         EXPIRED  owner w3  epoch 3" in out
    assert "expires 35s ago" in out
    row = next(
        line
        for line in run("--store", str(store_dir), "status")[1].splitlines()
        if line.startswith("session:s1")
    )
    assert "expired 35s ago" in row


def test_status_of_a_missing_session_is_one_line(store_dir: Path, log: dict[str, str]) -> None:
    code, out, err = run("--store", str(store_dir), "status", "nope")
    assert (code, out) == (1, "")
    assert err == f"stalwart: error: no session 'session:nope' in {store_dir}\n"


def test_activations_of_a_missing_session_is_one_line(store_dir: Path, log: dict[str, str]) -> None:
    code, out, err = run("--store", str(store_dir), "activations", "--session", "nope")
    assert (code, out) == (1, "")
    assert err == f"stalwart: error: no session 'session:nope' in {store_dir}\n"


def test_status_of_an_empty_store(store_dir: Path) -> None:
    store_module.open(store_dir).close()
    code, out, _ = run("--store", str(store_dir), "status")
    assert code == 0
    assert out.splitlines()[0] == "0 sessions"
    assert "providers: none seen in the log" in out


# -- session actions --------------------------------------------------------------------------


def _refused(store_dir: Path, *args: str) -> str:
    before = _head(store_dir)
    code, out, err = run("--store", str(store_dir), "session", *args)
    assert (code, out) == (1, "")
    assert err.count("\n") == 1
    assert err.startswith("stalwart: error: ")
    assert "Traceback" not in err
    assert _head(store_dir) == before, "a refused action appended"
    return err


def test_confirm_allows_once_then_refuses(store_dir: Path, log: dict[str, str]) -> None:
    before = _head(store_dir)
    code, out, _ = run("--store", str(store_dir), "session", "confirm", "s2", "r1", "--allow")
    assert code == 0
    assert out.startswith("allowed request r1 of session:s2; resume queued as activation ")
    with store_module.open(store_dir, create=False) as store:  # type: ignore[attr-defined]
        added = [(r.type, r.event) for r in store.read_all(before + 1)]
    assert [t for t, _ in added] == ["user:tool_confirmation", "activation:ready"]
    assert added[0][1].allow is True  # type: ignore[attr-defined]
    err = _refused(store_dir, "confirm", "s2", "r1", "--deny")
    assert "no pending request 'r1'" in err


def test_confirm_with_a_wrong_id_is_refused(store_dir: Path, log: dict[str, str]) -> None:
    err = _refused(store_dir, "confirm", "s2", "r9", "--allow")
    assert "it waits for 'r1'" in err


def test_confirm_after_an_interrupt_is_refused(store_dir: Path, log: dict[str, str]) -> None:
    code, out, _ = run("--store", str(store_dir), "session", "interrupt", "s2", "--reason", "stop")
    assert code == 0
    assert out == "interrupted session:s2: 1 queued activation cancelled (later)\n"
    _refused(store_dir, "confirm", "s2", "r1", "--allow")


@pytest.mark.parametrize("verdicts", [[], ["--allow", "--deny"], ["--deny", "--allow"]])
def test_confirm_needs_one_of_allow_and_deny(
    store_dir: Path, log: dict[str, str], verdicts: list[str]
) -> None:
    """Both flags used to be accepted, the last one winning: an operator who typed both
    got whichever came last, with no word."""
    before = _head(store_dir)
    args = ["--store", str(store_dir), "session", "confirm", "s2", "r1", *verdicts]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0
    assert "one of --allow and --deny" in result.stderr
    assert _head(store_dir) == before


@pytest.mark.parametrize("bad", ["a b", "", "tab\there", "x" * 129, "session:", "context:s1"])
def test_actions_refuse_an_id_no_session_can_have(
    store_dir: Path, log: dict[str, str], bad: str
) -> None:
    """``session send 'a b' hi`` used to queue a message for a session whose every turn
    the context engine refuses (the user got only the static failure text); '' made the
    stream ``session:``."""
    err = _refused(store_dir, "send", bad, "hi")
    assert "not a session id" in err
    assert bad not in err or not bad
    _refused(store_dir, "interrupt", bad)


def test_tool_result_from_text_and_from_a_file(
    store_dir: Path, log: dict[str, str], tmp_path: Path
) -> None:
    _refused(store_dir, "tool-result", "s2", "r1", "--output", "x")  # r1 is an approval
    answer = tmp_path / "answer.txt"
    answer.write_text("order 1234: shipped\n", encoding="utf-8")
    before = _head(store_dir)
    code, out, _ = run(
        "--store",
        str(store_dir),
        "session",
        "tool-result",
        "s3",
        "r2",
        "--output-file",
        str(answer),
    )
    assert code == 0
    assert "tool result for request r2 of session:s3 recorded (20 chars)" in out
    with store_module.open(store_dir, create=False) as store:  # type: ignore[attr-defined]
        first = next(iter(store.read_all(before + 1)))
    assert first.type == "user:custom_tool_result"
    assert first.event.output == "order 1234: shipped\n"  # type: ignore[union-attr]
    _refused(store_dir, "tool-result", "s3", "r2", "--output", "again")


def test_tool_result_needs_exactly_one_output(store_dir: Path, log: dict[str, str]) -> None:
    for extra in ([], ["--output", "a", "--output-file", __file__]):
        result = CliRunner().invoke(
            cli, ["--store", str(store_dir), "session", "tool-result", "s3", "r2", *extra]
        )
        assert result.exit_code != 0
        assert "exactly one of --output TEXT and --output-file FILE" in result.stderr


def test_interrupt_cancels_the_queue_and_clears_the_request(
    store_dir: Path, log: dict[str, str]
) -> None:
    code, out, _ = run("--store", str(store_dir), "session", "interrupt", "s3")
    assert code == 0
    assert out == "interrupted session:s3: 1 queued activation cancelled (w1)\n"
    data = json.loads(run("--store", str(store_dir), "status", "s3", "--json")[1])
    assert (data["status"], data["pending"], data["backlog"]) == ("idle", None, [])
    _refused(store_dir, "interrupt", "nope")


def test_session_events_prints_only_that_stream(store_dir: Path, log: dict[str, str]) -> None:
    code, out, _ = run("--store", str(store_dir), "session", "events", "s2")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 3
    assert all("  session:s2  " in line for line in lines)
    assert "session:requires_action" in lines[1]
    code, out, _ = run("--store", str(store_dir), "session", "events", "session:s2", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["type"] for r in rows] == [
        "session:created",
        "session:requires_action",
        "activation:ready",
    ]
    assert set(rows[0]) == {"position", "stream", "version", "type", "ts", "data"}
    _refused(store_dir, "events", "nope")


# -- activations and watch --------------------------------------------------------------------


def test_activations_lists_the_lifecycle(store_dir: Path, log: dict[str, str]) -> None:
    code, out, _ = run("--store", str(store_dir), "activations", "--session", "s1")
    assert code == 0
    whats = [line.split("  ")[3] for line in out.splitlines()]
    assert whats == ["ready", "leased", "lease_expired", "leased", "requeued", "leased", "renewed"]
    requeued = out.splitlines()[4]
    assert "  w2#2" not in requeued
    assert "delay=4000ms  streak=2  error=provider_timeout" in requeued
    expired = out.splitlines()[2]
    assert "w1#1" in expired
    assert "streak=1" in expired
    code, out, _ = run("--store", str(store_dir), "activations", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert {r["session"] for r in rows} == {"session:s1", "session:s2", "session:s3", "session:s4"}
    assert all(
        set(r)
        == {
            "position",
            "ts",
            "session",
            "activation_id",
            "what",
            "owner",
            "epoch",
            "delay_ms",
            "streak",
            "error_class",
            "detail",
        }
        for r in rows
    )
    abandoned = next(r for r in rows if r["what"] == "abandoned")
    assert (abandoned["activation_id"], abandoned["error_class"], abandoned["streak"]) == (
        "x1",
        "bad_request",
        1,
    )
    assert abandoned["detail"]["retryable"] is False


def test_watch_once_draws_one_frame(store_dir: Path, log: dict[str, str]) -> None:
    code, out, _ = run("--store", str(store_dir), "watch", "--once")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"stalwart watch  {store_dir}  2027-01-15T08:00:55.000Z  position ")
    assert "\x1b[" not in out  # not a terminal: no cursor movement
    assert lines[2].startswith("4 sessions")
    assert "dead letters: 1 undelivered announcement, 1 abandoned activation" in out
    assert "openai" in out
    code, out, _ = run("--store", str(store_dir), "watch", "--once", "--rows", "2")
    assert "... and 2 more" in out


def test_activations_follow_sees_appends_from_another_thread(
    store_dir: Path, log: dict[str, str]
) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stalwart",
            "--store",
            str(store_dir),
            "activations",
            "--follow",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()
    try:

        def append() -> None:
            with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
                for n in range(5):
                    store.append(
                        "session:s9", [ActivationReady(activation_id=f"f{n}", kind="wake")]
                    )
                    store.append("session:s9", [SessionCreated()])  # not an activation event

        writer = threading.Thread(target=append)
        writer.start()
        writer.join(timeout=10)
        waited = threading.Event()
        for _ in range(200):
            if sum('"session":"session:s9"' in line for line in lines) >= 5:
                break
            waited.wait(0.05)
        followed = [json.loads(line) for line in lines]
        assert [r["activation_id"] for r in followed if r["session"] == "session:s9"] == [
            f"f{n}" for n in range(5)
        ]
        assert len({r["position"] for r in followed}) == len(followed)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
        reader.join(timeout=10)
        assert proc.returncode == 0
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_session_events_follow_prints_only_new_events_of_that_session(
    store_dir: Path, log: dict[str, str]
) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stalwart",
            "--store",
            str(store_dir),
            "session",
            "events",
            "s3",
            "-f",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()
    try:
        with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
            for n in range(3):
                store.append(
                    "session:s2", [ActivationReady(activation_id=f"other{n}", kind="wake")]
                )
                store.append("session:s3", [ActivationReady(activation_id=f"mine{n}", kind="wake")])
        waited = threading.Event()
        for _ in range(200):
            if len(lines) >= 6:
                break
            waited.wait(0.05)
        rows = [json.loads(line) for line in lines]
        assert {r["stream"] for r in rows} == {"session:s3"}
        assert [r["version"] for r in rows] == list(range(1, 7))  # the 3 old ones, then 3 new
        assert [r["data"]["activation_id"] for r in rows[3:]] == ["mine0", "mine1", "mine2"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
        reader.join(timeout=10)
        assert proc.returncode == 0
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_interrupt_from_the_runtime_shows_in_status(
    store_dir: Path, log: dict[str, str], clock: FakeClock
) -> None:
    with store_module.open(store_dir, clock=clock) as store:  # type: ignore[attr-defined]
        cancelled = interrupt(store, "s1", "operator")
    assert cancelled == [log["a1"]]
    data = json.loads(run("--store", str(store_dir), "status", "s1", "--json")[1])
    assert data["lease"] is None
    assert data["epoch"] == 4
    assert data["last_outcome"]["status"] == "cancelled"
    assert data["retry"]["attempt"] is None
    assert [c["ended"] for c in data["history"]] == ["expired", "requeued", "interrupted"]


@pytest.mark.parametrize(
    ("delta", "shown"),
    [
        (0.2, "now"),
        (12, "in 12s"),
        (-3, "3s ago"),
        (185, "in 3m05s"),
        (-7260, "2h01m ago"),
        (90000, "in 1d01h"),
    ],
)
def test_relative_times(delta: float, shown: str) -> None:
    assert fmt_rel(T0 + delta, T0) == shown
    assert fmt_rel(None, T0) == "-"


def test_watch_lists_only_the_newest_dead_letters(store_dir: Path, log: dict[str, str]) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        for n in range(8):
            store.append(
                "session:s4",
                [
                    ActivationReady(activation_id=f"y{n}", kind="wake"),
                    ActivationAbandoned(activation_id=f"y{n}", attempts=5, error_class="internal"),
                ],
            )
    out = run("--store", str(store_dir), "watch", "--once")[1]
    listed = [line.split()[1] for line in out.splitlines() if line.startswith("  activation ")]
    assert listed == ["y3", "y4", "y5", "y6", "y7"]
    assert "dead letters: 1 undelivered announcement, 9 abandoned activations" in out
    assert "  ... and 4 older" in out
    full = run("--store", str(store_dir), "status")[1]
    assert sum(line.startswith("  activation ") for line in full.splitlines()) == 9


def test_status_shows_staged_and_committed_drafts(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    with store_module.open(store_dir) as store:
        staged = DraftStaged(path="a.md", content="x", content_hash="ab" * 32, size=1)
        store.append(
            "session:d",
            [
                SessionCreated(agent="default"),
                staged,
                DraftStaged(path="b.md", content="yy", content_hash="cd" * 32, size=2),
                DraftCommitted(path="b.md", content_hash="cd" * 32),
            ],
        )
    result = CliRunner().invoke(cli, ["--store", str(store_dir), "status", "d"])
    assert result.exit_code == 0, result.output
    assert "drafts: 1 staged, not committed" in result.output
    assert "a.md" in result.output
    assert "committed" in result.output
    result = CliRunner().invoke(cli, ["--store", str(store_dir), "status", "d", "--json"])
    drafts = json.loads(result.output)["drafts"]
    assert [(d["path"], d["status"], d["size"]) for d in drafts] == [
        ("a.md", "staged", 1),
        ("b.md", "committed", 2),
    ]


def test_a_sub_agent_run_stream_shows_as_a_run_not_a_new_session(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    with store_module.open(store_dir) as store:
        store.append(
            "session:r1",
            [SubagentSpawned(parent="p", task="t", task_class="formatting", timeout_ms=1000)],
        )
    result = CliRunner().invoke(cli, ["--store", str(store_dir), "status", "--json"])
    data = json.loads(result.output)
    assert data["counts"]["run"] == 1
    assert data["counts"]["new"] == 0
    assert [row["status"] for row in data["sessions"]] == ["run"]
