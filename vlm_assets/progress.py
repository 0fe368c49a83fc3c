"""Progress of long loops as a few log lines (Dagster log, or stdout outside Dagster).

Written by hand rather than with tqdm: tqdm redraws one terminal line with carriage returns, which
arrives in Dagster's captured logs as a stream of partial bars; here each report is one whole line,
at most every ``every_s`` seconds, plus the last.
"""

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def report_progress(
    items: Iterable[T],
    desc: str,
    log: Callable[[str], None] | None,
    *,
    total: int | None = None,
    unit: str = "items",
    every_s: float = 10.0,
    size: Callable[[T], int] = lambda _: 1,
) -> Iterator[T]:
    """Yield ``items`` unchanged, logging ``desc: done[/total] unit (rate/s)`` now and then."""
    if log is None:
        yield from items
        return
    start = last = time.monotonic()
    done = 0
    for item in items:
        yield item
        done += size(item)
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            log(_line(desc, done, total, unit, now - start))
    log(_line(desc, done, total, unit, time.monotonic() - start) + " done")


def _line(desc: str, done: int, total: int | None, unit: str, seconds: float) -> str:
    of = f"/{total:,}" if total else ""
    return f"{desc}: {done:,}{of} {unit} ({done / max(seconds, 1e-9):,.0f}/s)"
