"""One provider's breaker in several processes on one store (workers on one PostgreSQL
database, processes on one LMDB directory): every process decides on the provider
stream as the log holds it, so the breaker opens once, at the threshold, for all of
them, and ``replay --verify`` re-derives every decision."""

from __future__ import annotations

import anyio
import pytest

from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.config import Config, parse_config
from stalwart.errors import BreakerOpenError, ProviderError
from stalwart.events import BreakerHalfOpened, BreakerOpened, ProviderCallFailed
from stalwart.providers import Message, ProviderRequest
from stalwart.runtime import ProviderLayer, runtime_started
from stalwart.store import EventStore
from stalwart.testing import Answer, Fail, FakeProvider

REQUEST = ProviderRequest(messages=(Message(role="user", content="hi"),), max_tokens=10)


def _config(base_url: str) -> Config:
    return parse_config(
        {
            "providers": {
                "main": {
                    "kind": "openai",
                    "base_url": base_url,
                    "breaker_failure_threshold": 3,
                    "breaker_reset_timeout_ms": 10_000,
                }
            },
            "agents": {"default": {"provider": "main", "model": "m", "max_retries": 0}},
        }
    )


async def _call(layer: ProviderLayer) -> str:
    """One call through ``layer``: the reply's text, or the error's kind."""
    try:
        reply = await layer.caller().call("session:s1", REQUEST)
    except BreakerOpenError:
        return "refused"
    except ProviderError as exc:
        return exc.kind
    return reply.text


async def _close(*layers: ProviderLayer) -> None:
    for layer in layers:
        await layer.aclose()


def _types(store: EventStore) -> list[str]:
    return [record.type for record in store.read_stream("provider:main")]


# Was: DEFECT: each process's breaker folded only the outcomes it appended: it opened late (after 5 of 6 interleaved failures), twice, and verify reported both decisions  # noqa: E501
def test_two_processes_open_the_breaker_once_at_the_threshold(
    store: EventStore, clock: FakeClock
) -> None:
    with FakeProvider() as fake:
        fake.set_default(Fail(status=503))
        config = _config(fake.base_url)
        one, two = (ProviderLayer(config, store, clock=clock) for _ in range(2))

        async def main() -> list[str]:
            await one.sink.emit("runtime", [runtime_started(config, store, "r1")], clock.now())
            kinds = []
            for layer in (one, two, one, two, one, two):
                kinds.append(await _call(layer))
                clock.advance(1)
            await _close(one, two)
            return kinds

        kinds = anyio.run(main)
        sent = len(fake.requests)
    assert kinds == ["unavailable"] * 3 + ["refused"] * 3  # the third failure opens it
    assert sent == 3
    assert _types(store) == ["provider:call_failed"] * 3 + ["breaker:opened"]
    report = verify_store(store, None)
    assert not report.findings, report.findings


def test_a_probe_in_one_process_closes_the_breaker_for_the_other(
    store: EventStore, clock: FakeClock
) -> None:
    """Opened by the failures of one process; after the reset timeout the other's call is
    the half-open probe, its success closes the breaker, and the first process's next
    call goes through on the closed breaker it reads from the log."""
    with FakeProvider() as fake:
        fake.add(*(Fail(status=503) for _ in range(3)))
        fake.set_default(Answer(text="fine"))
        config = _config(fake.base_url)
        one, two = (ProviderLayer(config, store, clock=clock) for _ in range(2))

        async def main() -> list[str]:
            await one.sink.emit("runtime", [runtime_started(config, store, "r1")], clock.now())
            kinds = [await _call(one) for _ in range(3)]
            kinds.append(await _call(two))  # open: refused without a request
            clock.advance(11)
            kinds.append(await _call(two))  # the probe
            kinds.append(await _call(one))
            await _close(one, two)
            return kinds

        kinds = anyio.run(main)
    assert kinds == ["unavailable"] * 3 + ["refused", "fine", "fine"]
    types = _types(store)
    assert types.count(BreakerOpened.__struct_config__.tag) == 1
    assert types.count(BreakerHalfOpened.__struct_config__.tag) == 1
    assert types[-2:] == ["breaker:closed", "provider:call_succeeded"]
    assert types.count(ProviderCallFailed.__struct_config__.tag) == 3
    assert not verify_store(store, None).findings


@pytest.mark.parametrize("rounds", [8])
def test_interleaved_outcomes_of_many_processes_verify_clean(
    store: EventStore, clock: FakeClock, rounds: int
) -> None:
    """Three processes, failures and successes interleaved and concurrent: whatever each
    decided, the log's decisions are the ones its own fold re-derives."""
    with FakeProvider() as fake:
        fake.add(*(Fail(status=503) if k % 3 else Answer(text="ok") for k in range(40)))
        fake.set_default(Fail(status=503))
        config = _config(fake.base_url)
        layers = [ProviderLayer(config, store, clock=clock) for _ in range(3)]

        async def main() -> None:
            await layers[0].sink.emit(
                "runtime", [runtime_started(config, store, "r1")], clock.now()
            )
            for _ in range(rounds):
                async with anyio.create_task_group() as group:
                    for layer in layers:
                        group.start_soon(_call, layer)
                clock.advance(4)
            await _close(*layers)

        anyio.run(main)
    assert not verify_store(store, None).findings


def test_a_success_records_when_its_attempt_began(store: EventStore, clock: FakeClock) -> None:
    """Health passes over a success of an attempt begun before the outage: the caller
    records when the attempt began (its ``prompt:started``), not only its latency."""
    from stalwart.events import PromptStarted, ProviderCallSucceeded

    with FakeProvider() as fake:
        fake.set_default(Answer(text="fine"))
        layer = ProviderLayer(_config(fake.base_url), store, clock=clock)

        async def main() -> str:
            kind = await _call(layer)
            await _close(layer)
            return kind

        assert anyio.run(main) == "fine"
    [started] = [r for r in store.read_stream("session:s1") if isinstance(r.event, PromptStarted)]
    [success] = [r.event for r in store.read_stream("provider:main")]
    assert isinstance(success, ProviderCallSucceeded)
    assert success.started_at == started.ts
