"""Uncertainty of the quality figures the gates judge: Wilson intervals for an accuracy, and the paired
gain of two systems scored on the same items (exact McNemar test, paired-bootstrap interval).

Every function is deterministic (the bootstrap's generator is seeded), so two evaluations of the same
predictions report the same interval.
"""

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054  # two-sided 95 % normal quantile
MIN_PAIRS = 100  # below this many paired items an interval says too little to gate on; the checks say so


def small_sample_note(n: int) -> str:
    """What a check says beside a verdict on fewer than ``MIN_PAIRS`` items (empty otherwise)."""
    return (
        f"; only {n} images: under {MIN_PAIRS} the interval is too wide to mean much, evaluate more"
        if n < MIN_PAIRS
        else ""
    )


def wilson_interval(hits: int, total: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``hits / total`` (95 % by default)."""
    if total <= 0:
        raise ValueError(f"an interval needs at least one sample, got {total}")
    if not 0 <= hits <= total:
        raise ValueError(f"hits must be within [0, {total}], got {hits}")
    p = hits / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact_p(wins: int, losses: int) -> float:
    """Two-sided exact McNemar p-value: the discordant pairs as a Binomial(wins + losses, 1/2)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


@dataclasses.dataclass(frozen=True)
class PairedGain:
    """System A's accuracy minus system B's on the same items."""

    gain: float
    ci95: tuple[float, float]  # paired-bootstrap percentile interval
    p_value: float  # exact McNemar, two-sided
    wins: int  # A right, B wrong
    losses: int  # A wrong, B right
    num_pairs: int


def paired_gain(a: Sequence[bool], b: Sequence[bool], *, resamples: int = 10_000, seed: int = 0) -> PairedGain:
    """Return the paired gain of A over B from per-item correctness.

    It comes with a 95 % paired-bootstrap interval (items resampled with replacement, both systems together) and
    the exact McNemar p-value.
    """
    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired scores need two equal-length lists, got {a.shape} and {b.shape}")
    if a.size == 0:
        raise ValueError("paired scores need at least one item")
    diff = a.astype(np.int8) - b.astype(np.int8)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for start in range(0, resamples, 1000):  # chunks keep memory flat for large evaluations
        count = min(1000, resamples - start)
        means[start : start + count] = diff[rng.integers(0, a.size, size=(count, a.size))].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    wins, losses = int((diff > 0).sum()), int((diff < 0).sum())
    return PairedGain(
        gain=float(diff.mean()),
        ci95=(float(low), float(high)),
        p_value=mcnemar_exact_p(wins, losses),
        wins=wins,
        losses=losses,
        num_pairs=int(a.size),
    )
