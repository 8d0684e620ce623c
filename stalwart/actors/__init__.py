"""pykka actors and the scheduler that turns deadlines into their messages."""

from ._health import (
    CallOutcome,
    HealthChanged,
    HealthReport,
    HealthView,
    Poll,
    ProviderHealthActor,
    Status,
)
from ._scheduler import (
    DEFAULT_LATENESS_WINDOW,
    MAX_WAIT_S,
    Scheduler,
    SchedulerStats,
    TimerHandle,
    TimerState,
)

__all__ = [
    "DEFAULT_LATENESS_WINDOW",
    "MAX_WAIT_S",
    "CallOutcome",
    "HealthChanged",
    "HealthReport",
    "HealthView",
    "Poll",
    "ProviderHealthActor",
    "Scheduler",
    "SchedulerStats",
    "Status",
    "TimerHandle",
    "TimerState",
]
