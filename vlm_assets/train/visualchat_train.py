"""VisualChat training entry point: the plain DeepSpeed engine (ZeRO-2 or 3), LoRA on the decoder, then
LoRA merged and the whole model exported. One process per device, started by torchrun or the launcher:

    torchrun --nnodes=1 --nproc-per-node=2 -m vlm_assets.train.visualchat_train --config run.json

``run.json`` holds a ``VisualChatTrainConfig`` and ``RunPaths`` (input ``occlusion_manifests``, optional).
bf16 on GPUs (NCCL), fp32 on CPU (gloo). Every ``checkpoint_every`` steps the engine's checkpoint
(module, optimizer, scheduler, global step and data position) is committed to the artifact store; a
relaunch resumes from the newest intact one at the same step and data position, so the loss curve
continues exactly (LoRA dropout 0: nothing random is left to carry). At the end rank 0 gathers the
weights (from the ZeRO-3 partitions too), merges LoRA into the decoder, checks the merged model
against the unmerged one on a fixed batch, writes ``model/`` (``VisualChatModel.save_pretrained``) and
``history.json`` into ``out_dir``, reloads that export and measures its VQA exact match on held-out
validation images of the manifests with a two-image conversation (``eval.json``), and reports through
Pipes.
"""

import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device

from vlm_assets.data import visualchat_data as vd
from vlm_assets.launch.spec import InputRefused
from vlm_assets.models.visualchat import VisualChatModel, decoder_positions
from vlm_assets.models.visualchat_attention import attention_layout
from vlm_assets.storage.disk import staged_write
from vlm_assets.train.checkpoints import StoreCheckpointIO
from vlm_assets.train.entry import TrainerRun, backend, entry_point
from vlm_assets.train.reporting import Reporter, process_group_backend
from vlm_assets.train.visualchat_config import GPT_DECODER, VisualChatTrainConfig

EVAL_BATCH = 4
# DeepSpeed probes for an accelerator and warns at every process start when it finds none; on CPU say so.
os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
# DeepSpeed's ZeRO calls torch collectives that torch deprecated (all_gather_into_tensor,
# reduce_scatter_tensor): nothing of ours to change.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def build_model(config: VisualChatTrainConfig) -> VisualChatModel:
    """The model to train: pretrained parts, projection at init, LoRA (zero at init) on the decoder, and
    ``requires_grad`` set by ``freeze_modules``. Deterministic in ``config.seed``."""
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(config.seed)
    model = VisualChatModel.build(config)
    # GPT-2 stores its linear layers as Conv1D, (in, out): peft must be told (it warns and guesses otherwise).
    transposed = any(isinstance(m, Conv1D) for m in model.decoder.modules())
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules="all-linear",
        fan_in_fan_out=transposed,
    )
    model.decoder = get_peft_model(model.decoder, lora)
    if config.lora_encoder:
        model.encoder = get_peft_model(
            model.encoder, LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, target_modules="all-linear")
        )
    for name, param in model.named_parameters():
        module = "lora" if "lora_" in name else name.split(".")[0]
        param.requires_grad_(module not in config.freeze_modules)
    if config.cache_image_features:
        model.cache_image_features()
    if config.gradient_checkpointing:
        model.decoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def build_samples(config: VisualChatTrainConfig, model: VisualChatModel, manifests: Path | None):
    """(train rows, eval samples): blended, split, rendered (bad records fail here, naming file:line), packed."""
    paths = sorted(config.chat_datasets)
    datasets = [(records, config.chat_datasets[p]) for p, records in zip(paths, config.read_chat_datasets(paths))]
    if manifests is not None:
        vqa = vd.manifest_records(
            manifests, "train", pairs=config.pair_count, phrased=config.phrasing_count, seed=config.seed
        )
        phrased = len(vqa) - config.phrasing_count  # the phrased records come last
        datasets += [
            ([r for r in vqa[:phrased] if len(r.images) == 1], config.vqa_count),
            ([r for r in vqa[:phrased] if len(r.images) == 2] + vqa[phrased:], None),
        ]
    records = vd.blend(datasets, config.seed)
    if not records:
        raise ValueError("no training data: set chat_datasets, or give the occlusion manifests with vqa_count > 0")
    train, held = vd.split(records, config.eval_fraction, config.seed)
    limit = config.max_length
    positions = decoder_positions(model.decoder.config)
    if positions is not None and positions < limit:
        limit = positions  # a learned position table (GPT-2) ends there: a longer sample cannot be embedded
    try:
        render = [vd.render(r, model.tokenizer, model.image_token_id, model.num_image_tokens, limit) for r in train]
        evaluation = [vd.render(r, model.tokenizer, model.image_token_id, model.num_image_tokens, limit) for r in held]
    except ValueError as err:
        if limit == config.max_length:
            raise
        raise ValueError(f"{err} (the decoder {config.decoder} has {positions} positions)") from None
    if config.packing:
        rows = [[render[i] for i in row] for row in vd.pack([len(s.ids) for s in render], config.pack_tokens)]
    else:
        rows = [[s] for s in render]
    return rows, evaluation


def deepspeed_config(config: VisualChatTrainConfig, world: int) -> dict:
    cuda = torch.cuda.is_available()
    return {
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": config.accumulation(world),
        "gradient_clipping": config.grad_clip,
        "zero_optimization": {"stage": config.zero_stage},
        "bf16": {"enabled": cuda},
        # a torch optimizer: DeepSpeed's own Adam builds a C++ op on first use (~1 min on CPU)
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class RowOrder:
    """Which rows micro-batch ``n`` of rank ``r`` takes: a seeded permutation per pass over the data, the
    micro-batches of one optimizer step spread over the ranks. The position (micro-batches taken per
    rank) is all a resumed run needs to continue with the same rows."""

    def __init__(self, num_rows: int, micro: int, world: int, rank: int, seed: int):
        self.num_rows, self.micro, self.world, self.rank, self.seed = num_rows, micro, world, rank, seed

    def rows(self, position: int) -> list[int]:
        per_pass = max(self.num_rows // (self.micro * self.world), 1)
        epoch, slot = divmod(position, per_pass)
        order = torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        start = (slot * self.world + self.rank) * self.micro
        return [order[(start + i) % self.num_rows] for i in range(self.micro)]


def train(run: TrainerRun[VisualChatTrainConfig]) -> None:
    import deepspeed

    config, paths, rank, reporter = run.config, run.paths, run.rank, run.reporter
    if config.decoder == GPT_DECODER:  # the asset resolved the in-graph GPT export to a directory
        config = config.model_copy(update={"decoder": paths.input("decoder")})
    cuda = torch.cuda.is_available()
    if cuda:  # NCCL bound to this rank's GPU (DeepSpeed's init_distributed takes no device; unbound, barriers warn)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    deepspeed.init_distributed(dist_backend=backend())  # uses the group above when there is one
    world = dist.get_world_size()
    model = build_model(config)
    manifests = Path(paths.inputs["occlusion_manifests"]) if "occlusion_manifests" in paths.inputs else None
    try:
        rows, evaluation = build_samples(config, model, manifests)
    except (ValueError, FileNotFoundError) as err:  # a bad record or sample, named: every rank sees the same
        raise InputRefused(f"{type(err).__name__}: {err}") from None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    reporter.log(
        f"visualchat: {len(rows)} train rows, {len(evaluation)} eval samples; trains "
        f"{', '.join(config.trained_modules())}: {trainable:,} of {sum(p.numel() for p in model.parameters()):,} "
        f"parameters; ZeRO-{config.zero_stage}, {world} process(es)"
    )
    pad, size = model.tokenizer.pad_token_id, model.encoder.image_size
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (config.warmup_steps + 1)))
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=schedule,
        model_parameters=params,
        config=deepspeed_config(config, world),
    )
    committer = run.checkpoint_io(keep_last=2)
    state = {"step": 0, "position": 0, "history": [], "baseline_eval_loss": None, "resumed_from_step": None}
    found = run.latest_checkpoint()
    if found is not None:
        directory = found[1].parent
        # the tag its `latest` file names; the frozen weights are not in it (below): they are the model's as built
        _, client = engine.load_checkpoint(str(directory), load_module_strict=False)
        state.update(client["visualchat"], resumed_from_step=client["visualchat"]["step"])
        reporter.log(f"resumed at step {state['step']} from {found[0]}")
    if state["baseline_eval_loss"] is None:
        state["baseline_eval_loss"] = evaluate(engine, evaluation, pad, size)
        reporter.log(f"eval loss before training (projection at init, LoRA zero): {state['baseline_eval_loss']:.4f}")
    order = RowOrder(len(rows), config.micro_batch_size, world, rank, config.seed)
    accumulation = config.accumulation(world)
    loggers = reporter.loggers()
    started, start_step, tokens = time.perf_counter(), state["step"], torch.zeros((), device=engine.device)
    while state["step"] < config.max_steps:
        losses = []
        for _ in range(accumulation):
            rows_now = [rows[i] for i in order.rows(state["position"])]
            batch = move_data_to_device(vd.collate(rows_now, pad, size), engine.device)
            state["position"] += 1
            with attention_layout(model.layout(batch["input_ids"], batch["segments"])):  # backward recomputes
                loss = engine(**batch).loss
                engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
            tokens += (batch["segments"] > 0).sum()
        step_loss = torch.stack(losses).mean()
        dist.all_reduce(step_loss)
        state["step"] += 1
        state["history"].append({"step": state["step"], "loss": float(step_loss) / world})
        if state["step"] % config.log_every == 0 or state["step"] == config.max_steps:
            for logger in loggers:
                logger.log_metrics(
                    {"train/loss": state["history"][-1]["loss"], "train/lr": schedule.get_last_lr()[0]},
                    step=state["step"],
                )
        if state["step"] % config.checkpoint_every == 0 or state["step"] == config.max_steps:
            save_checkpoint(engine, state, run.cache, committer, rank)
    elapsed = time.perf_counter() - started
    dist.all_reduce(tokens)  # tokens that are not padding, over every rank, in this attempt's steps
    eval_loss = evaluate(engine, evaluation, pad, size)
    export(
        engine,
        config,
        evaluation,
        rank,
        Path(paths.out_dir),
        reporter,
        manifests,
        {
            "eval_loss": eval_loss,
            "baseline_eval_loss": state["baseline_eval_loss"],
            "steps": state["step"],
            "tokens_per_s": float(tokens) / elapsed if state["step"] > start_step else 0.0,
            "train_loss": state["history"][-1]["loss"],
            "trainable_parameters": trainable,
            "resumed_from_step": -1 if state["resumed_from_step"] is None else state["resumed_from_step"],
            "backend": process_group_backend(),
            "param_dtype": str(next(engine.module.parameters()).dtype).removeprefix("torch."),
        },
        state["history"],
    )


def save_checkpoint(engine, state: dict, cache: Path, committer: StoreCheckpointIO, rank: int) -> None:
    """The engine's checkpoint (every rank writes its shards into one directory on this node), then
    committed by rank 0 as ``<prefix>/step-<N>``. Multi-node runs need that directory on a shared volume."""
    local = [str(cache / "staging")] if rank == 0 else [None]
    dist.broadcast_object_list(local, src=0)
    tag = f"step-{state['step']:08d}"
    # Trained weights only: a frozen 7B decoder would make every checkpoint 14 GB, a LoRA one is megabytes.
    staging = Path(local[0]) / tag
    with staged_write(staging, f"checkpoint step {state['step']}"):
        engine.save_checkpoint(
            str(staging), tag=tag, client_state={"visualchat": dict(state)}, exclude_frozen_parameters=True
        )
    dist.barrier()
    if rank == 0:
        committer.commit(staging, state["step"], 0)
    dist.barrier()


@torch.no_grad()
def evaluate(engine, samples: list[vd.Sample], pad: int, size: int) -> float:
    """Mean answer-token loss over the held-out samples (every rank the same, sharded or not)."""
    engine.eval()
    total, count = 0.0, 0
    for at in range(0, len(samples), EVAL_BATCH):
        chunk = samples[at : at + EVAL_BATCH]
        batch = move_data_to_device(vd.collate([[s] for s in chunk], pad, size), engine.device)
        tokens = int((batch["labels"][:, 1:] != vd.IGNORE_INDEX).sum())
        total += float(engine(**batch).loss) * tokens
        count += tokens
    engine.train()
    return total / max(count, 1)


def export(
    engine,
    config: VisualChatTrainConfig,
    evaluation: list[vd.Sample],
    rank: int,
    out: Path,
    reporter: Reporter,
    manifests: Path | None,
    metrics: dict,
    history: list[dict],
) -> None:
    """Gather every weight on rank 0, merge LoRA into a CPU replica, check it against the unmerged one,
    save the merged model, and evaluate the saved model as a user loads it (``eval.json``)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        weights = (
            {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()} if rank == 0 else None
        )
    if rank == 0:
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
            if config.lora_encoder:
                replica.encoder = replica.encoder.merge_and_unload()
            merged = replica(**batch).logits
        staging = out / "model"
        shutil.rmtree(staging, ignore_errors=True)
        replica.save_pretrained(staging)
        metrics["merge_max_abs_diff"] = float((merged - unmerged).abs().max())
        if manifests is not None and config.eval_images:
            metrics.update(evaluate_export(staging, manifests, config.eval_images, out / "eval.json", reporter))
        (out / "history.json").write_text(json.dumps({"train": history, **metrics}))
        reporter.materialization(metrics)
    dist.barrier()


def evaluate_export(model_dir: Path, manifests: Path, count: int, out: Path, reporter: Reporter) -> dict:
    """VQA exact match of the exported model on held-out validation images (asked the template's prompt,
    and held-out phrasings), and a two-image, two-round conversation, written to ``out``; returns the numbers."""
    from vlm_assets.evaluate.visualchat_eval import two_image_conversation, vqa_report

    model = VisualChatModel.from_pretrained(model_dir)
    result = vqa_report(model, manifests, "validation", count)
    result["conversation"] = two_image_conversation(model, manifests)
    out.write_text(json.dumps(result, indent=1))
    template, phrased = result["vqa"]["template"], result["vqa"]["held_out_phrasings"]
    reporter.log(
        f"merged model: VQA exact match {template['exact_match']:.1%} on {template['num_images']} held-out "
        f"images (chance {result['chance']:.0%}); asked in held-out phrasings {phrased['exact_match']:.1%}"
    )
    return {
        "vqa_exact_match": template["exact_match"],
        "vqa_exact_match_ci95_low": template["ci95"][0],
        "vqa_exact_match_ci95_high": template["ci95"][1],
        "vqa_chance": result["chance"],
        "vqa_images": template["num_images"],
        "vqa_held_out_phrasings_exact_match": phrased["exact_match"],
        "vqa_held_out_phrasings_ci95_low": phrased["ci95"][0],
        "vqa_held_out_phrasings_ci95_high": phrased["ci95"][1],
    }


main = entry_point(VisualChatTrainConfig, train)

if __name__ == "__main__":
    main()
