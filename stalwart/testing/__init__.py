"""Test doubles for agents built on stalwart: a fault-injecting loopback provider.

``FakeProvider`` is a real HTTP server on 127.0.0.1 that speaks the OpenAI Chat
Completions and Anthropic Messages APIs and plays a script of faults, so an agent's
timeouts, retries and fallbacks can be tested end to end without a network or a key.
``PostgresServer`` starts a throwaway PostgreSQL cluster (initdb + pg_ctl in a temp dir)
for testing against the PostgreSQL store; ``PlainStore`` hides a store's optional work
queue, as a third-party EventStore would not have one. ``conversation`` is a session's
stored messages, long enough for the context engine to summarize; ``recorded`` an event
as a log would hold it, for folds tested without a store.
"""

from ._conversation import conversation
from ._plain import PlainStore
from ._postgres import PostgresServer, postgres_bindir
from ._records import recorded
from ._script import (
    Answer,
    Cut,
    ErrorEvent,
    Fail,
    FakeToolCall,
    Hang,
    Malformed,
    Reset,
    Script,
    Stall,
    Step,
    Trickle,
    Truncated,
    WrongContentType,
    load_script,
    parse_script,
)
from ._server import FakeProvider, RecordedRequest

__all__ = [
    "Answer",
    "Cut",
    "ErrorEvent",
    "Fail",
    "FakeProvider",
    "FakeToolCall",
    "Hang",
    "Malformed",
    "PlainStore",
    "PostgresServer",
    "RecordedRequest",
    "Reset",
    "Script",
    "Stall",
    "Step",
    "Trickle",
    "Truncated",
    "WrongContentType",
    "conversation",
    "load_script",
    "parse_script",
    "postgres_bindir",
    "recorded",
]
