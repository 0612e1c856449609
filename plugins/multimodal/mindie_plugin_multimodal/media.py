"""Fetching media parts: base64 data URLs, allow-listed server-local files, and (when configured) http(s).

Every failure is a :class:`~mindie_host.api.RequestError` (422) with the spec's wording
(``Request param image_url null.``, ``[InferTokenizer::DownloadUrl] download fail: ...``);
the messages never echo file-system details beyond the path the client gave.
Received and downloaded images are written to the cache directory (``LOCAL_CACHE_DIR``)
under their SHA-256, so a repeated image is decoded from one file.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindie_host.api import RequestError

#: spec §1.3: at most this many image/video/audio URLs per request
MAX_MULTIMODAL_URL_NUM = 20
#: spec §1.3: an image is at most 20 MB
MAX_IMAGE_BYTES = 20 * 1024 * 1024
IMAGE_FORMATS = ("JPEG", "PNG", "MPO")
BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")


def default_cache_dir() -> Path:
    """``LOCAL_CACHE_DIR``, else ``${MIES_INSTALL_PATH}/bin/cache``, else ``~/.cache/mindie_host/multimodal``."""
    env = os.environ.get("LOCAL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    install = os.environ.get("MIES_INSTALL_PATH")
    if install:
        return Path(install).expanduser() / "bin" / "cache"
    return Path.home() / ".cache" / "mindie_host" / "multimodal"


@dataclass
class MediaPolicy:
    """Where media may come from (``Plugins.multimodal``)."""

    allowed_dirs: list[Path]
    allow_http: bool = False
    http_timeout_s: float = 10.0
    cache_dir: Path | None = None


def download_fail(reason: str, field: str) -> RequestError:
    """The spec's message for a media part that could not be read."""
    return RequestError(f"[InferTokenizer::DownloadUrl] download fail: {reason}", field=field)


def url_of(item: dict[str, Any], kind: str, field: str) -> str:
    """The URL string of a part: MindIE's plain string, or OpenAI's ``{"url": ...}`` object."""
    value = item.get(kind)
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value.strip():
        raise RequestError(f"Request param {kind} null.", field=f"{field}.{kind}")
    return value.strip()


def _data_url(url: str, field: str) -> bytes:
    head, _, data = url.partition(",")
    if ";base64" not in head:
        raise download_fail("a data URL must be base64-encoded (data:image/jpeg;base64,...)", field)
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise download_fail(f"the image is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MB", field)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise download_fail("the data URL is not valid base64", field) from None


def _local(url: str, policy: MediaPolicy, field: str) -> bytes:
    raw = url.removeprefix("file://")
    path = Path(raw).expanduser()
    try:
        resolved = path.resolve(strict=True)
    except (OSError, RuntimeError):
        raise download_fail(f"{raw!r} is not a readable file in an allowed directory", field) from None
    if not any(resolved.is_relative_to(d) for d in policy.allowed_dirs) or not resolved.is_file():
        # the same words whether the file exists outside the allow-list or not at all
        raise download_fail(f"{raw!r} is not a readable file in an allowed directory", field)
    if resolved.stat().st_size > MAX_IMAGE_BYTES:
        raise download_fail(f"the image is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MB", field)
    return resolved.read_bytes()


def _http(url: str, policy: MediaPolicy, field: str) -> bytes:
    if not policy.allow_http:
        raise download_fail("http(s) URLs are off (Plugins.multimodal.allowHttp)", field)
    try:
        with urllib.request.urlopen(url, timeout=policy.http_timeout_s) as resp:  # noqa: S310 - scheme checked
            data = resp.read(MAX_IMAGE_BYTES + 1)
    except Exception as exc:  # network errors of every kind are the client's URL's fault
        raise download_fail(f"{type(exc).__name__}", field) from None
    if len(data) > MAX_IMAGE_BYTES:
        raise download_fail(f"the image is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MB", field)
    return data


def _is_bare_base64(url: str) -> bool:
    """The spec's "base64-encoded jpg" given without a ``data:`` prefix (not a path: no dot, length 4k)."""
    return len(url) >= 64 and len(url) % 4 == 0 and "." not in url and BASE64.fullmatch(url) is not None


def read_media(url: str, policy: MediaPolicy, field: str) -> tuple[bytes, bool]:
    """The bytes of a media URL, and whether they came from the client or the network (to cache)."""
    if url.startswith("data:"):
        return _data_url(url, field), True
    if _is_bare_base64(url):
        return _data_url("data:;base64," + url, field), True
    if url.startswith(("http://", "https://")):
        return _http(url, policy, field), True
    if "://" in url and not url.startswith("file://"):
        raise download_fail("allowed: a data: URL, a server-local path, or http(s) when configured", field)
    if not policy.allowed_dirs:
        raise download_fail("server-local paths are off (Plugins.multimodal.allowedLocalMediaPath)", field)
    return _local(url, policy, field), False


def load_image(url: str, policy: MediaPolicy, field: str) -> tuple[Any, bytes]:
    """Decode an ``image_url`` into an RGB PIL image; returns it and the SHA-256 of its bytes."""
    from PIL import Image

    data, received = read_media(url, policy, field)
    if len(data) > MAX_IMAGE_BYTES:
        raise download_fail(f"the image is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MB", field)
    digest = hashlib.sha256(data).digest()
    if received and policy.cache_dir is not None:
        _cache(policy.cache_dir, digest, data)
    try:
        image = Image.open(io.BytesIO(data))
        if image.format not in IMAGE_FORMATS:
            raise download_fail(f"image format {image.format!r} is not supported (allowed: jpg, jpeg, png)", field)
        image = image.convert("RGB")
    except RequestError:
        raise
    except Exception:
        raise download_fail("the data is not a decodable jpg/png image", field) from None
    return image, digest


def _cache(directory: Path, digest: bytes, data: bytes) -> None:
    path = directory / f"{digest.hex()}.img"
    if path.exists():
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    except OSError:  # a full or read-only cache never fails the request
        pass
