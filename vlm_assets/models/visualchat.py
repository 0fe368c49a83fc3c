"""VisualChat: a vision encoder joined to a causal-LM decoder through a learnable projection
(DeepSpeed-VisualChat's recipe). No distributed code here: the trainer applies LoRA and DeepSpeed.

An ``<image>`` token is added to the decoder's tokenizer. The chat template (``data/visualchat_data``)
writes ``num_image_tokens`` of them for each image; ``embed`` puts the projected image features at
those positions, images in order. The decoder is any Hugging Face causal LM (Llama family, the graph's
own GPT-2 export, SmolLM2-135M), run with the ``visualchat`` attention (``visualchat_attention``):
packed samples kept apart and, optionally, multi-modal causal attention.

Saved layout (``save_pretrained``), loadable with transformers + safetensors alone (no peft, no trainer):

    visualchat.json        encoder kind, projection, image token, MMCA, limits, preprocessing
    encoder/               the vision encoder's weights (and its processor files)
    projection.safetensors
    decoder/               the (merged) decoder and its tokenizer, ``<image>`` included
"""

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn

from vlm_assets.data.tokens import IGNORE_INDEX, positions_from_segments
from vlm_assets.models import visualchat_attention
from vlm_assets.models.hf_compat import cache_argument
from vlm_assets.models.linear_cross_entropy import head_loss
from vlm_assets.models.projections import build_projection, tokens_out
from vlm_assets.models.vision_encoders import VisionEncoder, build_encoder, load_encoder
from vlm_assets.models.visualchat_attention import Layout, attention_layout
from vlm_assets.models.visualchat_spec import VisualChatModelConfig, VisualChatSpec
from vlm_assets.paths import require_local

IMAGE_TOKEN = "<image>"


def pixel_keys(pixels: torch.Tensor) -> list[bytes]:
    """The feature cache's key of each image of (N, 3, S, S) pixels: a digest of its values."""
    import hashlib

    return [hashlib.blake2b(p.detach().float().cpu().numpy().tobytes(), digest_size=16).digest() for p in pixels]


# Causal LMs whose forward is their output embeddings over their decoder's output, and whose loss is the
# cross-entropy of those logits alone (transformers 5's modeling code, read for each). Others may cap,
# scale or cut their logits (Gemma 2/3, Cohere, Granite) or add a router loss (mixture-of-experts).
PLAIN_HEAD_TYPES = frozenset({"gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "smollm3", "olmo2"})


def plain_output_head(config) -> bool:
    """Whether a causal LM's loss is the cross-entropy of its output embeddings over its decoder's output."""
    return config.get_text_config().model_type in PLAIN_HEAD_TYPES


class VisualChatModel(nn.Module):
    """A vision encoder, a projection into the decoder's embeddings, and a causal language model decoder."""

    def __init__(
        self, encoder: VisionEncoder, projection: nn.Module, decoder: nn.Module, tokenizer, spec: VisualChatSpec
    ):
        super().__init__()
        self.encoder, self.projection, self.decoder, self.tokenizer = encoder, projection, decoder, tokenizer
        self.spec = spec
        self.image_token_id, self.num_image_tokens, self.mmca = spec.image_token_id, spec.num_image_tokens, spec.mmca
        self._feature_cache: dict[bytes, torch.Tensor] | None = None
        self.feature_misses = 0  # images the cache did not hold when a forward met them

    def train(self, mode: bool = True) -> "VisualChatModel":
        """Set training mode, but keep a frozen encoder in eval mode; return the model."""
        super().train(mode)
        if not self._encoder_trains():
            self.encoder.eval()  # frozen: fixed batch-norm statistics and no dropout, in training too
        return self

    def _encoder_trains(self) -> bool:
        return any(p.requires_grad for p in self.encoder.parameters())

    def cache_image_features(self) -> None:
        """Keep each image's encoder features after computing them once (the encoder must be frozen).

        A frozen encoder gives the same features every epoch, and on a CPU it is most of a step.
        """
        if self._encoder_trains():
            raise ValueError("image features can only be cached for a frozen encoder (freeze_modules: encoder)")
        self._feature_cache = {}

    # -- building and loading ------------------------------------------------------------------------
    @classmethod
    def build(cls, config: VisualChatModelConfig) -> "VisualChatModel":
        """A new model: the pretrained encoder and decoder, the projection at its initialisation."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        encoder = build_encoder(config.encoder_kind, config.encoder, config.encoder_image_size)
        _check_decoder(config.decoder)
        tokenizer = AutoTokenizer.from_pretrained(config.decoder)
        decoder = AutoModelForCausalLM.from_pretrained(config.decoder, dtype=torch.float32)
        return cls.from_parts(config, encoder, decoder, tokenizer)

    @classmethod
    def from_parts(cls, config: VisualChatModelConfig, encoder, decoder, tokenizer) -> "VisualChatModel":
        """Build a new model of an encoder, a decoder and its tokenizer already in memory.

        The parts are ``build``'s, or parts a benchmark initialised on a GPU: ``<image>`` is added, the projection is at
        its initialisation, on the decoder's device and dtype.
        """
        tokenizer.add_special_tokens({"extra_special_tokens": [IMAGE_TOKEN]})
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        if len(tokenizer) > decoder.get_input_embeddings().num_embeddings:
            decoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        embeddings = decoder.get_input_embeddings().weight
        projection = build_projection(
            config.projection,
            encoder.hidden_size,
            embeddings.shape[1],
            num_tokens_in=encoder.num_tokens,
            num_queries=config.num_queries,
        ).to(device=embeddings.device, dtype=embeddings.dtype)
        spec = VisualChatSpec(
            encoder_kind=encoder.kind,
            projection=config.projection,
            num_queries=config.num_queries,
            encoder_dim=encoder.hidden_size,
            decoder_dim=embeddings.shape[1],
            encoder_tokens=encoder.num_tokens,
            num_image_tokens=tokens_out(config.projection, encoder.num_tokens, config.num_queries),
            image_token=IMAGE_TOKEN,
            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
            mmca=config.mmca,
            max_images=config.max_images,
            max_length=config.max_length,
            preprocessing=encoder.preprocessing(),
        )
        return cls._assemble(encoder, projection, decoder, tokenizer, spec)

    @classmethod
    def _assemble(cls, encoder, projection, decoder, tokenizer, spec) -> "VisualChatModel":
        visualchat_attention.register()
        decoder.set_attn_implementation(visualchat_attention.ATTENTION)
        return cls(encoder, projection, decoder, tokenizer, spec)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Save the encoder, projection, decoder, tokenizer and spec in ``directory``; return it."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.encoder.save(directory / "encoder")
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in self.projection.state_dict().items()},
            str(directory / "projection.safetensors"),
        )
        # Saved with standard attention so that the decoder directory is a plain HF checkpoint.
        self.decoder.config._attn_implementation = "sdpa"
        try:
            self.decoder.save_pretrained(directory / "decoder")
        finally:
            self.decoder.set_attn_implementation(visualchat_attention.ATTENTION)
        self.tokenizer.save_pretrained(directory / "decoder")
        self.spec.write(directory)
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "VisualChatModel":
        """Load a model saved by ``save_pretrained`` from ``directory``."""
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        directory = Path(directory)
        spec = VisualChatSpec.read(directory)
        encoder = load_encoder(spec.encoder_kind, directory / "encoder")
        projection = build_projection(
            spec.projection,
            spec.encoder_dim,
            spec.decoder_dim,
            num_tokens_in=spec.encoder_tokens,
            num_queries=spec.num_queries,
        )
        projection.load_state_dict(load_file(str(directory / "projection.safetensors")))
        decoder = AutoModelForCausalLM.from_pretrained(directory / "decoder", dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(directory / "decoder")
        return cls._assemble(encoder, projection, decoder, tokenizer, spec).eval()

    # -- forward -------------------------------------------------------------------------------------
    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) pixels in [0, 1] -> (N, num_image_tokens, decoder width)."""
        if self._feature_cache is None:
            return self.projection(self.encoder(pixels.to(self.encoder.mean.dtype)))  # bf16 under DeepSpeed on GPUs
        cache = self._feature_cache
        keys = pixel_keys(pixels.to(self.encoder.mean.dtype))  # a batch cast to bf16 or not: one key
        missing: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            if key not in cache:
                missing.setdefault(key, i)
        if missing:
            self.feature_misses += len(missing)
            self.add_cached_features(list(missing), self.encode_frozen(pixels[list(missing.values())]))
        return self.projection(torch.stack([cache[key] for key in keys]))

    @torch.no_grad()
    def encode_frozen(self, pixels: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) pixels in [0, 1] -> the frozen encoder's (N, encoder tokens, encoder width) features."""
        return self.encoder(pixels.to(self.encoder.mean.dtype))

    def add_cached_features(self, keys: list[bytes], features: torch.Tensor) -> None:
        """Cache ``features`` (``encode_frozen``'s) under their images' ``pixel_keys``."""
        if self._feature_cache is None:
            raise ValueError("the feature cache is off: call cache_image_features() first")
        self._feature_cache.update(zip(keys, features))

    def embed(self, input_ids: torch.Tensor, pixels: torch.Tensor | None) -> torch.Tensor:
        """Token embeddings with each image's projected features at its ``<image>`` positions, in order."""
        embeddings = self.decoder.get_input_embeddings()(input_ids)
        slots = input_ids == self.image_token_id
        num_slots = int(slots.sum())
        num_images = 0 if pixels is None else pixels.shape[0]
        if num_slots != num_images * self.num_image_tokens:
            raise ValueError(
                f"{num_slots} image token positions for {num_images} image(s) of {self.num_image_tokens} tokens each"
            )
        if num_images:
            features = self.image_features(pixels).to(embeddings.dtype)
            embeddings = embeddings.masked_scatter(slots[..., None], features.reshape(-1, features.shape[-1]))
        return embeddings

    def forward(
        self,
        input_ids: torch.Tensor,
        pixels: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        return_logits: bool = True,
    ):
        """Return the decoder output.

        With ``labels``: ``.loss`` (mean over the unmasked answer tokens; a decoder outside ``PLAIN_HEAD_TYPES``
        gives its own loss, which may add to that, e.g. a router loss) and ``.logits`` (N, vocab) at the N
        tokens that a label follows only, in row-major order. ``segments`` (B, T): packed-sample ids, 0 = padding
        (default: one sample per row, no padding); ``position_ids`` restart per segment (default: 0..T-1).
        ``return_logits=False`` leaves ``.logits`` None: on a CPU a plain head's loss is then computed without
        them (``head_loss``), the same loss and gradients.
        """
        if segments is None:
            segments = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = positions_from_segments(segments)
        with attention_layout(self.layout(input_ids, segments)):
            embeds = self.embed(input_ids, pixels)
            if labels is None:
                return self.decoder(inputs_embeds=embeds, position_ids=position_ids)
            from transformers.modeling_outputs import CausalLMOutput

            # The vocabulary projection only at the tokens a label follows (the answers: a quarter of a
            # demo row, a few percent of a long chat): over a 50k vocabulary it is most of a small
            # decoder's work otherwise. transformers' loss takes every position's logits and its
            # ``logits_to_keep`` one set of positions for all rows, so the decoder's body runs alone here.
            targets = labels[:, 1:]
            answered = targets != IGNORE_INDEX
            if not plain_output_head(self.decoder.config):
                out = self.decoder(inputs_embeds=embeds, position_ids=position_ids, labels=labels)
                return CausalLMOutput(loss=out.loss, logits=out.logits[:, :-1][answered] if return_logits else None)
            hidden = self.decoder.get_decoder()(inputs_embeds=embeds, position_ids=position_ids).last_hidden_state
            head, rows = self.decoder.get_output_embeddings(), hidden[:, :-1][answered]
            logits, loss = head_loss(rows, head.weight, head.bias, targets[answered], return_logits, project=head)
            return CausalLMOutput(loss=loss, logits=logits if return_logits else None)

    def layout(self, input_ids: torch.Tensor, segments: torch.Tensor | None = None) -> Layout:
        """Return the attention layout of a batch.

        A training step with gradient checkpointing holds it around backward too (``attention_layout``): the
        recomputed forward runs there.
        """
        return Layout(
            torch.ones_like(input_ids) if segments is None else segments, input_ids == self.image_token_id, self.mmca
        )

    def reply(self, messages: list[dict], pixels: torch.Tensor | None, max_new_tokens: int = 8) -> str:
        """The greedy reply to a conversation (chat messages) whose image parts are ``pixels``, in order."""
        return self.replies([messages], pixels, max_new_tokens)[0]

    def replies(
        self, conversations: list[list[dict]], pixels: torch.Tensor | None, max_new_tokens: int = 8
    ) -> list[str]:
        """Return the greedy replies to several conversations at once.

        ``pixels`` holds every image part of the first conversation, then of the second, and so on.
        """
        from vlm_assets.data.visualchat_data import prompt_ids

        prompts = [prompt_ids(m, self.tokenizer, self.image_token_id, self.num_image_tokens) for m in conversations]
        return [
            self.tokenizer.decode(ids, skip_special_tokens=True).strip()
            for ids in self.generate(prompts, pixels, max_new_tokens=max_new_tokens)
        ]

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], pixels: torch.Tensor | None, max_new_tokens: int = 8
    ) -> list[list[int]]:
        """Return greedy new token ids for a batch of prompts decoded together (left-padded, KV cache kept).

        A row ends at the end-of-sequence token, the batch at ``max_new_tokens`` or the decoder's last position.
        ``pixels`` are the prompts' images in order. Padding is a segment of its own (id 0) that no token
        attends to, so each row decodes as it would alone.
        """
        from transformers import DynamicCache

        if not prompts:
            return []
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.tokenizer.pad_token_id, dtype=torch.long)
        segments = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            segments[row, width - len(prompt) :] = 1
        lengths = segments.sum(1)
        image = ids == self.image_token_id
        positions = (segments.cumsum(1) - 1).clamp(min=0)
        embeds = self.embed(ids, pixels)
        limit = decoder_positions(self.decoder.config)
        # each row's own budget: a position table ends at its last row (stream's limit, per row)
        budgets = (limit - lengths).clamp(0, max_new_tokens) if limit else torch.full_like(lengths, max_new_tokens)
        cache, out_ids = DynamicCache(), [[] for _ in prompts]
        done = torch.zeros(len(prompts), dtype=torch.bool)
        for step in range(int(budgets.max())):
            tokens = self._next_logits(embeds, positions, cache, segments, image).argmax(-1)
            done |= (tokens == self.tokenizer.eos_token_id) | (budgets <= step)
            if bool(done.all()):
                break
            for row in (~done).nonzero().flatten().tolist():
                out_ids[row].append(int(tokens[row]))
            segments = torch.cat([segments, torch.ones(len(prompts), 1, dtype=torch.long)], dim=1)
            image = torch.cat([image, torch.zeros(len(prompts), 1, dtype=torch.bool)], dim=1)
            positions = (lengths if limit is None else lengths.clamp(max=limit - 1))[:, None]  # done rows too
            lengths = lengths + 1
            embeds = self.decoder.get_input_embeddings()(tokens[:, None])
        return out_ids

    def _next_logits(self, embeds, positions, cache, segments, image) -> torch.Tensor:
        """(B, vocab) logits at each row's last position for the new ``embeds``; ``cache`` is extended.
        ``segments`` and ``image`` cover every key position so far (0 = padding)."""
        with attention_layout(Layout(segments, image, self.mmca)):
            kv = {cache_argument(self.decoder): cache}
            out = self.decoder(inputs_embeds=embeds, position_ids=positions, use_cache=True, logits_to_keep=1, **kv)
        return out.logits[:, -1]

    @torch.no_grad()
    def stream(
        self,
        input_ids: list[int],
        pixels: torch.Tensor | None,
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> Iterator[int]:
        """Yield new token ids one at a time (greedy at temperature 0, else nucleus sampling), KV cache kept.

        Stop at the end-of-sequence token, or at the decoder's last position.
        """
        from transformers import DynamicCache

        ids = torch.tensor([input_ids])
        image = ids == self.image_token_id
        cache = DynamicCache()
        embeds = self.embed(ids, pixels)
        length = ids.shape[1]
        limit = decoder_positions(self.decoder.config) or length + max_new_tokens
        for _ in range(min(max_new_tokens, limit - length)):  # a position table ends at its last row
            positions = torch.arange(length - embeds.shape[1], length)[None]
            logits = self._next_logits(embeds, positions, cache, torch.ones(1, length, dtype=torch.long), image)
            token = _pick(logits[0], temperature, top_p, generator)
            if token == self.tokenizer.eos_token_id:
                return
            yield token
            image = torch.cat([image, torch.zeros(1, 1, dtype=torch.bool)], dim=1)
            embeds = self.decoder.get_input_embeddings()(torch.tensor([[token]]))
            length += 1


def decoder_positions(config) -> int | None:
    """Return the most positions a decoder's config declares, or None when it declares none.

    GPT-2's learned table (``n_positions``), Llama's ``max_position_embeddings``.
    """
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    ordered, order = probs.sort(descending=True)
    keep = ordered.cumsum(0) - ordered < top_p
    ordered = ordered * keep
    return int(order[torch.multinomial(ordered / ordered.sum(), 1, generator=generator)])


def _check_decoder(name_or_path: str) -> None:
    require_local(name_or_path, "decoder")
    if name_or_path.startswith(("/", ".", "~")) and not (Path(name_or_path).expanduser() / "config.json").is_file():
        raise ValueError(f"decoder: {name_or_path} is not a Hugging Face model directory (no config.json)")
