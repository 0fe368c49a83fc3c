"""Chat datasets in the formats users hold (OpenAI image_url, LLaVA JSON, Hugging Face Parquet and
save_to_disk) on the real CIFAR-10 images, read into the same records, and every bad input named with
FILE:N, through the reader and through the inspector (`python -m vlm_assets.chat_data`)."""

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlm_assets.chat_data import DEMO_IMAGE_TOKENS
from vlm_assets.data import chat_formats as cf
from vlm_assets.data.visualchat_data import load_image
from vlm_assets_tests.conftest import CIFAR10_CLASSES, free_port, serve_directory

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def images(offline_data, tmp_path, monkeypatch):
    """Four real CIFAR-10 PNGs copied into tmp_path/images, and an image cache of this test's own."""
    monkeypatch.setenv("VLM_ASSETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "images"
    folder.mkdir()
    files = sorted((offline_data / "cifar10-samples").glob("*.png"))[:4]
    for f in files:
        shutil.copy(f, folder / f.name)
    return [folder / f.name for f in files]


def label(path: Path) -> str:
    return CIFAR10_CLASSES[int(path.stem.split("_")[2])]


def pixels(refs: list[str]) -> torch.Tensor:
    return torch.stack([load_image(ref, 32) for ref in refs])


def write_jsonl(path: Path, *records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def openai(parts: list[dict], answer: str = "a cat") -> dict:
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def test_openai_image_url_as_path_file_http_and_data_uri_give_the_same_pixels(images, tmp_path):
    one = images[0]
    with serve_directory(one.parent) as (base, requests):
        refs = [
            {"type": "image_url", "image_url": {"url": one.name}},  # relative to the file
            {"type": "image_url", "image_url": {"url": f"file://{one}"}},
            {"type": "image_url", "image_url": {"url": f"{base}/{one.name}"}},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(one)}"}},
            {"type": "image", "image": one.name},  # the project's own part keeps working
        ]
        path = write_jsonl(
            tmp_path / "images" / "chat.jsonl", *[openai([r, {"type": "text", "text": "What?"}]) for r in refs]
        )
        records = cf.read_chat_dataset(path, max_images=8)
        again = cf.read_chat_dataset(path, max_images=8)  # the URL is cached: fetched once
    assert cf.detect_format(path) == "openai" and len(records) == 5
    assert [r.where for r in records] == [f"{path}:{n}" for n in range(1, 6)]
    assert [len(r.images) for r in records] == [1] * 5 and requests == [f"/{one.name}"]
    assert [r.images for r in again] == [r.images for r in records]
    expected = pixels([str(one)])[0]
    for r in records:
        assert torch.equal(pixels(r.images)[0], expected), r.where
    assert records[2].messages[0]["content"][0] == {"type": "image", "image": records[2].images[0]}


def test_llava_json_places_each_image_at_its_marker_and_finds_the_images_folder(images, tmp_path):
    data = [
        {
            "id": "a",
            "image": images[0].name,
            "conversations": [
                {"from": "human", "value": "<image>\nWhat is in this photo?"},
                {"from": "gpt", "value": label(images[0])},
            ],
        },
        {
            "id": "b",
            "image": [images[1].name, images[2].name],
            "conversations": [
                {"from": "system", "value": "Answer in one word."},
                {"from": "human", "value": "Compare <image> with <image>: which is first?"},
                {"from": "gpt", "value": "The first."},
                {"from": "human", "value": "And now?"},
                {"from": "gpt", "value": "Still the first."},
            ],
        },
    ]
    path = tmp_path / "llava.json"  # beside images/, as LLaVA's releases are laid out
    path.write_text(json.dumps(data))
    first, second = cf.read_chat_dataset(path, max_images=8)
    assert cf.detect_format(path) == "llava"
    assert first.where == f"{path}:1" and second.where == f"{path}:2"
    assert first.messages[0]["content"] == [
        {"type": "image", "image": str(images[0])},
        {"type": "text", "text": "What is in this photo?"},
    ]
    assert second.messages[1]["content"] == [
        {"type": "text", "text": "Compare"},
        {"type": "image", "image": str(images[1])},
        {"type": "text", "text": "with"},
        {"type": "image", "image": str(images[2])},
        {"type": "text", "text": ": which is first?"},
    ]
    assert [m["role"] for m in second.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert second.images == [str(images[1]), str(images[2])]
    # JSONL and an explicit image folder
    (tmp_path / "other").mkdir()
    elsewhere = write_jsonl(tmp_path / "other" / "llava.jsonl", *data)
    records = cf.read_chat_dataset(elsewhere, max_images=8, image_folder=images[0].parent)
    assert [r.images for r in records] == [first.images, second.images]


def _hf_table(images: list[Path], path: str | None = None) -> dict:
    return {
        "messages": [
            [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": label(images[0])}]},
            ],
            [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same class?"}],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "No."}]},
            ],
        ],
        "images": [
            [{"bytes": images[0].read_bytes(), "path": None}],
            [{"bytes": None, "path": path or images[1].name}, {"bytes": images[2].read_bytes(), "path": "ignored.png"}],
        ],
    }


def test_hugging_face_parquet_and_save_to_disk_with_bytes_and_paths(images, tmp_path):
    import datasets

    table = datasets.Dataset.from_dict(_hf_table(images))
    parquet = images[0].parent / "train.parquet"
    table.to_parquet(str(parquet))
    # An Image feature (decoded to PIL by default; its reader keeps the bytes), a path-only image absolute
    featured = datasets.Dataset.from_dict(_hf_table(images, path=str(images[1])))
    featured.cast_column("images", datasets.List(datasets.Image())).save_to_disk(str(tmp_path / "saved"))
    for path in (parquet, tmp_path / "saved"):
        first, second = cf.read_chat_dataset(path, max_images=8)
        assert cf.detect_format(path) == "hf" and first.where.endswith(":1") and second.where.endswith(":2")
        assert first.messages[0]["content"][1] == {"type": "text", "text": "What is this?"}
        assert len(second.images) == 2
        assert torch.equal(pixels(first.images + second.images), pixels([str(p) for p in images[:3]]))


BAD_OPENAI = [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "unknown role 'robot'"),
    (openai([{"type": "image_url", "image_url": {"url": "nope.png"}}]), r"image file .*nope\.png does not exist"),
    (openai([{"type": "image_url", "image_url": {"url": "data:image/png,abc"}}]), "data: URI .* is not base64"),
    (openai([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]), "invalid base64"),
    (
        openai(
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"text").decode()}}]
        ),
        "the data: URI's payload is not a readable image",
    ),
    (openai([{"type": "video", "video": "x.mp4"}]), "content part .* is neither text nor image"),
]


def test_every_bad_openai_record_is_named_with_its_line_and_all_are_listed(images, tmp_path):
    good = openai([{"type": "image", "image": images[0].name}])
    path = write_jsonl(images[0].parent / "bad.jsonl", good, *[r for r, _ in BAD_OPENAI])
    with pytest.raises(cf.ChatDataError) as raised:
        cf.read_chat_dataset(path, max_images=8)
    assert len(raised.value.problems) == len(BAD_OPENAI)  # every bad record, not only the first
    for problem, (n, (_, reason)) in zip(raised.value.problems, enumerate(BAD_OPENAI, 2)):
        assert problem.startswith(f"{path}:{n}: "), problem
        assert re.search(reason, problem), (reason, problem)


def test_a_file_that_is_not_json_is_named_with_its_line(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"messages": [\n')
    with pytest.raises(cf.ChatDataError, match=rf"{broken}:1: not JSON"):
        cf.read_chat_dataset(broken, max_images=8)
    with pytest.raises(ValueError, match="cannot tell the chat format"):
        cf.read_chat_dataset(write_jsonl(tmp_path / "other.jsonl", {"text": "hi"}), max_images=8)


def test_unreachable_oversized_and_non_image_urls_are_named(images, tmp_path, monkeypatch):
    monkeypatch.setattr(cf, "FETCH_TIMEOUT_S", 5.0)
    (images[0].parent / "notes.txt").write_text("not an image")
    closed = f"http://127.0.0.1:{free_port()}/x.png"
    with serve_directory(images[0].parent) as (base, requests):
        path = write_jsonl(
            tmp_path / "urls.jsonl",
            openai([{"type": "image_url", "image_url": {"url": f"{base}/missing.png"}}]),
            openai([{"type": "image_url", "image_url": {"url": closed}}]),
            openai([{"type": "image_url", "image_url": {"url": f"{base}/notes.txt"}}]),
        )
        with pytest.raises(cf.ChatDataError) as raised:
            cf.read_chat_dataset(path, max_images=8)
        monkeypatch.setattr(cf, "MAX_IMAGE_BYTES", 100)
        big = write_jsonl(
            tmp_path / "big.jsonl", openai([{"type": "image_url", "image_url": {"url": f"{base}/{images[1].name}"}}])
        )
        with pytest.raises(cf.ChatDataError, match=rf"{big}:1: .* bytes, more than the 100-byte image limit"):
            cf.read_chat_dataset(big, max_images=8)
    missing, refused, text = raised.value.problems
    assert missing.startswith(f"{path}:1: image {base}/missing.png could not be fetched (HTTP 404")
    # asked once, not again (the loopback server logs a 404 twice: the error, then the request)
    assert requests.count("/missing.png") == 2
    assert refused.startswith(f"{path}:2: image {closed} could not be fetched") and "3 attempts" in refused
    assert text.startswith(f"{path}:3: {base}/notes.txt is not a readable image")


def bad_llava(images: list[Path]) -> tuple[Path, list[str]]:
    """A LLaVA file of bad records, and the problems it must raise."""

    def llava(value: str, image, who: str = "human") -> dict:
        turns = [{"from": who, "value": value}, {"from": "gpt", "value": "ok"}]
        return {"id": "x", "image": image, "conversations": turns}

    path = images[0].parent / "bad.json"
    path.write_text(
        json.dumps(
            [
                llava("<image>\n<image>\nTwo?", images[0].name),  # more markers than images
                llava("No marker here", [images[0].name]),  # fewer
                llava("<image> hi", images[0].name, who="robot"),
                llava("<image> hi", "gone.png"),
                {"id": "y", "image": images[0].name, "conversations": [{"from": "human", "value": "<image>"}]},
            ]
        )
    )
    folder = images[0].parent
    return path, [
        f"{path}:1: 2 <image> marker(s) for 1 image(s): they must match",
        f"{path}:2: 0 <image> marker(s) for 1 image(s): they must match",
        f"{path}:3: unknown 'from' 'robot' (expected one of human, gpt, system)",
        f"{path}:4: image file {folder / 'gone.png'} does not exist (nor in {folder / 'images'})",
        f"{path}:5: no assistant turn: nothing to learn from",
    ]


def bad_parquet(images: list[Path], tmp_path: Path) -> tuple[Path, list[str]]:
    import datasets

    table = _hf_table(images)
    table["images"][0] = [{"bytes": b"corrupt", "path": None}]
    table["images"][1] = table["images"][1][:1]  # two placeholders, one image
    user = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    table["messages"] += [[{**user, "role": "robot"}], [user]]
    table["images"] += [[], []]
    path = tmp_path / "bad.parquet"
    datasets.Dataset.from_dict(table).to_parquet(str(path))
    return path, [
        f"{path}:1: the image's bytes is not a readable image",
        f"{path}:2: 2 image placeholder(s) for 1 image(s): they must match",
        f"{path}:3: unknown role 'robot' (expected one of system, user, assistant)",
        f"{path}:4: no assistant turn: nothing to learn from",
    ]


def bad_columns(tmp_path: Path) -> tuple[Path, list[str]]:
    import datasets

    path = tmp_path / "columns.parquet"
    datasets.Dataset.from_dict({"text": ["hi"]}).to_parquet(str(path))
    return path, [f"{path}: no column 'messages' or 'images' (columns: text)"]


def test_bad_llava_and_hf_records_are_named(images, tmp_path):
    for path, expected in (bad_llava(images), bad_parquet(images, tmp_path), bad_columns(tmp_path)):
        with pytest.raises(cf.ChatDataError) as raised:
            cf.read_chat_dataset(path, max_images=8)
        assert len(raised.value.problems) == len(expected), raised.value.problems
        for problem, start in zip(raised.value.problems, expected):
            assert problem.startswith(start), (problem, start)


def _inspect(*args: str, env_cache: Path, in_process: bool = True) -> subprocess.CompletedProcess:
    """``python -m vlm_assets.chat_data ARGS``: in a subprocess, as a user runs it, or (to spare the
    suite the imports) by calling its ``main`` with the same arguments and capturing what it prints."""
    import contextlib
    import io
    import os

    if not in_process:
        env = {**os.environ, "VLM_ASSETS_CACHE": str(env_cache)}
        command = [sys.executable, "-m", "vlm_assets.chat_data", *args]
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    from vlm_assets.chat_data import main

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.setenv("VLM_ASSETS_CACHE", str(env_cache))
        code = main(list(args))
    return subprocess.CompletedProcess(["vlm_assets.chat_data", *args], code, out.getvalue(), err.getvalue())


@pytest.mark.slow  # runs the inspector in a process of its own
def test_the_inspector_prints_one_summary_per_file_and_exits_65_listing_every_bad_record(
    images, tmp_path, offline_data
):
    cache = tmp_path / "cache"
    (cache / "offline-data").mkdir(parents=True, exist_ok=True)
    (cache / "offline-data" / "gpt2-tokenizer").symlink_to(offline_data / "gpt2-tokenizer")
    llava = tmp_path / "llava.json"
    llava.write_text(
        json.dumps(
            [
                {
                    "image": [images[0].name, images[1].name],
                    "conversations": [
                        {"from": "human", "value": "<image><image>Which?"},
                        {"from": "gpt", "value": "2"},
                    ],
                }
            ]
        )
    )
    chat = write_jsonl(tmp_path / "chat.jsonl", openai([{"type": "image", "image": str(images[0])}], "cat"))
    ok = _inspect(str(llava), str(chat), "--image-folder", str(images[0].parent), env_cache=cache, in_process=False)
    assert ok.returncode == 0, ok.stderr
    first, second = (json.loads(line) for line in ok.stdout.splitlines())
    assert first["format"] == "llava" and first["records"] == 1 and first["images"] == 2
    assert first["max_images_per_record"] == 2 and first["longest_record_tokens"] > 2 * DEMO_IMAGE_TOKENS
    assert second["format"] == "openai" and second["tokens"] == second["longest_record_tokens"] > DEMO_IMAGE_TOKENS
    bad = write_jsonl(tmp_path / "bad.jsonl", *[r for r, _ in BAD_OPENAI])
    failed = _inspect(str(chat), str(bad), env_cache=cache, in_process=False)
    assert failed.returncode == 65
    assert [json.loads(line)["file"] for line in failed.stdout.splitlines()] == [str(chat)]
    named = [line for line in failed.stderr.splitlines() if line.startswith(f"{bad}:")]
    assert [line.split(":")[1] for line in named] == [str(n) for n in range(1, len(BAD_OPENAI) + 1)]
    # The other formats' bad files, each record named
    files = [bad_llava(images), bad_parquet(images, tmp_path), bad_columns(tmp_path)]
    failed = _inspect(*[str(path) for path, _ in files], env_cache=cache)
    assert failed.returncode == 65 and not failed.stdout
    for _, expected in files:
        for start in expected:
            assert any(line.startswith(start) for line in failed.stderr.splitlines()), (start, failed.stderr)
    capped = _inspect(str(bad), "--max-errors", "2", env_cache=cache)
    assert capped.returncode == 65 and f"(and {len(BAD_OPENAI) - 2} more)" in capped.stderr
