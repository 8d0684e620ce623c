"""The provider client keeps connections alive between calls, and drops aborted ones."""

from __future__ import annotations

import anyio
import pytest

from stalwart.config import ProviderSettings
from stalwart.providers import Message, ProviderClient, ProviderRequest
from stalwart.testing import Answer, FakeProvider, Script, Stall

REQUEST = ProviderRequest(messages=(Message(role="user", content="hi"),))


def _calls(fake: FakeProvider, api: str, budgets: list[float]) -> None:
    """Streamed calls one after the other through one client, each within its budget."""

    async def main() -> None:
        settings = ProviderSettings(kind=api, base_url=fake.base_url)  # type: ignore[arg-type]
        client = ProviderClient("fake", settings)
        try:
            for within in budgets:
                with anyio.move_on_after(within):
                    async for _event in client.stream("m", REQUEST):
                        pass
        finally:
            await client.aclose()

    anyio.run(main)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_finished_streams_leave_their_connection_for_the_next_call(api: str) -> None:
    with FakeProvider(Script(default=Answer(text="one two three"))) as fake:
        _calls(fake, api, [5.0, 5.0, 5.0])
        done = fake.wait_for(lambda rs: len(rs) == 3 and rs[2].outcome != "running")
    assert [r.outcome for r in done] == ["completed"] * 3
    assert len({r.client_port for r in done}) == 1


def test_an_aborted_stream_does_not_go_back_to_the_pool() -> None:
    with FakeProvider([Stall(after_deltas=1)]) as fake:
        fake.set_default(Answer(text="fine"))
        _calls(fake, "openai", [0.2, 5.0])
        stalled, answered = fake.wait_for(lambda rs: len(rs) == 2 and rs[1].outcome != "running")
    assert stalled.outcome == "client_closed"
    assert answered.outcome == "completed"
    assert stalled.client_port != answered.client_port
