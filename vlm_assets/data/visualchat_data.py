"""VisualChat training data: chat datasets (``chat_formats``: OpenAI, LLaVA, Hugging Face) and the
occlusion manifests' clean images, in DeepSpeed-VisualChat's conversation template, with the loss on the
assistant's answers only.

A record (``ChatRecord``) is one conversation; ``content`` is a string or a list of parts
``{"type": "text", "text": ...}`` / ``{"type": "image", "image": FILE}``. Rendered::

    ### System: <system line>
    ### Image 1:
    <image> x num_image_tokens
    ### Question: <user text>
    ### Answer: <assistant text><eos>      (only the answer text and <eos> carry labels)

Every bad record fails before training, naming the file and line (``chat_formats``), and so does one
with more tokens than ``max_length`` (``render``).

Samples may be packed first-fit (largest first) into rows of ``pack_tokens``: each keeps its own
segment id, so the attention keeps samples apart and positions restart (``visualchat_attention``).
"""

import dataclasses
import json
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from vlm_assets.data.chat_formats import ChatRecord, fetch_image
from vlm_assets.data.tokens import IGNORE_INDEX, positions_from_segments

DEFAULT_SYSTEM = "You are a helpful assistant that answers questions about images."


@dataclasses.dataclass(frozen=True)
class Sample:
    """One rendered record: its token ids, its labels and its image files."""

    ids: list[int]
    labels: list[int]
    images: list[str]


def _parts(content) -> list[dict]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def render(
    record: ChatRecord,
    tokenizer,
    image_token_id: int,
    num_image_tokens: int,
    max_length: int,
    *,
    open_answer: bool = False,
) -> Sample:
    """Return the token ids and labels of a record in the template (labels on the answers and their <eos> only).

    ``open_answer`` ends with the assistant's header, for the model to continue.
    """
    ids: list[int] = []
    labels: list[int] = []

    def add(text: str, learn: bool = False) -> None:
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.extend(tokens)
        labels.extend(tokens if learn else [IGNORE_INDEX] * len(tokens))

    system = [m for m in record.messages if m["role"] == "system"]
    add(f"### System: {text_of(system[0]['content']) if system else DEFAULT_SYSTEM}\n")
    image_no = 0
    for message in record.messages:
        if message["role"] == "user":
            for part in _parts(message["content"]):
                if part["type"] == "image":
                    image_no += 1
                    add(f"### Image {image_no}:\n")
                    ids.extend([image_token_id] * num_image_tokens)
                    labels.extend([IGNORE_INDEX] * num_image_tokens)
                    add("\n")
            if text := text_of(message["content"]):
                add(f"### Question: {text}\n")
        elif message["role"] == "assistant":
            add("### Answer: ")
            add(text_of(message["content"]), learn=True)
            ids.append(tokenizer.eos_token_id)
            labels.append(tokenizer.eos_token_id)
            add("\n")
    if open_answer:
        add("### Answer: ")
    if len(ids) > max_length:
        raise ValueError(
            f"{record.where}: {len(ids)} tokens ({image_no} image(s) of {num_image_tokens}), "
            f"more than max_length {max_length}"
        )
    return Sample(ids, labels, record.images)


def prompt_ids(messages: list[dict], tokenizer, image_token_id: int, num_image_tokens: int) -> list[int]:
    """A conversation so far, ending with the assistant's header: what the model continues (chat, eval)."""
    record = ChatRecord(messages, [], "prompt")
    return render(record, tokenizer, image_token_id, num_image_tokens, max_length=10**9, open_answer=True).ids


def text_of(content) -> str:
    """The text parts of a message's content, joined."""
    return " ".join(p["text"] for p in _parts(content) if p["type"] == "text").strip()


# -- the occlusion manifests as chat data ------------------------------------------------------------
# Other ways to ask what an image shows, for ``phrased`` VQA records; the evaluation's held-out phrasings
# (``vlm_assets.evaluate.visualchat_eval.HELD_OUT_PHRASINGS``) are none of these.
TRAIN_PHRASINGS = (
    "What is shown?",
    "What is in this image?",
    "Which item is this?",
    "What kind of item is pictured?",
    "Identify the object.",
    "What clothing item or accessory is this?",
    "Tell me what this is.",
    "Classify this picture.",
    "What does the image show?",
    "What is it?",
)


def manifest_records(root: Path, split: str, *, pairs: int = 0, phrased: int = 0, seed: int = 0) -> list[ChatRecord]:
    """Return the chat records of a split of an occlusion dataset.

    Each clean image comes as VQA (the manifest row's own prompt, the question the occlusion adapter's backbone is
    asked, -> class name), then ``pairs`` two-image, two-round conversations ("Which of these is a <class>?" ->
    "Image N", then "And the other one?" -> its class), then ``phrased`` one-image records asked one of
    ``TRAIN_PHRASINGS`` (seeded images and phrasings).
    """
    images = root / "images" / f"{split}.npy"
    rows = [json.loads(line) for line in (root / f"{split}.jsonl").read_text().splitlines()]
    records = []
    for line_no, row in enumerate(rows, 1):
        ref = f"{images}#{row['index']}"
        records.append(
            ChatRecord(
                [
                    {
                        "role": "user",
                        "content": [{"type": "image", "image": ref}, {"type": "text", "text": row["prompt"]}],
                    },
                    {"role": "assistant", "content": row["label"]},
                ],
                [ref],
                f"{root / split}.jsonl:{line_no}",
            )
        )
    rng = random.Random(seed)
    by_class: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        by_class.setdefault(row["label"], []).append(i)
    classes = sorted(by_class)
    for _ in range(pairs if len(classes) > 1 else 0):
        first, second = rng.sample(classes, 2)
        a, b = rng.choice(by_class[first]), rng.choice(by_class[second])
        target = rng.randrange(2)
        refs = [f"{images}#{rows[i]['index']}" for i in (a, b)]
        asked, other = (first, second) if target == 0 else (second, first)
        records.append(
            ChatRecord(
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "image": refs[0]},
                            {"type": "image", "image": refs[1]},
                            {"type": "text", "text": f"Which of these is a {asked}?"},
                        ],
                    },
                    {"role": "assistant", "content": f"Image {target + 1}"},
                    {"role": "user", "content": "And the other one?"},
                    {"role": "assistant", "content": other},
                ],
                refs,
                f"{root / split}.jsonl:pairs",
            )
        )
    for _ in range(phrased):
        i = rng.randrange(len(rows))
        ref = f"{images}#{rows[i]['index']}"
        records.append(
            ChatRecord(
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "image": ref},
                            {"type": "text", "text": rng.choice(TRAIN_PHRASINGS)},
                        ],
                    },
                    {"role": "assistant", "content": rows[i]["label"]},
                ],
                [ref],
                f"{root / split}.jsonl:{i + 1}",
            )
        )
    return records


# -- blending, split, packing -------------------------------------------------------------------------
def blend(datasets: Sequence[tuple[list, int | None]], seed: int) -> list:
    """``count`` records of each dataset (None = all; more than it has = repeated), shuffled together."""
    rng = random.Random(seed)
    out = []
    for records, count in datasets:
        if not records:
            continue
        count = len(records) if count is None else count
        order = list(range(len(records)))
        rng.shuffle(order)
        out.extend(records[order[i % len(order)]] for i in range(count))
    rng.shuffle(out)
    return out


def split(records: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, eval): a seeded ``eval_fraction`` held out (at least one record when the fraction is > 0)."""
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    held = max(1, round(eval_fraction * len(records))) if eval_fraction else 0
    return [records[i] for i in sorted(order[held:])], [records[i] for i in sorted(order[:held])]


def pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: sample indices grouped into rows of at most ``budget`` tokens."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > budget:
            raise ValueError(f"sample {i} has {lengths[i]} tokens, more than the packing budget {budget}")
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(budget - lengths[i])
    return rows


# -- images and batches -------------------------------------------------------------------------------
_ARRAYS: dict[str, np.ndarray] = {}


def load_image(ref: str, size: int) -> torch.Tensor:
    """(3, size, size) float pixels in [0, 1]."""
    from PIL import Image

    if ref.startswith(("http://", "https://")):
        image = Image.open(fetch_image(ref))
    else:
        path, _, index = ref.partition("#")
        if index:
            array = _ARRAYS.get(path)
            if array is None:
                array = _ARRAYS[path] = np.load(path, mmap_mode="r")
            image = Image.fromarray(np.asarray(array[int(index)]).squeeze())
        else:
            image = Image.open(path)
    return to_pixels(image, size)


def to_pixels(image, size: int) -> torch.Tensor:
    """A PIL image as (3, size, size) float pixels in [0, 1] (RGB, bicubic resize)."""
    from PIL import Image

    image = image.convert("RGB").resize((size, size), Image.BICUBIC)
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


def collate(rows: Sequence[Sequence[Sample]], pad_id: int, image_size: int) -> dict[str, torch.Tensor]:
    """Return a batch of rows, each one or more packed samples.

    The batch holds ids, labels, segments (0 = padding), restarted position ids and every image in order.
    """
    width = max(sum(len(s.ids) for s in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    segments = torch.zeros((len(rows), width), dtype=torch.long)
    images = []
    for r, row in enumerate(rows):
        at = 0
        for s, sample in enumerate(row, 1):
            span = slice(at, at + len(sample.ids))
            ids[r, span], labels[r, span], segments[r, span] = torch.tensor(sample.ids), torch.tensor(sample.labels), s
            images.extend(sample.images)
            at += len(sample.ids)
    pixels = torch.stack([load_image(ref, image_size) for ref in images]) if images else None
    return {
        "input_ids": ids,
        "labels": labels,
        "segments": segments,
        "position_ids": positions_from_segments(segments),
        "pixels": pixels,
    }
