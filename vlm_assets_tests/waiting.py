"""Waiting in tests for a condition, never for a length of time."""

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# The bound only turns a hang into a failure: a condition that holds returns at once, so the bound is
# sized for a machine several times slower than the slowest of this kind, not for the one at hand.
BOUND_S = 600.0


def wait_until(predicate: Callable[[], T], what: str, timeout: float = BOUND_S, every: float = 0.5) -> T:
    """The first truthy value of ``predicate()``, polled every ``every`` seconds; AssertionError naming
    ``what`` after ``timeout`` seconds without one."""
    deadline = time.monotonic() + timeout
    while True:
        if value := predicate():
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
