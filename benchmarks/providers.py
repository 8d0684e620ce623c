"""What the stalwart streaming path costs over a bare httpx stream, on the same server.

The fake provider runs as its own process (``stalwart fake-provider``), so this process's
CPU time (``time.process_time``) is the client's alone. Four clients read the same
replies from it:

- ``bare``: httpx streams the body and throws the bytes away (the floor: transport only);
- ``peer``: httpx plus the least a hand-written client must do: split the event stream
  into lines and JSON-decode each ``data:`` frame;
- ``client``: stalwart's ``ProviderClient.stream`` (SSE parser, wire decoder, neutral
  events), no log;
- ``caller``: stalwart's ``ModelCaller.call``: the client plus deadlines (on a scheduler
  timer, as a runtime keeps them), the breaker and every event appended durably to an
  LMDB store (what an agent really runs).

Throughput is tokens (deltas) per second of a long reply; latency is the wall time of a
short call, sequentially. Ratios are stalwart / peer. The fake provider (a Python server)
is usually the slower side, so tokens/s says whether stalwart keeps up with the stream;
CPU time per token says what stalwart's parsing costs over the least a client must do.
The caller's extra latency per call is mostly its durable appends (a call records
``prompt:started``, the first ``prompt:activity``, and its outcome in two streams).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable

import anyio
import httpx
import msgspec

from benchmarks._machine import scratch
from benchmarks._registry import Result, benchmark, ratio
from stalwart import store as store_module
from stalwart.actors import Scheduler
from stalwart.clock import SystemClock
from stalwart.config import parse_config
from stalwart.providers import Message, ProviderRequest
from stalwart.runtime import ProviderLayer

_SCRIPT = """
[[steps]]
action = "answer"
model = "long"
times = 0
text = "{long}"

[default]
action = "answer"
text = "The refund was issued on Monday."
"""


def _start_fake(words: int, directory: str) -> tuple[subprocess.Popen[str], str]:
    script = os.path.join(directory, "script.toml")
    with open(script, "w", encoding="utf-8") as handle:
        handle.write(_SCRIPT.format(long=" ".join(["token"] * words)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalwart", "fake-provider", "--script", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    banner = proc.stdout.readline()
    # it prints a line per request: keep its pipe drained or it blocks on a full pipe
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, banner.rsplit(" ", 1)[-1].strip()


def _body(model: str) -> bytes:
    return msgspec.json.encode(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Where is my refund?"}],
            "max_tokens": 1024,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


async def _bare(http: httpx.AsyncClient, url: str, model: str) -> int:
    async with http.stream("POST", url, content=_body(model)) as response:
        size = 0
        async for chunk in response.aiter_raw():
            size += len(chunk)
        return size


async def _peer(http: httpx.AsyncClient, url: str, model: str) -> int:
    decode = msgspec.json.decode
    tokens = 0
    async with http.stream("POST", url, content=_body(model)) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = decode(line[6:])
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        tokens += 1
    return tokens


def _timed(run: Callable[[], Awaitable[object]], calls: int) -> tuple[list[float], float]:
    """Wall seconds of each call, and the CPU seconds of them all."""

    async def go() -> tuple[list[float], float]:
        walls = []
        cpu = time.process_time()
        for _ in range(calls):
            started = time.perf_counter()
            await run()
            walls.append(time.perf_counter() - started)
        return walls, time.process_time() - cpu

    return anyio.run(go)


class _Clients:
    """The four clients of one run, over one fake provider and one store."""

    def __init__(self, base_url: str, directory: str) -> None:
        self.url = f"{base_url}/chat/completions"
        self.store = store_module.open(os.path.join(directory, "store"))
        config = parse_config(
            {
                "providers": {"fake": {"kind": "openai", "base_url": base_url}},
                "agents": {"default": {"provider": "fake", "model": "long"}},
            }
        )
        self.config = config
        self.http: httpx.AsyncClient | None = None
        self.layer: ProviderLayer | None = None
        # the caller as a runtime runs it: deadlines and backoffs on a scheduler timer
        self.clock = SystemClock()
        self.scheduler = Scheduler(self.clock).start()

    def request(self) -> ProviderRequest:
        return ProviderRequest(messages=(Message(role="user", content="Where is my refund?"),))

    def run(self, kind: str, model: str) -> Callable[[], Awaitable[object]]:
        async def call() -> object:
            if self.http is None:  # made inside the event loop that uses them
                self.http = httpx.AsyncClient(timeout=None)
                self.layer = ProviderLayer(self.config, self.store)
            assert self.layer is not None
            if kind == "bare":
                return await _bare(self.http, self.url, model)
            if kind == "peer":
                return await _peer(self.http, self.url, model)
            if kind == "client":
                events = 0
                async for _ in self.layer.clients["fake"].stream(model, self.request()):
                    events += 1
                return events
            caller = self.layer.caller(timer=self._timer)
            caller.agent = msgspec.structs.replace(caller.agent, model=model)
            return await caller.call("session:bench", self.request())

        return call

    def reset(self) -> None:
        """A fresh client per measurement: each opens its own connection pool."""
        self.http = None
        self.layer = None

    def _timer(self, seconds: float, expire: Callable[[], object]) -> Callable[[], object]:
        """The runtime's ``clock_timer``, with this event loop in its portal's place."""
        loop = asyncio.get_running_loop()

        def fire(_at: float) -> None:
            loop.call_soon_threadsafe(expire)

        return self.scheduler.schedule(self.clock.now() + seconds, fire).cancel

    def close(self) -> None:
        self.scheduler.stop()
        self.store.close()


KINDS = ("bare", "peer", "client", "caller")


def _measure(result: Result, clients: _Clients, words: int, long_calls: int, short: int) -> None:
    """Best of three interleaved rounds: a noisy moment on the shared machine hits one
    round of every client, not every round of one."""
    figures = result.figures
    for _ in range(3):
        for kind in KINDS:
            clients.reset()
            walls, cpu = _timed(clients.run(kind, "long"), long_calls + 1)
            tokens = words * long_calls
            rate = tokens / sum(walls[1:])  # the first call warms the connection
            cpu_us = cpu / (tokens + words) * 1e6
            clients.reset()
            walls, _ = _timed(clients.run(kind, "short"), short + 1)
            p50 = statistics.median(walls[1:]) * 1000
            for key, value, better in (
                (f"{kind}_tokens_per_s", rate, max),
                (f"{kind}_cpu_us_per_token", cpu_us, min),
                (f"{kind}_call_p50_ms", p50, min),
            ):
                figures[key] = better(figures.get(key, value), value)


@benchmark("providers")
def run(quick: bool) -> Result:
    """Stalwart's streaming path against bare httpx on the fake provider."""
    words, long_calls, short = (1_000, 2, 20) if quick else (20_000, 3, 150)
    result = Result("providers")
    with scratch() as directory:
        proc, base_url = _start_fake(words, directory)
        clients = _Clients(base_url, directory)
        try:
            _measure(result, clients, words, long_calls, short)
        finally:
            clients.close()
            proc.terminate()
            proc.wait(timeout=10)
    figures = result.figures
    result.ratios["client_vs_peer_tokens"] = ratio(
        figures["client_tokens_per_s"], figures["peer_tokens_per_s"]
    )
    result.ratios["caller_vs_peer_tokens"] = ratio(
        figures["caller_tokens_per_s"], figures["peer_tokens_per_s"]
    )
    result.ratios["peer_vs_client_cpu"] = ratio(
        figures["peer_cpu_us_per_token"], figures["client_cpu_us_per_token"]
    )
    figures["caller_added_ms_per_call"] = (
        figures["caller_call_p50_ms"] - figures["peer_call_p50_ms"]
    )
    figures["client_added_ms_per_call"] = (
        figures["client_call_p50_ms"] - figures["peer_call_p50_ms"]
    )
    result.goal("peer_vs_client_cpu", ">=", 0.7)
    result.goal("caller_vs_peer_tokens", ">=", 0.7)
    result.goal("caller_added_ms_per_call", "<=", 10.0)
    return result
