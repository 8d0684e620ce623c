"""Recorded activity says how far a streaming call has got, not only that it is alive."""

from __future__ import annotations

import itertools
from pathlib import Path

import anyio

from stalwart import store as store_module
from stalwart.config import parse_config
from stalwart.events import PromptActivity
from stalwart.providers import Message, ProviderRequest
from stalwart.runtime import ProviderLayer
from stalwart.testing import Answer, FakeProvider, Script

WORDS = 40


def test_activity_counts_the_deltas_received_so_far(tmp_path: Path) -> None:
    text = " ".join(["word"] * WORDS)
    with FakeProvider(Script(default=Answer(text=text, delay_ms=4))) as fake:
        config = parse_config(
            {
                "providers": {"p": {"kind": "openai", "base_url": fake.base_url}},
                "agents": {"default": {"provider": "p", "model": "m", "activity_interval_ms": 20}},
            }
        )
        log = store_module.open(tmp_path / "store")
        try:

            async def main() -> None:
                layer = ProviderLayer(config, log)
                try:
                    request = ProviderRequest(messages=(Message(role="user", content="hi"),))
                    await layer.caller().call("session:s", request)
                finally:
                    await layer.aclose()

            anyio.run(main)
            counts = [
                r.event.tokens
                for r in log.read_stream("session:s")
                if isinstance(r.event, PromptActivity)
            ]
        finally:
            log.close()
    assert counts[0] == 1  # the first delta is always recorded
    assert len(counts) >= 2
    assert all(a < b for a, b in itertools.pairwise(counts))
    assert counts[-1] <= WORDS
