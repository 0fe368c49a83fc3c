"""The adapter's exact architecture, and Qwen's packed patches against the real image processor."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlm_assets.models.occlusion_adapter import NUM_PARAMETERS, OcclusionAdapter
from vlm_assets.models.qwen_patches import dense_to_packed, packed_to_dense


def test_adapter_has_the_seed_parameter_count_and_starts_near_identity():
    adapter = OcclusionAdapter()
    assert sum(p.numel() for p in adapter.parameters()) == NUM_PARAMETERS == 10_532
    assert adapter.gate.item() == pytest.approx(0.10)
    pixels, mask = torch.rand(2, 3, 28, 28), torch.zeros(2, 1, 28, 28)
    out = adapter(pixels, mask)
    assert out.shape == pixels.shape
    assert (out - pixels).abs().max() <= np.tanh(0.10) + 1e-6  # |tanh(gate) * tanh(.)| bound


def test_adapter_refuses_wrong_shapes():
    adapter = OcclusionAdapter()
    with pytest.raises(ValueError, match="pixels must be"):
        adapter(torch.rand(2, 4, 28, 28), torch.zeros(2, 1, 28, 28))
    with pytest.raises(ValueError, match="mask must be"):
        adapter(torch.rand(2, 3, 28, 28), torch.zeros(2, 1, 14, 28))


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 3), gh=st.integers(1, 4), gw=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_dense_and_packed_are_exact_inverses(batch, gh, gw, seed):
    pixels = torch.randn(batch, 3, 28 * gh, 28 * gw, generator=torch.Generator().manual_seed(seed))
    packed, grid = dense_to_packed(pixels)
    assert packed.shape == (batch * 4 * gh * gw, 3 * 2 * 14 * 14)
    assert grid.tolist() == [[1, 2 * gh, 2 * gw]] * batch
    back = packed_to_dense(packed, grid)
    assert all(torch.equal(b, p) for b, p in zip(back, pixels))
    assert torch.equal(dense_to_packed(torch.stack(back))[0], packed)


@settings(max_examples=10, deadline=None)
@given(height=st.sampled_from([56, 84, 112]), width=st.sampled_from([56, 112, 140]), seed=st.integers(0, 2**16))
def test_packing_matches_the_real_qwen_image_processor(height, width, seed):
    from transformers import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=1024 * 1024)
    image = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = processor(images=[image], return_tensors="pt")
    mean, std = torch.tensor(processor.image_mean), torch.tensor(processor.image_std)
    dense = ((torch.from_numpy(image).permute(2, 0, 1).float() / 255 - mean[:, None, None]) / std[:, None, None])[None]
    packed, grid = dense_to_packed(dense)
    assert grid.tolist() == out["image_grid_thw"].tolist()
    assert torch.allclose(packed, out["pixel_values"], atol=1e-5)
    (recovered,) = packed_to_dense(out["pixel_values"], out["image_grid_thw"])
    assert torch.allclose(recovered, dense[0], atol=1e-5)


def test_packing_refuses_sizes_that_do_not_tile():
    with pytest.raises(ValueError, match="multiple of patch x merge = 28"):
        dense_to_packed(torch.zeros(1, 3, 30, 28))


@pytest.mark.parametrize("steps", [1, 3])
def test_each_step_reaches_two_pixels_further(steps):
    """A pixel changed at (10, 10) moves the output within 2 x steps pixels of it and nowhere else:
    why one step cannot carry the surroundings into a box wider than 4 pixels."""
    torch.manual_seed(0)
    adapter = OcclusionAdapter(steps=steps, gate_init=1.0)
    pixels, mask = torch.rand(1, 3, 28, 28), torch.zeros(1, 1, 28, 28)
    poked = pixels.clone()
    poked[0, :, 10, 10] += 0.5
    with torch.no_grad():
        moved = (adapter(poked, mask) - adapter(pixels, mask)).abs().amax(dim=(0, 1)) > 0
    rows, cols = moved.nonzero(as_tuple=True)
    reach = 2 * steps
    assert int((rows - 10).abs().max()) == reach and int((cols - 10).abs().max()) == reach
    assert OcclusionAdapter(steps=steps).state_dict().keys() == OcclusionAdapter().state_dict().keys()


def test_the_adapters_gradient_through_the_folded_visualchat_backbone_is_the_unfolded_models(tmp_path, offline_data):
    """The backbone folds its EfficientNet's BatchNorm (in float32, before a bfloat16 backbone is cast); the
    loss, and the gradient it sends back to the adapter's parameters through the frozen model, are the
    unfolded model's to float rounding."""
    from vlm_assets.data.visualchat_data import load_image
    from vlm_assets.models.frozen_vlm import VisualChatBackbone
    from vlm_assets.models.vision_encoders import load_encoder
    from vlm_assets.models.visualchat import VisualChatModel, VisualChatModelConfig
    from vlm_assets_tests.models.visualchat_fixtures import tiny_decoder

    decoder = str(tiny_decoder(tmp_path / "llama", offline_data, init_std=0.2))
    config = VisualChatModelConfig(encoder_kind="efficientnet_lite0", encoder=None, decoder=decoder)
    VisualChatModel.build(config).save_pretrained(tmp_path / "visualchat")
    folded = VisualChatBackbone(str(tmp_path / "visualchat"))
    unfolded = VisualChatBackbone(str(tmp_path / "visualchat"))
    unfolded.model.encoder = load_encoder("efficientnet_lite0", tmp_path / "visualchat" / "encoder")
    unfolded.model.requires_grad_(False).eval()
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in folded.modules())
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in unfolded.modules())

    images = sorted((offline_data / "cifar10-samples").glob("*.png"))[:2]
    pixels = torch.stack([load_image(str(p), 224) for p in images])
    mask = torch.zeros(2, 1, 224, 224)
    mask[..., 64:160, 64:160] = 1
    prompts, answers = ["What is shown?"] * 2, ["a cat", "a ship"]
    losses, grads = [], []
    for backbone in (folded, unfolded):
        torch.manual_seed(0)
        adapter = OcclusionAdapter()
        loss = backbone.loss(adapter(pixels * (1 - mask), mask), prompts, answers)
        losses.append(loss.detach())
        grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(adapter.parameters()))]))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    assert grads[1].abs().max() > 0 and not any(p.requires_grad for p in folded.parameters())
    assert (grads[0] - grads[1]).abs().max() <= 1e-3 * grads[1].abs().max()

    half = VisualChatBackbone(str(tmp_path / "visualchat"), dtype=torch.bfloat16)
    for (name, p16), p32 in zip(half.model.encoder.named_parameters(), folded.model.encoder.parameters()):
        assert torch.equal(p16, p32.to(torch.bfloat16)), name
