"""Checks that scale: run in their asset's step, on what the build recorded.

Every check runs in its asset's own step (``check_specs`` declares them, ``judge`` yields their
results after the output), so a cache hit costs one step process. A data asset's build scans its
staged artifact once (``Built.scan``: every check's inputs, as JSON) and the scan is committed inside
the artifact's manifest. Each check judges that recorded scan after ``quick_verify`` (each listed file
present with its recorded size: one stat or one S3 listing, never the content). Only when sizes
disagree, or an older artifact has no scan, does a check read the content again, and it says so in
its metadata.
"""

import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from vlm_assets.evaluate.stats import MIN_PAIRS, small_sample_note
from vlm_assets.storage import ArtifactRef, ArtifactStore


def artifact_scan(
    ref: ArtifactRef, store: ArtifactStore, scan: Callable[[Path], dict[str, Any]]
) -> tuple[dict[str, Any], str]:
    """The scan to judge and where it came from (recorded at build, or a full scan now and why)."""
    problems = store.quick_verify(ref.key)
    if not problems and "scan" in ref.metadata:
        return ref.metadata["scan"], "recorded when built (file sizes verified)"
    why = "; ".join(problems[:3]) if problems else "no scan recorded"
    return scan(store.local_path(ref.key)), f"full scan ({why})"


@dataclasses.dataclass(frozen=True)
class Judged:
    """What an asset's checks judge, inside the asset's own step.

    It holds the artifact the step returns (built now, or a cache hit), the ``checks`` section of the asset's
    config (its thresholds), the store, and the upstream artifacts it was built from.
    """

    ref: ArtifactRef
    settings: Any = None
    store: ArtifactStore | None = None
    upstream: Mapping[str, ArtifactRef] = dataclasses.field(default_factory=dict)

    def scan(self, scan: Callable[[Path], dict[str, Any]]) -> tuple[dict[str, Any], str]:
        """Return ``scan`` of the artifact and where that scan came from (``artifact_scan``)."""
        assert self.store is not None, "a scan needs the artifact store"
        return artifact_scan(self.ref, self.store, scan)

    def outcome(
        self, scan: Callable[[Path], dict[str, Any]], judge: Callable[[dict[str, Any]], Any]
    ) -> dg.AssetCheckResult:
        """Run a data check: ``judge`` (a pure ``CheckOutcome``) of the artifact's scan, as Dagster's result.

        ``warning`` outcomes do not block.
        """
        scanned, source = self.scan(scan)
        outcome = judge(scanned)
        return dg.AssetCheckResult(
            passed=outcome.passed,
            description=outcome.description,
            metadata={**outcome.metadata, "scan": source},
            severity=dg.AssetCheckSeverity.WARN if outcome.warning else dg.AssetCheckSeverity.ERROR,
        )


Check = Callable[[Judged], dg.AssetCheckResult]
CHECKS_SECTION = "The checks' settings: changing one judges the same artifact again, never rebuilds it."


def check_specs(asset: str, checks: Sequence[Check]) -> list[dg.AssetCheckSpec]:
    """The asset's checks as blocking specs of its own step (named and described by the functions).

    They run where the artifact is in hand, so a cache hit costs one step process, not one more per
    check (Dagster runs an ``@asset_check`` in a step of its own, which loads the definitions again).
    A failed one records its evaluation beside the materialization, then fails the step without
    retries: nothing downstream runs."""
    return [dg.AssetCheckSpec(c.__name__, asset=asset, blocking=True, description=inspect.getdoc(c)) for c in checks]


def judge(output: dg.Output[ArtifactRef], checks: Sequence[Check], subject: Judged) -> Iterator[Any]:
    """The step's events: its output, then each check's result on it."""
    yield output
    for check in checks:
        result = check(subject)
        yield dg.AssetCheckResult(
            check_name=check.__name__,
            passed=result.passed,
            description=result.description,
            metadata=result.metadata,
            severity=result.severity,
        )


def threshold_field(default: float, description: str) -> Any:
    """A check setting that is a fraction (an accuracy's threshold), refused outside [0, 1] at load."""
    return Field(default=default, ge=0, le=1, description=description)


def lower_bound_check(
    estimate: str,
    value: float,
    low: float,
    threshold: tuple[str, float],
    n: int,
    *,
    what: str,
    chance: float | None = None,
    also: str = "",
    **metadata: Any,
) -> dg.AssetCheckResult:
    """Return a quality gate on an estimate's 95 % lower bound (a Wilson interval's).

    It passes when ``low`` reaches the threshold (``(its setting's name, its value)``); the description says the
    estimate, its bound, ``n``, chance beside it, ``also`` (a related figure) and, under ``MIN_PAIRS``, that the
    interval is too wide to mean much; the metadata carries the same as numbers, named after ``estimate``.
    """
    name, bound = threshold
    return dg.AssetCheckResult(
        passed=bool(low >= bound),
        description=f"{what} {value:.1%} (95% CI lower bound {low:.1%}, n={n}) vs threshold {bound:.1%}"
        + (f" (chance {chance:.0%})" if chance is not None else "")
        + also
        + small_sample_note(n),
        metadata={
            estimate: value,
            f"{estimate}_ci95_low": low,
            name: bound,
            "num_samples": n,
            "too_few_samples": n < MIN_PAIRS,
            **({"chance": chance} if chance is not None else {}),
            **metadata,
        },
    )
