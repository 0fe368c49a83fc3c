"""A run whose step waits for a pool slot sleeps between its claims (vlm_assets/defs/platform/pool_wait.py),
on a real instance: sqlite storage, a pool of one slot held by another run's step."""

import threading
import time
import types

import dagster as dg

import vlm_assets.definitions  # noqa: F401  (what every Dagster process of the project loads first)
from vlm_assets.defs.platform import pool_wait
from vlm_assets_tests.waiting import BOUND_S, wait_until

WINDOW_S = 3.0


@dg.asset(pool="p")
def pooled():
    return 1


def test_a_step_waiting_for_a_pool_slot_sleeps_then_runs_once_the_slot_is_freed(tmp_path):
    (tmp_path / "dagster.yaml").write_text(
        "telemetry:\n  enabled: false\nconcurrency:\n  pools:\n    default_limit: 1\n"
    )
    instance = dg.DagsterInstance.from_config(str(tmp_path))
    storage = instance.event_log_storage
    storage.set_concurrency_slots("p", 1)
    assert storage.claim_concurrency_slot("p", "other-run", "train").is_claimed

    results = []
    run = threading.Thread(target=lambda: results.append(dg.materialize([pooled], instance=instance)))
    run.start()
    try:
        wait_until(lambda: storage.get_concurrency_info("p").pending_step_count == 1, "the step to wait for the slot")
        # The waiting thread's own CPU clock, not the process's: other tests' threads may still be running.
        clock = time.pthread_getcpuclockid(run.ident)
        cpu0, wall0 = time.clock_gettime(clock), time.monotonic()
        time.sleep(WINDOW_S)
        share = (time.clock_gettime(clock) - cpu0) / (time.monotonic() - wall0)
    finally:
        storage.free_concurrency_slot_for_step("other-run", "train")
        run.join(timeout=BOUND_S)
    # Spinning keeps a core busy (share 1.0 on an idle machine, still > 0.3 on a loaded one); a claim a
    # second costs a few milliseconds of sqlite.
    assert share < 0.1, f"the waiting run kept {share:.0%} of a core busy"
    assert not run.is_alive() and results[0].success


def test_dagsters_own_interval_still_never_sleeps():
    """When this fails, Dagster returns the time to the next claim itself: remove pool_wait.py and its call."""
    now = time.time()
    waiting = types.SimpleNamespace(_pending_claims={"train"}, _pending_timeouts={"train": now + 5.0})
    assert pool_wait.DAGSTER_INTERVAL(waiting) <= 0
    fixed = pool_wait._interval_to_next_pending_claim_check(waiting)
    assert 4.0 < fixed <= 5.0
    due = types.SimpleNamespace(_pending_claims={"train", "eval"}, _pending_timeouts={"train": now + 5.0})
    assert pool_wait._interval_to_next_pending_claim_check(due) == 0.0  # a claim not tried yet is due now
