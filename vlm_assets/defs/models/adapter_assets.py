"""``occlusion_adapter`` -> ``eval_report`` -> ``registered_adapter``: train the adapter in front of a
frozen VLM, prove it helps, and register it in the MLflow Model Registry only when the checks pass."""

import json
from pathlib import Path

import dagster as dg

from vlm_assets.defs.platform.checks import Judged
from vlm_assets.defs.platform.memo import Built, Step, UpstreamAsset
from vlm_assets.defs.platform.training import TrainingConfig, dagster_config, last_try, numbers, training_asset
from vlm_assets.paths import require_local
from vlm_assets.train.adapter_config import AdapterTrainConfig
from vlm_assets.train.run_config import step_field


class BackboneAsset(UpstreamAsset):
    """A model of this graph that can be the frozen backbone."""

    visualchat_model = "visualchat_model"  # its merged model/ directory


class OcclusionAdapterConfig(dagster_config(AdapterTrainConfig), TrainingConfig):
    """``AdapterTrainConfig`` as the asset's config, with the resources and the backbone choice.

    It has the same fields, constraints and defaults, the resources apart, and which of the graph's models is the
    backbone (if one is).
    """

    profile_key = "occlusion_adapter"

    backbone_asset: BackboneAsset | None = step_field(
        "Read the frozen backbone from this asset instead of `backbone` (demo: visualchat_model).", default=None
    )

    def check_values(self) -> None:
        """Refuse a config whose local backbone does not exist (when no backbone asset is named)."""
        if self.backbone_asset is None:
            require_local(self.model.backbone, "config field model.backbone")


def preflight(config: OcclusionAdapterConfig, manifests: Path) -> None:
    """Bad rows fail the step at once (no retries), naming the manifest line."""
    from vlm_assets.data.occlusion_dataset import OcclusionSamples

    for split, limit in (("train", config.data.num_train), ("validation", config.data.num_validation)):
        OcclusionSamples(manifests, split, config.data.image_size, limit).check_images()


def adapter_training_complete(judged: Judged) -> dg.AssetCheckResult:
    """Check that training finished every epoch.

    A partial adapter (materialized from the last recovery checkpoint after training failed for good) fails here,
    so eval and registration never use it.
    """
    partial = bool(judged.ref.metadata["metadata"].get("partial"))
    epochs = judged.ref.metadata["metrics"].get("epochs")
    return dg.AssetCheckResult(
        passed=not partial,
        metadata={"partial": partial, "epochs": epochs},
        description="partial: training failed for good" if partial else "complete",
    )


def adapter_weights_finite(judged: Judged) -> dg.AssetCheckResult:
    """Check that the gate and every adapter weight are finite.

    Read when built; on a hit, judged from that record after a size check (``defs/platform/checks.py``).
    """
    from vlm_assets.models.occlusion_adapter import weights_scan

    scanned, source = judged.scan(weights_scan)
    bad = scanned["non_finite"]
    return dg.AssetCheckResult(
        passed=not bad,
        description=f"non-finite: {bad}" if bad else "all finite",
        metadata={"gate": scanned["gate"], "num_parameters": scanned["num_parameters"], "scan": source},
    )


def adapter_inputs(step: Step) -> dict[str, str]:
    """The manifests and the backbone the workers load, once the bad input that would fail them is refused."""
    from vlm_assets.data.occlusion_dataset import OcclusionSamples
    from vlm_assets.models.frozen_vlm import check_prompt_lengths

    config, manifests = step.config, step.local("occlusion_manifests")
    preflight(config, manifests)
    backbone = (
        str(step.local(config.backbone_asset.value) / "model") if config.backbone_asset else config.model.backbone
    )
    check_prompt_lengths(
        backbone,
        OcclusionSamples(manifests, "train", config.data.image_size, None).images.rows,
        config.data.image_size,
        config.data.max_length,
        str(manifests / "train.jsonl"),
    )
    return {"occlusion_manifests": str(manifests), "backbone": backbone}


def partial_on_failure(step: Step, failure: dg.Failure) -> dict:
    """On the last try, when the config asks for it, the last recovery checkpoint as a partial adapter."""
    if not (step.config.checkpoint.materialize_partial_on_failure and last_try(step)):
        raise failure
    step.context.log.warning(
        f"training failed for good; materializing the last checkpoint as partial: {failure.description}"
    )
    from vlm_assets.train.adapter_train import partial_from_checkpoint

    return partial_from_checkpoint(step.store, f"checkpoints/{step.key}", step.staging)


def adapter_report(step: Step, values: dict) -> Built:
    """``backbone.json`` (what the adapter was trained against: eval_report loads it) and the numbers."""
    from vlm_assets.models import occlusion_adapter

    config, staging, backbone = step.config, step.staging, step.inputs["backbone"]
    with (step.local("occlusion_manifests") / "train.jsonl").open() as rows:
        prompt = json.loads(next(rows))["prompt"]
    (staging / "backbone.json").write_text(
        json.dumps(
            {
                "backbone": backbone,
                "image_size": config.data.image_size,
                "max_length": config.data.max_length,
                "prompt": prompt,
                "adapter_steps": config.model.adapter_steps,
            }
        )
    )
    partial = bool(json.loads((staging / "history.json").read_text()).get("partial"))
    return Built(
        metrics=numbers(values),
        metadata={
            "backbone": backbone,
            "partial": partial,
            **{k: values[k] for k in ("strategy", "precision", "backend") if k in values},  # a partial has none
        },
        scan=occlusion_adapter.weights_scan(staging),
    )


occlusion_adapter = training_asset(
    "occlusion_adapter",
    description="""A 10,532-parameter residual Conv2d adapter trained in front of a frozen VLM (a Qwen2.5-VL,
    or the graph's merged VisualChat model) so it answers correctly on occluded images: LM loss on the
    answer tokens + 0.35 x masked L1 to the clean image. Contains ``adapter.safetensors``, ``backbone.json``
    (what it was trained against) and ``history.json``. A retry resumes from the last per-epoch recovery
    checkpoint.""",
    config_type=OcclusionAdapterConfig,
    trainer="vlm_assets.train.adapter_train",
    source="occlusion_manifests",
    inputs=adapter_inputs,
    finish=adapter_report,
    on_failure=partial_on_failure,
    checks=(adapter_training_complete, adapter_weights_finite),
    kinds={"pytorch", "lightning"},
)
