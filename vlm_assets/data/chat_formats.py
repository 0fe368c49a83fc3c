"""Chat datasets in the formats users hold, read into one record shape (``ChatRecord``), so that blending,
packing and the template apply unchanged:

``openai``  JSONL (or a JSON array) of ``{"messages": [{"role", "content"}]}``; ``content`` is a string or
            parts: ``{"type": "text", "text"}``, ``{"type": "image_url", "image_url": {"url"}}`` (OpenAI's
            own) or ``{"type": "image", "image"}``. An image is a path (relative to the file), a ``file://``,
            ``http(s)://`` or ``data:image/...;base64,`` URI, or ``FILE.npy#I`` (image I of a uint8 pack).
``llava``   LLaVA's JSON (or JSONL): ``{"id", "image": PATH | [PATH, ...], "conversations": [{"from":
            "human" | "gpt" | "system", "value"}]}``; each ``<image>`` marker is where an image goes, in
            order. Paths are relative to ``image_folder`` (default: the file's folder, then its
            ``images/``, as LLaVA's releases are laid out).
``hf``      the Hugging Face VLM SFT layout, read with ``datasets``: a Parquet file (or a folder of them)
            or a ``save_to_disk`` folder, columns ``messages`` (parts with ``{"type": "image"}``
            placeholders) and ``images`` (a list of images as ``{bytes, path}``).

``read_chat_dataset`` detects the format from the content (``format`` overrides it). Every bad record is
collected as ``FILE:N: reason`` (N: the JSONL line, the position from 1 in a JSON array, the Parquet row
from 1), up to ``max_errors``, and raised together as one ``ChatDataError``: nothing is trained on a
file that failed. Remote and inline images are fetched (timeout, bounded retries, size limit), checked to
be images, and kept in a content cache, so records name local files only.
"""

import base64
import binascii
import dataclasses
import hashlib
import io
import itertools
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from vlm_assets.paths import cache_dir

ROLES = ("system", "user", "assistant")
FORMATS = ("auto", "openai", "llava", "hf")
LLAVA_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
IMAGE_MARKER = "<image>"


def max_image_bytes(env=os.environ) -> int:
    """The largest image a chat dataset may fetch, in bytes (``VLM_ASSETS_MAX_IMAGE_BYTES``, default 20 MiB)."""
    value = env.get("VLM_ASSETS_MAX_IMAGE_BYTES", str(20 * 2**20))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"VLM_ASSETS_MAX_IMAGE_BYTES={value!r}: expected a whole number of bytes, at least 1")
    return int(value)


MAX_IMAGE_BYTES = max_image_bytes()
FETCH_TIMEOUT_S = 30.0
FETCH_ATTEMPTS = 3


@dataclasses.dataclass(frozen=True)
class ChatRecord:
    """One conversation read from a chat dataset: its messages, its local image files and where it came from."""

    messages: list[dict]  # content: a string or parts {"type": "text", "text"} / {"type": "image", "image"}
    images: list[str]  # local image files (or FILE.npy#I), in order of appearance
    where: str  # "file:line" for errors


class ChatDataError(ValueError):
    """Every problem found in a chat dataset, one ``FILE:N: reason`` per line."""

    def __init__(self, problems: list[str], more: int = 0):
        self.problems, self.more = problems, more
        super().__init__("\n".join(problems) + (f"\n(and {more} more)" if more else ""))


class BadRecord(ValueError):
    """One record's reason (the reader adds ``FILE:N``)."""


# -- images ------------------------------------------------------------------------------------------------
def image_cache() -> Path:
    """Return the folder (created) where images fetched or decoded from chat records are kept."""
    path = cache_dir() / "chat-images"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _keep_image(data: bytes, what: str) -> str:
    """Bytes that must be an image, kept under their sha256 in the image cache; the file's path."""
    if len(data) > MAX_IMAGE_BYTES:
        raise BadRecord(f"{what} is {len(data):,} bytes, more than the {MAX_IMAGE_BYTES:,}-byte image limit")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
            kind = (image.format or "img").lower()
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise BadRecord(f"{what} is not a readable image ({err})") from None
    path = image_cache() / f"{hashlib.sha256(data).hexdigest()}.{kind}"
    if not path.is_file():
        tmp = path.with_suffix(f".{os.getpid()}.partial")
        tmp.write_bytes(data)
        tmp.replace(path)  # atomic: a reader never sees half an image
    return str(path)


def fetch_image(url: str) -> str:
    """An http(s) image, fetched once (cached by URL) with a timeout, bounded retries and a size limit."""
    marker = image_cache() / f"url-{hashlib.sha256(url.encode()).hexdigest()}.txt"
    if marker.is_file() and Path(kept := marker.read_text()).is_file():
        return kept
    last = ""
    for attempt in range(FETCH_ATTEMPTS):
        try:
            with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
                declared = int(response.headers.get("Content-Length") or 0)
                if declared > MAX_IMAGE_BYTES:
                    raise BadRecord(f"{url} is {declared:,} bytes, more than the {MAX_IMAGE_BYTES:,}-byte image limit")
                data = response.read(MAX_IMAGE_BYTES + 1)
            kept = _keep_image(data, url)
            marker.write_text(kept)
            return kept
        except urllib.error.HTTPError as err:
            last = f"HTTP {err.code} {err.reason}"
            if err.code < 500 and err.code != 429:  # 404, 403...: asking again will not help
                break
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            last = str(getattr(err, "reason", err))
        if attempt + 1 < FETCH_ATTEMPTS:
            time.sleep(0.5 * 2**attempt)
    raise BadRecord(f"image {url} could not be fetched ({last}; {FETCH_ATTEMPTS} attempts at most)")


def data_uri_image(uri: str) -> str:
    """Decode a base64 ``data:`` URI's image, keep it in the image cache and return its local file."""
    header, comma, payload = uri.partition(",")
    if not comma or not header.endswith(";base64"):
        raise BadRecord(f"data: URI {uri[:40]!r}... is not base64 (expected data:image/...;base64,...)")
    try:
        data = base64.b64decode(payload, validate=True)
    except binascii.Error as err:
        raise BadRecord(f"data: URI holds invalid base64 ({err})") from None
    return _keep_image(data, "the data: URI's payload")


def resolve_image(ref: str, folders: list[Path]) -> str:
    """A local file for an image reference (see the module's docstring); ``BadRecord`` otherwise."""
    if not isinstance(ref, str) or not ref:
        raise BadRecord(f"image reference {ref!r} is not a non-empty string")
    if ref.startswith(("http://", "https://")):
        return fetch_image(ref)
    if ref.startswith("data:"):
        return data_uri_image(ref)
    path_part, _, index = ref.removeprefix("file://").partition("#")
    candidates = [Path(path_part)] if Path(path_part).is_absolute() else [f / path_part for f in folders]
    for path in candidates:
        if path.is_file():
            return f"{path}#{index}" if index else str(path)
    raise BadRecord(
        f"image file {candidates[0]} does not exist" + (f" (nor in {folders[1]})" if len(folders) > 1 else "")
    )


# -- one record of each format -----------------------------------------------------------------------------
def _check_messages(messages, image_of: Callable[[dict], str | None]) -> tuple[list[dict], list[str]]:
    """Messages in the project's parts, with every image resolved; ``image_of`` returns a part's image
    reference (or None: not an image part)."""
    if not isinstance(messages, list) or not messages:
        raise BadRecord("expected a non-empty 'messages' list")
    out, images = [], []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise BadRecord(f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise BadRecord(f"a {role} message needs 'content' (a string or a list of parts)")
        parts = []
        for part in content:
            ref = image_of(part) if isinstance(part, dict) else None
            if ref is not None:
                if role != "user":
                    raise BadRecord(f"images belong in user turns, found one in a {role} turn")
                images.append(ref)
                parts.append({"type": "image", "image": ref})
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise BadRecord(f"content part {part!r} is neither text nor image")
        out.append({"role": role, "content": parts})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRecord("no assistant turn: nothing to learn from")
    return out, images


def openai_record(data, folders: list[Path]) -> tuple[list[dict], list[str]]:
    """Read one OpenAI-style record (``messages`` with image parts); return its messages and image files."""
    if not isinstance(data, dict) or "messages" not in data:
        raise BadRecord("expected an object with a 'messages' list")

    def image_of(part: dict) -> str | None:
        if part.get("type") == "image":
            return resolve_image(part.get("image"), folders)
        if part.get("type") == "image_url":
            url = part.get("image_url")
            return resolve_image(url.get("url") if isinstance(url, dict) else url, folders)
        return None

    return _check_messages(data["messages"], image_of)


def llava_record(data, folders: list[Path]) -> tuple[list[dict], list[str]]:
    """Read one LLaVA-style record (``conversations`` and ``image``); return its messages and image files.

    The ``<image>`` markers in the turns must match the listed images in number.
    """
    if not isinstance(data, dict) or not isinstance(data.get("conversations"), list):
        raise BadRecord("expected an object with a 'conversations' list")
    listed = data.get("image", [])
    listed = [listed] if isinstance(listed, str) else listed
    if not isinstance(listed, list):
        raise BadRecord(f"'image' must be a path or a list of paths, got {listed!r}")
    turns = data["conversations"]
    markers = sum(t.get("value", "").count(IMAGE_MARKER) for t in turns if isinstance(t, dict))
    if markers != len(listed):
        raise BadRecord(f"{markers} {IMAGE_MARKER} marker(s) for {len(listed)} image(s): they must match")
    pending = iter(listed)
    messages = []
    for turn in turns:
        who = turn.get("from") if isinstance(turn, dict) else None
        if who not in LLAVA_ROLES:
            raise BadRecord(f"unknown 'from' {who!r} (expected one of {', '.join(LLAVA_ROLES)})")
        value = turn.get("value")
        if not isinstance(value, str):
            raise BadRecord(f"a {who} turn needs a string 'value'")
        pieces = value.split(IMAGE_MARKER)
        parts = []
        for i, text in enumerate(pieces):
            if i:
                parts.append({"type": "image", "image": next(pending)})
            if text.strip():
                parts.append({"type": "text", "text": text.strip()})
        messages.append({"role": LLAVA_ROLES[who], "content": parts})
    return _check_messages(messages, lambda p: resolve_image(p["image"], folders) if p.get("type") == "image" else None)


def hf_record(data: dict, folders: list[Path]) -> tuple[list[dict], list[str]]:
    """Read one Hugging Face-style row (``messages`` and ``images``); return its messages and image files.

    Image placeholders must match the images in number; an image is given as bytes or a path.
    """
    images = data.get("images") or []
    if not isinstance(images, list):
        raise BadRecord(f"'images' must be a list, got {type(images).__name__}")
    messages = data.get("messages")
    if isinstance(messages, list):  # Arrow gives every part every field: keep what the part's type uses
        placeholders = sum(
            1
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), list)
            for p in m["content"]
            if isinstance(p, dict) and p.get("type") == "image"
        )
        if placeholders != len(images):
            raise BadRecord(f"{placeholders} image placeholder(s) for {len(images)} image(s): they must match")
    pending = iter(images)

    def image_of(part: dict) -> str | None:
        if part.get("type") != "image":
            return None
        image = next(pending)
        if isinstance(image, dict) and image.get("bytes"):
            return _keep_image(image["bytes"], "the image's bytes")
        if isinstance(image, dict) and image.get("path"):
            return resolve_image(image["path"], folders)
        raise BadRecord(f"an image with neither bytes nor a path: {str(image)[:80]}")

    return _check_messages(messages, image_of)


READERS = {"openai": openai_record, "llava": llava_record, "hf": hf_record}


# -- files -------------------------------------------------------------------------------------------------
def _json_rows(path: Path) -> Iterator[tuple[int, object]]:
    """(N, record) of a JSON array (N: position from 1) or JSONL file (N: line); a JSON error is a row."""
    text = path.read_text()
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            yield err.lineno, BadRecord(f"not JSON ({err.msg}, line {err.lineno} column {err.colno})")
            return
        yield from enumerate(rows, 1)
        return
    for line_no, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as err:
                yield line_no, BadRecord(f"not JSON ({err.msg})")


def _hf_rows(path: Path) -> Iterator[tuple[int, object]]:
    import datasets

    datasets.disable_progress_bars()
    try:
        if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "state.json").is_file()):
            table = datasets.load_from_disk(str(path))
        else:
            files = sorted(path.glob("**/*.parquet")) if path.is_dir() else [path]
            if not files:
                raise BadRecord("neither a datasets folder (save_to_disk) nor a folder of Parquet files")
            table = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train")
    except BadRecord:
        raise
    except Exception as err:  # pyarrow's and datasets' own errors, whatever their class
        raise BadRecord(f"not readable as Parquet or a datasets folder ({type(err).__name__}: {err})") from None
    if isinstance(table, datasets.DatasetDict):
        table = table["train"] if "train" in table else next(iter(table.values()))
    missing = [c for c in ("messages", "images") if c not in table.column_names]
    if missing:
        raise BadRecord(f"no column {' or '.join(map(repr, missing))} (columns: {', '.join(table.column_names)})")
    feature = table.features["images"]
    inner = getattr(feature, "feature", None)
    if isinstance(inner, datasets.Image) and inner.decode:  # keep the bytes: the reader checks them itself
        table = table.cast_column("images", type(feature)(datasets.Image(decode=False)))
    yield from enumerate(table, 1)


def detect_format(path: Path) -> str:
    """Return the format of the chat dataset at ``path``: ``hf`` for a folder or Parquet file, else its JSON format."""
    if path.is_dir() or path.suffix == ".parquet":
        return "hf"
    return _json_format(path, next(_json_rows(path), None))


def _json_format(path: Path, first: tuple[int, object] | None) -> str:
    """The format of a JSON / JSONL file, told by its first row ``(N, record)``."""
    if first is not None:
        n, record = first
        if isinstance(record, BadRecord):  # the first record is not JSON: say so, not "which format"
            raise ChatDataError([f"{path}:{n}: {record}"])
        if isinstance(record, dict) and "conversations" in record:
            return "llava"
        if isinstance(record, dict) and "messages" in record:
            return "openai"
    raise ValueError(
        f"{path}: cannot tell the chat format from the first record (expected 'messages' (OpenAI), "
        "'conversations' (LLaVA), or a Parquet / datasets folder); set format explicitly"
    )


def read_chat_dataset(
    path: str | Path,
    *,
    max_images: int,
    format: str = "auto",
    image_folder: str | Path | None = None,
    max_errors: int = 20,
) -> list[ChatRecord]:
    """Read every record of one chat dataset, validated and with local image files.

    Raise ``ChatDataError`` listing up to ``max_errors`` bad records otherwise.
    """
    path = Path(path).expanduser()
    if format not in FORMATS:
        raise ValueError(f"format {format!r}: expected one of {', '.join(FORMATS)}")
    if not path.exists():
        raise FileNotFoundError(f"chat dataset {path} does not exist")
    rows = None
    if format != "auto":
        kind = format
    elif path.is_dir() or path.suffix == ".parquet":
        kind = "hf"
    else:  # told by the first row of the one parse the records come from
        rows = _json_rows(path)
        first = next(rows, None)
        kind = _json_format(path, first)
        rows = itertools.chain([first], rows)
    base = path if path.is_dir() else path.parent
    if image_folder is not None:
        folders = [Path(image_folder).expanduser()]
    elif kind == "llava":
        folders = [base, base / "images"]
    else:
        folders = [base]
    problems, more, records = [], 0, []
    if rows is None:
        rows = _hf_rows(path) if kind == "hf" else _json_rows(path)
    try:
        for n, data in rows:
            where = f"{path}:{n}"
            try:
                if isinstance(data, BadRecord):
                    raise data
                messages, images = READERS[kind](data, folders)
                if len(images) > max_images:
                    raise BadRecord(f"{len(images)} images, more than max_images {max_images}")
                records.append(ChatRecord(messages, images, where))
            except BadRecord as err:
                if len(problems) < max_errors:
                    problems.append(f"{where}: {err}")
                else:
                    more += 1
    except BadRecord as err:  # the file as a whole (a Parquet file without the expected columns)
        problems.append(f"{path}: {err}")
    if problems:
        raise ChatDataError(problems, more)
    return records
