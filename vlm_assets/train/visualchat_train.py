"""VisualChat training entry point: Lightning's ``DeepSpeedStrategy`` (ZeRO-2 or 3), LoRA on the decoder,
then LoRA merged and the whole model exported. One process per device, started by torchrun or the launcher:

    torchrun --nnodes=1 --nproc-per-node=2 -m vlm_assets.train.visualchat_train --config run.json

``run.json`` holds a ``VisualChatTrainConfig`` and ``RunPaths`` (inputs ``occlusion_manifests``, optional,
and ``decoder`` when the asset resolved the in-graph GPT). bf16 on GPUs (NCCL), fp32 on CPU (gloo). The
data order is ``DistributedSampler``'s (seeded, reshuffled per epoch; torchdata's resumable one, its epoch
kept too) through torchdata's ``StatefulDataLoader``, whose position Lightning saves in every checkpoint.
Every ``checkpoint.every`` steps the checkpoint (trained weights, optimizer, scheduler, loop and loader
state, history) is committed to the artifact store; a relaunch resumes from the newest intact one at the
same step and data position, so the loss curve continues exactly (dropout's masks are seeded per step:
``StepSeed``). At the end rank 0 gathers the weights (from the ZeRO-3 partitions too), merges LoRA into
the decoder, checks the merged model against the unmerged one on a fixed batch, writes ``model/``
(``VisualChatModel.save_pretrained``) and ``history.json`` into ``out_dir``, reloads that export and
measures its VQA exact match on held-out validation images of the manifests with a two-image
conversation (``eval.json``), and reports through Pipes.
"""

import contextlib
import functools
import json
import math
import os
import shutil
import time
import warnings
from pathlib import Path

import deepspeed
import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from peft import LoraConfig, get_peft_model
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from transformers.pytorch_utils import Conv1D

from vlm_assets.data import visualchat_data as vd
from vlm_assets.evaluate.visualchat_eval import evaluate_export
from vlm_assets.launch.spec import InputRefused
from vlm_assets.models.hf_compat import set_activation_checkpointing
from vlm_assets.models.visualchat import VisualChatModel, decoder_positions, pixel_keys
from vlm_assets.models.visualchat_attention import attention_layout
from vlm_assets.train.checkpoints import StepCheckpoint, StepSeed
from vlm_assets.train.deepspeed_store import deepspeed_strategy
from vlm_assets.train.entry import TrainerRun, entry_point
from vlm_assets.train.reporting import TrainingHistory
from vlm_assets.train.visualchat_config import VisualChatTrainConfig

EVAL_BATCH = 4
FEATURE_BATCH = 64  # images per encoder forward when the ranks fill the feature cache
# DeepSpeed probes for an accelerator and warns at every process start when it finds none; on CPU say so.
os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
# DeepSpeed's ZeRO calls torch collectives that torch deprecated (all_gather_into_tensor,
# reduce_scatter_tensor): nothing of ours to change.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
# A frozen encoder is kept in eval mode on purpose (fixed batch-norm statistics, no dropout): Lightning's
# warning about modules in eval mode at the start of training is about exactly that.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
warnings.filterwarnings("ignore", message=".*does not have many workers.*")  # rows are in memory
# torchdata 0.11 (its latest) calls torch's telemetry hook set_vital, which torch 2.13 deprecated.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
# peft 0.21 (its latest) reads transformers' old `is_gradient_checkpointing` name in get_peft_model.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def build_model(config: VisualChatTrainConfig) -> VisualChatModel:
    """Build the model to train, deterministic in ``config.seed``.

    Pretrained parts, projection at init, LoRA (zero at init) on the decoder, and ``requires_grad`` set by
    ``freeze_modules``.
    """
    torch.manual_seed(config.seed)
    model = VisualChatModel.build(config.model)
    # GPT-2 stores its linear layers as Conv1D, (in, out): peft must be told (it warns and guesses otherwise).
    transposed = any(isinstance(m, Conv1D) for m in model.decoder.modules())
    lora = LoraConfig(
        r=config.model.lora_r,
        lora_alpha=config.model.lora_alpha,
        lora_dropout=config.model.lora_dropout,
        target_modules="all-linear",
        fan_in_fan_out=transposed,
    )
    model.decoder = get_peft_model(model.decoder, lora)
    if config.model.lora_encoder:
        model.encoder = get_peft_model(
            model.encoder,
            LoraConfig(r=config.model.lora_r, lora_alpha=config.model.lora_alpha, target_modules="all-linear"),
        )
    for name, param in model.named_parameters():
        module = "lora" if "lora_" in name else name.split(".")[0]
        param.requires_grad_(module not in config.model.freeze_modules)
    if config.parallelism.cache_image_features:
        model.cache_image_features()
    if config.parallelism.gradient_checkpointing:
        set_activation_checkpointing(model.decoder)
    return model


def build_samples(config: VisualChatTrainConfig, model: VisualChatModel, manifests: Path | None):
    """(train rows, eval samples): blended, split, rendered (bad records fail here, naming file:line), packed."""
    paths = sorted(config.data.chat_datasets)
    datasets = [
        (records, config.data.chat_datasets[p])
        for p, records in zip(paths, config.data.read_chat_datasets(paths, config.model.max_images))
    ]
    if manifests is not None:
        vqa = vd.manifest_records(
            manifests, "train", pairs=config.data.pair_count, phrased=config.data.phrasing_count, seed=config.seed
        )
        phrased = len(vqa) - config.data.phrasing_count  # the phrased records come last
        datasets += [
            ([r for r in vqa[:phrased] if len(r.images) == 1], config.data.vqa_count),
            ([r for r in vqa[:phrased] if len(r.images) == 2] + vqa[phrased:], None),
        ]
    records = vd.blend(datasets, config.seed)
    if not records:
        raise ValueError("no training data: set chat_datasets, or give the occlusion manifests with vqa_count > 0")
    train, held = vd.split(records, config.data.eval_fraction, config.seed)
    limit = config.model.max_length
    positions = decoder_positions(model.decoder.config)
    if positions is not None and positions < limit:
        limit = positions  # a learned position table (GPT-2) ends there: a longer sample cannot be embedded
    try:
        render = [vd.render(r, model.tokenizer, model.image_token_id, model.num_image_tokens, limit) for r in train]
        evaluation = [vd.render(r, model.tokenizer, model.image_token_id, model.num_image_tokens, limit) for r in held]
    except ValueError as err:
        if limit == config.model.max_length:
            raise
        raise ValueError(f"{err} (the decoder {config.model.decoder} has {positions} positions)") from None
    if config.data.packing:
        rows = [[render[i] for i in row] for row in vd.pack([len(s.ids) for s in render], config.data.pack_tokens)]
    else:
        rows = [[s] for s in render]
    return rows, evaluation


class Rows(Dataset):
    """The packed rows, an epoch rounded up to whole optimizer steps by repeating the first rows.

    This is as ``DistributedSampler`` rounds up to whole ranks: Lightning counts an optimizer step every
    ``accumulation`` batches of an epoch, DeepSpeed every ``accumulation`` batches of the run, and the
    two agree only when an epoch is a whole number of steps.
    """

    def __init__(self, rows: list[list[vd.Sample]], global_batch: int):
        self.rows, self.length = rows, math.ceil(len(rows) / global_batch) * global_batch

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> list[vd.Sample]:
        return self.rows[index % len(self.rows)]


class EpochSampler(StatefulDistributedSampler):
    """torchdata's resumable ``DistributedSampler`` (the same order), whose state also holds its epoch.

    A restored loader draws the rest of its epoch's order before Lightning sets the sampler's epoch, so
    without the epoch in the state a run resumed in its second epoch would train on the rest of the
    first epoch's order. A state saved after its epoch's last batch is the next epoch's start:
    torchdata's sampler would skip that many samples of the next epoch's order, leaving it empty, and
    Lightning would go on with the epoch after. (Both are regression tests in test_visualchat_train.)"""

    def state_dict(self) -> dict:
        """Return the sampler's state with its epoch."""
        return {**super().state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the sampler's state and epoch; a state saved at its epoch's end starts the next epoch."""
        super().load_state_dict(state_dict)
        epoch = state_dict["epoch"]
        if self.next_yielded is not None and self.next_yielded >= self.num_samples:
            self.next_yielded, epoch = None, epoch + 1
        self.set_epoch(epoch)


class VisualChatModule(L.LightningModule):
    """The Lightning module that trains a ``VisualChatModel`` on its own loss (answer tokens).

    It uses AdamW with a linear warm-up, measures the held-out loss before training (kept in the checkpoint) and
    counts the non-padding tokens trained on.
    """

    def __init__(
        self,
        config: VisualChatTrainConfig,
        model: VisualChatModel,
        evaluation: list[vd.Sample],
        log,
        feature_images: list[str] = (),
    ):
        super().__init__()
        self.config, self.model, self.evaluation, self.log_line = config, model, evaluation, log
        self.feature_images = list(feature_images)  # every image of the run, when its features are cached
        self.strict_loading = False  # checkpoints hold the trained weights only (exclude_frozen_parameters)
        self.step_losses: list[float] = []  # this optimizer step's micro-batch losses, over all ranks
        self.baseline_eval_loss: float | None = None
        self.eval_loss: float | None = None  # held-out loss after training (finish)
        self.feature_misses, self.elapsed = 0, 0.0  # after training: over every rank, and this attempt's time
        self.tokens, self.started = 0, 0.0  # this attempt's trained tokens (non-padding; finish sums the ranks')
        # The attention layout is held from the batch's start to its end: with gradient checkpointing the
        # forward is recomputed inside backward, which Lightning runs outside training_step.
        self._layout = contextlib.ExitStack()

    def on_train_start(self) -> None:
        """Fill the feature cache, measure the held-out loss unless a checkpoint holds it, start the clock."""
        if self.feature_images:
            self.share_image_features()
        if self.baseline_eval_loss is None:
            self.baseline_eval_loss = evaluate(self.model, self.evaluation, self.device)
            self.log_line(f"eval loss before training (projection at init, LoRA zero): {self.baseline_eval_loss:.4f}")
        self.started = time.perf_counter()

    def share_image_features(self) -> None:
        """Encode each of ``feature_images`` once across the ranks and cache every image's features on every rank.

        Left to the steps, each rank would encode every image it meets: over a few epochs, all of them on
        each rank. Each rank encodes every ``world``-th image, its share padded to the same number of batches
        as every other rank's (ZeRO-3's encoder forward is collective; the all-gather needs equal shapes).
        """
        started = time.perf_counter()
        world, rank, size = self.trainer.world_size, self.global_rank, self.model.encoder.image_size
        per_rank = math.ceil(len(self.feature_images) / world)
        share = self.feature_images[rank::world] or self.feature_images[-1:]
        share += share[-1:] * (per_rank - len(share))
        keys, features = [], []
        for at in range(0, per_rank, FEATURE_BATCH):
            pixels = torch.stack([vd.load_image(ref, size) for ref in share[at : at + FEATURE_BATCH]])
            pixels = pixels.to(self.device, self.model.encoder.mean.dtype)
            keys += pixel_keys(pixels)
            features.append(self.model.encode_frozen(pixels))
        encoded = torch.cat(features)
        digests = torch.tensor([list(key) for key in keys], dtype=torch.uint8, device=self.device)
        encodes = len(keys)
        if world > 1:
            encoded, digests = self.all_gather(encoded).flatten(0, 1), self.all_gather(digests).flatten(0, 1)
            encodes = int(self.trainer.strategy.reduce(torch.tensor(encodes, device=self.device), reduce_op="sum"))
        self.model.add_cached_features([bytes(d) for d in digests.cpu().tolist()], encoded)
        self.log_line(
            f"image features: {len(self.feature_images):,} images, {encodes:,} encoder passes over "
            f"{world} process(es) in {time.perf_counter() - started:.1f} s"
        )

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        """Enter the batch's attention layout (its packed segments) for the step."""
        self._layout.enter_context(attention_layout(self.model.layout(batch["input_ids"], batch["segments"])))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        """Return the batch's loss; keep its mean over ranks for the history and count its tokens."""
        loss = self.model(**batch, return_logits=False).loss
        self.step_losses.append(float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")))  # the history
        self.tokens += int((batch["segments"] > 0).sum())
        return loss

    def on_train_batch_end(self, outputs, batch: dict, batch_idx: int) -> None:
        """Leave the batch's attention layout."""
        self._layout.close()

    def on_train_end(self) -> None:
        """Finish on the training device.

        Here rather than after ``fit``: Lightning's teardown moves the module to the CPU, where neither an
        NCCL collective nor a large model's evaluation can run.
        """
        self.finish(self.device, self.device)

    def finish(self, collective_device: torch.device, model_device: torch.device) -> None:
        """Stop the clock, sum the tokens and cache misses over ranks, measure the held-out loss."""
        self.elapsed = time.perf_counter() - self.started
        reduce = self.trainer.strategy.reduce
        self.tokens = int(reduce(torch.tensor(self.tokens, device=collective_device), reduce_op="sum"))
        misses = torch.tensor(self.model.feature_misses, device=collective_device)
        self.feature_misses = int(reduce(misses, reduce_op="sum"))
        self.eval_loss = evaluate(self.model, self.evaluation, model_device)

    def configure_optimizers(self):
        """Return AdamW over the trainable parameters with a per-step linear warm-up."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=self.config.optimizer.lr, weight_decay=self.config.optimizer.weight_decay
        )
        warmup = self.config.optimizer.warmup_steps
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Save the held-out loss before training in the checkpoint."""
        checkpoint["baseline_eval_loss"] = self.baseline_eval_loss

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Restore the held-out loss before training from the checkpoint."""
        self.baseline_eval_loss = checkpoint["baseline_eval_loss"]


def train(run: TrainerRun[VisualChatTrainConfig]) -> None:
    """Train a VisualChat model on one process of the launch, then export and report it (the trainer's ``train``)."""
    config, paths, reporter = run.config, run.paths, run.reporter
    if "decoder" in paths.inputs:  # the decoder the asset resolved (the in-graph GPT's export, or `decoder`)
        spec = config.model.model_copy(update={"decoder": paths.input("decoder")})
        config = config.model_copy(update={"model": spec})
    L.seed_everything(config.seed, verbose=False)
    model = build_model(config)
    # Training mode for every module but a frozen encoder (VisualChatModel.train: fixed batch-norm
    # statistics), set here so that a fresh run and a resumed one (which skips the evaluation before
    # training) train alike.
    model.train()
    manifests = Path(paths.inputs["occlusion_manifests"]) if "occlusion_manifests" in paths.inputs else None
    try:
        rows, evaluation = build_samples(config, model, manifests)
    except (ValueError, FileNotFoundError) as err:  # a bad record or sample, named: every rank sees the same
        raise InputRefused(f"{type(err).__name__}: {err}") from None
    cached = []
    if config.parallelism.cache_image_features:
        samples = [sample for row in rows for sample in row] + evaluation
        cached = sorted({ref for sample in samples for ref in sample.images})
    module = VisualChatModule(config, model, evaluation, reporter.log, cached)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    reporter.log(
        f"visualchat: {len(rows)} train rows, {len(evaluation)} eval samples; trains "
        f"{', '.join(config.model.trained_modules())}: {trainable:,} of {sum(p.numel() for p in model.parameters()):,} "
        f"parameters; ZeRO-{config.parallelism.zero_stage}, {run.world} process(es)"
    )
    data = Rows(rows, config.optimizer.global_batch_size)
    loader = StatefulDataLoader(
        data,
        batch_size=config.parallelism.micro_batch_size,
        sampler=EpochSampler(data, num_replicas=run.world, rank=run.rank, shuffle=True, seed=config.seed),
        collate_fn=functools.partial(
            vd.collate, pad_id=model.tokenizer.pad_token_id, image_size=model.encoder.image_size
        ),
    )
    history = TrainingHistory(reporter, config.optimizer.max_steps, tokens_per_step=None)
    checkpoints = StepCheckpoint(run.cache / "staging", every=config.checkpoint.every)
    trainer = run.trainer(
        deepspeed_strategy(
            run.checkpoint_io(keep_last=2), stage=config.parallelism.zero_stage, exclude_frozen_parameters=True
        ),
        [history, checkpoints, StepSeed(config.seed)],
        max_steps=config.optimizer.max_steps,
        max_epochs=-1,
        accumulate_grad_batches=config.accumulation(run.world),
        gradient_clip_val=config.optimizer.grad_clip or None,
        use_distributed_sampler=False,  # the loader's own sampler
    )
    resume = run.latest_checkpoint()
    run.fit(trainer, module, resume, train_dataloaders=loader)
    if module.eval_loss is None:  # resumed at its last step: Lightning ran no training loop, no on_train_end
        module.finish(trainer.strategy.root_device, module.device)
    if cached:
        reporter.log(f"image features: {module.feature_misses} image(s) encoded by the steps (not in the cache)")
    export(
        run,
        trainer,
        model,
        config,
        evaluation,
        manifests,
        {
            "eval_loss": module.eval_loss,
            "baseline_eval_loss": module.baseline_eval_loss,
            "steps": trainer.global_step,
            "tokens_per_s": module.tokens / module.elapsed if module.tokens else 0.0,
            "train_loss": history.train[-1]["loss"],
            "trainable_parameters": trainable,
            "resumed_from_step": -1 if history.resumed_from_step is None else history.resumed_from_step,
            "param_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        },
        history.train,
    )


@torch.no_grad()
def evaluate(model: VisualChatModel, samples: list[vd.Sample], device: torch.device) -> float:
    """Mean answer-token loss over the held-out samples (every rank the same, sharded or not).

    Each module is left in the mode it was in, so that a fresh run (which evaluates before training) and
    a resumed one (which does not) train in the same modes. By hand: torch has no "restore modes", and
    Lightning's is private."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    pad, size = model.tokenizer.pad_token_id, model.encoder.image_size
    total, count = 0.0, 0
    for at in range(0, len(samples), EVAL_BATCH):
        batch = move_data_to_device(vd.collate([[s] for s in samples[at : at + EVAL_BATCH]], pad, size), device)
        tokens = int((batch["labels"][:, 1:] != vd.IGNORE_INDEX).sum())
        total += float(model(**batch, return_logits=False).loss) * tokens
        count += tokens
    for module, mode in modes:
        module.training = mode
    return total / max(count, 1)


def export(
    run: TrainerRun[VisualChatTrainConfig],
    trainer: L.Trainer,
    model: VisualChatModel,
    config: VisualChatTrainConfig,
    evaluation: list[vd.Sample],
    manifests: Path | None,
    metrics: dict,
    history: list[dict],
) -> None:
    """Gather every weight on rank 0, merge LoRA into a CPU replica, and save the merged model.

    The merged model is checked against the unmerged one, and the saved model is evaluated as a user loads it
    (``eval.json``).
    """
    rank = run.rank
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        weights = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()} if rank == 0 else None
    if rank == 0:
        out = run.out
        replica = build_model(config)
        replica.load_state_dict(weights)
        replica.eval()
        batch = vd.collate(
            [[s] for s in evaluation[:EVAL_BATCH]], replica.tokenizer.pad_token_id, replica.encoder.image_size
        )
        batch.pop("labels")  # the logits at every position, not only the answers'
        with torch.no_grad():
            unmerged = replica(**batch).logits
            replica.decoder = replica.decoder.merge_and_unload()
            if config.model.lora_encoder:
                replica.encoder = replica.encoder.merge_and_unload()
            merged = replica(**batch).logits
        staging = out / "model"
        shutil.rmtree(staging, ignore_errors=True)
        replica.save_pretrained(staging)
        metrics["merge_max_abs_diff"] = float((merged - unmerged).abs().max())
        if manifests is not None and config.data.eval_images:
            metrics.update(
                evaluate_export(staging, manifests, config.data.eval_images, out / "eval.json", run.reporter.log)
            )
        (out / "history.json").write_text(json.dumps({"train": history, **metrics}))
        run.report(trainer, metrics)
    trainer.strategy.barrier("visualchat exported")  # device_ids on NCCL, unlike a bare dist.barrier


main = entry_point(VisualChatTrainConfig, train)

if __name__ == "__main__":
    main()
