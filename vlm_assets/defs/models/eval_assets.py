"""``eval_report`` (accuracy with and without the adapter, HTML report) and ``registered_adapter``
(the MLflow Model Registry entry, whose ``champion`` alias moves only when the eval checks pass)."""

import json

import dagster as dg
from pydantic import Field

from vlm_assets.defs.platform.checks import CHECKS_SECTION, Judged, lower_bound_check, threshold_field
from vlm_assets.defs.platform.memo import AssetConfig, Built, Step, memoized_asset
from vlm_assets.defs.platform.profiles import ProfileDefaults
from vlm_assets.defs.platform.registration import registered_model_asset
from vlm_assets.evaluate.stats import MIN_PAIRS, small_sample_note
from vlm_assets.models import adapter_card
from vlm_assets.train.run_config import step_field


class EvalChecksConfig(ProfileDefaults, dg.Config):
    """Settings of the ``eval_report`` checks."""

    profile_key = "eval_report.checks"

    min_accuracy: float = threshold_field(
        0.5, "The 95 % Wilson lower bound of the exact-match accuracy with the adapter must reach this."
    )
    min_gain: float = Field(
        default=0.0,
        ge=-1,
        le=1,
        description=(
            "The 95 % interval of the adapter's paired gain over the identity must lie above this (0: the "
            "adapter significantly helps)."
        ),
    )


class EvalReportConfig(AssetConfig):
    """Config of the ``eval_report`` asset."""

    profile_key = "eval_report"

    num_samples: int | None = Field(default=None, ge=1, description="Validation images evaluated (unset = all).")
    batch_size: int = Field(
        default=16,
        ge=1,
        description="Images per batch; each is decoded three ways (adapter, identity, clean) in one greedy decode.",
    )
    num_cards: int = Field(default=24, ge=0, description="Prediction cards in the HTML report.")
    checks: EvalChecksConfig = step_field(CHECKS_SECTION, default_factory=EvalChecksConfig)


def adapter_accuracy_meets_threshold(judged: Judged) -> dg.AssetCheckResult:
    """Check that the 95 % Wilson lower bound of the accuracy with the adapter reaches ``checks.min_accuracy``.

    The accuracy is exact match, reported beside chance (one over the classes).
    """
    metrics = judged.ref.metadata["metrics"]
    return lower_bound_check(
        "accuracy_adapter",
        metrics["accuracy_adapter"],
        metrics["accuracy_adapter_ci95_low"],
        ("min_accuracy", judged.settings.min_accuracy),
        int(metrics["num_samples"]),
        what="accuracy",
        chance=metrics.get("chance"),
    )


def adapter_gain_significant(judged: Judged) -> dg.AssetCheckResult:
    """Check that the adapter helps, beyond the evaluation's own noise.

    The 95 % paired-bootstrap interval of its gain over the identity (accuracy with minus without it, on the same
    occluded images) must lie above ``checks.min_gain``. Beside it: the exact McNemar p-value and the discordant
    pairs.
    """
    metrics, config = judged.ref.metadata["metrics"], judged.settings
    gain, low, high = metrics["adapter_gain"], metrics["adapter_gain_ci95_low"], metrics["adapter_gain_ci95_high"]
    n = int(metrics["num_samples"])
    return dg.AssetCheckResult(
        passed=bool(low > config.min_gain),
        description=f"adapter gain {gain:+.1%} (95% CI [{low:+.1%}, {high:+.1%}], "
        f"McNemar p={metrics['adapter_gain_p_value']:.2g}, n={n}) vs min_gain {config.min_gain:+.1%}"
        + small_sample_note(n),
        metadata={
            "adapter_gain": gain,
            "adapter_gain_ci95_low": low,
            "adapter_gain_ci95_high": high,
            "adapter_gain_p_value": metrics["adapter_gain_p_value"],
            "wins": int(metrics["adapter_wins"]),
            "losses": int(metrics["adapter_losses"]),
            "min_gain": config.min_gain,
            "num_samples": n,
            "too_few_samples": n < MIN_PAIRS,
        },
    )


def build_report(step: Step) -> Built:
    """Build the ``eval_report`` artifact: evaluate the trained adapter on the validation images, write the report."""
    # heavy imports only when building: a cache hit needs none of them
    from vlm_assets.data.occlusion_dataset import OcclusionSamples, class_names
    from vlm_assets.evaluate.occlusion_eval import evaluate
    from vlm_assets.evaluate.report import accuracy_png, data_uri, markdown_table, write_report
    from vlm_assets.models.occlusion_adapter import load_trained

    config, staging = step.config, step.staging
    root = step.local("occlusion_adapter")
    backbone, adapter, info = load_trained(root / "adapter.safetensors", root / "backbone.json")
    manifests = step.local("occlusion_manifests")
    data = OcclusionSamples(manifests, "validation", info["image_size"], None)
    result = evaluate(
        backbone,
        adapter,
        data,
        class_names(manifests),
        count=config.num_samples,
        batch_size=config.batch_size,
        log=step.context.log.info,
    )
    epochs = json.loads((root / "history.json").read_text())["epochs"]
    summary = write_report(staging, result, data, adapter, epochs, config.num_cards)
    step.run.log_artifact(str(staging / "report.html"))
    step.run.log_artifact(str(staging / "eval.json"))
    return Built(
        metrics=summary,
        markdown={"summary": markdown_table(summary), "accuracy": f"![accuracy]({data_uri(accuracy_png(summary))})"},
    )


eval_report = memoized_asset(
    "eval_report",
    description="""Greedy decoding on the validation split: exact-match (and the seed's lenient) accuracy
    with the adapter, without it (identity) on the same occluded images, and on the clean images;
    per-class accuracy, confusion matrix, and ``report.html`` (self-contained: curves, tables,
    prediction cards).""",
    config_type=EvalReportConfig,
    build=build_report,
    ins=("occlusion_adapter", "occlusion_manifests"),
    checks=(adapter_accuracy_meets_threshold, adapter_gain_significant),
    kinds={"pytorch", "html"},
    group_name="models",
)


class RegisteredAdapterConfig(AssetConfig):
    """Config of the ``registered_adapter`` asset: the registered model's name and alias."""

    model_name: str = Field(default="occlusion_adapter", min_length=1, description="MLflow registered model name.")
    alias: str = Field(default="champion", min_length=1, description="Alias pointed at this adapter's version.")


registered_adapter = registered_model_asset(
    "registered_adapter",
    description="""The adapter as an MLflow pyfunc model (PNG + box -> label; models-from-code, safetensors
    weights, the backbone recorded, a signature and an input example) in the Model Registry, with
    ``alias`` pointed at it. The registry, not a local cache, decides: a version is found by its weights'
    sha256, so the same weights never make a second version and a reset registry or a hand-moved alias
    is mended on the next run. Downstream of the blocking eval checks: it never runs when they fail.
    Load it with ``mlflow.pyfunc.load_model('models:/<name>@<alias>')``.""",
    source="occlusion_adapter",
    config_type=RegisteredAdapterConfig,
    code_version="2",
    deps=[eval_report],
    weights_sha256=lambda files: files["adapter.safetensors"]["sha256"],
    pyfunc="vlm_assets.models.adapter_pyfunc",
    card=adapter_card.DESCRIPTION,
)
