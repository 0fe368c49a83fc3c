"""GPT pretraining entry point: one process per device, started by torchrun (or by the launcher).

    torchrun --nnodes=1 --nproc-per-node=2 -m vlm_assets.train.gpt_pretrain --config run.json

``run.json`` holds a ``PretrainConfig`` and the ``RunPaths`` of the launch (``write_run_file``). The run
resumes by itself from the newest intact checkpoint under ``checkpoint_prefix``; at the end rank 0 writes
into ``out_dir``: ``checkpoint.ckpt`` (consolidated, the last committed one), ``hf/`` (a ``GPT2LMHeadModel``
export with tokenizer), ``history.json`` and ``reference.json`` (the loss of this model on a fixed
validation batch, for the export check).
Launched by Dagster, global rank 0 reports logs, metrics and the final metadata through Pipes.
"""

import json
import math
import os
import shutil
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from vlm_assets.data.token_stream import reference_batch
from vlm_assets.models.gpt import GPT, preset
from vlm_assets.models.gpt_export import export_hf
from vlm_assets.storage.disk import private_download
from vlm_assets.train.checkpoints import CHECKPOINT_FILE, StepCheckpoint, StepSeed, step_key
from vlm_assets.train.entry import TrainerRun, backend, entry_point
from vlm_assets.train.gpt_config import PretrainConfig
from vlm_assets.train.gpt_module import GPTPretrainModule, TokenDataModule
from vlm_assets.train.reporting import TrainingHistory

REFERENCE_SAMPLES = 8
# Lightning only knows resumable *loaders*; the position is restored by TokenDataModule.load_state_dict.
warnings.filterwarnings("ignore", message=".*your dataloader is not resumable.*")
# StreamingDataset has a length and partitions samples over ranks and loader workers itself: the
# duplicate-samples risk Lightning warns about for iterable datasets with a length does not apply.
warnings.filterwarnings("ignore", message=r".*Your `IterableDataset` has `__len__` defined")


def build_trainer(run: TrainerRun[PretrainConfig], callbacks: list[L.Callback], checkpoint_io) -> L.Trainer:
    """Return the GPT pretraining's Lightning trainer: FSDP2 or DDP, checkpoints through ``checkpoint_io``."""
    config = run.config
    if config.parallelism.strategy == "fsdp2":
        strategy = ModelParallelStrategy(
            data_parallel_size=run.world, tensor_parallel_size=1, save_distributed_checkpoint=False
        )
    else:
        strategy = DDPStrategy(process_group_backend=backend())
    accumulation = config.accumulation(run.world)
    return run.trainer(
        strategy,
        callbacks,
        max_steps=config.optimizer.max_steps,
        max_epochs=-1,
        accumulate_grad_batches=accumulation,
        val_check_interval=config.data.val_check_interval * accumulation,
        check_val_every_n_epoch=None,
        limit_val_batches=config.data.val_batches,
        use_distributed_sampler=False,  # streaming shards the samples over ranks itself
        plugins=[checkpoint_io],
    )


def train(run: TrainerRun[PretrainConfig]) -> None:
    """Pretrain the GPT on one process of the launch, then export and report it (the trainer's ``train``)."""
    config, paths, rank, world, reporter = run.config, run.paths, run.rank, run.world, run.reporter
    shards_uri = paths.input("token_shards")
    summary = json.loads(_shards_path(shards_uri, paths.cache_dir, "tokens.json").read_text())
    model_config, preset_lr = preset(
        config.model.preset,
        **{"vocab_size": summary["vocab_size"], "block_size": summary["max_length"], "dropout": config.model.dropout},
        **config.model.shape(),
    )
    lr = config.optimizer.lr or preset_lr
    L.seed_everything(config.seed, workers=True, verbose=False)
    resume = run.latest_checkpoint()
    tokens_per_step = config.optimizer.global_batch_size * summary["max_length"]
    history = TrainingHistory(reporter, config.optimizer.max_steps, tokens_per_step)
    checkpoints = StepCheckpoint(
        run.cache / "staging", every=config.checkpoint.every, val_every=config.data.val_check_interval
    )
    trainer = build_trainer(
        run, [history, checkpoints, StepSeed(config.seed)], run.checkpoint_io(config.checkpoint.keep_last)
    )
    module = GPTPretrainModule(model_config, config, lr)
    data = TokenDataModule(config, shards_uri, paths.cache_dir)
    reporter.log(
        f"GPT {config.model.preset} ({model_config}), {config.parallelism.strategy} on {world} process(es), "
        f"accumulation {config.accumulation(world)}, lr {lr}, "
        + (f"resuming from {resume[0]}" if resume else "starting from scratch")
    )
    run.fit(trainer, module, resume, datamodule=data)
    tokens_per_s = history.tokens_per_s(trainer.global_step)
    if history.val and history.val[-1]["step"] == trainer.global_step:  # fit validated at its last step
        final_val = history.val[-1]["loss"]
    else:
        final_val = trainer.validate(module, datamodule=data, verbose=False)[0]["val/loss"]

    # Every rank takes part in gathering the full (unsharded) weights; rank 0 writes them out.
    state = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Every rank opens the streaming dataset (its set-up is collective); rank 0 uses the batch.
    batch = reference_batch(shards_uri, REFERENCE_SAMPLES, Path(paths.cache_dir) / "reference")
    if rank == 0:
        out = run.out
        final = run.latest_checkpoint()
        assert final is not None and final[0] == step_key(paths.checkpoint_prefix, trainer.global_step)
        shutil.copy2(final[1], out / CHECKPOINT_FILE)
        export_hf(state, model_config, out / "hf", _shards_path(shards_uri, paths.cache_dir, "tokenizer"))
        reference = _reference_loss(model_config, state, batch)
        (out / "reference.json").write_text(json.dumps({"val_batch_loss": reference, "num_samples": REFERENCE_SAMPLES}))
        history.save(out / "history.json")
        train_loss = history.train[-1]["loss"]
        run.report(
            trainer,
            {
                "train_loss": train_loss,
                "train_perplexity": math.exp(min(train_loss, 20)),
                "val_loss": final_val,
                "val_perplexity": math.exp(min(final_val, 20)),
                "steps": trainer.global_step,
                "tokens_seen": trainer.global_step * tokens_per_step,
                "tokens_per_s": tokens_per_s,
                "num_params": sum(v.numel() for k, v in state.items() if k != "lm_head.weight"),
                "resumed_from_step": history.resumed_from_step if history.resumed_from_step is not None else -1,
                "strategy": config.parallelism.strategy,
                "checkpoint": final[0],
            },
        )
    trainer.strategy.barrier("export written")


def _reference_loss(model_config, state, batch) -> float:
    """This model's (fp32, eval mode) loss on the first validation samples."""
    model = GPT(model_config)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return float(model(batch["input_ids"], batch["labels"])[1])


def _shards_path(shards_uri: str, cache_dir: str, rel: str) -> Path:
    """A file or directory of the token_shards artifact on local disk (downloaded once if on S3;
    ``S3_ENDPOINT_URL`` names a non-AWS endpoint, as for streaming itself)."""
    if not shards_uri.startswith("s3://"):
        return Path(shards_uri) / rel
    import boto3

    target = Path(cache_dir) / "shards-meta" / rel
    bucket, _, prefix = shards_uri.removeprefix("s3://").partition("/")
    base = f"{prefix.rstrip('/')}/{rel}"
    client = boto3.client("s3", endpoint_url=os.environ.get("S3_ENDPOINT_URL"))
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base):
        for obj in page.get("Contents", []):
            if obj["Key"] != base and not obj["Key"].startswith(base + "/"):
                continue
            path = target if obj["Key"] == base else target / obj["Key"][len(base) + 1 :]
            with private_download(path) as tmp:
                client.download_file(bucket, obj["Key"], str(tmp))
    if not target.exists():
        raise FileNotFoundError(f"{shards_uri}/{rel} does not exist")
    return target


main = entry_point(PretrainConfig, train)

if __name__ == "__main__":
    main()
