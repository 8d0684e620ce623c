"""A review of the thirty-fifth session's later changes (a third pass).

Real parts only: real sends through the busy gate on a FakeClock with a host's own
channel kind (a ``Channel`` is the host's to implement), run on anyio.
"""

from __future__ import annotations

import anyio
import pytest

from stalwart.channels import RECEIVER_BUSY, Delivery, OutboundMessage, busy_gated
from stalwart.clock import FakeClock
from stalwart.errors import ChannelError


class _HostChannel:
    """A host's own channel kind (a chat workspace per tenant, say): refused with a
    Retry-After while ``busy``."""

    def __init__(self, name: str, *, busy: bool) -> None:
        self.name = name
        self.busy = busy
        self.sent: list[OutboundMessage] = []

    async def send(self, message: OutboundMessage) -> Delivery:
        if self.busy:
            raise ChannelError(
                f"channel {self.name!r}: rate limited",
                kind="rate_limited",
                retryable=True,
                channel=self.name,
                status=429,
                retry_after=600.0,
            )
        self.sent.append(message)
        return Delivery(channel=self.name, attempts=1)

    async def aclose(self) -> None:
        return None


def _send(channel: _HostChannel, clock: FakeClock) -> None:
    gated = busy_gated(channel, clock)
    assert gated is not None
    message = OutboundMessage(conversation="c", text="hello", idempotency_key=new_key())
    anyio.run(gated.send, message)


_KEYS = iter(range(1_000_000))


def new_key() -> str:
    return f"k{next(_KEYS)}"


# Was: DEFECT: the busy gate knew a non-webhook receiver by its channel's name only, so a
# 429 with Retry-After from one tenant's channel held back (and dead-lettered, for up to
# an hour) the sends of another runtime's unrelated channel of the same name
def test_a_busy_receiver_does_not_hold_back_another_channel_of_the_same_name(
    clock: FakeClock,
) -> None:
    tenant_a = _HostChannel("chat", busy=True)
    tenant_b = _HostChannel("chat", busy=False)
    with pytest.raises(ChannelError) as refused:
        _send(tenant_a, clock)
    assert refused.value.kind == "rate_limited"

    _send(tenant_b, clock)  # another receiver: it goes out
    assert len(tenant_b.sent) == 1

    tenant_a.busy = False  # the busy one is still held back, as it asked
    with pytest.raises(ChannelError) as held:
        _send(tenant_a, clock)
    assert held.value.kind == RECEIVER_BUSY
    assert tenant_a.sent == []
