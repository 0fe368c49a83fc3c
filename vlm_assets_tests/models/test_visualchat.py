"""VisualChat model: multi-modal causal attention against an explicit reference, packed samples equal
to unpacked ones, image splicing, save/load round trip without peft, streaming decode, bad paths."""

import numpy as np
import pytest
import torch

from vlm_assets.data.tokens import positions_from_segments
from vlm_assets.models.hf_compat import set_activation_checkpointing
from vlm_assets.models.visualchat import VisualChatModel, VisualChatModelConfig, plain_output_head
from vlm_assets.models.visualchat_attention import Layout, visualchat_attention
from vlm_assets_tests.models.visualchat_fixtures import tiny_clip, tiny_decoder


def reference_attention(query, key, value, layout: Layout, scaling: float) -> torch.Tensor:
    """One query at a time with explicit softmaxes over the keys each group may see: a text token's
    image part and text part normalised separately and summed; an image token sees images only."""
    b, h, q, d = query.shape
    out = torch.zeros(b, q, h, d, dtype=query.dtype)
    offset = key.shape[2] - q
    for bi in range(b):
        for qi in range(q):
            pos = offset + qi
            seg = int(layout.segments[bi, pos])
            keys = [j for j in range(pos + 1) if (seg and int(layout.segments[bi, j]) == seg) or (not seg and j == pos)]
            groups = [keys]
            if layout.mmca:
                images = [j for j in keys if layout.image[bi, j]]
                text = [j for j in keys if not layout.image[bi, j]]
                groups = [images] if layout.image[bi, pos] else [g for g in (images, text) if g]
            for hi in range(h):
                for group in groups:
                    scores = torch.stack([query[bi, hi, qi] @ key[bi, hi, j] for j in group]) * scaling
                    weights = torch.softmax(scores, dim=0)
                    out[bi, qi, hi] += sum(w * value[bi, hi, j] for w, j in zip(weights, group))
    return out


class _Module:
    training = False


@pytest.mark.parametrize("mmca", [True, False])
def test_attention_matches_the_reference_on_a_two_image_sample(mmca):
    """Text, image 1 (3 tokens), text, image 2 (3 tokens), text; a second packed sample; padding."""
    torch.manual_seed(0)
    image = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 0, 0, 0]], dtype=torch.bool)
    segments = torch.tensor([[1] * 12 + [2, 2, 2, 0]])
    layout = Layout(segments, image, mmca)
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(3))
    from vlm_assets.models.visualchat_attention import attention_layout

    with attention_layout(layout):
        fast, _ = visualchat_attention(_Module(), q, k, v, None, scaling=8**-0.5)
    torch.testing.assert_close(fast, reference_attention(q, k, v, layout, 8**-0.5), rtol=1e-10, atol=1e-10)
    if mmca:  # not plain causal attention: the image part is normalised on its own
        plain = Layout(segments, image, False)
        with attention_layout(plain):
            causal, _ = visualchat_attention(_Module(), q, k, v, None, scaling=8**-0.5)
        assert (causal - fast).abs().max() > 0.1


def test_cached_decoding_sees_the_same_layout_as_a_full_pass():
    """The last query of a full pass equals one decoding step over cached keys (queries are the last Q)."""
    torch.manual_seed(1)
    image = torch.tensor([[0, 1, 1, 0, 0, 1]], dtype=torch.bool)
    layout = Layout(torch.ones(1, 6, dtype=torch.long), image, True)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    from vlm_assets.models.visualchat_attention import attention_layout

    with attention_layout(layout):
        full, _ = visualchat_attention(_Module(), q, k, v, None, scaling=0.5)
        step, _ = visualchat_attention(_Module(), q[:, :, -1:], k, v, None, scaling=0.5)
    torch.testing.assert_close(step[:, 0], full[:, -1])


def test_positions_restart_per_segment():
    segments = torch.tensor([[1, 1, 1, 2, 2, 3, 0, 0]])
    assert positions_from_segments(segments).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


@pytest.fixture(scope="module")
def clip_model(tmp_path_factory, offline_data):
    root = tmp_path_factory.mktemp("vc")
    config = VisualChatModelConfig(
        encoder_kind="clip",
        encoder=str(tiny_clip(root / "clip")),
        projection="linear",
        decoder=str(tiny_decoder(root / "llama", offline_data)),
        mmca=True,
    )
    return VisualChatModel.build(config)


def _sample(model, n_images: int, text: str, answer: str):
    prompt = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = prompt[:2] + [model.image_token_id] * model.num_image_tokens * n_images + prompt[2:]
    target = model.tokenizer(answer, add_special_tokens=False)["input_ids"] + [model.tokenizer.eos_token_id]
    return ids + target, [-100] * len(ids) + target


def _padded_batch(model, rows: list[tuple[list[int], list[int]]]):
    """The ids, labels and segments (1 = the sample, 0 = padding) of ``_sample`` rows padded on the right."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), model.tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    segments = torch.zeros(len(rows), width, dtype=torch.long)
    for row, (i, lab) in enumerate(rows):
        ids[row, : len(i)], labels[row, : len(lab)], segments[row, : len(i)] = torch.tensor(i), torch.tensor(lab), 1
    return ids, labels, segments


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_samples_give_the_loss_of_the_same_samples_unpacked(tmp_path, offline_data, arch):
    config = VisualChatModelConfig(
        encoder_kind="clip",
        encoder=str(tiny_clip(tmp_path / "clip")),
        projection="perceiver",
        num_queries=4,
        mmca=True,
        decoder=str(tiny_decoder(tmp_path / arch, offline_data, arch)),
    )
    model = VisualChatModel.build(config).eval()
    torch.manual_seed(0)
    a, b = _sample(model, 2, "Which of these is a cat?", "the first"), _sample(model, 1, "What is shown?", "a ship")
    pixels = torch.rand(3, 3, 32, 32)
    ids, labels, segments = _padded_batch(model, [a, b])
    unpacked = model(ids, pixels, labels=labels, segments=segments).loss
    packed_ids = torch.tensor([a[0] + b[0]])
    packed = model(
        packed_ids,
        pixels,
        labels=torch.tensor([a[1] + b[1]]),
        segments=torch.tensor([[1] * len(a[0]) + [2] * len(b[0])]),
    ).loss
    torch.testing.assert_close(packed, unpacked, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("return_logits", [True, False])  # False: the chunked loss, no logits (a plain head)
@pytest.mark.parametrize("arch", ["llama", "gpt2", "granite"])
def test_the_loss_from_the_answers_logits_alone_is_transformers_loss_with_its_gradients(
    tmp_path, offline_data, arch, return_logits
):
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    from vlm_assets.data.tokens import positions_from_segments
    from vlm_assets.models.visualchat_attention import attention_layout

    config = VisualChatModelConfig(
        encoder_kind="clip",
        encoder=str(tiny_clip(tmp_path / "clip")),
        projection="linear",
        decoder=str(tiny_decoder(tmp_path / arch, offline_data, arch)),
    )
    model = VisualChatModel.build(config).eval()
    transposed = any(isinstance(m, Conv1D) for m in model.decoder.modules())
    lora = LoraConfig(r=4, target_modules="all-linear", fan_in_fan_out=transposed, init_lora_weights=False)
    model.decoder = get_peft_model(model.decoder, lora)  # as the trainer wraps it; non-zero, so it counts
    torch.manual_seed(0)
    rows = [_sample(model, 2, "Which of these is a cat?", "the first"), _sample(model, 1, "Shown?", "a ship")]
    ids, labels, segments = _padded_batch(model, rows)  # the answers at other positions in each row
    pixels = torch.rand(3, 3, 32, 32)
    names, trained = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])

    assert plain_output_head(model.decoder.config) is (arch != "granite")  # granite: through its own forward
    ours = model(ids, pixels, labels=labels, segments=segments, return_logits=return_logits)
    with attention_layout(model.layout(ids, segments)):  # transformers' loss: every position's logits
        embeds = model.embed(ids, pixels)
        theirs = model.decoder(inputs_embeds=embeds, position_ids=positions_from_segments(segments), labels=labels)
    if return_logits:
        assert ours.logits.shape == ((labels[:, 1:] != -100).sum(), len(model.tokenizer))
    else:
        assert ours.logits is None
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6)
    mine = torch.autograd.grad(ours.loss, trained, allow_unused=True)
    reference = torch.autograd.grad(theirs.loss, trained, allow_unused=True)
    for name, a, b in zip(names, mine, reference):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "config, settings, plain",
    [
        ("LlamaConfig", {}, True),
        ("Qwen2Config", {}, True),
        ("Gemma2Config", {}, False),  # soft-capped logits
        ("CohereConfig", {}, False),  # scaled logits
        ("GraniteConfig", {}, False),  # scaled logits
        ("MixtralConfig", {"output_router_logits": True}, False),  # a router loss added
    ],
)
def test_only_decoders_whose_logits_are_the_bare_projection_take_the_answers_only_loss(config, settings, plain):
    import transformers

    assert plain_output_head(getattr(transformers, config)(**settings)) is plain


def test_image_features_land_at_the_image_tokens(clip_model):
    ids, _ = _sample(clip_model, 2, "Compare these", "ok")
    pixels = torch.rand(2, 3, 32, 32)
    embeds = clip_model.embed(torch.tensor([ids]), pixels)
    slots = torch.tensor(ids) == clip_model.image_token_id
    torch.testing.assert_close(embeds[0, slots], clip_model.image_features(pixels).reshape(-1, embeds.shape[-1]))
    with pytest.raises(ValueError, match="image token positions for 1 image"):
        clip_model.embed(torch.tensor([ids]), pixels[:1])


def test_saved_model_reloads_without_peft_and_answers_the_same(clip_model, tmp_path, monkeypatch):
    import sys

    ids, labels = _sample(clip_model, 1, "What is shown?", "a cat")
    pixels = torch.rand(1, 3, 32, 32)
    clip_model.eval()
    before = clip_model(torch.tensor([ids]), pixels, labels=torch.tensor([labels])).loss
    streamed = list(clip_model.stream(ids, pixels, max_new_tokens=5))
    clip_model.save_pretrained(tmp_path / "vc")
    monkeypatch.setitem(sys.modules, "peft", None)  # any import of peft now fails
    loaded = VisualChatModel.from_pretrained(tmp_path / "vc")
    assert loaded.tokenizer.convert_tokens_to_ids("<image>") == clip_model.image_token_id
    torch.testing.assert_close(loaded(torch.tensor([ids]), pixels, labels=torch.tensor([labels])).loss, before)
    assert list(loaded.stream(ids, pixels, max_new_tokens=5)) == streamed


def test_streaming_with_a_cache_equals_recomputing_every_step(clip_model):
    ids, _ = _sample(clip_model, 1, "What is shown?", "")
    ids = ids[:-1]
    pixels = torch.rand(1, 3, 32, 32)
    streamed = list(clip_model.stream(ids, pixels, max_new_tokens=6))
    greedy, current = [], list(ids)
    with torch.no_grad():
        for _ in range(len(streamed)):
            logits = clip_model(torch.tensor([current]), pixels).logits
            greedy.append(int(logits[0, -1].argmax()))
            current.append(greedy[-1])
    assert streamed == greedy


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_prompts_decoded_together_answer_as_each_alone(tmp_path, offline_data, arch):
    """Left padding is a segment nothing attends to and positions start at each prompt's first token, so a
    batch (prompts of other lengths and image counts) decodes every row as it would alone."""
    config = VisualChatModelConfig(
        encoder_kind="clip",
        encoder=str(tiny_clip(tmp_path / "clip")),
        projection="linear",
        mmca=True,
        decoder=str(tiny_decoder(tmp_path / arch, offline_data, arch)),
    )
    model = VisualChatModel.build(config).eval()
    torch.manual_seed(1)
    prompts = [
        _sample(model, 1, "What is shown?", "")[0][:-1],
        _sample(model, 2, "Which of these two pictures is a cat, the first or the second?", "")[0][:-1],
        _sample(model, 0, "Hello", "")[0][:-1],
    ]
    images = [torch.rand(1, 3, 32, 32), torch.rand(2, 3, 32, 32), torch.rand(0, 3, 32, 32)]
    alone = [list(model.stream(ids, px if len(px) else None, max_new_tokens=6)) for ids, px in zip(prompts, images)]
    together = model.generate(prompts, torch.cat(images), max_new_tokens=6)
    assert together == alone
    assert len({len(p) for p in prompts}) == 3 and any(alone)  # padded rows, and something was generated
    # At the decoder's last position each row stops where it would alone: the longest prompt gets 1 token.
    limit = max(map(len, prompts)) + 1
    setattr(model.decoder.config, "n_positions" if arch == "gpt2" else "max_position_embeddings", limit)
    alone = [list(model.stream(ids, px if len(px) else None, max_new_tokens=6)) for ids, px in zip(prompts, images)]
    assert model.generate(prompts, torch.cat(images), max_new_tokens=6) == alone
    assert len(alone[1]) <= 1 < max(map(len, alone))  # the limit bit the longest prompt, not the others


def test_efficientnet_lite0_gives_49_tokens_of_1280_from_pretrained_weights(offline_data):
    from PIL import Image

    from vlm_assets.models.vision_encoders import EfficientNetLite0Encoder

    encoder = EfficientNetLite0Encoder().eval()
    images = sorted((offline_data / "cifar10-samples").glob("*.png"))[:2]
    pixels = (
        torch.stack(
            [
                torch.from_numpy(np.array(Image.open(p).convert("RGB").resize((224, 224)))).permute(2, 0, 1)
                for p in images
            ]
        ).float()
        / 255
    )
    layouts = []  # what the first convolution is given
    hook = encoder.net._conv_stem.register_forward_pre_hook(
        lambda _, args: layouts.append(args[0].is_contiguous(memory_format=torch.channels_last))
    )
    with torch.no_grad():
        features = encoder(pixels.contiguous())
    hook.remove()
    assert features.shape == (2, 49, 1280) and torch.isfinite(features).all()
    assert features.std() > 0.1  # real weights, not an untrained net
    # it runs channels-last, with the features of the network on pixels in the default layout
    assert layouts == [True]
    with torch.no_grad():
        nchw = encoder.net.extract_features(encoder.normalize(pixels.contiguous())).flatten(2).transpose(1, 2)
    assert (features - nchw).abs().max() <= 1e-4 * nchw.abs().max()
    # and its weights stay in the default layout: DeepSpeed broadcasts every parameter as a flat byte view
    assert all(p.is_contiguous() for p in encoder.parameters())
    # the package's network with the same weights, each "same" padding a copy, gives the same features;
    # the encoder pads in the convolution where the padding is symmetric (all but 5 strided ones)
    from efficientnet_lite_pytorch import EfficientNet

    packaged = EfficientNet.from_name("efficientnet-lite0")
    missing = packaged.load_state_dict(encoder.net.state_dict(), strict=False).missing_keys
    assert missing == ["_fc.weight", "_fc.bias"]  # the classifier, which the encoder leaves out
    with torch.no_grad():
        theirs = packaged.eval().extract_features(encoder.normalize(pixels.contiguous())).flatten(2).transpose(1, 2)
    assert (nchw - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    pads = [sum(isinstance(m, torch.nn.ZeroPad2d) for m in net.modules()) for net in (packaged, encoder.net)]
    assert pads == [17, 5]


def test_a_folded_efficientnet_gives_the_same_features_and_refuses_to_save(tmp_path, offline_data):
    from PIL import Image

    from vlm_assets.models.vision_encoders import EfficientNetLite0Encoder

    encoder = EfficientNetLite0Encoder(image_size=128)
    images = sorted((offline_data / "cifar10-samples").glob("*.png"))[:4]
    pixels = torch.stack(
        [torch.from_numpy(np.array(Image.open(p).convert("RGB").resize((128, 128)))).permute(2, 0, 1) for p in images]
    ).float()
    pixels = pixels / 255
    with pytest.raises(ValueError, match="eval mode"):
        encoder.fold_batchnorm()  # training BatchNorm normalizes by the batch: nothing to fold
    encoder.eval()
    with torch.no_grad():
        unfolded = encoder(pixels)
        encoder.fold_batchnorm()
        folded = encoder(pixels)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in encoder.modules())
    assert unfolded.std() > 0.1 and (folded - unfolded).abs().max() <= 1e-4 * unfolded.abs().max()
    encoder.fold_batchnorm()  # a second fold leaves it as it is
    with torch.no_grad():
        assert torch.equal(encoder(pixels), folded)
    with pytest.raises(ValueError, match="save the encoder before folding"):
        encoder.save(tmp_path / "encoder")
    assert not (tmp_path / "encoder" / "model.safetensors").exists()


def test_efficientnet_at_another_input_size_gives_a_token_per_32_pixels_and_saves_it(tmp_path, offline_data):
    """At 128 px EfficientNet-Lite0 gives 4 x 4 = 16 tokens; saved and loaded, the encoder keeps its size and
    gives the same features. A size the feature map's stride does not divide, or a size for another kind of
    encoder, is refused naming it."""
    from vlm_assets.data.visualchat_data import load_image
    from vlm_assets.models.vision_encoders import EfficientNetLite0Encoder, build_encoder, load_encoder

    encoder = build_encoder("efficientnet_lite0", None, 128).eval()
    assert (encoder.image_size, encoder.num_tokens) == (128, 16)
    images = sorted((offline_data / "cifar10-samples").glob("*.png"))[:2]
    pixels = torch.stack([load_image(str(p), 128) for p in images])
    encoder.save(tmp_path / "encoder")
    loaded = load_encoder("efficientnet_lite0", tmp_path / "encoder").eval()
    assert loaded.preprocessing() == encoder.preprocessing()
    with torch.no_grad():
        features = encoder(pixels)
        assert features.shape == (2, 16, 1280) and features.std() > 0.1
        torch.testing.assert_close(loaded(pixels), features)
        with pytest.raises(ValueError, match=r"expects \(N, 3, 128, 128\) pixels"):
            encoder(torch.stack([load_image(str(p), 224) for p in images]))
    with pytest.raises(ValueError, match="image_size 100 must be a positive multiple of 32"):
        EfficientNetLite0Encoder(pretrained=False, image_size=100)
    with pytest.raises(ValueError, match="encoder_image_size is for the efficientnet_lite0 encoder only, not clip"):
        build_encoder("clip", str(tmp_path / "clip"), 128)


def test_a_frozen_encoder_stays_in_eval_mode_and_its_features_can_be_cached(tmp_path, offline_data):
    """EfficientNet-Lite0 has batch norm: frozen, a training step must neither use batch statistics nor
    move its running ones. Cached features equal computed ones, per image, in any order."""
    from vlm_assets.data.visualchat_data import load_image

    decoder = str(tiny_decoder(tmp_path / "llama", offline_data))
    config = VisualChatModelConfig(encoder_kind="efficientnet_lite0", encoder=None, decoder=decoder)
    model = VisualChatModel.build(config)
    model.encoder.requires_grad_(False)
    model.train()
    assert model.decoder.training and not model.encoder.training
    images = sorted((offline_data / "cifar10-samples").glob("*.png"))[:2]
    pixels = torch.stack([load_image(str(p), 224) for p in images])
    running = {k: v.clone() for k, v in model.encoder.state_dict().items() if "running" in k}
    with torch.no_grad():
        computed = model.image_features(pixels)
        assert all(torch.equal(v, model.encoder.state_dict()[k]) for k, v in running.items())
        model.cache_image_features()
        first = model.image_features(pixels)
        misses = model.feature_misses
        swapped = model.image_features(pixels[[1, 0, 1]])
    assert len(model._feature_cache) == 2 and misses == model.feature_misses == 2  # then read from the cache alone
    # The projection runs on each call's batch, and a batch of 3 may meet other kernel blocking than one of 2
    # (torch's AVX2 kernels do): equal within float rounding, not bit for bit.
    assert torch.allclose(first, computed, atol=1e-5) and torch.allclose(swapped, first[[1, 0, 1]], atol=1e-6)
    model.encoder.requires_grad_(True)
    with pytest.raises(ValueError, match="only be cached for a frozen encoder"):
        model.cache_image_features()


def test_an_encoder_that_does_not_load_names_the_path(tmp_path):
    from vlm_assets.models.vision_encoders import build_encoder

    (tmp_path / "empty").mkdir()
    for kind, path in (
        ("clip", tmp_path / "missing"),
        ("clip", tmp_path / "empty"),
        ("qwen2_5_vl", tmp_path / "missing"),
        ("efficientnet_lite0", tmp_path / "missing.pt"),
    ):
        with pytest.raises((FileNotFoundError, OSError, ValueError)) as info:
            build_encoder(kind, str(path))
        assert str(path) in str(info.value), (kind, str(info.value))


def test_a_decoder_directory_that_does_not_load_names_the_path(tmp_path):
    (tmp_path / "empty").mkdir()
    for path, error in ((tmp_path / "missing", "does not exist"), (tmp_path / "empty", "no config.json")):
        with pytest.raises((FileNotFoundError, ValueError), match=error) as info:
            config = VisualChatModelConfig(encoder_kind="efficientnet_lite0", encoder=None, decoder=str(path))
            VisualChatModel.build(config)
        assert str(path) in str(info.value)


def test_the_qwen2_5_vl_visual_tower_encodes_saves_and_reloads(tmp_path):
    from vlm_assets.models.tiny_qwen import build_tiny_qwen
    from vlm_assets.models.vision_encoders import QwenVisualEncoder, load_encoder

    qwen = build_tiny_qwen(tmp_path / "qwen", ["a cat", "a ship"])
    encoder = QwenVisualEncoder(str(qwen), image_size=56).eval()
    pixels = torch.rand(2, 3, 56, 56)
    with torch.no_grad():
        features = encoder(pixels)
    assert features.shape == (2, encoder.num_tokens, encoder.hidden_size) == (2, 4, encoder.hidden_size)
    encoder.save(tmp_path / "saved")
    with torch.no_grad():
        torch.testing.assert_close(load_encoder("qwen2_5_vl", tmp_path / "saved").eval()(pixels), features)
    with pytest.raises(ValueError, match="multiple of 28"):
        QwenVisualEncoder(str(qwen), image_size=50)


def test_gradient_checkpointing_recomputes_with_the_same_layout(clip_model):
    """Packed MMCA batch: gradients with the decoder's activations recomputed in backward (the layout
    held around backward, as the trainer does) equal those without."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from vlm_assets.models.visualchat_attention import attention_layout

    a, b = (
        _sample(clip_model, 2, "Which of these is a cat?", "the first"),
        _sample(clip_model, 1, "What is shown?", "a ship"),
    )
    ids, labels = torch.tensor([a[0] + b[0]]), torch.tensor([a[1] + b[1]])
    segments = torch.tensor([[1] * len(a[0]) + [2] * len(b[0])])
    pixels = torch.rand(3, 3, 32, 32)
    grads, calls = [], []
    layer = next(m for m in clip_model.decoder.modules() if isinstance(m, GradientCheckpointingLayer))
    # A module inside the layer: transformers checkpoints the layer's forward, its own hooks stay outside.
    hook = next(layer.children()).register_forward_pre_hook(lambda *_: calls.__setitem__(-1, calls[-1] + 1))
    clip_model.train()
    for checkpointing in (False, True):
        if checkpointing:
            set_activation_checkpointing(clip_model.decoder)
        clip_model.zero_grad()
        calls.append(0)
        with attention_layout(clip_model.layout(ids, segments)):
            clip_model(ids, pixels, labels=labels, segments=segments).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in clip_model.decoder.parameters() if p.grad is not None]))
    hook.remove()
    set_activation_checkpointing(clip_model.decoder, on=False)
    clip_model.eval()
    assert calls == [1, 2]  # with checkpointing, the first decoder layer's forward ran again in backward
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_a_saved_spec_that_is_not_one_names_the_file_and_fields(clip_model, tmp_path):
    from vlm_assets.models.visualchat_spec import SPEC_FILE, VisualChatSpec

    clip_model.spec.write(tmp_path)
    assert VisualChatSpec.read(tmp_path) == clip_model.spec
    (tmp_path / SPEC_FILE).write_text('{"encoder_kind": "clip", "colour": "red"}')
    with pytest.raises(ValueError, match=r"visualchat.json: missing \[.*'decoder_dim'.*\], unknown \['colour'\]"):
        VisualChatSpec.read(tmp_path)
    (tmp_path / SPEC_FILE).write_text("{")
    with pytest.raises(ValueError, match="visualchat.json: not JSON"):
        VisualChatSpec.read(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a VisualChat model directory"):
        VisualChatSpec.read(tmp_path / "nothing")
