"""Download-once file cache with checksum verification."""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from vlm_assets.progress import report_progress

_CHUNK = 1 << 20


def is_url(uri: str) -> bool:
    """Return whether ``uri`` is an http(s) URL."""
    return urlparse(uri).scheme in {"http", "https"}


def md5_file(path: Path) -> str:
    """Return the hex MD5 digest of the file at ``path``, read in chunks."""
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


MIRROR_ENV = "VLM_ASSETS_DOWNLOAD_MIRROR"


def mirrored(url: str) -> str:
    """Return ``url`` on the mirror that ``$VLM_ASSETS_DOWNLOAD_MIRROR`` names, else ``url`` itself.

    The mirror is a base URL that serves the same paths, e.g. an internal copy of public datasets for a cluster
    without internet.
    """
    mirror = os.environ.get(MIRROR_ENV)
    if not mirror:
        return url
    if not is_url(mirror):
        raise ValueError(f"{MIRROR_ENV}={mirror!r} is not an http(s) URL")
    return mirror.rstrip("/") + "/" + urlparse(url).path.lstrip("/")


def fetch(uri: str, cache_dir: Path, md5: str | None = None, log: Callable[[str], None] | None = None) -> Path:
    """Return a local path for ``uri`` (a URL or a local path), downloading a URL once.

    A URL is fetched from ``$VLM_ASSETS_DOWNLOAD_MIRROR`` when set.
    Downloads land in ``cache_dir/<md5 of the url's folder>/<file name>`` via a temporary file, so an interrupted
    download never looks cached. With ``md5`` the file (cached or fresh) is verified; a mismatch in a
    fresh download raises ``ValueError`` naming the URL, a mismatch in a cached copy re-downloads it.
    """
    if not is_url(uri):
        path = Path(uri).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or directory")
        if md5 and path.is_file() and md5_file(path) != md5:
            raise ValueError(f"{path}: md5 {md5_file(path)} does not match the expected {md5}")
        return path

    uri = mirrored(uri)
    name = Path(urlparse(uri).path).name or "download"
    # Keyed by the URL's directory, so files published side by side (idx files) land side by side.
    folder = uri.rsplit("/", 1)[0]
    target = Path(cache_dir) / hashlib.md5(folder.encode(), usedforsecurity=False).hexdigest() / name
    if target.is_file() and (md5 is None or md5_file(target) == md5):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                response = urllib.request.urlopen(uri, timeout=60)
            except (urllib.error.URLError, OSError) as err:
                raise ValueError(f"cannot download {uri}: {err}") from err
            with response:
                chunks = iter(lambda: response.read(_CHUNK), b"")
                for chunk in report_progress(
                    chunks,
                    f"download {name}",
                    log,
                    unit="bytes",
                    size=len,
                    total=int(response.headers.get("Content-Length") or 0) or None,
                ):
                    out.write(chunk)
        if md5 and (actual := md5_file(tmp)) != md5:
            raise ValueError(f"{uri}: downloaded file has md5 {actual}, expected {md5} (corrupt or truncated)")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
