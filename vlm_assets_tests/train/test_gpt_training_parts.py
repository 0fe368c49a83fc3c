"""The pure parts of GPT pretraining: schedule, weight-decay groups, accumulation, activation
checkpointing, and the Hugging Face export (same logits as our model, loaded by transformers alone)."""

import math

import pytest
import torch

from vlm_assets.models.gpt import GPT, preset
from vlm_assets.models.gpt_export import export_hf
from vlm_assets.train.gpt_config import PretrainConfig
from vlm_assets.train.gpt_module import param_groups, perplexity, warmup_cosine
from vlm_assets.train.parallelize import apply_activation_checkpointing


def config(**overrides):
    return PretrainConfig(**overrides)


def test_warmup_then_cosine_to_the_floor():
    lrs = [warmup_cosine(s, warmup=10, total=110, min_ratio=0.1) for s in range(120)]
    assert lrs[0] == pytest.approx(1 / 11) and all(a < b for a, b in zip(lrs[:10], lrs[1:11]))
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[110] == pytest.approx(0.1) and lrs[119] == pytest.approx(0.1)  # stays at the floor


def test_weight_decay_only_on_matrices_and_embeddings():
    model = GPT(preset("tiny", block_size=16)[0])
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_accumulation_from_global_batch_and_world_size():
    batch = {"parallelism": {"micro_batch_size": 8}, "optimizer": {"global_batch_size": 256}}
    assert config(**batch).accumulation(4) == 8 and config(**batch).accumulation(32) == 1
    with pytest.raises(
        ValueError,
        match=r"optimizer\.global_batch_size 104 is not a multiple of parallelism\.micro_batch_size 8 x world size 2",
    ):
        config(parallelism={"micro_batch_size": 8}, optimizer={"global_batch_size": 104}).accumulation(2)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"parallelism": {"strategy": "fsdp1"}}, r"parallelism\.strategy"),
        ({"model": {"preset": "7B"}}, r"model\.preset"),
        ({"optimizer": {"max_steps": 0}}, r"optimizer\.max_steps"),
        ({"optimizer": {"min_lr_ratio": 2.0}}, r"optimizer\.min_lr_ratio"),
        ({"optimizer": {"warmup_steps": 50, "max_steps": 10}}, "warmup_steps 50 exceeds"),
        (
            {"parallelism": {"micro_batch_size": 8, "nproc_per_node": 2}, "optimizer": {"global_batch_size": 100}},
            "global_batch_size 100 is not a multiple",
        ),
        ({"timeout_s": 0}, "timeout_s"),
        ({"optimizer": {"learning_rate": 1.0}}, r"optimizer\.learning_rate"),
        ({"lr": 1.0}, "lr"),  # a section's field given at the top
    ],
)
def test_bad_pretrain_config_names_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        config(**bad)


def test_perplexity_is_clamped():
    assert perplexity(torch.tensor(1000.0)) == pytest.approx(math.exp(20))
    assert perplexity(torch.tensor(2.0)) == pytest.approx(math.exp(2))


def test_activation_checkpointing_changes_memory_not_math():
    torch.manual_seed(0)
    plain = GPT(preset("tiny", block_size=32)[0])
    wrapped = GPT(plain.config)
    wrapped.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(wrapped)
    assert wrapped.state_dict().keys() == plain.state_dict().keys()  # checkpoints stay interchangeable
    ids = torch.randint(0, 50257, (2, 32))
    losses, calls = [], []
    for model in (plain, wrapped):
        calls.append(0)
        model.blocks[0].attn.register_forward_pre_hook(lambda *_: calls.__setitem__(-1, calls[-1] + 1))
        _, loss = model(ids, ids)
        loss.backward()
        losses.append(loss.item())
    assert calls == [1, 2]  # the wrapped block's forward ran again in backward
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_hf_export_gives_our_logits_through_transformers_alone(tmp_path):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    ours = GPT(preset("tiny", block_size=32, vocab_size=1000)[0]).eval()
    export_hf(ours.state_dict(), ours.config, tmp_path / "hf", tokenizer_dir=None)
    theirs = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert theirs.transformer.wte.weight.shape == (1000, 64)  # padding rows dropped
    assert theirs.lm_head.weight.data_ptr() == theirs.transformer.wte.weight.data_ptr()  # still tied
    ids = torch.randint(0, 1000, (2, 32))
    with torch.no_grad():
        ours_logits, ours_loss = ours(ids, ids)
        out = theirs(input_ids=ids, labels=ids)
    assert torch.allclose(ours_logits, out.logits, atol=1e-4)
    assert ours_loss.item() == pytest.approx(out.loss.item(), abs=1e-5)


def test_only_rank_0_logs_to_the_mlflow_run(tmp_path):
    from mlflow import MlflowClient

    from vlm_assets.train.reporting import PipesLogger, Reporter, StepRunMLFlowLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("parts")).info.run_id
    kinds = {rank: [type(logger) for logger in Reporter(rank, None, uri, run_id).loggers()] for rank in (0, 1)}
    assert kinds == {0: [PipesLogger, StepRunMLFlowLogger], 1: [PipesLogger]}
    assert [type(logger) for logger in Reporter(0, None, None, None).loggers()] == [PipesLogger]
