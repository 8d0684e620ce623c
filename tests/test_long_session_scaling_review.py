"""Review: does a long session degrade? Per-turn cost against history length.

A session that lives for months holds tens of thousands of events. What one turn costs
must not grow with that history (apart from the prompt itself, which the context engine
keeps inside the window). Each test builds one session from real data, the tau-bench
airline trajectories (``tests/data/tau-bench``, MIT: 200 GPT-4o customer-service
runs concatenated into one ~5,300-message session, as their README describes), at a
size n and at 8n, on a real LMDB store in a temporary directory, drives the real parts
(a Runtime with the loopback fake provider and a fake clock, or the public session
functions) and compares what one operation reads or costs at the two sizes.

Reads are counted at the storage boundary: the store handed to stalwart is wrapped in
:class:`CountingStore`, which passes every call through and counts the records each
``read_stream`` / ``read_all`` yields, per stream. Nothing of stalwart is replaced.

Tests marked ``# Was:`` failed on the code reviewed; each docstring says what grew,
the figures measured, the cause and the fix.
"""

from __future__ import annotations

import itertools
import json
import lzma
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from stalwart import store as store_module
from stalwart.actors import Assemble, ContextStoreActor, ask_context
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import ActivationSettings
from stalwart.context import ContextMessage, DagEngine, ExtractiveSummarizer, parse_transcript
from stalwart.events import (
    ActivationAcked,
    ActivationReady,
    MessageAppended,
    SessionCreated,
    ToolCall,
    TurnCompleted,
    TurnStarted,
)
from stalwart.runtime import Runtime, interrupt, policy_of, schedule_wake, send_message
from stalwart.store import EventStore, NewEvent
from stalwart.testing import Answer, FakeProvider
from tests._runtime_support import GUARD, CountingStore, delivered, runtime_config

#: the trajectories, compressed, in the repository (tests/data/tau-bench/README.md)
TAU = Path(__file__).resolve().parent / "data" / "tau-bench" / "gpt-4o-airline.json.xz"
#: history sizes compared, in tau-bench messages (n and 8n)
SMALL, LARGE = 600, 4_800
#: the session every test builds
SESSION = "tau"
STREAM = f"session:{SESSION}"
START = 1_800_000_000.0
#: passivate_after_ms of the runtime tests: the sweep runs every 30 s of fake time
IDLE_MS = 60_000
#: live turns measured per history size
TURNS = 8


# -- the data ------------------------------------------------------------------------------


_ITEMS: list[tuple[int, dict[str, Any]]] = []


def tau_items() -> list[tuple[int, dict[str, Any]]]:
    """The trajectories as one conversation, in (task_id, trial) order: (run, message).
    The first run's system prompt is left out; later runs' instructions become the
    user's words."""
    if not _ITEMS:
        runs = json.loads(lzma.decompress(TAU.read_bytes()))
        runs.sort(key=lambda run: (run.get("task_id", 0), run.get("trial", 0)))
        for number, run in enumerate(runs):
            for item in run.get("traj", ()):
                entry = dict(item)
                if entry.get("role") == "system":
                    if not number:
                        continue
                    entry["role"] = "user"
                _ITEMS.append((number, entry))
    return _ITEMS


def tau_history(count: int, ts: float) -> list[NewEvent]:
    """``session:created`` and ``count`` tau-bench messages as the session's turns (each
    user message opens one), tool-call ids namespaced per run, one second apart."""
    events = [NewEvent(event=SessionCreated(agent="default", channel="chat"), ts=ts)]
    turn: str | None = None
    for index, (number, entry) in enumerate(tau_items()[:count]):
        at = ts + index
        role = entry["role"]
        if role == "user" or turn is None:
            if turn is not None:
                done = TurnCompleted(turn_id=turn, outcome="answered", steps=1)
                events.append(NewEvent(event=done, ts=at))
            turn = f"t{index}"
            events.append(NewEvent(event=TurnStarted(turn_id=turn), ts=at))
        calls = tuple(
            ToolCall(
                id=f"r{number}.{call['id']}",
                name=call["function"]["name"],
                arguments=call["function"]["arguments"],
            )
            for call in entry.get("tool_calls") or ()
        )
        answered = entry.get("tool_call_id")
        message = MessageAppended(
            message_id=f"m{index}",
            role=role,
            content=entry.get("content") or "",
            tool_calls=calls,
            tool_call_id=f"r{number}.{answered}" if answered else None,
            name=entry.get("name") if role == "tool" else None,
            turn_id=turn,
        )
        events.append(NewEvent(event=message, ts=at))
    if turn is not None:
        done = TurnCompleted(turn_id=turn, outcome="answered", steps=1)
        events.append(NewEvent(event=done, ts=ts + count))
    return events


def write_history(store: EventStore, count: int, ts: float) -> int:
    """The tau session of ``count`` messages appended to ``store``; its version."""
    events = tau_history(count, ts)
    for start in range(0, len(events), 2_000):
        store.append(STREAM, events[start : start + 2_000])
    return len(events)


def tau_context_messages(count: int) -> list[ContextMessage]:
    """The first ``count`` tau-bench messages as the context engine takes them."""
    items = []
    for index, (number, entry) in enumerate(tau_items()[:count]):
        item = dict(entry)
        if item.get("tool_calls"):
            item["tool_calls"] = [
                {**call, "id": f"r{number}.{call['id']}"} for call in item["tool_calls"]
            ]
        if item.get("tool_call_id"):
            item["tool_call_id"] = f"r{number}.{item['tool_call_id']}"
        item["ts"] = START + 20.0 * index
        items.append(item)
    return parse_transcript(items, source=str(TAU))


# -- the storage boundary, counted ---------------------------------------------------------


def acked_after(store: EventStore, version: int) -> int:
    """Wait (woken by appends) until the session records an ``activation:acked`` after
    ``version``; its version."""
    give_up = time.monotonic() + GUARD
    while True:
        head = store.head()
        for record in store.read_stream(STREAM, version + 1):
            version = record.version
            if isinstance(record.event, ActivationAcked):
                return version
        left = give_up - time.monotonic()
        assert left > 0, "the wake was never acked"
        store.wait_for(head + 1, left)


# -- one runtime per history size ----------------------------------------------------------


@dataclass(frozen=True)
class Driven:
    """What one history size cost."""

    events: int
    #: records of the session stream read per live turn (the Agent stays up)
    turn_reads: list[int]
    #: records of the session stream read by one wake after the Agent was passivated
    passivated_wake_reads: int


def drive(path: Path, count: int) -> Driven:
    """A runtime over a session of ``count`` tau-bench messages: one warm-up turn (the
    context engine summarizes the history), :data:`TURNS` live turns, then the Agent is
    passivated and one more message wakes it."""
    clock = FakeClock(start=START)
    log = store_module.open(path, clock=clock)
    counted = CountingStore(log)
    chat = MemoryChannel("chat")
    try:
        events = write_history(log, count, START - 10_000_000)
        version = events
        with FakeProvider() as fake:
            fake.set_default(Answer(text="it is on its way"))
            cfg = runtime_config(fake.base_url, activations={"passivate_after_ms": IDLE_MS})
            with Runtime(cfg, store=counted, clock=clock, channels={"chat": chat}) as rt:
                session = rt.session(SESSION, channel="chat")
                sent = 0

                def turn(text: str) -> int:
                    nonlocal sent, version
                    counted.taken()
                    session.send(text)
                    sent += 1
                    delivered(rt, chat, sent)
                    version = acked_after(log, version)
                    return counted.taken()[STREAM]

                turn("where is my refund?")  # the warm-up: the history is summarized
                reads = [turn(f"and order {n}?") for n in range(TURNS)]
                agent = session.ref
                give_up = time.monotonic() + GUARD
                while agent.is_alive():
                    assert time.monotonic() < give_up, "the idle Agent was never passivated"
                    clock.advance(IDLE_MS / 2000)
                    time.sleep(0.01)  # real-time: the sweep stops the Agent on its own thread
                woken = turn("one more question after a quiet hour")
                assert session.ref is not agent  # a new Agent ran the wake
        return Driven(events=events, turn_reads=reads, passivated_wake_reads=woken)
    finally:
        log.close()


@pytest.fixture(scope="module")
def driven(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Driven]:
    root = tmp_path_factory.mktemp("long-session")
    return {count: drive(root / f"n{count}", count) for count in (SMALL, LARGE)}


def test_a_live_turn_reads_a_bounded_number_of_records_however_long_the_session(
    driven: dict[int, Driven],
) -> None:
    """While the Agent is up, a turn folds only what it appended (the Agent, the
    ContextStore, the caller); the worker folds the session's activations again from
    their snapshot each wake, at most ``snapshot_every`` (500) records. None of it grows
    with the history."""
    small, large = driven[SMALL], driven[LARGE]
    assert large.events >= 7 * small.events
    per_turn_small = statistics.mean(small.turn_reads)
    per_turn_large = statistics.mean(large.turn_reads)
    assert max(large.turn_reads) <= 500 + 100, large.turn_reads
    assert per_turn_large <= 3 * per_turn_small + 50, (small.turn_reads, large.turn_reads)


# Was: a wake after passivation read the whole session stream despite its snapshot
def test_a_wake_after_passivation_does_not_read_the_whole_session(
    driven: dict[int, Driven],
) -> None:
    """A chat session's Agent is passivated whenever the user goes quiet for
    ``passivate_after_ms`` (5 min), so in a months-long session nearly every message
    starts a new Agent. Its start should cost what the snapshot leaves to fold. It read
    every record of the session again: 1,250 records with a 903-event history (600 tau
    messages), 8,140 with 7,785 events (4,800 messages), linear in the history, so a
    session's total cost was quadratic in its length.

    Cause: ``AgentActor.started`` loaded its view with ``load_state(..., AGENT_VIEW)``
    from the newest snapshot, then read the stream again from version 1 to fold the
    three folds the snapshot did not hold: the ``WakeLedger``, the context engine's
    ``SessionMessages`` and the prompt calls' ``CALLS``.

    Fix: ``AgentView`` (fold version 2) holds all of it, the ledger as a frozen
    ``LedgerState`` and the conversation as the stored ``ContextMessage``s the context
    engine takes, so one snapshot restores the Agent. Now 237 and 242 records."""
    small, large = driven[SMALL], driven[LARGE]
    assert large.events >= 7 * small.events
    # the worker folds up to snapshot_every (500) records since its own snapshot
    assert large.passivated_wake_reads < 3 * small.passivated_wake_reads + 500, (
        f"one wake after passivation read {small.passivated_wake_reads} session records "
        f"with {small.events} events of history and {large.passivated_wake_reads} with "
        f"{large.events}: the Agent's start reads the whole stream"
    )


# -- the session functions: wake_at, interrupt, confirm, tool results -----------------------


def _session_action_reads(path: Path, count: int, clock: FakeClock) -> tuple[int, int, int]:
    """Records of the session read by a second ``schedule_wake`` and then an
    ``interrupt`` on a session of ``count`` tau-bench messages; and its events."""
    log = store_module.open(path, clock=clock)
    try:
        events = write_history(log, count, clock.now() - 10_000_000)
        counted = CountingStore(log)
        now, policy = clock.now(), policy_of(ActivationSettings())
        # the first call may fold it all (and save a snapshot); the next ones need not
        schedule_wake(counted, SESSION, now + 600, now=now, policy=policy, text="check in")
        counted.taken()
        schedule_wake(counted, SESSION, now + 1200, now=now, policy=policy, text="again")
        wake = counted.taken()[STREAM]
        interrupt(counted, SESSION, "operator")
        stop = counted.taken()[STREAM]
        return events, wake, stop
    finally:
        log.close()


# Was: wake_at / confirm / submit_tool_result / interrupt fold the whole session each call
def test_scheduling_a_wake_or_interrupting_does_not_fold_the_whole_session(
    tmp_path: Path, clock: FakeClock
) -> None:
    """An agent that schedules its own next check-in every turn (``rt.wake_at``), a host
    whose custom tool answers through ``rt.submit_tool_result`` every turn, an approval
    per turn (``rt.confirm``), an operator's ``interrupt``: each is one call per turn
    and should cost the same in a long session as in a short one. Each folded the whole
    session. Measured (session records read by one call): ~890 events of history -> ~890
    per call; ~7,100 -> ~7,100. Now 2 (``schedule_wake``) and 4 (``interrupt``) at
    903 events and at 7,785.

    Cause: ``_act`` (stalwart/runtime/_control.py:88-104) calls ``load_session``
    (:61-71), which folds ``SESSION`` and ``ACTIVATIONS`` from version 1 with no
    snapshot, on every attempt. ``send_message`` next to it already does it right: it
    ``load_state``s ``RECENT_MESSAGES`` from its snapshot (:151).

    Fixed: ``load_session`` from snapshots (``load_state(store, stream, SESSION)`` and
    ``load_state(store, stream, ACTIVATIONS)``, or one snapshotted aggregate of both),
    and on a conflict fold on from the version reached instead of from scratch."""
    small = _session_action_reads(tmp_path / "small", SMALL, clock)
    large = _session_action_reads(tmp_path / "large", LARGE, clock)
    assert large[0] >= 7 * small[0]
    assert large[1] < 3 * small[1] + 50, (
        f"schedule_wake read {small[1]} records of a {small[0]}-event session and "
        f"{large[1]} of a {large[0]}-event one"
    )
    assert large[2] < 3 * small[2] + 50, (
        f"interrupt read {small[2]} records of a {small[0]}-event session and "
        f"{large[2]} of a {large[0]}-event one"
    )


def test_a_message_with_an_id_reads_only_what_came_since_the_snapshot(
    tmp_path: Path, clock: FakeClock
) -> None:
    """``send_message`` with a message id (a redelivered webhook is answered once) folds
    the newest message ids from their snapshot, not the whole session: the first call
    saves one, later calls read only what came since."""
    reads: dict[int, int] = {}
    for count in (SMALL, LARGE):
        log = store_module.open(tmp_path / f"n{count}", clock=clock)
        try:
            write_history(log, count, clock.now() - 10_000_000)
            counted = CountingStore(log)
            send_message(counted, SESSION, "first", message_id=f"hook-{count}-0")
            counted.taken()
            for n in range(1, 6):
                send_message(counted, SESSION, f"again {n}", message_id=f"hook-{count}-{n}")
            reads[count] = counted.taken()[STREAM]
            ready = [
                r.event for r in log.read_stream(STREAM) if isinstance(r.event, ActivationReady)
            ]
            assert len(ready) == 6
        finally:
            log.close()
    assert reads[LARGE] <= 3 * reads[SMALL] + 50, reads


# -- the context engine ---------------------------------------------------------------------


def _assembly_costs(
    messages: list[ContextMessage], budget: int
) -> tuple[DagEngine, dict[int, float]]:
    """Assemble the session before every user message, as an agent would, the clock
    moving with the messages; the seconds each assembly took that made no summary, by
    how many messages it was given."""
    clock = FakeClock(START)
    engine = DagEngine(summarizer=ExtractiveSummarizer(), clock=clock)
    costs: dict[int, float] = {}
    for index in range(1, len(messages) + 1):
        if messages[index - 1].role != "user":
            continue
        clock.advance(max(0.0, messages[index - 1].ts - clock.now()))  # 20 s a message
        given = messages[:index]
        began = time.perf_counter()
        assembly = engine.assemble(SESSION, given, budget)
        took = time.perf_counter() - began
        assert assembly.tokens <= budget
        if not assembly.summaries_made:
            costs[index] = took
    return engine, costs


def test_an_assembly_costs_the_same_at_8x_the_history_and_the_dag_stays_shallow() -> None:
    """The DAG engine over the tau session: an assembly that makes no summary costs
    about the same with 4,800 messages stored as with 600 (it ingests only what is new,
    and the history it weighs is the few top-level summaries plus what is not summarized
    yet), and the top-level summaries stay a handful (condensed 4 at a time)."""
    messages = tau_context_messages(LARGE + 200)
    engine, costs = _assembly_costs(messages, 32_000)
    early = [took for index, took in costs.items() if SMALL <= index < SMALL + 200]
    late = [took for index, took in costs.items() if LARGE <= index < LARGE + 200]
    assert len(early) >= 10
    assert len(late) >= 10
    assert statistics.median(late) < 3 * statistics.median(early), (
        f"median assembly {statistics.median(early) * 1e3:.3f} ms at {SMALL} messages, "
        f"{statistics.median(late) * 1e3:.3f} ms at {LARGE}"
    )
    dag = engine.sessions[SESSION]
    assert len(dag.roots) <= 16, len(dag.roots)


# -- the ContextStore, past max_sessions ------------------------------------------------------


def _rebuild_reads(path: Path, count: int) -> tuple[int, int, int]:
    """A ContextStore holding one session at a time (``max_sessions`` 1, as a host
    rotating through more sessions than its 256 does) assembles the tau session before
    each of its ``count`` messages' user turns, as the Agent would; then another session
    pushes it out twice, with one more turn between. Returns the ``context:`` records of
    the session, and the records each rebuild read (the first, and the next)."""
    clock = FakeClock(START)
    log = store_module.open(path, clock=clock)
    counted = CountingStore(log)
    messages = tau_context_messages(count + 1)
    ref = ContextStoreActor.start(
        store=counted, clock=clock, summarizer=ExtractiveSummarizer(), max_sessions=1
    )
    other = (ContextMessage(message_id="o", seq=0, role="user", content="hello"),)

    def assemble(session_id: str, given: tuple[ContextMessage, ...]) -> None:
        clock.advance(max(0.0, given[-1].ts - clock.now()))
        ask_context(ref, Assemble(session_id=session_id, messages=given, budget=32_000), 30.0)

    try:
        for index in range(1, count + 1):
            if messages[index - 1].role == "user":
                assemble(SESSION, tuple(messages[:index]))
        reads = []
        for given in (messages[:count], messages[: count + 1]):
            assemble("other", other)  # the tau session is pushed out of memory
            counted.taken()
            assemble(SESSION, tuple(given))  # and rebuilt from the log
            reads.append(counted.taken()[f"context:{SESSION}"])
        return log.stream_version(f"context:{SESSION}"), reads[0], reads[1]
    finally:
        ref.stop()
        log.close()


# Was: a session the ContextStore had let go of was rebuilt from its whole context stream
def test_a_context_session_rebuilt_after_eviction_reads_what_its_snapshot_leaves(
    tmp_path: Path,
) -> None:
    """A ContextStore keeps its 256 most recently used sessions; a host that serves
    more rebuilds a session whenever it comes back. The rebuild read the whole
    ``context:`` stream, one ``context:assembled`` per model call ever made (measured on
    the review: 38 ms at 600 messages, 285 ms at 4,800), on every turn of such a host:
    1,553 records at 4,800 messages.

    Cause: ``ContextStoreActor._restore`` read every record and folded ``CONTEXT_DAG``
    from nothing; the pipeline engine did the same with its fold, and recall (search,
    expand) folded the messages from the whole ``session:`` stream.

    Fix: all three go through ``load_state``, from the fold's snapshot (the messages
    from the Agent's ``agent_view`` snapshot). The first rebuild of a stream with no
    snapshot still reads it all and saves one; the next reads what came after it: 1
    record at 4,800 messages (at 600, 159: the stream is shorter than the snapshot
    cadence, so it has no snapshot yet)."""
    small = _rebuild_reads(tmp_path / "small", SMALL)
    large = _rebuild_reads(tmp_path / "large", LARGE)
    assert large[0] >= 5 * small[0], (small, large)  # the context stream grew with the history
    assert large[1] >= large[0] - 10  # no snapshot yet: read whole, and one saved
    # the next rebuild: what came after the snapshot (under snapshot_every, 500, before
    # the first is saved), however long the history
    assert small[2] <= 500, (small, large)
    assert large[2] <= 10, (small, large)


def _assembled(messages: list[ContextMessage], *, search_early: bool) -> DagEngine:
    """The tau session assembled before every user message; with ``search_early`` its
    search index is built at the first assembly and kept up to date from then on."""
    clock = FakeClock(START)
    ids = (f"id{n}" for n in itertools.count())  # the same summary ids in both runs
    engine = DagEngine(summarizer=ExtractiveSummarizer(), clock=clock, make_id=ids.__next__)
    for index in range(1, len(messages) + 1):
        if messages[index - 1].role != "user":
            continue
        clock.advance(max(0.0, messages[index - 1].ts - clock.now()))
        engine.assemble(SESSION, messages[:index], 8_000)
        if search_early:
            assert len(engine.sessions[SESSION].index) > 0
    return engine


def test_a_search_index_built_when_first_searched_ranks_as_one_kept_all_along() -> None:
    """A session rebuilt from the log indexes its history for full-text search only
    when something searches it (the rebuild above went from 290 ms to about 10 ms at
    4,800 messages, nearly all of it that index). Built late, from the messages and
    summaries the session holds, it must rank exactly as the index kept up to date
    message by message and summary by summary."""
    messages = tau_context_messages(SMALL)
    kept = _assembled(messages, search_early=True).sessions[SESSION]
    late = _assembled(messages, search_early=False).sessions[SESSION]
    assert kept.nodes  # summaries were made
    assert kept.nodes.keys() == late.nodes.keys()
    queries = [m.content for m in messages if m.role == "user"][:: len(messages) // 40]
    queries += ["refund", "cancel my reservation", "economy basic_economy", "HAT170"]
    docs = [f"m:{m.message_id}" for m in kept.messages] + [f"s:{node}" for node in kept.nodes]
    assert len(late.index) == len(kept.index) == len(docs)
    for query in queries:
        assert late.index.search(query, 20) == kept.index.search(query, 20), query
        assert late.index.scores(query, docs) == kept.index.scores(query, docs), query
