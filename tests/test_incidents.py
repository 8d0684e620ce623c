"""Incidents per provider and model: the projection on hand-built logs, the command, and
real calls through the provider layer against the fake provider."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.clock import SystemClock
from stalwart.config import parse_config
from stalwart.errors import ConfigError
from stalwart.events import (
    BreakerOpened,
    Event,
    MessageAppended,
    ModelFallbackAttempt,
    ModelFallbackExhausted,
    PromptCompleted,
    PromptFailed,
    PromptStarted,
    PromptTimeout,
    ProviderCallFailed,
    ProviderCallSucceeded,
    ProviderDegraded,
    ProviderRecovered,
)
from stalwart.providers import Message, ProviderRequest
from stalwart.runtime import ProviderLayer
from stalwart.state import (
    IncidentsFolder,
    IncidentsState,
    ModelIncidents,
    apply_incidents,
    bucket_upper,
    incidents,
    latency_bucket,
    latency_percentile,
    split_model,
)
from stalwart.store import EventStore, NewEvent
from stalwart.testing import Answer, Fail, FakeProvider, Stall

T0 = 1_790_000_000.0


@pytest.fixture
def store(store_dir: Path) -> Iterator[EventStore]:
    opened = store_module.open(store_dir)
    try:
        yield opened
    finally:
        opened.close()


def put(store: EventStore, stream: str, ts: float, *events: Event) -> None:
    store.append(stream, [NewEvent(event=event, ts=ts) for event in events])


def started(call_id: str, provider: str, model: str) -> PromptStarted:
    return PromptStarted(call_id=call_id, provider=provider, model=model)


def ok(provider: str, model: str, latency_ms: int = 100) -> ProviderCallSucceeded:
    return ProviderCallSucceeded(provider=provider, model=model, agent="a", latency_ms=latency_ms)


def failed(provider: str, model: str, error_class: str, status: int | None = None) -> Event:
    return ProviderCallFailed(
        provider=provider, model=model, agent="a", error_class=error_class, status=status
    )


def stall(call_id: str) -> PromptTimeout:
    return PromptTimeout(
        call_id=call_id, limit="stall", knob="prompt_timeout_ms", limit_ms=250, elapsed_ms=260
    )


def fill(store: EventStore) -> None:
    """gpt-4o: a success, a stall; a fallback to claude, which answers once and 503s once."""
    put(store, "session:a", T0, started("c1", "openai", "gpt-4o"))
    put(store, "provider:openai", T0 + 1, ok("openai", "gpt-4o", 120))
    put(store, "session:a", T0 + 1, PromptCompleted(call_id="c1"))
    put(store, "session:a", T0 + 10, started("c2", "openai", "gpt-4o"))
    put(store, "session:a", T0 + 11, stall("c2"))
    put(store, "session:a", T0 + 11, PromptFailed(call_id="c2", error_class="timeout_stall"))
    put(store, "provider:openai", T0 + 11, failed("openai", "gpt-4o", "timeout_stall"))
    put(
        store,
        "session:a",
        T0 + 12,
        ModelFallbackAttempt(
            from_model="openai:gpt-4o", to_model="anthropic:claude", attempt=1, reason="x"
        ),
        started("c3", "anthropic", "claude"),
    )
    put(store, "provider:anthropic", T0 + 13, ok("anthropic", "claude", 300))
    put(store, "session:a", T0 + 13, PromptCompleted(call_id="c3"))
    put(
        store, "provider:openai", T0 + 15, BreakerOpened(provider="openai", failures=3, threshold=3)
    )
    put(store, "provider:openai", T0 + 16, ProviderDegraded(provider="openai", rule="agents"))
    put(store, "provider:openai", T0 + 17, ProviderRecovered(provider="openai"))
    put(store, "provider:anthropic", T0 + 20, failed("anthropic", "claude", "unavailable", 503))
    put(
        store,
        "session:b",
        T0 + 30,
        ModelFallbackExhausted(models=("openai:gpt-4o", "anthropic:claude"), reason="unavailable"),
    )


def by_model(state: IncidentsState) -> dict[tuple[str, str], ModelIncidents]:
    return {(m.provider, m.model): m for m in state.models}


# -- the projection -----------------------------------------------------------------------


def test_counts_rates_and_provider_episodes(store: EventStore) -> None:
    fill(store)
    state = incidents(store.read_all())
    rows = by_model(state)
    assert set(rows) == {("openai", "gpt-4o"), ("anthropic", "claude")}
    gpt, claude = rows["openai", "gpt-4o"], rows["anthropic", "claude"]
    assert (gpt.calls, gpt.succeeded, gpt.failed, gpt.failure_rate) == (2, 1, 1, 0.5)
    assert gpt.failures == {"timeout_stall": 1}
    assert gpt.timeouts == {"stall": 1}
    assert (gpt.fallbacks_away, gpt.fallbacks_to, gpt.fallbacks_exhausted) == (1, 0, 1)
    assert (gpt.first_seen, gpt.last_seen) == (T0 + 1, T0 + 30)
    assert (claude.calls, claude.failed, claude.failures) == (2, 1, {"unavailable": 1})
    assert (claude.fallbacks_away, claude.fallbacks_to, claude.fallbacks_exhausted) == (0, 1, 0)
    assert claude.timeouts == {}
    assert (claude.first_seen, claude.last_seen) == (T0 + 12, T0 + 20)
    [openai] = state.providers
    assert (openai.provider, openai.breaker_openings, openai.degraded_episodes) == (
        "openai",
        1,
        1,
    )
    assert (openai.first_seen, openai.last_seen) == (T0 + 15, T0 + 16)
    assert state.open_calls == ()  # every call ended, so the join holds nothing
    assert (state.unmatched_timeouts, state.forgotten_calls) == (0, 0)


def test_timeouts_are_attributed_through_call_ids(store: EventStore) -> None:
    # two calls open at once on different models, in different sessions; the timeouts name
    # only their call ids, and come in the other order
    put(store, "session:a", T0, started("a1", "openai", "gpt-4o"))
    put(store, "session:b", T0 + 1, started("b1", "anthropic", "claude"))
    put(
        store,
        "session:b",
        T0 + 2,
        PromptTimeout(call_id="b1", limit="makespan", knob="k", limit_ms=500, elapsed_ms=510),
    )
    put(store, "session:a", T0 + 3, stall("a1"))
    put(store, "session:c", T0 + 4, stall("nobody"))
    state = incidents(store.read_all())
    rows = by_model(state)
    assert rows["openai", "gpt-4o"].timeouts == {"stall": 1}
    assert rows["anthropic", "claude"].timeouts == {"makespan": 1}
    assert rows["anthropic", "claude"].timeout_count == 1
    assert rows["anthropic", "claude"].calls == 0  # a timeout is not a call by itself
    assert state.unmatched_timeouts == 1


def test_a_timeout_counts_once_even_if_repeated(store: EventStore) -> None:
    put(store, "session:a", T0, started("a1", "openai", "gpt-4o"))
    put(store, "session:a", T0 + 1, stall("a1"), stall("a1"))
    state = incidents(store.read_all())
    assert by_model(state)["openai", "gpt-4o"].timeouts == {"stall": 1}
    assert state.unmatched_timeouts == 1  # the call had ended: the join forgot it


def test_the_join_memory_is_bounded(store: EventStore) -> None:
    # ten calls that never end (a crashed process): only the newest three are remembered
    for n in range(10):
        put(store, "session:a", T0 + n, started(f"c{n}", "openai", f"m{n}"))
    put(store, "session:a", T0 + 20, stall("c0"), stall("c9"))
    state = incidents(store.read_all(), max_open_calls=3)
    assert [c.call_id for c in state.open_calls] == ["c7", "c8"]
    assert state.forgotten_calls == 7
    assert state.unmatched_timeouts == 1
    assert by_model(state)["openai", "m9"].timeouts == {"stall": 1}
    assert ("openai", "m0") not in by_model(state)


def test_ended_calls_are_forgotten(store: EventStore) -> None:
    for n in range(200):
        put(
            store,
            "session:a",
            T0 + n,
            started(f"c{n}", "openai", "m"),
            PromptCompleted(call_id=f"c{n}")
            if n % 2
            else PromptFailed(call_id=f"c{n}", error_class="unavailable"),
        )
    folder = IncidentsFolder(IncidentsState(max_open_calls=10))
    for record in store.read_all():
        folder.add(record)
        assert len(folder.state().open_calls) <= 1
    assert folder.state().forgotten_calls == 0


def test_max_open_calls_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max_open_calls"):
        incidents([], max_open_calls=0)


def test_fallbacks_count_both_ways(store: EventStore) -> None:
    def attempt(source: str, target: str) -> ModelFallbackAttempt:
        return ModelFallbackAttempt(from_model=source, to_model=target, attempt=1, reason="x")

    put(
        store,
        "session:a",
        T0,
        attempt("main:m1", "backup:m2"),
        attempt("backup:m2", "main:m3"),
        attempt("main:m1", "main:m3"),
        ModelFallbackExhausted(models=("main:m1", "backup:m2", "main:m3"), reason="x"),
        ModelFallbackExhausted(models=(), reason="x"),  # nothing to attribute it to
    )
    rows = by_model(incidents(store.read_all()))
    away_to_exhausted = {
        key: (m.fallbacks_away, m.fallbacks_to, m.fallbacks_exhausted) for key, m in rows.items()
    }
    assert away_to_exhausted == {
        ("main", "m1"): (2, 0, 1),
        ("backup", "m2"): (1, 1, 0),
        ("main", "m3"): (0, 2, 0),
    }
    assert all(m.calls == 0 and m.failure_rate == 0.0 for m in rows.values())


def attempt_failed(
    call_id: str, error_class: str = "unavailable", retry_of: str = "", model: str = "gpt-4o"
) -> ProviderCallFailed:
    return ProviderCallFailed(
        provider="openai",
        model=model,
        agent="a",
        error_class=error_class,
        call_id=call_id,
        retry_of=retry_of,
    )


def test_a_call_is_counted_once_by_its_latest_attempt(store: EventStore) -> None:
    """The attempts on one model are one call, as the breaker and the health monitor
    count them: a retry takes its failed attempt's place, whatever it ends in."""
    put(
        store,
        "provider:openai",
        T0,
        # a call whose retry answered: one success, its failure taken back
        attempt_failed("a1", "timeout_stall"),
        ProviderCallSucceeded(provider="openai", model="gpt-4o", agent="a", retry_of="a1"),
        # a call of three failed attempts: one failure, of the last attempt's class
        attempt_failed("b1", "rate_limited"),
        attempt_failed("b2", "unavailable", retry_of="b1"),
        attempt_failed("b3", "server_error", retry_of="b2"),
        # a call that failed once, with no retry
        attempt_failed("c1", "unavailable"),
    )
    gpt = by_model(incidents(store.read_all()))["openai", "gpt-4o"]
    assert (gpt.calls, gpt.succeeded, gpt.failed, gpt.retried) == (3, 1, 2, 3)
    assert gpt.failures == {"server_error": 1, "unavailable": 1}
    assert gpt.failure_rate == 2 / 3


def test_a_retry_whose_attempt_is_not_counted_is_a_call_of_its_own(store: EventStore) -> None:
    put(store, "provider:openai", T0, attempt_failed("a1"))
    put(store, "provider:openai", T0 + 10, attempt_failed("a2", retry_of="a1"))
    put(store, "provider:openai", T0 + 11, attempt_failed("b1"), attempt_failed("b2"))
    put(store, "provider:openai", T0 + 12, attempt_failed("b3", retry_of="b1"))
    put(store, "provider:openai", T0 + 12, attempt_failed("b4", retry_of="b2"))
    late = by_model(incidents(store.read_all(), since=T0 + 5))["openai", "gpt-4o"]
    assert (late.calls, late.failed, late.retried) == (3, 3, 2)  # a1 was before since
    state = incidents(store.read_all(), since=T0 + 5, max_open_calls=1)
    bounded = by_model(state)["openai", "gpt-4o"]
    # one failed attempt remembered: each is forgotten for the next before its retry
    # comes, so every retry is a call of its own
    assert (bounded.calls, bounded.failed, bounded.retried) == (5, 5, 0)
    assert [f.call_id for f in state.failed_attempts] == ["b4"]
    assert state.forgotten_calls == 4


def test_calls_are_counted_only_in_provider_streams(store: EventStore) -> None:
    put(store, "session:a", T0, ok("openai", "gpt-4o"), failed("openai", "gpt-4o", "x"))
    put(store, "provider:openai", T0, ok("openai", "gpt-4o"))
    assert by_model(incidents(store.read_all()))["openai", "gpt-4o"].calls == 1


def test_events_of_other_kinds_are_ignored(store: EventStore) -> None:
    put(store, "session:a", T0, MessageAppended(message_id="m", role="user", content="hi"))
    assert incidents(store.read_all()) == IncidentsState()


@pytest.mark.parametrize(
    ("since", "gpt_calls", "claude_calls", "exhausted"),
    [
        (None, 2, 2, 1),
        (T0 + 1, 2, 2, 1),  # at an event's own timestamp: it is in
        (T0 + 1.001, 1, 2, 1),  # just after: it is out
        (T0 + 20, 0, 1, 1),
        (T0 + 30, 0, 0, 1),  # claude has no row at all
        (T0 + 30.001, None, None, None),
    ],
)
def test_since_boundaries(
    store: EventStore,
    since: float | None,
    gpt_calls: int | None,
    claude_calls: int | None,
    exhausted: int | None,
) -> None:
    fill(store)
    state = incidents(store.read_all(), since=since)
    assert state.since == since
    rows = by_model(state)
    if gpt_calls is None:
        assert state.models == ()
        assert state.providers == ()
        return
    gpt = rows["openai", "gpt-4o"]
    assert (gpt.calls, gpt.fallbacks_exhausted) == (gpt_calls, exhausted)
    nothing = ModelIncidents(provider="anthropic", model="claude")
    assert rows.get(("anthropic", "claude"), nothing).calls == claude_calls
    assert gpt.first_seen is not None
    assert since is None or gpt.first_seen >= since


def test_a_call_started_before_since_is_still_attributed(store: EventStore) -> None:
    put(store, "session:a", T0, started("c1", "openai", "gpt-4o"))
    put(store, "session:a", T0 + 100, stall("c1"))
    put(store, "session:a", T0 + 100, started("c2", "openai", "gpt-4o"))
    put(store, "session:a", T0 + 50, stall("c2"))  # stamped before since: not counted
    state = incidents(store.read_all(), since=T0 + 60)
    gpt = by_model(state)["openai", "gpt-4o"]
    assert gpt.timeouts == {"stall": 1}
    assert (gpt.first_seen, gpt.last_seen) == (T0 + 100, T0 + 100)
    assert state.unmatched_timeouts == 0


def test_apply_equals_the_folder_and_a_prefix_then_the_rest_equals_all(
    store: EventStore,
) -> None:
    fill(store)
    put(store, "session:z", T0 + 40, started("open", "openai", "gpt-4o"))
    put(store, "provider:openai", T0 + 41, attempt_failed("r1"), attempt_failed("s1"))
    put(store, "provider:openai", T0 + 42, attempt_failed("r2", retry_of="r1"))
    records = list(store.read_all())
    whole = incidents(records, since=T0 + 5, max_open_calls=2)
    state = IncidentsState(since=T0 + 5, max_open_calls=2)
    for record in records:
        state = apply_incidents(state, record)
    assert state == whole
    for cut in range(len(records) + 1):
        folder = IncidentsFolder(IncidentsState(since=T0 + 5, max_open_calls=2))
        for record in records[:cut]:
            folder.add(record)
        resumed = IncidentsFolder(folder.state())
        for record in records[cut:]:
            resumed.add(record)
        assert resumed.state() == whole


# -- latency ------------------------------------------------------------------------------


def test_latency_buckets_cover_every_value_within_an_eighth() -> None:
    previous = 0
    for ms in range(100_000):
        bucket = latency_bucket(ms)
        assert bucket in (previous, previous + 1)  # monotone, no bucket skipped
        assert ms <= bucket_upper(bucket) <= ms + ms // 8 + 1
        assert bucket == 0 or bucket_upper(bucket - 1) < ms
        previous = bucket
    assert [latency_bucket(ms) for ms in (0, 15, 16, 17, 18, 31, 32)] == [
        0,
        15,
        16,
        16,
        17,
        23,
        24,
    ]
    assert latency_bucket(-5) == 0


def test_latency_percentiles(store: EventStore) -> None:
    for ms in range(1, 101):
        put(store, "provider:p", T0 + ms, ok("p", "m", ms))
    put(store, "provider:p", T0 + 200, failed("p", "m", "unavailable"))
    model = by_model(incidents(store.read_all()))["p", "m"]
    p50, p99 = latency_percentile(model, 50), latency_percentile(model, 99)
    assert p50 is not None
    assert 50 <= p50 <= 50 * 9 // 8
    assert p99 is not None
    assert 99 <= p99 <= 100
    assert latency_percentile(model, 100) == 100
    assert model.latency_max_ms == 100
    assert sum(count for _, count in model.latency_buckets) == 100  # failures have none
    assert latency_percentile(ModelIncidents(provider="p", model="m"), 50) is None


def test_a_single_latency_is_reported_exactly(store: EventStore) -> None:
    put(store, "provider:p", T0, ok("p", "m", 1234))
    model = by_model(incidents(store.read_all()))["p", "m"]
    assert latency_percentile(model, 50) == latency_percentile(model, 99) == 1234


def test_split_model() -> None:
    assert split_model("openai:gpt-4o") == ("openai", "gpt-4o")
    assert split_model("ollama:llama3:8b") == ("ollama", "llama3:8b")
    assert split_model("bare") == ("", "bare")


# -- the command --------------------------------------------------------------------------


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def filled(store_dir: Path) -> Path:
    with store_module.open(store_dir) as opened:  # type: ignore[attr-defined]
        fill(opened)
        # a third model with no failures, and a worse one with fewer calls
        put(opened, "provider:openai", T0 + 40, ok("openai", "gpt-4o-mini"))
        put(
            opened,
            "provider:local",
            T0 + 41,
            failed("local", "llama", "connect"),
            failed("local", "llama", "connect"),
        )
        put(
            opened,
            "provider:flaky",
            T0 + 42,
            BreakerOpened(provider="flaky", failures=3, threshold=3),
        )
    return store_dir


def test_the_table_is_worst_first(filled: Path) -> None:
    code, out, err = run("--store", str(filled), "incidents")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "7 calls, 4 failed, 1 timeout across 4 models"
    assert lines[1].split() == [
        "PROVIDER",
        "MODEL",
        "CALLS",
        "FAILURES",
        "RATE",
        "TIMEOUTS",
        "FALLBACKS",
        "AWAY",
        "LAST",
        "SEEN",
    ]
    table = [line.split() for line in lines[2:]]
    assert [row[:7] for row in table] == [
        ["local", "llama", "2", "2", "100.0%", "0", "0"],
        ["anthropic", "claude", "2", "1", "50.0%", "0", "0"],
        ["openai", "gpt-4o", "2", "1", "50.0%", "1", "1"],
        ["flaky", "-", "0", "0", "0.0%", "0", "0"],
        ["openai", "gpt-4o-mini", "1", "0", "0.0%", "0", "0"],
    ]
    assert table[0][7] == "2026-09-21T14:14:01.000Z"


def test_json_is_one_object_per_model_with_the_documented_keys(filled: Path) -> None:
    code, out, _ = run("--store", str(filled), "incidents", "--json")
    assert code == 0
    objects = [json.loads(line) for line in out.splitlines()]
    assert [(o["provider"], o["model"]) for o in objects] == [
        ("local", "llama"),
        ("anthropic", "claude"),
        ("openai", "gpt-4o"),
        ("flaky", None),
        ("openai", "gpt-4o-mini"),
    ]
    assert {frozenset(o) for o in objects} == {
        frozenset(
            {
                "provider",
                "model",
                "calls",
                "succeeded",
                "failed",
                "failure_rate",
                "failures_by_class",
                "retried",
                "timeouts",
                "timeouts_by_limit",
                "fallbacks_away",
                "fallbacks_to",
                "fallbacks_exhausted",
                "breaker_openings",
                "degraded_episodes",
                "first_seen",
                "last_seen",
                "latency_p50_ms",
                "latency_p99_ms",
            }
        )
    }
    gpt = objects[2]
    assert gpt == {
        "provider": "openai",
        "model": "gpt-4o",
        "calls": 2,
        "succeeded": 1,
        "failed": 1,
        "failure_rate": 0.5,
        "failures_by_class": {"timeout_stall": 1},
        "retried": 0,
        "timeouts": 1,
        "timeouts_by_limit": {"stall": 1},
        "fallbacks_away": 1,
        "fallbacks_to": 0,
        "fallbacks_exhausted": 1,
        "breaker_openings": 1,
        "degraded_episodes": 1,
        "first_seen": T0 + 1,
        "last_seen": T0 + 30,
        "latency_p50_ms": 120,
        "latency_p99_ms": 120,
    }
    assert objects[3]["breaker_openings"] == 1
    assert objects[3]["first_seen"] == T0 + 42


def test_provider_filter(filled: Path) -> None:
    code, out, _ = run("--store", str(filled), "incidents", "--provider", "openai", "--json")
    assert code == 0
    assert [json.loads(line)["model"] for line in out.splitlines()] == ["gpt-4o", "gpt-4o-mini"]
    code, out, _ = run("--store", str(filled), "incidents", "--provider", "openai")
    assert out.splitlines()[0] == "3 calls, 1 failed, 1 timeout across 2 models"
    code, out, _ = run("--store", str(filled), "incidents", "--provider", "nobody")
    assert (code, out) == (0, "no provider calls match the filters\n")
    code, out, _ = run("--store", str(filled), "incidents", "--provider", "nobody", "--json")
    assert (code, out) == (0, "")


LLAMA, CLAUDE, GPT, FLAKY, MINI = (
    ("local", "llama"),
    ("anthropic", "claude"),
    ("openai", "gpt-4o"),
    ("flaky", None),
    ("openai", "gpt-4o-mini"),
)
EVERY = [LLAMA, CLAUDE, GPT, FLAKY, MINI]


@pytest.mark.parametrize(
    ("since", "models"),
    [
        # the newest event is at T0 + 42: relative forms count back from it, not from now
        ("1s", [LLAMA, FLAKY]),
        ("2s", [LLAMA, FLAKY, MINI]),
        ("22s", [LLAMA, CLAUDE, FLAKY, GPT, MINI]),  # only claude's 503 and gpt's exhausted
        ("32s", [LLAMA, GPT, CLAUDE, FLAKY, MINI]),  # gpt: its stall only, 100 %
        ("1m", EVERY),
        ("2h", EVERY),
        ("1d", EVERY),
        (str(int(T0 + 41)), [LLAMA, FLAKY]),
        (f"{T0 + 41.5}", [FLAKY]),
        (str(int(T0 + 43)), []),
    ],
)
def test_since_forms(filled: Path, since: str, models: list[tuple[str, str | None]]) -> None:
    code, out, err = run("--store", str(filled), "incidents", "--since", since, "--json")
    assert (code, err) == (0, "")
    assert [(o["provider"], o["model"]) for o in map(json.loads, out.splitlines())] == models


def test_since_relative_to_the_newest_event_in_the_header(filled: Path) -> None:
    code, out, _ = run("--store", str(filled), "incidents", "--since", "32s")
    assert code == 0
    gpt = next(line for line in out.splitlines() if "gpt-4o " in line)
    assert gpt.split()[2:6] == ["1", "1", "100.0%", "1"]  # the success at T0 + 1 is out
    assert out.splitlines()[0].endswith(" since 2026-09-21T14:13:30.000Z")
    code, out, _ = run("--store", str(filled), "incidents", "--since", str(int(T0 + 43)))
    assert (code, out) == (0, "no provider calls match the filters\n")


@pytest.mark.parametrize("since", ["soon", "5x", "-1", "1.5h", "", "30 m2"])
def test_a_bad_since_is_one_line(filled: Path, since: str) -> None:
    code, out, err = run("--store", str(filled), "incidents", "--since", since)
    assert (code, out) == (1, "")
    assert err.count("\n") == 1
    assert err.startswith("stalwart: error: --since: expected a duration (30m, 2h, 1d)")


def test_an_empty_log(store_dir: Path) -> None:
    store_module.open(store_dir).close()
    assert run("--store", str(store_dir), "incidents") == (0, "no provider calls in the log\n", "")
    assert run("--store", str(store_dir), "incidents", "--since", "1h") == (
        0,
        "no provider calls in the log\n",
        "",
    )
    assert run("--store", str(store_dir), "incidents", "--json") == (0, "", "")


def test_a_log_without_provider_calls(store_dir: Path) -> None:
    with store_module.open(store_dir) as opened:  # type: ignore[attr-defined]
        put(opened, "session:a", T0, MessageAppended(message_id="m", role="user", content="hi"))
    assert run("--store", str(store_dir), "incidents") == (0, "no provider calls in the log\n", "")


def test_a_missing_store_is_one_line(tmp_path: Path) -> None:
    code, out, err = run("--store", str(tmp_path / "nowhere"), "incidents")
    assert (code, out) == (1, "")
    assert err.count("\n") == 1
    assert err.startswith("stalwart: error: ")


def test_unmatched_timeouts_are_said_in_the_header(store_dir: Path) -> None:
    with store_module.open(store_dir) as opened:  # type: ignore[attr-defined]
        put(opened, "provider:p", T0, ok("p", "m"))
        put(opened, "session:a", T0, stall("lost"))
    code, out, _ = run("--store", str(store_dir), "incidents")
    assert code == 0
    assert out.splitlines()[0] == (
        "1 call, 0 failed, 0 timeouts across 1 model (1 timeout not matched to a call)"
    )


# -- end to end: real calls through the provider layer ------------------------------------


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_real_calls_are_attributed_to_the_right_models(store_dir: Path) -> None:
    request = ProviderRequest(messages=(Message(role="user", content="hi"),))
    with FakeProvider() as fake:
        fake.set_default(Answer(text="fine"))
        main = {"kind": "openai", "base_url": fake.base_url, "connect_timeout_ms": 1000}
        cfg = parse_config(
            {
                "providers": {"main": main, "backup": dict(main)},
                "agents": {
                    "default": {
                        "provider": "main",
                        "model": "m1",
                        "fallback_models": ["backup:m2"],
                        "prompt_timeout_ms": 250,
                        "retry_prompt_timeout_ms": 300,
                        "activity_interval_ms": 20,
                        "retry_base_ms": 10,
                        "retry_cap_ms": 50,
                        "max_retries": 1,
                    }
                },
            }
        )
        opened = store_module.open(store_dir)
        layer = ProviderLayer(cfg, opened, clock=SystemClock(), rng=random.Random(7))
        try:
            with anyio.fail_after(10):
                # a stall on m1, then its retry answers
                fake.add(Stall(after_deltas=1, model="m1"))
                assert (await layer.caller().call("session:s1", request)).model == "m1"
                # m1 answers 503 twice (the try and its retry): the chain falls back to m2
                fake.add(Fail(status=503, model="m1", times=2))
                reply = await layer.caller().call("session:s2", request)
                assert (reply.provider, reply.model) == ("backup", "m2")
        finally:
            await layer.aclose()
            opened.close()
    code, out, err = run("--store", str(store_dir), "incidents", "--json")
    assert (code, err) == (0, "")
    rows = {(o["provider"], o["model"]): o for o in map(json.loads, out.splitlines())}
    assert set(rows) == {("main", "m1"), ("backup", "m2")}
    m1, m2 = rows["main", "m1"], rows["backup", "m2"]
    # two calls of two attempts each: the stalled one's retry answered, the 503s' did not
    assert (m1["calls"], m1["succeeded"], m1["failed"], m1["retried"]) == (2, 1, 1, 2)
    assert m1["failures_by_class"] == {"unavailable": 1}
    assert m1["timeouts_by_limit"] == {"stall": 1}  # a timeout is an attempt's
    assert (m1["fallbacks_away"], m1["fallbacks_to"], m1["fallbacks_exhausted"]) == (1, 0, 0)
    assert m1["failure_rate"] == 0.5
    assert (m2["calls"], m2["failed"], m2["timeouts"]) == (1, 0, 0)
    assert (m2["fallbacks_away"], m2["fallbacks_to"]) == (0, 1)
    assert m2["latency_p50_ms"] is not None
    code, out, _ = run("--store", str(store_dir), "incidents")
    lines = out.splitlines()
    assert lines[0] == "3 calls, 1 failed (2 failed attempts retried), 1 timeout across 2 models"
    assert [line.split()[:2] for line in lines[2:]] == [["main", "m1"], ["backup", "m2"]]
