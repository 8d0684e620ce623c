"""The work queue's pure rules: ``due_at`` is exactly when ``decide_lease`` first decides,
and a due row kept by the store's rules (exact from a worker's fold, else lowered by
``due_hint``) is never later than that (or than now, once that has passed), over
histories the policies themselves make."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from stalwart.events import (
    ActivationReady,
    Event,
    LeaseRenewed,
    SessionRequiresAction,
    UserToolConfirmation,
)
from stalwart.state import (
    ActivationsState,
    WakeResult,
    decide_interrupt,
    decide_lease,
    decide_settlement,
    due_at,
    due_hint,
)

from ._log import FoldedLog
from .test_activation_policy import POLICY, log

INF = float("inf")
WAITS = (0.0, 0.5, 2.0, 5.0, 31.0)  # 31 s: past a lease's 30 s
ACTIONS = ("send", "wake", "lease", "ok", "fail", "block", "confirm", "renew", "interrupt")


def _due(state: ActivationsState) -> float:
    at = due_at(state)
    return INF if at is None else at


def _check_exact(state: ActivationsState) -> None:
    at = due_at(state)
    if at is None:
        assert decide_lease(state, "w", 1e9, POLICY) == []
        return
    assert decide_lease(state, "w", at, POLICY) != []
    assert decide_lease(state, "w", at - 0.001, POLICY) == []


def _events(state: ActivationsState, action: str, now: float, n: int) -> tuple[list[Event], bool]:
    """The events of ``action`` at ``now`` as the runtime would append them, and whether
    the appender folded the stream (a worker's lease: its due time is exact)."""
    lease = state.lease
    live = lease is not None and now < lease.expires_at
    match action:
        case "send":
            return [ActivationReady(activation_id=f"a{n}", kind="message")], False
        case "wake":
            wake = ActivationReady(activation_id=f"a{n}", kind="wake", wake_at=now + n % 7)
            return [wake], False
        case "lease":
            return decide_lease(state, "w", now, POLICY), True
        case "ok" | "fail" | "block" if live and lease is not None:
            result = {
                "ok": WakeResult(status="ok"),
                "fail": WakeResult(status="failed", error_class="x", retryable=True),
                "block": WakeResult(status="blocked", request_id=f"r{n}"),
            }[action]
            settled = decide_settlement(
                state, lease.activation_id, lease.epoch, result, now, POLICY
            )
            if action != "block":
                return [settled], False
            pause = SessionRequiresAction(request_id=f"r{n}", kind="approval", tool="t")
            return [pause, settled], False
        case "confirm" if state.blocked_on is not None:
            answer = UserToolConfirmation(request_id=state.blocked_on, allow=True)
            return [answer, ActivationReady(activation_id=f"a{n}", kind="resume")], False
        case "renew" if live and lease is not None:
            renewed = LeaseRenewed(
                activation_id=lease.activation_id,
                owner=lease.owner,
                epoch=lease.epoch,
                expires_at=now + POLICY.lease_ttl_ms / 1000,
            )
            return [renewed], False
        case "interrupt":
            return decide_interrupt(state, "user"), False
    return [], False


@settings(max_examples=500, deadline=None, database=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(ACTIONS), st.sampled_from(WAITS), st.booleans()),
        min_size=1,
        max_size=30,
    )
)
# a wake queued behind a lease is hidden by it; the ack must bring it back
@example([("send", 0, False), ("wake", 0, False), ("lease", 0, False), ("ok", 2, False)])
# ... and so must the abandonment of a message that failed max_attempts times
@example(
    [("send", 0, False), ("wake", 0, False), ("lease", 0, False), ("fail", 0, False)]
    + [("lease", 31, False), ("fail", 0, False)] * 4
)
def test_the_due_row_is_never_late_and_due_at_is_exact(
    steps: list[tuple[str, float, bool]],
) -> None:
    folded: FoldedLog[ActivationsState] = log()
    now, row = 1_000.0, INF
    for n, (action, wait, write_back) in enumerate(steps):
        now += wait
        events, exact = _events(folded.state, action, now, n)
        for event in events:
            folded.add(event, now)
        if exact and events:
            row = _due(folded.state)
        elif (hint := due_hint((e, now) for e in events)) is not None:
            row = min(row, hint)
        if write_back:  # a worker folded the session and wrote back what it found
            row = _due(folded.state)
        # never late: at or before the time work is due, or now once that has passed
        assert row <= max(_due(folded.state), now), (action, row, folded.state)
        _check_exact(folded.state)
