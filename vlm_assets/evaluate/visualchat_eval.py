"""VisualChat evaluation on the occlusion manifests' clean images: VQA exact match (the manifest's
prompt -> class name, greedy) and a multi-round, two-image conversation transcript."""

import json
from collections.abc import Callable
from pathlib import Path

import torch

from vlm_assets.data import visualchat_data as vd
from vlm_assets.evaluate.stats import wilson_interval
from vlm_assets.models.frozen_vlm import normalize_answer
from vlm_assets.models.visualchat import VisualChatModel


def answer(model: VisualChatModel, messages: list[dict], images: list[str], max_new_tokens: int = 8) -> str:
    """The model's greedy reply to a conversation whose image parts reference ``images``, in order."""
    pixels = torch.stack([vd.load_image(ref, model.encoder.image_size) for ref in images]) if images else None
    return model.reply(messages, pixels, max_new_tokens)


DECODE_BATCH = 50  # conversations decoded together

# Questions never asked in training (the manifest's prompt and ``visualchat_data.TRAIN_PHRASINGS`` are):
# how a person might ask. The eval reports their exact match beside the template's.
HELD_OUT_PHRASINGS = (
    "What is this?",
    "Name the item.",
    "Can you tell what this picture shows?",
    "Which piece of clothing or accessory do you see?",
    "What do you see?",
)


def vqa_exact_match(
    model: VisualChatModel,
    manifests: Path,
    split: str,
    count: int | None = None,
    questions: tuple[str, ...] | None = None,
) -> dict:
    """Return the exact match of the answers on the first ``count`` images of ``split``, with its interval.

    Answers are normalised as the adapter's eval does; the result carries the 95 % Wilson interval and the
    predictions. Each image is asked the manifest's prompt, or with ``questions`` image ``i`` is asked
    ``questions[i % len(questions)]`` (each asked about as often).
    """
    records = [r for r in vd.manifest_records(manifests, split) if len(r.images) == 1][:count]
    predictions = []
    for start in range(0, len(records), DECODE_BATCH):
        batch = records[start : start + DECODE_BATCH]
        conversations = []
        for i, record in enumerate(batch, start):
            messages = record.messages[:1]
            if questions:
                question = questions[i % len(questions)]
                content = [messages[0]["content"][0], {"type": "text", "text": question}]
                messages = [{"role": "user", "content": content}]
            conversations.append(messages)
        pixels = torch.stack([vd.load_image(r.images[0], model.encoder.image_size) for r in batch])
        for record, messages, predicted in zip(batch, conversations, model.replies(conversations, pixels)):
            predictions.append(
                {
                    "label": record.messages[1]["content"],
                    "predicted": predicted,
                    "question": vd.text_of(messages[0]["content"]),
                }
            )
    hits = sum(normalize_answer(p["predicted"]) == normalize_answer(p["label"]) for p in predictions)
    if not predictions:
        raise ValueError(f"no single-image records in {manifests}/{split}.jsonl to evaluate")
    classes = len(json.loads((manifests / "dataset.json").read_text())["class_names"])
    return {
        "exact_match": hits / len(predictions),
        "ci95": list(wilson_interval(hits, len(predictions))),
        "chance": 1 / classes,
        "num_images": len(predictions),
        "predictions": predictions,
    }


def vqa_report(model: VisualChatModel, manifests: Path, split: str, count: int | None = None) -> dict:
    """Return the VQA exact match asked the training template's prompt and asked held-out phrasings.

    Each comes with its interval, on the same images.
    """
    template = vqa_exact_match(model, manifests, split, count)
    phrased = vqa_exact_match(model, manifests, split, count, questions=HELD_OUT_PHRASINGS)
    return {"chance": template["chance"], "vqa": {"template": template, "held_out_phrasings": phrased}}


def two_image_conversation(model: VisualChatModel, manifests: Path, split: str = "validation") -> list[dict]:
    """Two images of different classes, two rounds: which one is a class, then what the other one is."""
    rows = [json.loads(line) for line in (manifests / f"{split}.jsonl").read_text().splitlines()]
    first = rows[0]
    second = next(r for r in rows if r["label"] != first["label"])
    images = [f"{manifests / 'images' / f'{split}.npy'}#{r['index']}" for r in (first, second)]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": images[0]},
                {"type": "image", "image": images[1]},
                {"type": "text", "text": f"Which of these is a {second['label']}?"},
            ],
        }
    ]
    for follow_up in ("And the other one?", None):
        messages.append({"role": "assistant", "content": answer(model, messages, images)})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return messages


def conversation_markdown(messages: list[dict]) -> str:
    """A conversation (chat messages, an image part shown as ``[image]``) as a markdown table."""
    lines = ["| role | message |", "|---|---|"]
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            content = " ".join("[image]" if p["type"] == "image" else p["text"] for p in content)
        lines.append(f"| {message['role']} | {content.replace('|', '/')} |")
    return "\n".join(lines)


def evaluate_export(model_dir: Path, manifests: Path, count: int, out: Path, log: Callable[[str], None]) -> dict:
    """Evaluate the exported model; write the results to ``out`` and return the numbers a model's metrics carry.

    The evaluation is the VQA exact match on held-out validation images (asked the template's prompt, and held-out
    phrasings), and a two-image, two-round conversation.
    """
    model = VisualChatModel.from_pretrained(model_dir).requires_grad_(False)
    model.cache_image_features()  # the held-out phrasings ask about the template's images again
    result = vqa_report(model, manifests, "validation", count)
    result["conversation"] = two_image_conversation(model, manifests)
    out.write_text(json.dumps(result, indent=1))
    template, phrased = result["vqa"]["template"], result["vqa"]["held_out_phrasings"]
    log(
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
