"""pykka actors and the scheduler that turns deadlines into their messages."""

from ._deadletter import (
    DEADLETTER_STREAM,
    DeadLetterActor,
    Due,
    Enqueue,
    ProviderRecovered,
    Sending,
    Sent,
    Snapshot,
)
from ._health import (
    CallOutcome,
    HealthChanged,
    HealthReport,
    HealthView,
    Poll,
    ProviderHealthActor,
    Status,
)
from ._portal import IoPortal
from ._scheduler import (
    DEFAULT_LATENESS_WINDOW,
    MAX_WAIT_S,
    Scheduler,
    SchedulerStats,
    TimerHandle,
    TimerState,
)

__all__ = [
    "DEADLETTER_STREAM",
    "DEFAULT_LATENESS_WINDOW",
    "MAX_WAIT_S",
    "CallOutcome",
    "DeadLetterActor",
    "Due",
    "Enqueue",
    "HealthChanged",
    "HealthReport",
    "HealthView",
    "IoPortal",
    "Poll",
    "ProviderHealthActor",
    "ProviderRecovered",
    "Scheduler",
    "SchedulerStats",
    "Sending",
    "Sent",
    "Snapshot",
    "Status",
    "TimerHandle",
    "TimerState",
]
