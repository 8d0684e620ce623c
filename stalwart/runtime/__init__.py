"""The embedding API: :class:`Runtime` starts the configured parts on one event log.

::

    with Runtime(config, store=".stalwart") as rt:
        rt.tool(lookup_order)                    # or @rt.tool
        chat = rt.session("s1", channel="console")
        chat.send("Where is my order 1234?")
        chat.status(timeout=5.0)                 # an AgentReport

Starting opens the store (a path, or an :class:`EventStore` the host keeps), appends
``runtime:started`` with the config in force (``Config.to_record()``: no secrets), and
starts the I/O portal (one event loop thread for all network I/O), the scheduler (driven
by the clock: a ``FakeClock`` fires timers inside ``advance()``), one
``ProviderHealthActor`` per configured provider sharing one :class:`HealthView`, and the
``DeadLetterActor`` over the channels; a provider's recovery drains the dead-letter queue;
one ``SupervisorActor`` (sub-agent sweeps, failure notices, recovery, restarts of crashed
agents and runs) and one ``Announcer`` (the parent of every run: completions batched per
parent). :meth:`Runtime.session` starts one ``AgentActor`` per session, on demand;
:meth:`Runtime.spawn` starts a sub-agent run (a :class:`RunHandle`), and an agent with
``subagents = true`` offers its model the ``spawn_subagent`` tool.

Closing stops the agents, the runs, the supervisor and the announcer, the health and
dead-letter actors, closes the provider clients and the channels the runtime built (on
the portal's loop), stops the scheduler and the portal (whatever is still in flight is
cancelled, which closes its HTTP request), appends ``runtime:stopped`` and closes the
store if it opened it. A failure in one step is logged and the next steps still run; a
second ``close()`` closes nothing again: it returns once the first has ended.

:class:`ProviderLayer` and :class:`StoreSink` are the provider layer on a store, which
``stalwart run`` also uses on its own.
"""

from ._control import (
    check_session_id,
    confirm,
    interrupt,
    load_session,
    schedule_wake,
    send_message,
    submit_tool_result,
)
from ._durable import Durability, policy_of
from ._foundation import runtime_started
from ._handles import RUNTIME_STREAM, STOP_TIMEOUT_S, RunHandle, SessionHandle
from ._layer import ProviderLayer, StoreSink
from ._runtime import Runtime
from ._tools import BUILTIN_TOOLS, SPAWN_TOOL

__all__ = [
    "BUILTIN_TOOLS",
    "RUNTIME_STREAM",
    "SPAWN_TOOL",
    "STOP_TIMEOUT_S",
    "Durability",
    "ProviderLayer",
    "RunHandle",
    "Runtime",
    "SessionHandle",
    "StoreSink",
    "check_session_id",
    "confirm",
    "interrupt",
    "load_session",
    "policy_of",
    "runtime_started",
    "schedule_wake",
    "send_message",
    "submit_tool_result",
]
