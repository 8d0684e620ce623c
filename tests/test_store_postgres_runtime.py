"""The runtime on the PostgreSQL store: a few of the runtime's and the durable sessions'
own tests (activations, leases, approvals, passivation), run unchanged with their
``store`` fixture pointing at PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stalwart import store as store_module
from stalwart.clock import FakeClock
from stalwart.store import EventStore

from . import test_durable_sessions as sessions
from . import test_runtime as runtime


@pytest.fixture
def store(pg_url: str, clock: FakeClock) -> Iterator[EventStore]:
    opened = store_module.open(pg_url, clock=clock)
    try:
        yield opened
    finally:
        opened.close()


rt = sessions.rt  # the durable sessions' runtime (its config), on this module's store
test_a_new_runtime_on_the_same_log_carries_the_session_on = (
    runtime.test_a_new_runtime_on_the_same_log_carries_the_session_on
)
test_a_message_is_an_activation_leased_run_and_acked_in_one_append = (
    sessions.test_a_message_is_an_activation_leased_run_and_acked_in_one_append
)
test_a_lease_is_renewed_while_the_wake_runs = sessions.test_a_lease_is_renewed_while_the_wake_runs
test_an_approval_pauses_the_session_and_an_allow_runs_the_stored_input_once = (
    sessions.test_an_approval_pauses_the_session_and_an_allow_runs_the_stored_input_once
)
test_an_idle_agent_is_passivated_and_rebuilt_by_its_next_wake = (
    sessions.test_an_idle_agent_is_passivated_and_rebuilt_by_its_next_wake
)
