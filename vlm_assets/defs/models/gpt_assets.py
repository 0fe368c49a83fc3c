"""``gpt_checkpoint``: a GPT-2-style model pretrained from scratch on ``token_shards``, and its checks."""

import json
import math

import dagster as dg
from pydantic import Field

from vlm_assets.defs.platform.checks import CHECKS_SECTION, Judged
from vlm_assets.defs.platform.memo import Built, Step
from vlm_assets.defs.platform.profiles import ProfileDefaults
from vlm_assets.defs.platform.training import TrainingConfig, dagster_config, numbers, training_asset
from vlm_assets.train.gpt_config import PretrainConfig
from vlm_assets.train.run_config import step_field


class ValLossCheckConfig(ProfileDefaults, dg.Config):
    """Settings of the ``gpt_checkpoint`` validation-loss check."""

    profile_key = "gpt_checkpoint.checks"

    min_val_loss_gain: float = Field(
        default=1.0,
        ge=0,
        description=("Val loss must be at least this many nats below ln(vocab size) (the loss of a uniform guess)."),
    )


class GPTCheckpointConfig(dagster_config(PretrainConfig), TrainingConfig):
    """``PretrainConfig`` as the asset's config, with the sections only the asset's step reads.

    It has the same fields, constraints and defaults, plus checks and resources.
    """

    profile_key = "gpt_checkpoint"

    checks: ValLossCheckConfig = step_field(CHECKS_SECTION, default_factory=ValLossCheckConfig)


def val_loss_beats_uniform(judged: Judged) -> dg.AssetCheckResult:
    """Check that the final validation loss is finite and at least ``checks.min_val_loss_gain`` nats below uniform.

    Uniform is the loss of a uniform predictor over the vocabulary (ln V = 10.82 for GPT-2 BPE). A run setting:
    changing it judges the same checkpoint again, never retrains it.
    """
    metrics, metadata = judged.ref.metadata["metrics"], judged.ref.metadata["metadata"]
    val_loss, uniform = metrics["val_loss"], math.log(metadata["vocab_size"])
    bound = uniform - judged.settings.min_val_loss_gain
    return dg.AssetCheckResult(
        passed=bool(math.isfinite(val_loss) and val_loss < bound),
        description=f"val loss {val_loss:.3f} vs uniform {uniform:.3f} (must be < {bound:.3f})",
        metadata={"val_loss": val_loss, "uniform_loss": uniform, "bound": bound},
    )


def export_reproduces_val_loss(judged: Judged) -> dg.AssetCheckResult:
    """Check that the Hugging Face export gives the trainer's loss on a fixed validation batch (within 1e-3 nats).

    The export is loaded with ``transformers`` alone (``GPT2LMHeadModel``). Measured when the artifact is built; on
    a cache hit judged from that record after a size check (``defs/platform/checks.py``).
    """
    from vlm_assets.models.gpt_export import export_scan

    scanned, source = judged.scan(lambda root: export_scan(root, judged.upstream["token_shards"].uri))
    loss, trainer = scanned["export_loss"], scanned["trainer_loss"]
    diff = abs(loss - trainer)
    return dg.AssetCheckResult(
        passed=bool(diff < 1e-3),
        description=f"export loss {loss:.5f}, trainer loss {trainer:.5f}",
        metadata={"export_loss": loss, "trainer_loss": trainer, "abs_diff": diff, "scan": source},
    )


def report(step: Step, values: dict) -> Built:
    """Report what the GPT trainer wrote, for the registry of runs and the UI.

    It shows the loss curve against the uniform guess, the export's scan and the trainer's numbers.
    """
    from vlm_assets.evaluate.report import loss_curve_png
    from vlm_assets.models.gpt_export import export_scan

    config, staging = step.config, step.staging
    history = json.loads((staging / "history.json").read_text())
    vocab = json.loads((staging / "hf" / "config.json").read_text())["vocab_size"]
    png = loss_curve_png(
        history,
        math.log(vocab),
        f"GPT {config.model.preset}, {config.parallelism.strategy}, "
        f"{config.parallelism.num_nodes}x{config.parallelism.nproc_per_node} processes",
    )
    (staging / "loss_curve.png").write_bytes(png)
    dataset = step.upstream["token_shards"].metadata
    return Built(
        scan=export_scan(staging, step.upstream["token_shards"].uri),
        metrics=numbers(values),
        metadata={
            "checkpoint_key": values["checkpoint"],
            **{k: values[k] for k in ("strategy", "precision", "backend")},
            "vocab_size": vocab,
            # the dataset it trained on, merged from this many token_chunks partitions (1: built whole)
            "dataset_partitions": dataset["metadata"].get("partitions", 1),
            **{f"dataset_{split}_shards": dataset["metrics"][f"{split}_num_shards"] for split in ("train", "val")},
            # tokens of text: the padding of each last block (its labels ignored) left out
            **{
                f"dataset_{split}_tokens": dataset["metrics"][f"{split}_num_tokens"]
                - dataset["metrics"].get(f"{split}_num_padding", 0)
                for split in ("train", "val")
            },
        },
        markdown={"loss_curve": step.run.log_image(staging / "loss_curve.png", "loss curve")},
    )


gpt_checkpoint = training_asset(
    "gpt_checkpoint",
    description="""A GPT-2-style decoder pretrained from scratch on ``token_shards`` with Lightning (DDP or
    FSDP2), as a distributed job on ``parallelism.num_nodes`` x ``nproc_per_node`` processes. Contains
    ``checkpoint.ckpt`` (consolidated Lightning checkpoint), ``hf/`` (a ``GPT2LMHeadModel`` export with
    tokenizer, loadable with transformers alone), ``history.json`` and ``loss_curve.png``. A retry resumes
    from the newest intact checkpoint of the same inputs.""",
    config_type=GPTCheckpointConfig,
    trainer="vlm_assets.train.gpt_pretrain",
    source="token_shards",
    inputs=lambda step: {"token_shards": step.upstream["token_shards"].uri},
    finish=report,
    checks=(val_loss_beats_uniform, export_reproduces_val_loss),
    kinds={"pytorch", "lightning"},
)
