"""Typed, range-checked reads of JSON request fields, shared by every protocol module.

Every failure raises :class:`RequestError` (422 by default) naming the field, the
allowed range and the value received, so bad input never becomes a 500.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ..engine.request import RequestError

_MISSING = object()
INT32_MAX = 2_147_483_647
UINT64_MAX = 18_446_744_073_709_551_615


#: a ``\\uD800``-``\\uDFFF`` escape: a surrogate, which is only valid as half of a pair
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF][0-9a-fA-F]{2}")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object (no lone surrogates, bounded nesting)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError("request body is nested too deeply", status=422, field="body") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}", status=422, field="body") from exc
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", status=422, field="body")
    if has_lone_surrogate(raw, body):
        raise RequestError("request body holds a lone UTF-16 surrogate (\\ud800-\\udfff escape without its pair); "
                           "strings must be valid Unicode", status=422, field="body")
    return body


def has_lone_surrogate(raw: bytes, value: Any) -> bool:
    """True when JSON text ``raw``, decoded as ``value``, holds a lone surrogate escape."""
    return bool(_SURROGATE_ESCAPE.search(raw)) and not _valid_unicode_or_too_deep(value)


def _valid_unicode_or_too_deep(value: Any) -> bool:
    try:
        return _valid_unicode(value)
    except RecursionError:
        raise RequestError("request body is nested too deeply", status=422, field="body") from None


def _valid_unicode(value: Any) -> bool:
    """True when no string in ``value`` (keys included) holds a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_valid_unicode(k) and _valid_unicode(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_valid_unicode(v) for v in value)
    return True


def _fmt_range(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    return f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"


def _range_check(name: str, value: float, lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> None:
    bad = (
        (lo is not None and (value < lo or (lo_open and value == lo)))
        or (hi is not None and (value > hi or (hi_open and value == hi)))
    )
    if bad:
        raise RequestError(
            f"{name} must be in {_fmt_range(lo, hi, lo_open, hi_open)}, got {value!r}", field=name
        )


class Fields:
    """Reads fields out of one JSON object, remembering which were sent.

    ``prefix`` is prepended to field names in error messages (``parameters.top_k``).
    ``nullable`` makes an explicit ``null`` mean "not sent" (the vLLM-style APIs).
    """

    def __init__(self, data: Any, prefix: str = "", nullable: bool = False) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise RequestError(f"{prefix.rstrip('.') or 'body'} must be a JSON object", field=prefix.rstrip(".") or "body")
        self.data = data
        self.prefix = prefix
        self.nullable = nullable
        self.sent: set[str] = set()

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def _raw(self, key: str) -> Any:
        value = self.data.get(key, _MISSING)
        if value is None and self.nullable:
            return _MISSING
        if value is not _MISSING:
            self.sent.add(key)
        return value

    def has(self, key: str) -> bool:
        return self._raw(key) is not _MISSING

    def bool(self, key: str, default: bool | None = None) -> bool | None:
        v = self._raw(key)
        if v is _MISSING:
            return default
        if not isinstance(v, bool):
            raise RequestError(f"{self.name(key)} must be a boolean, got {v!r}", field=self.name(key))
        return v

    def int(
        self, key: str, default: int | None = None, *, lo: int | None = None, hi: int | None = None,
        lo_open: bool = False, hi_open: bool = False, allow: tuple[int, ...] = (),
    ) -> int | None:
        v = self._raw(key)
        if v is _MISSING:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise RequestError(f"{self.name(key)} must be an integer, got {v!r}", field=self.name(key))
        if v in allow:
            return v
        try:
            _range_check(self.name(key), v, lo, hi, lo_open, hi_open)
        except RequestError as exc:
            if allow:
                exc.message = f"{exc.message} (or one of {list(allow)})"
                exc.args = (exc.message,)
            raise
        return v

    def float(
        self, key: str, default: float | None = None, *, lo: float | None = None, hi: float | None = None,
        lo_open: bool = False, hi_open: bool = False,
    ) -> float | None:
        v = self._raw(key)
        if v is _MISSING:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RequestError(f"{self.name(key)} must be a number, got {v!r}", field=self.name(key))
        _range_check(self.name(key), float(v), lo, hi, lo_open, hi_open)
        return float(v)

    def str(self, key: str, default: str | None = None, *, min_len: int = 0, max_len: int | None = None) -> str | None:
        v = self._raw(key)
        if v is _MISSING:
            return default
        if not isinstance(v, str):
            raise RequestError(f"{self.name(key)} must be a string, got {type(v).__name__}", field=self.name(key))
        if len(v) < min_len or (max_len is not None and len(v) > max_len):
            raise RequestError(
                f"{self.name(key)} length must be in [{min_len}, {max_len if max_len is not None else 'inf'}], "
                f"got {len(v)}",
                field=self.name(key),
            )
        return v

    def choice(self, key: str, choices: tuple[str, ...], default: str | None = None) -> str | None:
        v = self.str(key, default)
        if v is not None and v not in choices:
            raise RequestError(f"{self.name(key)} must be one of {list(choices)}, got {v!r}", field=self.name(key))
        return v

    def raw(self, key: str, default: Any = None) -> Any:
        v = self._raw(key)
        return default if v is _MISSING else v

    def stop_list(self, key: str, *, max_items: int | None, item_max: int | None, total_max: int,
                  str_max: int) -> list[str]:
        """``stop``: a string or a list of strings, with per-item and total length limits."""
        v = self._raw(key)
        if v is _MISSING:
            return []
        name = self.name(key)
        if isinstance(v, str):
            if not 1 <= len(v) <= str_max:
                raise RequestError(f"{name} string length must be in [1, {str_max}], got {len(v)}", field=name)
            return [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise RequestError(f"{name} must be a string or a list of strings", field=name)
        if max_items is not None and len(v) > max_items:
            raise RequestError(f"{name} may hold at most {max_items} strings, got {len(v)}", field=name)
        for i, s in enumerate(v):
            if len(s) < 1 or (item_max is not None and len(s) > item_max):
                raise RequestError(
                    f"{name}[{i}] length must be in [1, {item_max or 'inf'}], got {len(s)}", field=f"{name}[{i}]"
                )
        total = sum(len(s) for s in v)
        if total > total_max:
            raise RequestError(f"{name} total length must be at most {total_max}, got {total}", field=name)
        return list(v)

    def int_list(self, key: str, *, lo: int = -(2**31), hi: int = INT32_MAX, drop_out_of_range: bool = True,
                 allow_null_items: bool = True) -> list[int]:
        """A list of int32 (``stop_token_ids``); out-of-range items are dropped as the spec says."""
        v = self._raw(key)
        if v is _MISSING:
            return []
        name = self.name(key)
        if not isinstance(v, list):
            raise RequestError(f"{name} must be a list of integers", field=name)
        out = []
        for i, item in enumerate(v):
            if item is None and allow_null_items:
                continue
            if isinstance(item, bool) or not isinstance(item, int):
                raise RequestError(f"{name}[{i}] must be an integer, got {item!r}", field=f"{name}[{i}]")
            if lo <= item <= hi:
                out.append(item)
            elif not drop_out_of_range:
                raise RequestError(f"{name}[{i}] must be in [{lo}, {hi}], got {item}", field=f"{name}[{i}]")
        return out


def check_seed(fields: Fields, key: str = "seed", *, zero_allowed: bool = True) -> int | None:
    """A uint64 seed: [0, 2^64-1] (OpenAI) or (0, 2^64-1] (TGI, vLLM, Triton)."""
    return fields.int(key, None, lo=0, hi=UINT64_MAX, lo_open=not zero_allowed)


def check_fan_out(max_batch_size: int, prompts: int, n: int, field: str = "n") -> None:
    """One request may make at most ``maxBatchSize`` sequences: ``prompts x n <= maxBatchSize`` (422 otherwise).

    Checked before anything is tokenized or queued, so one request cannot flood the
    queue ahead of everyone else's.
    """
    if prompts * n > max_batch_size:
        raise RequestError(
            f"{field}: this request asks for {prompts} prompt(s) x {n} = {prompts * n} sequences; one request may "
            f"make at most {max_batch_size} (ScheduleConfig.maxBatchSize): prompts x n must be in [1, "
            f"{max_batch_size}]",
            field=field,
        )


def check_text_size(text: str, field: str, limit_bytes: int = 4 * 1024 * 1024) -> None:
    """The spec's 4 MB text limit (and non-empty)."""
    if not text:
        raise RequestError(f"{field} must not be empty", field=field)
    if len(text) > limit_bytes:
        raise RequestError(f"{field} must be at most {limit_bytes} characters (4 MB), got {len(text)}", field=field)
