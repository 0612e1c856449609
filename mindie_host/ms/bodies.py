"""Request bodies and query values of the MS management APIs, read as a hostile client may send them.

Every problem raises :class:`BodyError` with a message that names it (empty, larger than the limit,
not UTF-8, not JSON, nested deeper than the parser goes, a lone UTF-16 surrogate, a number that is
not an unsigned 64-bit integer); the routes answer it with a 400 and ``{"error": message}``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

U64_MAX = 2**64 - 1
#: a ``\\uD800``-``\\uDFFF`` escape: valid JSON, but a lone one is no Unicode text
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF][0-9a-fA-F]{2}")


class BodyError(ValueError):
    """A body or query value the API cannot take; the message names the problem (a 400)."""


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused once it grows past ``limit`` bytes (declared or sent chunked)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and len(declared) < 20 and int(declared) > limit:
        raise BodyError(f"the body is {declared} bytes; at most {limit} bytes are accepted")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyError(f"the body exceeds {limit} bytes, the most accepted")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json(raw: bytes) -> Any:
    """``raw`` as a JSON value; :class:`BodyError` names what is wrong with it."""
    if not raw.strip():
        raise BodyError("the body is empty; a JSON object is expected")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"the body is not UTF-8 text (byte {exc.start} cannot be decoded)") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise BodyError(
            "the body is JSON nested too deeply (arrays or objects inside each other beyond the parser's depth limit)"
        ) from None
    except ValueError as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        where = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise BodyError(f"the body is not JSON: {reason}{where}") from None
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(value):
        raise BodyError(
            "the body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair); "
            "strings must be valid Unicode"
        )
    return value


def _has_lone_surrogate(value: Any) -> bool:
    """True when a string of ``value`` (keys included) cannot be encoded as UTF-8; iterative, any depth."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def u64(value: Any, where: str) -> int:
    """``value`` as an unsigned 64-bit integer: a JSON integer, or a string of ASCII digits."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= U64_MAX:
        shown = value if not isinstance(value, str) or len(value) <= 40 else value[:40] + "..."
        raise BodyError(f"{where} must be an unsigned 64-bit integer (0 to {U64_MAX}), got {shown!r}")
    return value
