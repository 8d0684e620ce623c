"""What the benchmarks feed the store, and how they drive it: events and load generators."""

from __future__ import annotations

import math
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence

from stalwart.events import (
    DEFAULT_CODEC,
    Event,
    MessageAppended,
    PromptActivity,
    PromptCompleted,
    PromptStarted,
    RecordedEvent,
    ToolCall,
    ToolCompleted,
    ToolStarted,
    TurnCompleted,
    TurnStarted,
)

#: ~150 characters of assistant text: with its envelope a ~300-byte stored record.
CONTENT = (
    "The deployment finished without errors; the health checks on all three regions "
    "passed and latency is back under the target. Anything else to look at?"
)[:150]

_WORDS = [
    *("the", "agent", "read", "file", "config", "deploy", "region", "latency", "token"),
    *("model", "retry", "tool", "call", "result", "error", "stream", "session", "turn"),
    *("summary", "check", "health", "plan", "step", "output"),
]


def message(index: int = 0) -> MessageAppended:
    """One assistant message with :data:`CONTENT`."""
    return MessageAppended(message_id=f"{index:032x}", role="assistant", content=CONTENT)


def record_bytes(event: Event, stream: str = "session:append-00") -> bytes:
    """The bytes the store writes for ``event`` as the first event of ``stream``."""
    record = RecordedEvent(
        position=1,
        stream=stream,
        version=1,
        ts=1_800_000_000.123456,
        id="0" * 32,
        causation_id=None,
        correlation_id=None,
        schema=1,
        event=event,
    )
    return DEFAULT_CODEC.encode(record)


def _text(rng: random.Random, low: int, high: int) -> str:
    size = rng.randint(low, high)
    words: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:size]


def session_turn(rng: random.Random, turn: int) -> list[Event]:
    """One realistic turn of a session: 12 events (messages, a prompt, a tool call)."""
    turn_id = f"t{turn:08d}"
    call = f"c{turn:08d}"
    tool_call = f"tc{turn:07d}"
    events: list[Event] = [
        TurnStarted(turn_id=turn_id),
        MessageAppended(
            message_id=f"m{turn:08d}u", role="user", content=_text(rng, 40, 400), turn_id=turn_id
        ),
        PromptStarted(call_id=call, provider="anthropic", model="claude-sonnet", timeout_ms=60_000),
    ]
    events += [PromptActivity(call_id=call, tokens=rng.randint(1, 400)) for _ in range(3)]
    events += [
        PromptCompleted(call_id=call, input_tokens=rng.randint(500, 9000), output_tokens=400),
        MessageAppended(
            message_id=f"m{turn:08d}a",
            role="assistant",
            content=_text(rng, 100, 900),
            tool_calls=(ToolCall(id=tool_call, name="read_file", arguments='{"path": "a.py"}'),),
            turn_id=turn_id,
        ),
        ToolStarted(call_id=tool_call, tool="read_file", arguments='{"path": "a.py"}'),
        ToolCompleted(call_id=tool_call, tool="read_file", output=_text(rng, 50, 600)),
        MessageAppended(
            message_id=f"m{turn:08d}t",
            role="tool",
            content=_text(rng, 50, 300),
            tool_call_id=tool_call,
            turn_id=turn_id,
        ),
        TurnCompleted(turn_id=turn_id),
    ]
    return events


def concurrent_rate(workers: Sequence[Callable[[], object]], seconds: float) -> float:
    """Calls per second of ``workers``, each called in a loop by its own thread.

    Every worker is made before the clock starts; all threads start together on a
    barrier and stop after ``seconds``; the calls still in flight then finish and count.
    """
    stop = threading.Event()
    counts = [0] * len(workers)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(workers) + 1)

    def loop(index: int) -> None:
        call = workers[index]
        barrier.wait()
        done = 0
        try:
            while not stop.is_set():
                call()
                done += 1
        except BaseException as exc:
            errors.append(exc)
            stop.set()
        counts[index] = done

    threads = [
        threading.Thread(target=loop, args=(i,), name=f"bench-{i}", daemon=True)
        for i in range(len(workers))
    ]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    stop.wait(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return sum(counts) / elapsed


def handoff_rate(
    threads: int, seconds: float, commit: Callable[[int], object] | None = None
) -> float:
    """Calls per second when ``threads`` threads each hand a call to one server thread and
    wait for its answer, which it gives to every waiting call at once: the workload of the
    append benchmark with no store and no disk, its ceiling for threads of this process.

    With ``commit``, the server calls ``commit(n)`` for each batch of ``n`` calls before it
    answers them (a durable transaction of ``n`` puts, say): the same ceiling with the
    peer's own disk work in it."""
    requests: queue.SimpleQueue[threading.Lock | None] = queue.SimpleQueue()

    def serve() -> None:
        while (first := requests.get()) is not None:
            waiting = [first]
            while True:
                try:
                    more = requests.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    return
                waiting.append(more)
            if commit is not None:
                commit(len(waiting))
            for answered in waiting:
                answered.release()

    def call() -> None:
        done = threading.Lock()
        done.acquire()
        requests.put(done)
        done.acquire()

    server = threading.Thread(target=serve, name="bench-handoff", daemon=True)
    server.start()
    try:
        return concurrent_rate([call] * threads, seconds)
    finally:
        requests.put(None)
        server.join()


def fsync_rate(directory: str, seconds: float) -> float:
    """fsyncs per second of a 64-byte rewrite of one block: the disk's durable-commit limit."""
    path = os.path.join(directory, "fsync.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        done = 0
        started = time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            os.pwrite(fd, b"x" * 64, 0)
            os.fsync(fd)
            done += 1
        return done / elapsed
    finally:
        os.close(fd)
        os.remove(path)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]
