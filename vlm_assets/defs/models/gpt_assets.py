"""``gpt_checkpoint``: a GPT-2-style model pretrained from scratch on ``token_shards``, and its checks.

The asset is thin: it turns its config into a ``PretrainConfig`` and a ``LaunchSpec``, lets the
launcher run ``vlm_assets.train.gpt_pretrain`` on every process of every node, and commits what rank
0 wrote. Checkpoints go to the artifact store under ``checkpoints/<cache key>/`` while it trains, so a
retried (or re-launched) run with the same inputs resumes from the newest intact one.
"""

import base64
import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Literal

import dagster as dg
from pydantic import Field

from vlm_assets.data.token_stream import reference_batch
from vlm_assets.defs.platform.launcher import TrainingLauncher
from vlm_assets.defs.platform.memo import Built, ValidatedConfig, artifact_key, materialize_memoized
from vlm_assets.defs.platform.storage import ArtifactStoreResource
from vlm_assets.defs.platform.tracking import MlflowTrackingResource, TrackedRun
from vlm_assets.launch import LaunchSpec
from vlm_assets.models.gpt import PRESETS
from vlm_assets.models.gpt_export import hf_loss
from vlm_assets.paths import runs_dir
from vlm_assets.storage import ArtifactRef
from vlm_assets.train.gpt_config import PretrainConfig
from vlm_assets.train.plots import loss_curve_png

TRAINER_MODULE = "vlm_assets.train.gpt_pretrain"


class GPTCheckpointConfig(ValidatedConfig):
    preset: str = Field(default="124M", description=f"Model shape and default lr: one of {list(PRESETS)}.")
    dropout: float = Field(default=0.0, description="Dropout in embeddings, attention and MLP.")
    strategy: Literal["ddp", "fsdp2"] = Field(default="fsdp2", description="DDP, or FSDP2 (fully_shard per block).")
    num_nodes: int = Field(default=1, description="Nodes (local backend: torchrun agents on 127.0.0.1).")
    nproc_per_node: int = Field(default=1, description="Processes (devices) per node.")
    micro_batch_size: int = Field(default=8, description="Sequences per process per forward/backward.")
    global_batch_size: int = Field(default=256, description="Sequences per optimizer step (accumulation fills the gap).")
    lr: float | None = Field(default=None, description="Peak learning rate; unset = the preset's.")
    warmup_steps: int = Field(default=100, description="Linear warmup steps, then cosine decay to lr/10.")
    max_steps: int = Field(default=2000, description="Optimizer steps.")
    weight_decay: float = Field(default=0.1, description="AdamW weight decay on >= 2-D parameters.")
    grad_clip: float = Field(default=1.0, description="Max global gradient norm (0 disables).")
    activation_checkpointing: bool = Field(default=False, description="Recompute block activations in backward.")
    val_check_interval: int = Field(default=200, description="Validate every this many steps.")
    val_batches: int = Field(default=20, description="Micro-batches per validation.")
    checkpoint_every: int = Field(default=200, description="Commit a checkpoint every this many steps.")
    keep_last: int = Field(default=2, description="Complete checkpoints kept in the store.")
    log_every: int = Field(default=10, description="Report metrics every this many steps.")
    seed: int = Field(default=1337, description="Seeds init and data order.")
    timeout_s: int = Field(default=24 * 3600, description="The whole training job's time limit.")
    min_val_loss_gain: float = Field(
        default=1.0, description="Check: val loss must be at least this far (nats) below ln(vocab size).")

    def check_values(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"config field preset: unknown {self.preset!r}; choose one of {list(PRESETS)}")
        if self.num_nodes < 1 or self.nproc_per_node < 1:
            raise ValueError("config fields num_nodes and nproc_per_node must be >= 1")
        self.pretrain_config(shards_uri="", out_dir="", cache="", store={}, prefix="").accumulation(
            self.num_nodes * self.nproc_per_node)

    def pretrain_config(self, *, shards_uri: str, out_dir: str, cache: str, store: dict, prefix: str,
                        tracking_uri: str | None = None, run_id: str | None = None) -> PretrainConfig:
        try:
            return PretrainConfig(
                shards_uri=shards_uri, out_dir=out_dir, cache_dir=cache, checkpoint_store=store,
                checkpoint_prefix=prefix, preset=self.preset, model_overrides={"dropout": self.dropout},
                micro_batch_size=self.micro_batch_size, global_batch_size=self.global_batch_size, lr=self.lr,
                warmup_steps=self.warmup_steps, max_steps=self.max_steps, weight_decay=self.weight_decay,
                grad_clip=self.grad_clip, strategy=self.strategy, activation_checkpointing=self.activation_checkpointing,
                val_check_interval=self.val_check_interval, val_batches=self.val_batches,
                checkpoint_every=self.checkpoint_every, keep_last=self.keep_last, log_every=self.log_every,
                seed=self.seed, mlflow_tracking_uri=tracking_uri, mlflow_run_id=run_id,
            )
        except ValueError as err:
            raise ValueError(f"config field {err}") from err


@dg.asset(
    code_version="1",
    kinds={"pytorch", "lightning"},
    group_name="models",
    retry_policy=dg.RetryPolicy(max_retries=2, delay=2),
)
def gpt_checkpoint(
    context: dg.AssetExecutionContext,
    config: GPTCheckpointConfig,
    token_shards: ArtifactRef,
    artifact_store: ArtifactStoreResource,
    mlflow: MlflowTrackingResource,
    launcher: TrainingLauncher,
) -> dg.Output[ArtifactRef]:
    """A GPT-2-style decoder pretrained from scratch on ``token_shards`` with Lightning (DDP or FSDP2),
    as a distributed job on ``num_nodes`` x ``nproc_per_node`` processes. Contains ``checkpoint.ckpt``
    (consolidated Lightning checkpoint), ``hf/`` (a ``GPT2LMHeadModel`` export with tokenizer, loadable
    with transformers alone), ``history.json`` and ``loss_curve.png``. A retry resumes from the newest
    intact checkpoint of the same inputs."""
    upstream = {"token_shards": token_shards}
    key = artifact_key(context, config, upstream)
    store = artifact_store.get_store()

    def build(staging: Path, run: TrackedRun) -> Built:
        work = Path(tempfile.mkdtemp(prefix="gpt-", dir=runs_dir()))
        try:
            return _train(work, staging, run)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _train(work: Path, staging: Path, run: TrackedRun) -> Built:
        pretrain = config.pretrain_config(
            shards_uri=token_shards.uri, out_dir=str(staging), cache=str(work), store=artifact_store.spec(),
            prefix=f"checkpoints/{key}", tracking_uri=mlflow.tracking_uri, run_id=run.run_id)
        pretrain.save(work / "run.json")
        spec = LaunchSpec(TRAINER_MODULE, ("--config", str(work / "run.json")), num_nodes=config.num_nodes,
                          nproc_per_node=config.nproc_per_node, timeout_s=config.timeout_s, name="gpt_checkpoint")
        reports = launcher.launch(context, spec)
        if len(reports) != 1:
            raise RuntimeError(f"the trainer reported {len(reports)} materializations through Pipes, expected 1")
        values = {k: getattr(v, "value", v) for k, v in (reports[0].metadata or {}).items()}
        history = json.loads((staging / "history.json").read_text())
        vocab = json.loads((staging / "hf" / "config.json").read_text())["vocab_size"]
        png = loss_curve_png(history, math.log(vocab), f"GPT {config.preset}, {config.strategy}, "
                             f"{config.num_nodes}x{config.nproc_per_node} processes")
        (staging / "loss_curve.png").write_bytes(png)
        run.log_artifact(str(staging / "loss_curve.png"))
        return Built(
            metrics={k: float(v) for k, v in values.items() if isinstance(v, (int, float))},
            metadata={"checkpoint_key": values["checkpoint"], "strategy": values["strategy"], "vocab_size": vocab,
                      "min_val_loss_gain": config.min_val_loss_gain},
            markdown={"loss_curve": f"![loss curve](data:image/png;base64,{base64.b64encode(png).decode()})"},
        )

    return materialize_memoized(context, store=store, mlflow=mlflow, config=config, build=build, upstream=upstream)


@dg.asset_check(asset=gpt_checkpoint, blocking=True)
def val_loss_beats_uniform(gpt_checkpoint: ArtifactRef) -> dg.AssetCheckResult:
    """Final validation loss is finite and at least ``min_val_loss_gain`` nats below the loss of a
    uniform predictor over the vocabulary (ln V = 10.82 for GPT-2 BPE)."""
    metrics, metadata = gpt_checkpoint.metadata["metrics"], gpt_checkpoint.metadata["metadata"]
    val_loss, uniform = metrics["val_loss"], math.log(metadata["vocab_size"])
    bound = uniform - metadata["min_val_loss_gain"]
    return dg.AssetCheckResult(
        passed=bool(math.isfinite(val_loss) and val_loss < bound),
        description=f"val loss {val_loss:.3f} vs uniform {uniform:.3f} (must be < {bound:.3f})",
        metadata={"val_loss": val_loss, "uniform_loss": uniform, "bound": bound},
    )


@dg.asset_check(asset=gpt_checkpoint, blocking=True, additional_ins={"token_shards": dg.AssetIn()})
def export_reproduces_val_loss(gpt_checkpoint: ArtifactRef, token_shards: ArtifactRef,
                               artifact_store: ArtifactStoreResource) -> dg.AssetCheckResult:
    """The Hugging Face export, loaded with ``transformers`` alone (``GPT2LMHeadModel``), gives the
    trainer's loss on a fixed validation batch (within 1e-3 nats); every file matches its checksum."""
    store = artifact_store.get_store()
    store.verify(gpt_checkpoint.key)
    root = store.local_path(gpt_checkpoint.key)
    expected = json.loads((root / "reference.json").read_text())
    with tempfile.TemporaryDirectory(dir=runs_dir()) as tmp:
        batch = reference_batch(token_shards.uri, expected["num_samples"], tmp)
        loss = hf_loss(root / "hf", batch)
    diff = abs(loss - expected["val_batch_loss"])
    return dg.AssetCheckResult(
        passed=bool(diff < 1e-3), description=f"export loss {loss:.5f}, trainer loss {expected['val_batch_loss']:.5f}",
        metadata={"export_loss": loss, "trainer_loss": expected["val_batch_loss"], "abs_diff": diff},
    )
