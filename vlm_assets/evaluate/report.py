"""A self-contained HTML report (every image inlined) and the plots it and the Dagster UI show."""

import base64
import html
import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from vlm_assets.evaluate.occlusion_eval import CONDITIONS, EvalResult, exact_match  # noqa: E402


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def data_uri(png: bytes) -> str:
    """Return a PNG as a ``data:`` URI."""
    return f"data:image/png;base64,{base64.b64encode(png).decode()}"


def loss_curve_png(history: dict, uniform_loss: float, title: str, baseline_label: str | None = None) -> bytes:
    """Plot a trainer's loss curves as a PNG: what people look at instead of reading metric tables.

    Train loss per optimizer step, val loss per validation, and a baseline (by default the uniform predictor's).
    """
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    train, val = history["train"], history["val"]
    ax.plot([p["step"] for p in train], [p["loss"] for p in train], label="train", linewidth=1)
    if val:
        ax.plot([p["step"] for p in val], [p["loss"] for p in val], "o-", label="val")
    ax.axhline(
        uniform_loss,
        color="grey",
        linestyle="--",
        label=baseline_label or f"uniform predictor (ln V = {uniform_loss:.2f})",
    )
    if history.get("resumed_from_step") is not None:
        ax.axvline(history["resumed_from_step"], color="red", linestyle=":", label="resumed")
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats)", title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    return _png(fig)


def loss_curves_png(epochs: list[dict]) -> bytes:
    """Plot the adapter trainer's per-epoch losses (total and language-model, train and val) as a PNG."""
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    x = [e["epoch"] + 1 for e in epochs]
    for key, style in (
        ("train/loss", "-o"),
        ("val/loss", "-s"),
        ("train/lm_loss", ":"),
        ("val/lm_loss", ":"),
        ("val/reconstruction_loss", "--"),
    ):
        if any(key in e for e in epochs):  # train/lm_loss is absent from reconstruction warm-up epochs
            ax.plot(x, [e.get(key, float("nan")) for e in epochs], style, label=key)
    ax.set(xlabel="epoch", ylabel="loss", title="adapter training")
    ax.legend()
    ax.grid(alpha=0.3)
    return _png(fig)


def accuracy_png(summary: dict[str, float]) -> bytes:
    """Plot the exact and lenient accuracy of each condition (identity, adapter, clean) as a PNG bar chart."""
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    names = ["identity (occluded)", "adapter (occluded)", "clean"]
    keys = ["identity", "adapter", "clean"]
    strict = [summary[f"accuracy_{k}"] for k in keys]
    lenient = [summary[f"lenient_accuracy_{k}"] for k in keys]
    pos = np.arange(3)
    errors = None
    if all(f"accuracy_{k}_ci95_low" in summary for k in keys):  # the Wilson intervals as error bars
        errors = np.array(
            [
                [s - summary[f"accuracy_{k}_ci95_low"], summary[f"accuracy_{k}_ci95_high"] - s]
                for k, s in zip(keys, strict)
            ]
        ).T
    ax.bar(pos - 0.2, strict, 0.4, yerr=errors, capsize=4, label="exact match (95% CI)")
    ax.bar(pos + 0.2, lenient, 0.4, label="lenient match")
    ax.set_xticks(pos, names)
    ax.set(ylim=(0, 1), ylabel="accuracy", title=f"adapter gain {summary['adapter_gain']:+.1%} (exact match)")
    ax.legend()
    return _png(fig)


def confusion_png(result: EvalResult, condition: str = "adapter") -> bytes:
    """Plot ``condition``'s confusion matrix (true classes by predicted classes and "other") as a PNG."""
    matrix = result.confusion(condition)
    fig, ax = plt.subplots(figsize=(6.5, 5.5), dpi=100)
    ax.imshow(matrix, cmap="Blues")
    ax.set_xticks(range(matrix.shape[1]), result.class_names + ["other"], rotation=60, ha="right")
    ax.set_yticks(range(matrix.shape[0]), result.class_names)
    for (i, j), v in np.ndenumerate(matrix):
        if v:
            ax.text(j, i, str(v), ha="center", va="center", fontsize=7)
    ax.set(xlabel="predicted", ylabel="true", title=f"confusion ({condition})")
    return _png(fig)


def _image(pixels: torch.Tensor, size: int = 96) -> str:
    array = (pixels.detach().clamp(0, 1).permute(1, 2, 0).numpy() * 255).astype(np.uint8)
    img = Image.fromarray(array).resize((size, size), Image.Resampling.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return data_uri(buf.getvalue())


def interval(summary: dict[str, float], name: str) -> str:
    """``[low, high]`` of ``name``'s 95 % interval in the summary, in percent."""
    low, high = summary.get(f"{name}_ci95_low"), summary.get(f"{name}_ci95_high")
    return "" if low is None else f"[{low:.1%}, {high:.1%}]"


def gain_sentence(summary: dict[str, float]) -> str:
    """The adapter's paired gain with its uncertainty, in one line of plain text."""
    text = f"Adapter gain (exact match): {summary['adapter_gain']:+.1%}"
    if "adapter_gain_ci95_low" in summary:
        text += (
            f", 95% CI [{summary['adapter_gain_ci95_low']:+.1%}, {summary['adapter_gain_ci95_high']:+.1%}] "
            f"(paired bootstrap), McNemar p = {summary['adapter_gain_p_value']:.2g} "
            f"({summary['adapter_wins']:.0f} images won, {summary['adapter_losses']:.0f} lost)"
        )
    if "gap_recovered" in summary:
        text += f"; {summary['gap_recovered']:.0%} of the clean-minus-occluded gap recovered"
    return text + f"; {summary['num_samples']:.0f} images."


def markdown_table(summary: dict[str, float]) -> str:
    """Return the accuracy of each condition as a Markdown table, followed by the adapter's gain."""
    rows = ["| condition | exact match | 95% CI (Wilson) | lenient match |", "|---|---:|---:|---:|"]
    for c in CONDITIONS:
        rows.append(
            f"| {c} | {summary[f'accuracy_{c}']:.1%} | {interval(summary, f'accuracy_{c}')} "
            f"| {summary[f'lenient_accuracy_{c}']:.1%} |"
        )
    rows.append(f"\n{gain_sentence(summary)}")
    return "\n".join(rows)


def html_report(result: EvalResult, epochs: list[dict], cards: list[dict], title: str) -> str:
    """``cards``: dicts with occluded, restored, clean (tensors), label, predictions (condition -> answer)."""
    summary = result.summary()
    esc = html.escape
    epoch_keys = sorted({k for e in epochs for k in e if "/" in k})
    epoch_rows = "".join(
        "<tr>"
        + f"<td>{e['epoch'] + 1}</td>"
        + "".join(f"<td>{e.get(k, float('nan')):.4f}</td>" for k in epoch_keys)
        + "</tr>"
        for e in epochs
    )
    summary_rows = "".join(
        f"<tr><td>{c}</td><td>{summary[f'accuracy_{c}']:.1%}</td><td>{interval(summary, f'accuracy_{c}')}</td>"
        f"<td>{summary[f'lenient_accuracy_{c}']:.1%}</td></tr>"
        for c in CONDITIONS
    )
    per_class = "".join(
        f"<tr><td>{esc(name)}</td>" + "".join(f"<td>{result.per_class(c)[i]:.0%}</td>" for c in CONDITIONS) + "</tr>"
        for i, name in enumerate(result.class_names)
    )
    card_html = "".join(
        f"<div class='card'><img src='{_image(c['occluded'])}' title='occluded'><img src='{_image(c['restored'])}' "
        f"title='adapter output'><img src='{_image(c['clean'])}' title='clean'><p>label <b>{esc(c['label'])}</b><br>"
        + "".join(
            f"<span class='{'ok' if exact_match(p, c['label']) else 'bad'}'>{k}: {esc(p) or '(empty)'}</span><br>"
            for k, p in c["predictions"].items()
        )
        + "</p></div>"
        for c in cards
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{esc(title)}</title><style>
body{{font-family:sans-serif;margin:2em;max-width:1100px}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}} .card{{display:inline-block;margin:6px;padding:6px;
border:1px solid #ddd;width:310px;vertical-align:top}} .card img{{margin:2px}} .ok{{color:#070}} .bad{{color:#b00}}
</style></head><body><h1>{esc(title)}</h1>
<h2>Evaluation summary</h2><table><tr><th>condition</th><th>exact match</th><th>95% CI (Wilson)</th>
<th>lenient match</th></tr>{summary_rows}</table>
<p><b>{esc(gain_sentence(summary))}</b></p>
<img src="{data_uri(accuracy_png(summary))}">
<h2>Training</h2><img src="{data_uri(loss_curves_png(epochs))}">
<table><tr><th>epoch</th>{"".join(f"<th>{esc(k)}</th>" for k in epoch_keys)}</tr>{epoch_rows}</table>
<h2>Per class (exact match)</h2>
<table><tr><th>class</th>{"".join(f"<th>{c}</th>" for c in CONDITIONS)}</tr>{per_class}</table>
<img src="{data_uri(confusion_png(result))}">
<h2>Prediction cards</h2><p>occluded input, adapter output, clean image; predictions per condition.</p>{card_html}
</body></html>"""


def write_report(staging: Path, result: EvalResult, data, adapter, epochs: list[dict], num_cards: int) -> dict:
    """Write ``report.html``, ``eval.json`` and ``predictions.jsonl`` into ``staging``; return the summary.

    ``report.html`` shows its first ``num_cards`` images of ``data`` as prediction cards; ``eval.json`` holds the
    summary, its intervals as ``<name>_ci95: [low, high]``, per-class accuracy and the adapter's confusion.
    """
    summary = result.summary()
    cards = []
    with torch.no_grad():
        for i in range(min(num_cards, len(result.labels))):
            item = data[i]
            cards.append(
                {
                    "occluded": item["occluded"],
                    "clean": item["clean"],
                    "label": item["answer"],
                    "restored": adapter(item["occluded"][None], item["mask"][None])[0],
                    "predictions": {c: result.predictions[c][i] for c in result.predictions},
                }
            )
    (staging / "report.html").write_text(html_report(result, epochs, cards, "Occlusion adapter evaluation"))
    intervals = {
        key.removesuffix("_low"): [value, summary[key.removesuffix("_low") + "_high"]]
        for key, value in summary.items()
        if key.endswith("_ci95_low")
    }
    per_class = {c: result.per_class(c) for c in result.predictions}
    (staging / "eval.json").write_text(
        json.dumps(
            {**summary, **intervals, "per_class": per_class, "confusion_adapter": result.confusion("adapter").tolist()},
            indent=1,
        )
    )
    with open(staging / "predictions.jsonl", "w") as f:
        for i, y in enumerate(result.labels):
            row = {"label": result.class_names[y], **{c: result.predictions[c][i] for c in result.predictions}}
            f.write(json.dumps(row) + "\n")
    return summary
