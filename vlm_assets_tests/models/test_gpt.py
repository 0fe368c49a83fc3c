import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vlm_assets.models.gpt import GPT, GPTConfig, preset


def tiny(**overrides) -> GPT:
    torch.manual_seed(0)
    config, _ = preset("tiny", block_size=32, **overrides)
    return GPT(config).eval()


def test_124m_preset_has_gpt2_small_parameter_count():
    config, lr = preset("124M")
    with torch.device("meta"):
        model = GPT(config)
    assert config.padded_vocab_size == 50304 and lr == 6e-4
    assert model.num_params() == 124_475_904  # GPT-2 small with the vocab padded to 50304 (nanoGPT)
    assert model.lm_head.weight is model.wte.weight


def test_seed_presets_keep_the_seed_shapes():
    assert preset("1.5B")[0].n_embd == 2048 and preset("1.5B")[1] == 6e-4
    assert (preset("30B")[0].n_embd, preset("30B")[0].n_layer, preset("30B")[0].n_head) == (6656, 48, 52)
    assert (preset("65B")[0].n_layer, preset("65B")[0].n_head, preset("65B")[1]) == (80, 64, 1.5e-4)
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'"):
        preset("huge")
    with pytest.raises(ValueError, match=r"n_embd \(65\) must be divisible by n_head \(2\)"):
        GPTConfig(n_embd=65, n_head=2)


def test_attention_is_causal_and_padding_is_never_predicted():
    model = tiny()
    ids = torch.randint(0, 50257, (2, 32))
    changed = ids.clone()
    changed[:, 20:] = torch.randint(0, 50257, (2, 12))
    logits, _ = model(ids)
    logits_changed, _ = model(changed)
    assert logits.shape == (2, 32, 50257)  # 50304 rows, 47 of padding sliced off
    torch.testing.assert_close(logits[:, :20], logits_changed[:, :20])
    assert not torch.allclose(logits[:, 20:], logits_changed[:, 20:])


def test_loss_is_shifted_next_token_cross_entropy_with_ignore_index():
    model = tiny()
    ids = torch.randint(0, 50257, (2, 16))
    labels = ids.clone()
    labels[0, 5:] = -100
    logits, loss = model(ids, labels)
    keep = labels[:, 1:] != -100
    expected = F.cross_entropy(logits[:, :-1][keep], labels[:, 1:][keep])
    torch.testing.assert_close(loss, expected)
    assert abs(loss.item() - math.log(50257)) < 0.5  # near-uniform at initialisation


def test_sdpa_matches_an_explicitly_masked_attention():
    model = tiny()
    attn = model.blocks[0].attn
    x = torch.randn(2, 10, 64)
    q, k, v = attn.qkv(x).split(64, dim=2)
    q, k, v = (t.view(2, 10, 2, 32).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(32)
    scores = scores.masked_fill(torch.triu(torch.ones(10, 10, dtype=torch.bool), 1), float("-inf"))
    manual = attn.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 10, 64))
    torch.testing.assert_close(attn(x), manual, atol=1e-5, rtol=1e-5)


def test_too_long_sequence_is_refused():
    with pytest.raises(ValueError, match="sequence length 33 exceeds block_size 32"):
        tiny()(torch.zeros(1, 33, dtype=torch.long))


def test_a_few_steps_learn_real_shakespeare_tokens(offline_data):
    from vlm_assets.data.token_shards import load_gpt2_tokenizer, pack_blocks, paragraphs_of_files

    tokenizer = load_gpt2_tokenizer(str(offline_data / "gpt2-tokenizer"))
    docs = list(paragraphs_of_files(str(offline_data / "shakespeare" / "hamlet*.txt")))
    data = torch.from_numpy(np.stack([ids for ids, _ in pack_blocks(tokenizer, docs, 32, 8)])).long()
    model = tiny().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        _, loss = model(data, data)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 3  # memorises a real block: the model and its gradients work


def test_without_labels_the_logits_come_only_when_asked_for():
    model, ids = tiny(), torch.randint(0, 100, (2, 8))
    logits, loss = model(ids)
    assert logits.shape == (2, 8, model.config.vocab_size) and loss is None
    assert model(ids, return_logits=False) == (None, None)
