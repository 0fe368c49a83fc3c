"""Inspect chat datasets before training on them.

    python -m vlm_assets.chat_data PATH... [--image-folder DIR] [--format auto|openai|llava|hf]

Reads each PATH the way the ``visualchat_model`` asset will (``vlm_assets.data.chat_formats``: OpenAI
messages, LLaVA JSON, Hugging Face Parquet or datasets folders), renders every record in the training
template under the demo's tokenizer (GPT-2 BPE, 16 tokens per image: EfficientNet-Lite0 at 128 px) and prints one
JSON object per file: format, records, images, tokens, max_images_per_record, longest_record_tokens.
Exit 0 when every file is good; exit 65 (EX_DATAERR) after printing ``FILE:N: reason`` on stderr for
every bad record found (up to ``--max-errors`` per file).
"""

import argparse
import json
import sys
from pathlib import Path

EX_DATAERR = 65
DEMO_IMAGE_TOKENS = 16  # EfficientNet-Lite0 at 128 px, a 4x4 feature map: the demo's encoder


def summarize(path: str, records: list, tokenizer, image_tokens: int, kind: str) -> dict:
    """Return one file's summary: format, records, images, tokens, most images per record, longest record."""
    from vlm_assets.data.visualchat_data import render

    lengths = [len(render(r, tokenizer, 0, image_tokens, max_length=10**9).ids) for r in records]
    return {
        "file": path,
        "format": kind,
        "records": len(records),
        "images": sum(len(r.images) for r in records),
        "tokens": sum(lengths),
        "max_images_per_record": max((len(r.images) for r in records), default=0),
        "longest_record_tokens": max(lengths, default=0),
    }


def main(argv: list[str] | None = None) -> int:
    """Inspect each chat dataset named on the command line (see the module docstring); return the exit code."""
    from vlm_assets.data.chat_formats import FORMATS, ChatDataError, detect_format, read_chat_dataset

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="PATH")
    parser.add_argument("--image-folder", help="folder of relative image paths (default: beside each file)")
    parser.add_argument("--format", choices=FORMATS, default="auto")
    parser.add_argument("--max-images", type=int, default=8, help="most images in one record (the model's)")
    parser.add_argument("--max-errors", type=int, default=20, help="bad records listed per file")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the demo's GPT-2 BPE)")
    parser.add_argument("--image-tokens", type=int, default=DEMO_IMAGE_TOKENS, help="tokens per image")
    args = parser.parse_args(argv)

    from vlm_assets.data.token_shards import load_gpt2_tokenizer
    from vlm_assets.paths import offline_data_dir

    tokenizer_dir = args.tokenizer or str(offline_data_dir() / "gpt2-tokenizer")
    if not Path(tokenizer_dir).is_dir():
        print(
            f"tokenizer {tokenizer_dir} not found: run scripts/fetch-offline-data.sh or pass --tokenizer",
            file=sys.stderr,
        )
        return 2
    tokenizer = load_gpt2_tokenizer(tokenizer_dir)
    bad = False
    for path in args.paths:
        try:
            kind = detect_format(Path(path)) if args.format == "auto" else args.format
            records = read_chat_dataset(
                path,
                max_images=args.max_images,
                format=kind,
                image_folder=args.image_folder,
                max_errors=args.max_errors,
            )
        except ChatDataError as err:
            print(str(err), file=sys.stderr)
            bad = True
            continue
        except (ValueError, FileNotFoundError) as err:
            print(f"{path}: {err}" if not str(err).startswith(str(path)) else str(err), file=sys.stderr)
            bad = True
            continue
        print(json.dumps(summarize(path, records, tokenizer, args.image_tokens, kind)))
    return EX_DATAERR if bad else 0


if __name__ == "__main__":
    sys.exit(main())
