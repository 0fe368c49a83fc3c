"""Loss curves: what people look at instead of reading metric tables."""

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def loss_curve_png(history: dict, uniform_loss: float, title: str, baseline_label: str | None = None) -> bytes:
    """Train loss per optimizer step, val loss per validation, and a baseline (by default the
    uniform predictor's)."""
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
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()
