"""Embed stalwart in a host program: one runtime, one tool, one conversation.

Run it against a real provider (``OPENAI_API_KEY`` set) or the loopback fake::

    .venv/bin/stalwart fake-provider --port 8089 &
    STALWART_BASE_URL=http://127.0.0.1:8089/v1 .venv/bin/python docs/examples/embed.py

``STALWART_STORE`` says where the event log goes (``.stalwart`` by default).
"""

from __future__ import annotations

import os
import queue
import tomllib

from stalwart import store as event_store
from stalwart.channels import Delivery, OutboundMessage
from stalwart.config import parse_config
from stalwart.runtime import Runtime

CONFIG = """
[providers.main]
kind = "openai"
base_url = "{base_url}"
api_key_env = "OPENAI_API_KEY"

[agents.default]
provider = "main"
model = "gpt-4o-mini"
system_prompt = "You answer questions about orders. Be brief."
max_steps = 6

[supervision]
execution_timeout_ms = 120000
"""


class Inbox:
    """The host's own channel: every message for the user lands in a queue."""

    def __init__(self, name: str = "inbox") -> None:
        self.name = name
        self.replies: queue.Queue[OutboundMessage] = queue.Queue()

    async def send(self, message: OutboundMessage) -> Delivery:
        self.replies.put(message)
        return Delivery(channel=self.name)

    async def aclose(self) -> None:
        pass


def main() -> None:
    base_url = os.environ.get("STALWART_BASE_URL", "https://api.openai.com/v1")
    location = os.environ.get("STALWART_STORE", ".stalwart")
    config = parse_config(tomllib.loads(CONFIG.format(base_url=base_url)), source="embed.py")
    inbox = Inbox()

    with Runtime(config, store=location, channels={inbox.name: inbox}) as rt:

        @rt.tool(timeout_ms=5_000)
        def order_status(order_id: str) -> str:
            """The shipping status of an order."""
            return f"order {order_id}: packed, ships tomorrow"

        chat = rt.session(channel="inbox", conversation="customer-42")
        chat.send("Where is my order 1234?")
        reply = inbox.replies.get(timeout=60)  # the answer, or one plain static text
        print(f"[{reply.kind}] {reply.text}")
        print(f"session {chat.session_id}: {chat.status().session.turns} turn(s)")

    # everything that happened is in the log, the runtime's start and stop included
    log = event_store.open(location, create=False)
    try:
        for record in log.read_stream("runtime"):
            print(record.type)
    finally:
        log.close()


if __name__ == "__main__":
    main()
