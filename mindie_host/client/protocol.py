"""The HTTP mapping of the client API: URLs, request bodies, parameter checks and stream parsing.

Shared by the synchronous and the asyncio client so both send identical requests.
"""

from __future__ import annotations

import json
import os
import ssl
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import numpy as np

from .types import (
    MAX_TOKENS_PER_INPUT,
    Input,
    MindIEClientException,
    RequestedOutput,
    check_model_name,
    check_model_version,
    check_prompt,
    check_request_id,
)

U64_MAX = 2**64 - 1
I32_MAX = 2**31 - 1
U32_MAX = 2**32 - 1

#: (type, low, high, low-inclusive, high-inclusive) per parameter of the text APIs (generate*, chat, stream_self).
TEXT_PARAMS: dict[str, tuple[type, float | None, float | None, bool, bool]] = {
    "seed": (int, 0, U64_MAX, True, True),
    "temperature": (float, 1e-6, 2.0, False, True),
    "top_k": (int, 0, U32_MAX, True, True),
    "top_p": (float, 1e-6, 1.0, False, True),
    "do_sample": (bool, None, None, True, True),
    "repetition_penalty": (float, 0.0, None, False, True),
    "typical_p": (float, 0.0, 1.0, False, True),
    "batch_size": (int, 0, None, False, True),
    "details": (bool, None, None, True, True),
    "max_new_tokens": (int, 0, None, False, True),
}

#: The same for the token API (infer / async_infer), Tables 8-8 and 8-9.
TOKEN_PARAMS: dict[str, tuple[type, float | None, float | None, bool, bool]] = {
    "seed": (int, 0, U64_MAX, False, True),
    "temperature": (float, 1e-6, None, False, True),
    "top_k": (int, 0, I32_MAX, True, True),
    "top_p": (float, 1e-6, 1.0, False, True),
    "do_sample": (bool, None, None, True, True),
    "repetition_penalty": (float, 0.0, None, False, True),
    "max_new_tokens": (int, 0, None, False, True),
}


def check_parameters(parameters: Any, table: dict[str, tuple[type, float | None, float | None, bool, bool]]
                     ) -> dict[str, Any]:
    """Type- and range-check the known keys of ``parameters``; unknown keys pass through unchanged."""
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise MindIEClientException("parameters must be a dict or None")
    for key, value in parameters.items():
        if key not in table or (value is None and key == "seed"):
            continue
        kind, lo, hi, lo_in, hi_in = table[key]
        if kind is bool:
            if not isinstance(value, bool):
                raise MindIEClientException(f"parameters.{key} must be a bool, got {value!r}")
            continue
        ok_type = isinstance(value, int) if kind is int else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok_type:
            raise MindIEClientException(f"parameters.{key} must be {kind.__name__}, got {value!r}")
        low_ok = lo is None or (value >= lo if lo_in else value > lo)
        high_ok = hi is None or (value <= hi if hi_in else value < hi)
        if not (low_ok and high_ok):
            lb = "[" if lo_in else "("
            rb = "]" if hi_in else ")"
            raise MindIEClientException(
                f"parameters.{key}={value!r} is out of range {lb}{lo if lo is not None else '-inf'}, "
                f"{hi if hi is not None else 'inf'}{rb}")
    return dict(parameters)


@dataclass
class Endpoint:
    """Base URLs and TLS settings of one client."""

    base: str
    manage: str

    def health_base(self) -> str:
        """Where health, readiness and slot queries go: the management plane, as in the spec."""
        return self.manage


#: The spec's default management address (``management_url="https://127.0.0.2:1026"``).
DEFAULT_MANAGEMENT_ADDRESS = "127.0.0.2:1026"


def default_management_url(url: str) -> str:
    """The spec's default management address, with ``url``'s scheme (the two must match)."""
    return f"{url.split(':', 1)[0]}://{DEFAULT_MANAGEMENT_ADDRESS}"


def check_url(url: Any, what: str = "url") -> str:
    """``http://IP:Port`` or ``https://IP:Port``; returns it without a trailing slash."""
    if not isinstance(url, str):
        raise MindIEClientException(f"{what} must be a string")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MindIEClientException(f"{what} must look like http://IP:Port or https://IP:Port, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise MindIEClientException(f"{what} has an invalid port: {url!r}") from exc
    return url.rstrip("/")


def model_path(model_name: str, model_version: str, tail: str) -> str:
    """``/v2/models/{m}[/versions/{v}]/{tail}`` (tail may be empty)."""
    check_model_name(model_name)
    check_model_version(model_version)
    path = f"/v2/models/{quote(model_name, safe='')}"
    if model_version:
        path += f"/versions/{quote(model_version, safe='')}"
    return path + (f"/{tail}" if tail else "")


def _check_key_file(path: str) -> None:
    """A private key must not be readable by group or others (spec: cert files <= 600)."""
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise MindIEClientException(f"key file {path} must not be accessible by group/others (chmod 600)")


def build_ssl_context(url: str, enable_ssl: bool, ssl_options: dict[str, Any] | None) -> ssl.SSLContext | bool:
    """The ``verify`` argument for httpx: an SSLContext for https (CA, optional client cert, optional CRL)."""
    if not url.startswith("https://"):
        return True
    if not enable_ssl:
        raise MindIEClientException("url is https:// but enable_ssl is False")
    opts = dict(ssl_options or {})
    unknown = set(opts) - {"ca_certs", "certfile", "keyfile", "crlfile", "keyfile_password"}
    if unknown:
        raise MindIEClientException(f"unknown ssl_options keys: {sorted(unknown)}")
    ca = opts.get("ca_certs")
    if not ca:
        raise MindIEClientException("ssl_options['ca_certs'] is required for https")
    for key in ("ca_certs", "certfile", "keyfile", "crlfile"):
        if opts.get(key) and not os.path.isfile(opts[key]):
            raise MindIEClientException(f"ssl_options[{key!r}]: no such file {opts[key]}")
    try:
        ctx = ssl.create_default_context(cafile=ca)
        certfile, keyfile = opts.get("certfile"), opts.get("keyfile")
        if bool(certfile) != bool(keyfile):
            raise MindIEClientException("ssl_options needs both certfile and keyfile for mutual TLS")
        if certfile and keyfile:
            _check_key_file(keyfile)
            ctx.load_cert_chain(certfile, keyfile, password=opts.get("keyfile_password"))
        if opts.get("crlfile"):
            ctx.load_verify_locations(cafile=opts["crlfile"])
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    except ssl.SSLError as exc:
        raise MindIEClientException(f"TLS setup failed: {exc}") from exc
    return ctx


# -- request bodies ------------------------------------------------------------------------------------
def infer_body(inputs: Any, outputs: Any, request_id: str, parameters: Any) -> dict[str, Any]:
    """The Triton/KServe v2 token-inference body."""
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], Input):
        raise MindIEClientException("inputs must be a list with exactly one Input")
    if outputs is not None and (not isinstance(outputs, list) or len(outputs) > 1
                                or not all(isinstance(o, RequestedOutput) for o in outputs)):
        raise MindIEClientException("outputs must be None or a list with at most one RequestedOutput")
    outs = [o.get_output_tensor() for o in outputs] if outputs else [{"name": "output0"}]
    body: dict[str, Any] = {"id": check_request_id(request_id), "inputs": [inputs[0].get_input_tensor()],
                            "outputs": outs}
    params = check_parameters(parameters, TOKEN_PARAMS)
    if params:
        body["parameters"] = params
    return body


def generate_body(prompt: Any, request_id: str, parameters: Any) -> dict[str, Any]:
    """The Triton generate-extension body ``{"id","text_input","parameters"}``."""
    body: dict[str, Any] = {"id": check_request_id(request_id), "text_input": check_prompt(prompt)}
    params = check_parameters(parameters, TEXT_PARAMS)
    if params:
        body["parameters"] = params
    return body


def token_stream_body(token: Any, parameters: Any) -> dict[str, Any]:
    """MindIE native ``/infer_token`` streaming body from an array of token ids."""
    if not isinstance(token, np.ndarray) or token.size == 0:
        raise MindIEClientException("token must be a non-empty numpy array of token ids")
    if not np.issubdtype(token.dtype, np.integer):
        raise MindIEClientException(f"token must hold integers, got dtype {token.dtype}")
    ids = [int(x) for x in token.reshape(-1)]
    if len(ids) > MAX_TOKENS_PER_INPUT * 64 or min(ids) < 0:
        raise MindIEClientException("token ids must be >= 0")
    params = check_parameters(parameters, TEXT_PARAMS)
    body: dict[str, Any] = {"input_id": ids, "stream": True}
    if params:
        body["parameters"] = params
    return body


_CHAT_DROP = {"details", "batch_size", "do_sample", "typical_p", "perf_stat", "watermark", "priority", "timeout"}


def chat_body(model_name: str, prompt: Any, parameters: Any, stream: bool) -> dict[str, Any]:
    """An OpenAI chat body; ``prompt`` is a string (one user turn) or a list of messages.

    ``max_new_tokens`` becomes ``max_tokens``; ``do_sample=False`` without a temperature means greedy
    (``temperature=0``); Triton-only keys (details, batch_size, typical_p, ...) are dropped.
    """
    check_model_name(model_name)
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(m, dict) and "role" in m for m in prompt):
            raise MindIEClientException("prompt as a list must hold chat messages {'role','content'}")
        messages = prompt
    else:
        messages = [{"role": "user", "content": check_prompt(prompt)}]
    params = check_parameters(parameters, TEXT_PARAMS)
    body: dict[str, Any] = {"model": model_name, "messages": messages, "stream": stream}
    if params.get("do_sample") is False and "temperature" not in params:
        body["temperature"] = 0.0
    for key, value in params.items():
        if key == "max_new_tokens":
            body["max_tokens"] = value
        elif key not in _CHAT_DROP:
            body[key] = value
    return body


# -- responses ----------------------------------------------------------------------------------------
def error_text(status: int, content: bytes) -> str:
    """A readable message from an error response (the body's error/message field if JSON)."""
    text = content.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return f"HTTP {status}: {text.strip()[:2000]}"
    if isinstance(data, dict):
        err = data.get("error") or data.get("message") or data.get("error_msg") or data.get("detail")
        if isinstance(err, dict):
            err = err.get("message") or json.dumps(err)
        if err:
            return f"HTTP {status}: {err}"
    return f"HTTP {status}: {text.strip()[:2000]}"


def parse_sse_line(line: str) -> dict[str, Any] | None:
    """One ``data:`` line (with or without a space) as JSON; None for blank lines, comments and [DONE]."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise MindIEClientException(f"malformed stream event: {payload[:200]!r}") from exc
    if isinstance(obj, dict) and obj.get("error") and "text_output" not in obj and "token" not in obj \
            and "choices" not in obj:
        err = obj["error"]
        raise MindIEClientException(f"stream error: {err.get('message') if isinstance(err, dict) else err}")
    return obj if isinstance(obj, dict) else None


def triton_event_detail(event: dict[str, Any]) -> dict[str, Any]:
    """The dict ``generate_stream_with_details`` yields for one Triton stream event."""
    out: dict[str, Any] = {"text_output": event.get("text_output", "")}
    details = event.get("details")
    if isinstance(details, dict):
        out["batch_size"] = details.get("batch_size")
        out["queue_wait_time"] = details.get("queue_wait_time")
        out["generated_tokens"] = details.get("generated_tokens")
        if "finish_reason" in details:
            out["finish_reason"] = details["finish_reason"]
    for key in ("prefill_time", "decode_time"):
        if key in event:
            out[key] = event[key]
    return out


def chat_event_text(event: dict[str, Any]) -> str | None:
    """The content delta of one OpenAI chat stream chunk (None when it carries none)."""
    for choice in event.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            return str(content)
    return None


def chat_response_text(data: Any) -> str:
    """The assistant text of a non-stream chat completion."""
    try:
        return str(data["choices"][0]["message"].get("content") or "")
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise MindIEClientException(f"unexpected chat completion response: {str(data)[:500]}") from exc


class TokenStreamText:
    """Turns native /infer_token stream events into per-step text.

    The last event has ``token.text = null`` and carries ``generated_text``; its text is the part of
    ``generated_text`` not yet yielded.
    """

    def __init__(self) -> None:
        self.seen = ""

    def feed(self, event: dict[str, Any]) -> str | None:
        token = event.get("token") or {}
        text = token.get("text")
        if text is None and event.get("generated_text") is not None:
            full = str(event["generated_text"])
            text = full[len(self.seen):] if full.startswith(self.seen) else ""
        if text is None:
            return None
        self.seen += text
        return text


def iter_events(lines: Iterable[str]) -> Iterable[dict[str, Any]]:
    """Parse every SSE ``data:`` line of an iterable of lines."""
    for line in lines:
        event = parse_sse_line(line)
        if event is not None:
            yield event
