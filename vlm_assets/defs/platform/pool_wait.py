"""A step waiting for a pool slot sleeps until its next claim is due, instead of spinning on a core.

Dagster 1.13's ``InstanceConcurrencyContext.interval_to_next_pending_claim_check`` returns
``min([0, *seconds_until_each_retry])``, never more than 0, so the executor's ``sleep_til_ready`` never
sleeps: a run whose training step waits on the ``vlm_training`` pool re-checks in a loop and keeps a
whole core busy (the in-process executor, every job's default here; the multiprocess executor's loop
never calls ``sleep_til_ready`` and is not reached by this), the core that the training holding the
slot needs (on a 2-core machine, half of it).
Dagster has no setting for the wait; its own back-off (1 s, growing to 15 s between claims) is what the
replacement below sleeps. ``vlm_assets_tests/defs/test_pool_wait.py`` fails once Dagster returns the
right interval itself, so that this module can go.
"""

import time

from dagster._core.execution.plan.instance_concurrency_context import InstanceConcurrencyContext

DAGSTER_INTERVAL = InstanceConcurrencyContext.interval_to_next_pending_claim_check


def _interval_to_next_pending_claim_check(self: InstanceConcurrencyContext) -> float:
    """Seconds until the earliest blocked claim is due to be tried again; 0 when one is due now."""
    now = time.time()
    due = [self._pending_timeouts.get(step, now) - now for step in self._pending_claims]  # none yet: due now
    return max(0.0, min(due, default=0.0))


def sleep_while_waiting_for_pool_slots() -> None:
    """Make the in-process executor sleep between the claims of a step that waits for a pool slot."""
    InstanceConcurrencyContext.interval_to_next_pending_claim_check = _interval_to_next_pending_claim_check
