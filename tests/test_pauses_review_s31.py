"""Human-in-the-loop pauses, the session actions around them and the session's drafts:
defects a review found, each test failing on the code before its fix.

Real parts: a real LMDB store in tmp_path, the fake provider over loopback HTTP, the fake
clock, a MemoryChannel, and click's CliRunner for the command line.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.channels import MemoryChannel
from stalwart.cli import cli
from stalwart.clock import FakeClock
from stalwart.config import Config
from stalwart.errors import SessionActionError
from stalwart.events import (
    ActivationAcked,
    ActivationBlocked,
    DraftCommitted,
    DraftStaged,
    SessionCreated,
    SessionRequiresAction,
    UserCustomToolResult,
)
from stalwart.runtime import (
    Runtime,
    confirm,
    interrupt,
    policy_of,
    schedule_wake,
    submit_tool_result,
)
from stalwart.state import DRAFTS, fold
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, FakeToolCall
from tests._runtime_support import delivered, has, log_until, of, runtime_config

T0 = 1_800_000_000.0
POLICY = policy_of(Config().activations)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _paused(store: EventStore) -> None:
    """s2 waits for approval r1, s3 for custom tool r2 (as a worker left them)."""
    store.append(
        "session:s2",
        [SessionCreated(), SessionRequiresAction(request_id="r1", kind="approval", tool="rm")],
    )
    store.append(
        "session:s3",
        [SessionCreated(), SessionRequiresAction(request_id="r2", kind="custom_tool", tool="look")],
    )


# -- drafts ---------------------------------------------------------------------------------


# Was: DEFECT: a commit of an older revision marked a newer staged revision committed (lost edit)
def test_a_commit_of_an_older_revision_leaves_the_newer_one_open(store: EventStore) -> None:
    """The model stages v1, then in one step calls draft_commit and draft_write (tools
    run at once, up to ``tool_limit``): the commit hands v1 to the committer while v2 is
    staged, and records ``draft:committed`` of v1's hash after it. The fold marked the
    draft (now v2) committed: v2 was never written out, no longer listed as open (the
    next wake's system prompt says nothing of it) and draft_read refused it."""
    store.append(
        "session:s1",
        [
            SessionCreated(),
            DraftStaged(path="a.md", content="v1", content_hash=_sha("v1"), size=2, revision=1),
            DraftStaged(path="a.md", content="v2", content_hash=_sha("v2"), size=2, revision=2),
            DraftCommitted(path="a.md", content_hash=_sha("v1"), revision=1),
        ],
    )
    drafts = fold(DRAFTS, "session:s1", store.read_stream("session:s1"))
    [open_draft] = drafts.open()
    assert (open_draft.revision, open_draft.content_hash) == (2, _sha("v2"))
    # the newest revision's own commit does close it
    store.append("session:s1", [DraftCommitted(path="a.md", content_hash=_sha("v2"), revision=2)])
    drafts = fold(DRAFTS, "session:s1", store.read_stream("session:s1"))
    assert drafts.open() == []
    assert drafts.drafts["a.md"].status == "committed"


# Was: DEFECT: a draft_write racing a draft_commit in one step was hidden as committed
def test_a_draft_written_while_an_older_revision_commits_is_still_open_next_wake(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """End to end: the committer is still writing v1 when the same step's draft_write
    stages v2; the next wake's system prompt lists v2 as open (it was never committed).
    The two calls run at once: the commit reads the draft first in practice; should the
    write win, v2 is what was written out, and it is committed."""
    written: list[str] = []

    def committer(session_id: str, path: str, content: str, digest: str) -> None:
        # the step's other call stages v2 while this write is under way
        log_until(store, "session:s1", has(DraftStaged, 2))
        written.append(content)

    def call(call_id: str, name: str, **arguments: Any) -> FakeToolCall:
        return FakeToolCall(id=call_id, name=name, arguments=arguments)

    fake.add(
        Answer(text="", tool_calls=(call("w1", "draft_write", path="a.md", content="v1"),)),
        Answer(
            text="",
            tool_calls=(
                call("w2", "draft_commit", path="a.md"),
                call("w3", "draft_write", path="a.md", content="v2"),
            ),
        ),
        Answer(text="Done."),
        Answer(text="Noted."),
    )
    config = runtime_config(fake.base_url)
    channels = {"chat": chat}
    with Runtime(config, store=store, clock=clock, channels=channels, committer=committer) as rt:
        session = rt.session("s1", channel="chat")
        session.send("write and commit a.md")
        delivered(rt, chat, 1)
        session.send("what is left?")
        delivered(rt, chat, 2)
    system = fake.requests[3].body["messages"][0]
    assert system["role"] == "system"
    if written == ["v2"]:  # the write won the race (rare): v2 itself was written out
        assert "a.md" not in system["content"]
        return
    assert written == ["v1"]
    assert "a.md (revision 2, 2 bytes" in system["content"], "v2 was hidden as committed"


# -- session actions --------------------------------------------------------------------------


# Was: DEFECT: wake_at with the session's stream name named 'session:session:s1' in its refusal
def test_a_refused_wake_names_the_session_once_whichever_way_it_was_named(
    rt: Runtime, store: EventStore
) -> None:
    rt.session("s1", channel="chat")
    for named in ("s1", "session:s1"):
        with pytest.raises(SessionActionError) as refused:
            rt.wake_at(named, math.nan, "check")
        assert refused.value.reason == "wake_refused"
        assert refused.value.session == "session:s1"
        assert "'session:s1'" in str(refused.value)
        assert "session:session:" not in str(refused.value)


@pytest.mark.parametrize(
    ("action", "stream"),
    [
        (lambda store: confirm(store, "s2", "r1", allow="no"), "session:s2"),
        (lambda store: confirm(store, "s2", "r1", allow=None), "session:s2"),
        (lambda store: submit_tool_result(store, "s3", "r2", {"status": "shipped"}), "session:s3"),
        (lambda store: submit_tool_result(store, "s3", "r2", b"shipped"), "session:s3"),
        (lambda store: interrupt(store, "s2", reason=5), "session:s2"),
        (
            lambda store: schedule_wake(store, "s2", T0 + 60, now=T0, policy=POLICY, text=5),
            "session:s2",
        ),
        (
            lambda store: schedule_wake(store, "s2", T0 + 60, now=T0, policy=POLICY, dedupe_key=7),
            "session:s2",
        ),
    ],
)
# Was: DEFECT: a non-bool allow or a non-str output was refused as a "corrupt" record (EventError)
def test_an_answer_of_the_wrong_type_is_a_type_error_and_appends_nothing(
    store: EventStore, action: Any, stream: str
) -> None:
    """A host that passes its form's ``"no"`` as ``allow``, or its custom tool's dict as
    the output, got ``EventError: cannot encode an event ... record at position 5 is
    corrupt``: a store error for the host's own mistake, unlike ``handle.send`` (a
    TypeError before anything is recorded)."""
    _paused(store)
    head = store.stream_version(stream)
    with pytest.raises(TypeError):
        action(store)
    assert store.stream_version(stream) == head


# -- the command line ---------------------------------------------------------------------------


# Was: DEFECT: tool-result --output-file turned the file's CRLF and CR line ends into LF
def test_tool_result_from_a_file_gives_its_content_verbatim(
    store_dir: Path, clock: FakeClock, tmp_path: Path
) -> None:
    """The help says FILE's UTF-8 content is the output; read as text, Python's universal
    newlines rewrote every ``\\r\\n`` and ``\\r`` (a CSV export, a Windows tool's report)
    and the char count printed was that of the rewritten text."""
    with store_module.open(store_dir, clock=clock) as store:  # type: ignore[attr-defined]
        _paused(store)
    answer = tmp_path / "answer.csv"
    content = "order,status\r\n1234,shipped\r\nlone\rcr\n"
    answer.write_bytes(content.encode("utf-8"))
    args = ["--store", str(store_dir), "session", "tool-result", "s3", "r2"]
    result = CliRunner().invoke(cli, [*args, "--output-file", str(answer)])
    assert result.exit_code == 0, result.stderr
    assert f"recorded ({len(content)} chars)" in result.stdout
    with store_module.open(store_dir, create=False) as store:  # type: ignore[attr-defined]
        [answered] = [r.event for r in store.read_stream("session:s3")][2:3]
    assert answered.output == content  # type: ignore[attr-defined]


def test_a_pause_survives_a_close_and_is_answered_by_stream_name_in_the_next_runtime(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Close while paused: the next runtime on the log takes the answer (the session
    named by its stream), resumes the paused step with it, and a second answer, from
    either spelling of the id, is refused and appends nothing."""
    config = runtime_config(fake.base_url)
    call = FakeToolCall(id="c1", name="lookup", arguments={"order": 7})
    fake.add(Answer(text="", tool_calls=(call,)), Answer(text="Shipped."))
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.tools.register_custom("lookup", description="Look an order up.")
        rt.session("s1", channel="chat").send("where is order 7?")
        records = log_until(store, "session:s1", has(ActivationBlocked))
    [request] = of(SessionRequiresAction, records)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.submit_tool_result("session:s1", request.request_id, "order 7: shipped")
        log_until(store, "session:s1", has(ActivationAcked))
        for named in ("s1", "session:s1"):
            with pytest.raises(SessionActionError) as again:
                rt.submit_tool_result(named, request.request_id, "again")
            assert again.value.reason == "not_pending"
        assert delivered(rt, chat, 1)[-1].text == "Shipped."
    # the refused answers appended nothing (the reply's own records may come after the ack)
    answers = of(UserCustomToolResult, list(store.read_stream("session:s1")))
    assert [a.output for a in answers] == ["order 7: shipped"]
    tool_message = fake.requests[1].body["messages"][-1]
    assert (tool_message["role"], tool_message["content"]) == ("tool", "order 7: shipped")
