"""The gates' statistics against published values and against simulation, and both sides of the
blocking eval checks: a useless adapter is refused, one that significantly helps is promoted."""

import math

import dagster as dg
import numpy as np
import pytest

from vlm_assets.defs.models.eval_assets import (
    EvalChecksConfig,
    adapter_accuracy_meets_threshold,
    adapter_gain_significant,
)
from vlm_assets.defs.platform.checks import Judged
from vlm_assets.evaluate.occlusion_eval import EvalResult
from vlm_assets.evaluate.stats import mcnemar_exact_p, paired_gain, wilson_interval
from vlm_assets.storage import ArtifactRef


def test_wilson_interval_matches_published_values():
    # Newcombe (1998), Statistics in Medicine 17, table I: 81/263 -> 0.2553-0.3662; 15/148 -> 0.0624-0.1605.
    assert wilson_interval(81, 263) == pytest.approx((0.2553, 0.3662), abs=5e-5)
    assert wilson_interval(15, 148) == pytest.approx((0.0624, 0.1605), abs=5e-5)
    low, high = wilson_interval(0, 20)  # no hits: the interval still has width, unlike the Wald interval
    assert low == 0.0 and high == pytest.approx(0.1611, abs=5e-4)


@pytest.mark.parametrize("hits, total", [(-1, 10), (11, 10), (0, 0)])
def test_wilson_interval_refuses_impossible_counts(hits, total):
    with pytest.raises(ValueError):
        wilson_interval(hits, total)


def test_mcnemar_exact_p_is_the_two_sided_binomial():
    assert mcnemar_exact_p(0, 0) == 1.0
    assert mcnemar_exact_p(5, 5) == 1.0
    assert mcnemar_exact_p(10, 0) == pytest.approx(2 / 2**10)
    # 15 wins, 5 losses: 2 * P(X <= 5), X ~ Binomial(20, 1/2) = 0.041389...
    assert mcnemar_exact_p(15, 5) == pytest.approx(2 * sum(math.comb(20, i) for i in range(6)) / 2**20)
    assert mcnemar_exact_p(15, 5) == mcnemar_exact_p(5, 15)


def test_paired_gain_interval_covers_the_truth_at_about_95_percent():
    """Simulated evaluations of 300 paired items with a true gain of +5 points: the bootstrap interval
    holds the truth in about 95 % of them (binomial noise on 200 trials: 90-99 % accepted)."""
    rng = np.random.default_rng(1)
    covered = 0
    for trial in range(200):
        identity = rng.random(300) < 0.55
        flip_up = (~identity) & (rng.random(300) < 0.5)  # wins where the identity is wrong
        flip_down = identity & (rng.random(300) < (0.45 * 0.5 - 0.05) / 0.55)  # losses, for a net +5 points
        adapter = (identity & ~flip_down) | flip_up
        gain = paired_gain(adapter, identity, resamples=2000, seed=trial)
        covered += gain.ci95[0] <= 0.05 <= gain.ci95[1]
    assert 0.90 <= covered / 200 <= 0.99, covered


def test_paired_gain_counts_and_is_deterministic():
    a = [True] * 60 + [False] * 40
    b = [True] * 40 + [False] * 60
    gain = paired_gain(a, b)
    assert gain.gain == pytest.approx(0.2) and (gain.wins, gain.losses, gain.num_pairs) == (20, 0, 100)
    assert gain.ci95 == paired_gain(a, b).ci95  # seeded
    assert 0.1 < gain.ci95[0] < 0.2 < gain.ci95[1] < 0.3
    assert gain.p_value == pytest.approx(2 / 2**20)
    with pytest.raises(ValueError, match="equal-length"):
        paired_gain([True], [True, False])


def _report(adapter_right: int, identity_right: int, both: int, n: int = 400) -> ArtifactRef:
    """An eval_report ref whose metrics come from a real ``EvalResult`` summary: ``both`` images right in
    both conditions, then the adapter's other hits, then the identity's other hits."""
    names = ["Coat", "Bag"]
    labels = [0] * n
    adapter = ["Coat"] * both + ["Coat"] * (adapter_right - both) + ["Bag"] * (n - adapter_right)
    identity = ["Coat"] * both + ["Bag"] * (adapter_right - both) + ["Coat"] * (identity_right - both)
    identity += ["Bag"] * (n - len(identity))
    summary = EvalResult(names, labels, {"adapter": adapter, "identity": identity, "clean": ["Coat"] * n}).summary()
    return ArtifactRef("eval_report/x", "/nowhere", "v1", {"metrics": summary})


def _judge(check, config, ref) -> dg.AssetCheckResult:
    return check(Judged(ref, config))


def test_gain_gate_refuses_a_useless_adapter_and_promotes_a_good_one():
    useless = _report(adapter_right=232, identity_right=234, both=220)  # -0.5 points
    noisy = _report(adapter_right=240, identity_right=234, both=220)  # +1.5 points, inside the noise
    good = _report(adapter_right=270, identity_right=234, both=225)  # +9 points
    assert not _judge(adapter_gain_significant, EvalChecksConfig(), useless).passed
    assert not _judge(adapter_gain_significant, EvalChecksConfig(), noisy).passed
    verdict = _judge(adapter_gain_significant, EvalChecksConfig(), good)
    assert verdict.passed and "95% CI [+" in verdict.description
    assert verdict.metadata["adapter_gain_ci95_low"].value > 0 and verdict.metadata["num_samples"].value == 400
    # A stricter gate: the same adapter is refused when its interval does not clear min_gain.
    assert not _judge(adapter_gain_significant, EvalChecksConfig(min_gain=0.1), good).passed


def test_accuracy_gate_judges_the_wilson_lower_bound():
    ref = _report(adapter_right=130, identity_right=120, both=110)  # 32.5 % on 400: lower bound 28.1 %
    verdict = _judge(adapter_accuracy_meets_threshold, EvalChecksConfig(min_accuracy=0.28), ref)
    assert verdict.passed and verdict.metadata["chance"].value == 0.5 and "(chance 50%)" in verdict.description
    assert not _judge(adapter_accuracy_meets_threshold, EvalChecksConfig(min_accuracy=0.30), ref).passed


def test_a_small_evaluation_is_said_in_the_check():
    ref = _report(adapter_right=40, identity_right=10, both=10, n=50)
    verdict = _judge(adapter_gain_significant, EvalChecksConfig(), ref)
    assert verdict.metadata["too_few_samples"].value is True and "only 50 images" in verdict.description


@pytest.mark.parametrize("field", ["min_gain", "min_accuracy"])
def test_a_threshold_out_of_range_is_refused_naming_the_field(field):
    with pytest.raises(Exception, match=field):
        EvalChecksConfig(**{field: 1.5})
