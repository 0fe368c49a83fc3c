import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vlm_assets.models.gpt import GPT, preset
from vlm_assets.models.linear_cross_entropy import head_loss, linear_cross_entropy


def head_inputs(rows=40, dim=16, vocab=300, real=290):
    """Hidden states, a head, its -inf padding bias and targets with ignored rows (as the GPT's)."""
    torch.manual_seed(0)
    hidden = torch.randn(rows, dim, requires_grad=True)
    weight = (torch.randn(vocab, dim) * 0.5).requires_grad_()
    bias = torch.zeros(vocab)
    bias[real:] = float("-inf")
    targets = torch.randint(0, real, (rows,))
    targets[[3, 17, 39]] = -100
    return hidden, weight, bias, targets


@pytest.mark.parametrize("chunk_rows", [1, 7, 40, None])
@pytest.mark.parametrize("ignored", [True, False])
def test_loss_and_gradients_are_those_of_the_logits_cross_entropy(chunk_rows, ignored):
    hidden, weight, bias, targets = head_inputs()
    if not ignored:
        targets[targets == -100] = 5
    expected = F.cross_entropy(F.linear(hidden, weight, bias), targets, ignore_index=-100)
    expected.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    loss = linear_cross_entropy(hidden, weight, bias, targets, chunk_rows=chunk_rows)
    (2.5 * loss).backward()  # the upstream gradient scales both
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(hidden.grad, 2.5 * grads[0])
    torch.testing.assert_close(weight.grad, 2.5 * grads[1])


def test_without_gradients_the_loss_is_the_same_and_nothing_is_recorded():
    hidden, weight, bias, targets = head_inputs()
    expected = F.cross_entropy(F.linear(hidden, weight, bias), targets, ignore_index=-100)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, bias, targets, chunk_rows=9)
    torch.testing.assert_close(loss, expected.detach())
    assert loss.grad_fn is None


def test_every_target_ignored_gives_nan_as_torch_does():
    hidden, weight, bias, targets = head_inputs()
    ignored = torch.full_like(targets, -100)
    assert math.isnan(F.cross_entropy(F.linear(hidden, weight, bias), ignored, ignore_index=-100).item())
    assert math.isnan(linear_cross_entropy(hidden, weight, bias, ignored).item())


def test_mismatched_shapes_are_refused_naming_them():
    hidden, weight, bias, targets = head_inputs()
    with pytest.raises(ValueError, match=r"got \(40, 16\), \(300, 16\) and \(39,\)"):
        linear_cross_entropy(hidden, weight, bias, targets[:-1])


def test_the_gpt_without_logits_trains_on_real_tokens_as_with_them(offline_data):
    """Two copies of the tiny GPT on a real Shakespeare batch: one through the logits, one without them."""
    from vlm_assets.data.token_shards import load_gpt2_tokenizer, pack_blocks, paragraphs_of_files

    tokenizer = load_gpt2_tokenizer(str(offline_data / "gpt2-tokenizer"))
    docs = list(paragraphs_of_files(str(offline_data / "shakespeare" / "hamlet*.txt")))
    data = torch.from_numpy(np.stack([ids for ids, _ in pack_blocks(tokenizer, docs, 32, 8)])).long()
    labels = data.clone()
    labels[0, 10:] = -100
    torch.manual_seed(0)
    with_logits = GPT(preset("tiny", block_size=32)[0])
    without = GPT(with_logits.config)
    without.load_state_dict(with_logits.state_dict())
    logits, expected = with_logits(data, labels)
    none, loss = without(data, labels, return_logits=False)
    assert logits is not None and none is None
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss, expected)
    for (name, a), b in zip(with_logits.named_parameters(), without.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_theirs():
    hidden, weight, bias, targets = head_inputs()
    frozen = weight.detach()
    F.cross_entropy(F.linear(hidden, frozen, bias), targets, ignore_index=-100).backward()
    expected = hidden.grad.clone()
    hidden.grad = None
    linear_cross_entropy(hidden, frozen, bias, targets, chunk_rows=8).backward()
    torch.testing.assert_close(hidden.grad, expected)
    assert frozen.grad is None


def test_head_loss_skips_the_logits_on_cpu_unless_asked_and_a_zero3_weight_goes_through_its_module():
    hidden, weight, bias, targets = head_inputs()
    expected = F.cross_entropy(F.linear(hidden, weight, bias), targets, ignore_index=-100)
    logits, loss = head_loss(hidden, weight, bias, targets, want_logits=False)
    assert logits is None and loss.grad_fn.name().endswith("_LinearCrossEntropyBackward")
    torch.testing.assert_close(loss, expected)
    logits, loss = head_loss(hidden, weight, bias, targets, want_logits=True)
    torch.testing.assert_close(logits, F.linear(hidden, weight, bias))
    torch.testing.assert_close(loss, expected)

    # A ZeRO-3 partitioned weight (DeepSpeed marks it with ds_id) is empty outside its module's forward,
    # so the loss comes from the logits of ``project``, even when no logits are wanted.
    head = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    partitioned = torch.empty(0)
    partitioned.ds_id = 7
    calls = []
    project = lambda rows: calls.append(rows) or head(rows)  # noqa: E731
    logits, loss = head_loss(hidden, partitioned, None, targets, want_logits=False, project=project)
    assert len(calls) == 1 and logits.shape == (40, 300)
    torch.testing.assert_close(loss, expected)
