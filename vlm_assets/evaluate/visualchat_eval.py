"""VisualChat evaluation on the occlusion manifests' clean images: VQA exact match (the manifest's
prompt -> class name, greedy) and a multi-round, two-image conversation transcript."""

import json
from pathlib import Path

import torch

from vlm_assets.data import visualchat_data as vd
from vlm_assets.models.frozen_vlm import normalize_answer
from vlm_assets.models.visualchat import VisualChatModel


def answer(model: VisualChatModel, messages: list[dict], images: list[str], max_new_tokens: int = 8) -> str:
    """The model's greedy reply to a conversation whose image parts reference ``images``, in order."""
    pixels = torch.stack([vd.load_image(ref, model.encoder.image_size) for ref in images]) if images else None
    return model.reply(messages, pixels, max_new_tokens)


def vqa_exact_match(model: VisualChatModel, manifests: Path, split: str, count: int | None = None) -> dict:
    """Exact match (normalised as the adapter's eval does) of the answers to the manifest's prompt on the
    first ``count`` images of ``split``, with the predictions."""
    records = [r for r in vd.manifest_records(manifests, split) if len(r.images) == 1][:count]
    predictions = []
    for record in records:
        predicted = answer(model, record.messages[:1], record.images)
        predictions.append({"label": record.messages[1]["content"], "predicted": predicted})
    hits = sum(normalize_answer(p["predicted"]) == normalize_answer(p["label"]) for p in predictions)
    classes = len(json.loads((manifests / "dataset.json").read_text())["class_names"])
    return {"exact_match": hits / max(len(predictions), 1), "chance": 1 / classes, "num_images": len(predictions),
            "predictions": predictions}


def two_image_conversation(model: VisualChatModel, manifests: Path, split: str = "validation") -> list[dict]:
    """Two images of different classes, two rounds: which one is a class, then what the other one is."""
    rows = [json.loads(line) for line in (manifests / f"{split}.jsonl").read_text().splitlines()]
    first = rows[0]
    second = next(r for r in rows if r["label"] != first["label"])
    images = [f"{manifests / 'images' / f'{split}.npy'}#{r['index']}" for r in (first, second)]
    messages = [{"role": "user", "content": [{"type": "image", "image": images[0]}, {"type": "image", "image": images[1]},
                                             {"type": "text", "text": f"Which of these is a {second['label']}?"}]}]
    for follow_up in ("And the other one?", None):
        messages.append({"role": "assistant", "content": answer(model, messages, images)})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return messages
