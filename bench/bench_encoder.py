"""The EfficientNet-Lite0 encoder's forward: NCHW, channels-last, and channels-last with BatchNorm folded, in one run.

    python bench/bench_encoder.py [--batch 50] [--image-size 224] [--repeats 5] [--write]

The encoder is the demo's (the packaged ImageNet weights, eval mode, no grad; the demo runs it at 128 px):
most of ``eval_report``'s time (three forwards of each validation image) and what fills VisualChat's
feature cache (each image once). The folded forward is the frozen backbone's (``fold_batchnorm``: what
``eval_report`` runs). Each runs ``--repeats`` times, alternating, on the same random batch; the best time of
each is reported, the ratios to NCHW, and the largest difference of the features from NCHW's (each sums in
another order).
"""

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402

from vlm_assets.models.vision_encoders import EfficientNetLite0Encoder  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--batch",
        type=int,
        default=50,
        help="images per forward (the demo eval_report encodes 3 x its batch_size, 3 x 50, per decode)",
    )
    parser.add_argument("--image-size", type=int, default=224, help="input size, a multiple of 32 (demo: 128)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="write bench/results/encoder_<machine>_<date>.*")
    args = parser.parse_args()

    torch.manual_seed(0)
    # the platform's forward: channels-last pixels
    encoder = EfficientNetLite0Encoder(image_size=args.image_size).eval()

    def nchw(pixels: torch.Tensor) -> torch.Tensor:  # the same network on pixels in the default layout
        return encoder.net.extract_features(encoder.normalize(pixels)).flatten(2).transpose(1, 2)

    folded = copy.deepcopy(encoder)
    folded.fold_batchnorm()
    pixels = torch.rand(args.batch, 3, args.image_size, args.image_size)
    forwards = {"NCHW (torch's default)": nchw, "channels-last": encoder, "channels-last, BatchNorm folded": folded}
    times: dict[str, list[float]] = {name: [] for name in forwards}
    outputs = {}
    with torch.no_grad():
        for forward in forwards.values():
            forward(pixels[:2])  # oneDNN's kernels are chosen at the first call
        for _ in range(args.repeats):
            for name, forward in forwards.items():
                started = time.perf_counter()
                outputs[name] = forward(pixels)
                times[name].append(time.perf_counter() - started)
    best = {name: min(t) for name, t in times.items()}
    base = best["NCHW (torch's default)"]
    reference = outputs["NCHW (torch's default)"]
    diffs = {name: float((out - reference).abs().max()) for name, out in outputs.items()}
    scale = float(reference.abs().max())
    lines = [
        f"EfficientNet-Lite0 forward, {args.batch} images at {args.image_size} px, best of {args.repeats}, "
        f"{torch.get_num_threads()} threads.",
        "",
        "| forward | seconds | images/s | time / NCHW | largest feature difference from NCHW |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {name} | {t:.3f} | {args.batch / t:.1f} | {t / base:.2f} | {diffs[name] / scale:.1e} of the largest |"
            for name, t in best.items()
        ),
    ]
    markdown = "\n".join(lines)
    print(markdown)
    if args.write:
        ratios = {name: t / base for name, t in best.items()}
        data = {"batch": args.batch, "repeats": args.repeats, "seconds": times, "ratio": ratios, "max_diff": diffs}
        command = " ".join(["bench/bench_encoder.py", *sys.argv[1:]])
        print(results_file.write("encoder", results_file.header(command), markdown, data))


if __name__ == "__main__":
    main()
