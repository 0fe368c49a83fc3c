"""Chat with a VisualChat model in the terminal.

    python -m vlm_assets.chat MODEL [--max-new-tokens 64] [--temperature 0] [--top-p 0.9] [--seed 0]

MODEL is a directory written by ``VisualChatModel.save_pretrained`` (the ``visualchat_model`` asset's
``model/``) or a registry URI such as ``models:/visualchat@champion`` (``MLFLOW_TRACKING_URI`` says
which server). A line ``/image PATH`` attaches an image to your next turn; ``/reset`` starts a new
conversation; ``/quit`` (or end of input) leaves; any other line is your turn. Answers stream token by
token; the whole conversation, images included, is kept for the next round. Greedy at temperature 0.
"""

import argparse
import sys
from pathlib import Path

PROMPT = "you> "


def resolve_model(model: str) -> Path:
    """A model directory, downloading a registered model's artifacts for a ``models:/`` URI."""
    if model.startswith("models:/"):
        import mlflow

        root = Path(mlflow.artifacts.download_artifacts(artifact_uri=model))
        found = sorted(root.rglob("visualchat.json"))
        if not found:
            raise ValueError(f"{model}: the registered model holds no VisualChat model directory")
        return found[0].parent
    path = Path(model).expanduser()
    if not (path / "visualchat.json").is_file():
        raise ValueError(f"{model}: not a VisualChat model directory (no visualchat.json)")
    return path


def main(argv: list[str] | None = None) -> int:
    """Run the terminal chat (see the module docstring); return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="model directory or models:/NAME@ALIAS")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: nucleus sampling")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        directory = resolve_model(args.model)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    from vlm_assets.data.visualchat_data import load_image, prompt_ids
    from vlm_assets.models.visualchat import VisualChatModel

    model = VisualChatModel.from_pretrained(directory)
    generator = torch.Generator().manual_seed(args.seed)
    messages: list[dict] = []
    images: list[torch.Tensor] = []
    pending: list[dict] = []
    print(
        f"VisualChat {directory} ({model.spec.encoder_kind} + {model.spec.projection}): "
        "/image PATH attaches an image, /reset, /quit",
        flush=True,
    )
    while True:
        try:
            line = input(PROMPT).strip()
        except EOFError:
            print()
            return 0
        if not line:
            continue
        if line == "/quit":
            return 0
        if line == "/reset":
            messages, images, pending = [], [], []
            print("(new conversation)", flush=True)
            continue
        if line.startswith("/image"):
            path = Path(line.removeprefix("/image").strip()).expanduser()
            if len(images) + len(pending) >= model.spec.max_images:
                print(f"(at most {model.spec.max_images} images in a conversation)", flush=True)
            elif not path.is_file():
                print(f"(no image file {path})", flush=True)
            else:
                pending.append({"type": "image", "image": str(path)})
                images.append(load_image(str(path), model.encoder.image_size))
                print(f"(image {len(images)} attached: {path.name})", flush=True)
            continue
        messages.append({"role": "user", "content": [*pending, {"type": "text", "text": line}]})
        pending = []
        ids = prompt_ids(messages, model.tokenizer, model.image_token_id, model.num_image_tokens)
        pixels = torch.stack(images) if images else None
        tokens: list[int] = []
        shown = ""
        print("visualchat> ", end="", flush=True)
        for token in model.stream(
            ids,
            pixels,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            generator=generator,
        ):
            tokens.append(token)
            text = model.tokenizer.decode(tokens, skip_special_tokens=True)
            print(text[len(shown) :], end="", flush=True)
            shown = text
        print(flush=True)
        messages.append({"role": "assistant", "content": shown})


if __name__ == "__main__":
    sys.exit(main())
