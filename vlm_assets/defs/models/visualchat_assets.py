"""``visualchat_model`` -> ``registered_visualchat``: a vision encoder joined to an LLM decoder with LoRA,
trained under DeepSpeed ZeRO (``training_asset``), merged, exported and evaluated; registered as
``visualchat@champion`` only when its checks pass."""

import json
from pathlib import Path

import dagster as dg
from pydantic import Field

from vlm_assets.defs.platform.checks import CHECKS_SECTION, Judged, lower_bound_check, threshold_field
from vlm_assets.defs.platform.memo import AssetConfig, Built, Step, UpstreamAsset
from vlm_assets.defs.platform.profiles import ProfileDefaults
from vlm_assets.defs.platform.registration import registered_model_asset
from vlm_assets.defs.platform.tracking import TrackedRun
from vlm_assets.defs.platform.training import TrainingConfig, dagster_config, numbers, training_asset
from vlm_assets.models import visualchat_card
from vlm_assets.models.registry import combined_sha256
from vlm_assets.paths import require_local
from vlm_assets.train.run_config import step_field
from vlm_assets.train.visualchat_config import VisualChatTrainConfig


class VQACheckConfig(ProfileDefaults, dg.Config):
    """Settings of the ``visualchat_model`` VQA check."""

    profile_key = "visualchat_model.checks"

    min_exact_match: float = threshold_field(
        0.5, "The 95 % Wilson lower bound of the merged model's VQA exact match on held-out images must reach this."
    )


class DecoderAsset(UpstreamAsset):
    """A model of this graph that can be the decoder."""

    gpt_checkpoint = "gpt_checkpoint"  # its Hugging Face export, hf/


class VisualChatAssetConfig(dagster_config(VisualChatTrainConfig), TrainingConfig):
    """``VisualChatTrainConfig`` as the asset's config, with the fields only the asset's step reads.

    It has the same fields, constraints and defaults, plus checks, resources and which of the graph's models is the
    decoder.
    """

    profile_key = "visualchat_model"

    checks: VQACheckConfig = step_field(CHECKS_SECTION, default_factory=VQACheckConfig)
    decoder_asset: DecoderAsset | None = step_field(
        "Read the decoder from this asset instead of `decoder` (demo: gpt_checkpoint).", default=None
    )

    def check_values(self) -> None:
        """Refuse a config whose local decoder, encoder, chat datasets or image folder does not exist."""
        if self.decoder_asset is None:
            require_local(self.model.decoder, "config field model.decoder")
        if self.model.encoder is not None:  # efficientnet_lite0 takes a weights file, the others a directory
            require_local(
                self.model.encoder,
                "config field model.encoder",
                directory=self.model.encoder_kind != "efficientnet_lite0",
            )
        for path in self.data.chat_datasets:
            if not Path(path).expanduser().exists():
                raise FileNotFoundError(f"config field data.chat_datasets: {path} does not exist")
        if self.data.image_folder is not None and not Path(self.data.image_folder).expanduser().is_dir():
            raise FileNotFoundError(
                f"config field data.image_folder: directory {self.data.image_folder} does not exist"
            )


def eval_loss_beats_untrained(judged: Judged) -> dg.AssetCheckResult:
    """The held-out loss after training is below the untrained model's (projection at init, LoRA zero)."""
    metrics = judged.ref.metadata["metrics"]
    loss, baseline = metrics["eval_loss"], metrics["baseline_eval_loss"]
    return dg.AssetCheckResult(
        passed=bool(loss < baseline),
        description=f"held-out loss {loss:.4f} vs untrained {baseline:.4f}",
        metadata={"eval_loss": loss, "baseline_eval_loss": baseline},
    )


def vqa_exact_match_meets_threshold(judged: Judged) -> dg.AssetCheckResult:
    """Check that the 95 % Wilson lower bound of the merged model's VQA exact match reaches ``checks.min_exact_match``.

    The exact match is on held-out clean images (asked the template's prompt), reported beside chance (one over
    the classes) and the exact match asked in held-out phrasings.
    """
    metrics = judged.ref.metadata["metrics"]
    if "vqa_exact_match" not in metrics:
        return dg.AssetCheckResult(passed=False, description="not measured: eval_images is 0")
    phrased = metrics.get("vqa_held_out_phrasings_exact_match")
    return lower_bound_check(
        "vqa_exact_match",
        metrics["vqa_exact_match"],
        metrics.get("vqa_exact_match_ci95_low", -1.0),  # none recorded (an older build): below any threshold
        ("min_exact_match", judged.settings.min_exact_match),
        int(metrics["vqa_images"]),
        what="exact match on held-out images",
        chance=metrics["vqa_chance"],
        also=f"; in held-out phrasings {phrased:.1%}" if phrased is not None else "",
        **({"vqa_held_out_phrasings_exact_match": phrased} if phrased is not None else {}),
    )


def merged_equals_unmerged(judged: Judged) -> dg.AssetCheckResult:
    """Merging LoRA into the decoder changed no output by more than 1e-4 (logits on a fixed held-out batch)."""
    diff = judged.ref.metadata["metrics"]["merge_max_abs_diff"]
    return dg.AssetCheckResult(
        passed=bool(diff < 1e-4),
        description=f"largest logit difference {diff:.2e}",
        metadata={"merge_max_abs_diff": diff},
    )


def visualchat_inputs(step: Step) -> dict[str, str]:
    """Return the trainer's inputs: the manifests and the decoder (the in-graph GPT's export when the config names it).

    Bad chat records fail here (FILE:N), never retried.
    """
    config = step.config
    config.data.read_chat_datasets(sorted(config.data.chat_datasets), config.model.max_images)
    decoder = str(step.local(config.decoder_asset.value) / "hf") if config.decoder_asset else config.model.decoder
    return {"occlusion_manifests": str(step.local("occlusion_manifests")), "decoder": decoder}


def visualchat_report(step: Step, values: dict) -> Built:
    """Report the VisualChat trainer's values: its numbers, the decoder, backend and dtype, and the report markdown."""
    return Built(
        metrics=numbers(values),
        metadata={"decoder": step.inputs["decoder"], **{k: values[k] for k in ("backend", "param_dtype")}},
        markdown=report_markdown(step.staging, step.run, step.config),
    )


visualchat_model = training_asset(
    "visualchat_model",
    description="""A vision encoder + projection + causal-LM decoder with LoRA (DeepSpeed-VisualChat's
    recipe), trained with Lightning's DeepSpeedStrategy (ZeRO-2/3) on ``parallelism.nproc_per_node`` x ``num_nodes``
    processes; LoRA merged. Contains ``model/`` (``VisualChatModel.from_pretrained``; ``python -m
    vlm_assets.chat``), ``history.json``, ``eval.json`` (VQA exact match of the merged model on held-out
    images, a two-image conversation) and ``loss_curve.png``. A retry resumes from the newest checkpoint
    at the same step and data position.""",
    config_type=VisualChatAssetConfig,
    trainer="vlm_assets.train.visualchat_train",
    source="occlusion_manifests",
    inputs=visualchat_inputs,
    finish=visualchat_report,
    checks=(eval_loss_beats_untrained, vqa_exact_match_meets_threshold, merged_equals_unmerged),
    kinds={"pytorch", "deepspeed"},
)


def report_markdown(staging: Path, run: TrackedRun, config: VisualChatAssetConfig) -> dict[str, str]:
    """The loss curve (and the held-out loss before and after) and the two-image conversation, for the UI."""
    from vlm_assets.evaluate.report import loss_curve_png

    history = json.loads((staging / "history.json").read_text())
    held_out = [
        {"step": 0, "loss": history["baseline_eval_loss"]},
        {"step": history["steps"], "loss": history["eval_loss"]},
    ]
    png = loss_curve_png(
        {"train": history["train"], "val": held_out},
        history["baseline_eval_loss"],
        f"VisualChat: {config.model.encoder_kind} + {config.model.projection} + LoRA decoder, "
        f"ZeRO-{config.parallelism.zero_stage}",
        baseline_label="held-out loss untrained",
    )
    (staging / "loss_curve.png").write_bytes(png)
    markdown = {"loss_curve": run.log_image(staging / "loss_curve.png", "loss curve")}
    if (staging / "eval.json").is_file():
        run.log_artifact(str(staging / "eval.json"))
        from vlm_assets.evaluate.visualchat_eval import conversation_markdown

        markdown["conversation"] = conversation_markdown(
            json.loads((staging / "eval.json").read_text())["conversation"]
        )
    return markdown


class RegisteredVisualChatConfig(AssetConfig):
    """Config of the ``registered_visualchat`` asset: the registered model's name and alias."""

    model_name: str = Field(default="visualchat", min_length=1, description="MLflow registered model name.")
    alias: str = Field(default="champion", min_length=1, description="Alias pointed at this model's version.")


registered_visualchat = registered_model_asset(
    "registered_visualchat",
    description="""The merged VisualChat model as an MLflow pyfunc (models-from-code: a question and base64
    PNG images -> the answer) in the Model Registry, with ``alias`` pointed at it. As
    ``registered_adapter``: a version is found by the sha256 of the model's files, so the same model never
    makes a second version. Runs only when the blocking checks of ``visualchat_model`` passed. Chat with
    it: ``python -m vlm_assets.chat models:/visualchat@champion``.""",
    source="visualchat_model",
    config_type=RegisteredVisualChatConfig,
    weights_sha256=lambda files: combined_sha256(files, under="model/"),
    pyfunc="vlm_assets.models.visualchat_pyfunc",
    card=visualchat_card.DESCRIPTION,
)
