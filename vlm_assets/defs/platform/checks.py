"""Data checks that scale: the artifact is read once, when it is built; a cache hit reads its manifest.

A data asset's build scans its staged artifact once (``Built.scan``: every check's inputs, as JSON)
and the scan is committed inside the artifact's manifest. Each check judges that recorded scan after
``quick_verify`` (each listed file present with its recorded size: one stat or one S3 listing, never
the content). Only when sizes disagree, or an older artifact has no scan, does a check read the
content again, and it says so in its metadata.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg

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


def check_result(outcome: Any, scanned_from: str) -> dg.AssetCheckResult:
    """A pure ``CheckOutcome`` as Dagster's result; ``warning`` outcomes do not block."""
    return dg.AssetCheckResult(
        passed=outcome.passed,
        description=outcome.description,
        metadata={**outcome.metadata, "scan": scanned_from},
        severity=dg.AssetCheckSeverity.WARN if outcome.warning else dg.AssetCheckSeverity.ERROR,
    )
