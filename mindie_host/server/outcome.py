"""What a finished engine request means on the wire: the one place for finish reasons and failure statuses.

The engine ends a request with ``finish_reason`` ``"stop"`` (end-of-sequence, a stop
string or a stop token id), ``"length"``, ``"abort"``, ``"timeout"`` or ``"error"``.
Every protocol module asks this module what that becomes:

* :func:`failure`: ``"error"`` and ``"timeout"`` are failures, answered with 500 and 408
  (a stream gets a final error event in its protocol's format);
* :func:`finish_reason`: the protocol's own spelling of the others (:data:`SPELLINGS`).
"""

from __future__ import annotations

from ..engine.request import RequestError, RequestOutput

#: engine finish reasons that fail the request, with their HTTP status and default message
FAILURES: dict[str, tuple[int, str]] = {
    "error": (500, "generation failed"),
    "timeout": (408, "request timed out"),
}

#: each protocol family's word for how a request ended: (length, end-of-sequence, stop string/token, abort)
SPELLINGS: dict[str, dict[str, str]] = {
    # OpenAI (and the vLLM server's OpenAI-style routes): "stop" for every stop, aborts included
    "openai": {"length": "length", "eos": "stop", "stop": "stop", "abort": "stop"},
    # TGI, the MindIE native routes and Triton's generate extension share TGI's words
    "tgi": {"length": "length", "eos": "eos_token", "stop": "stop_sequence", "abort": "stop_sequence"},
}


def failure(out: RequestOutput) -> RequestError | None:
    """The error a failed output (engine error or timeout) stands for, else ``None``."""
    failed = FAILURES.get(out.finish_reason or "")
    if failed is None:
        return None
    status, message = failed
    return RequestError(out.error or message, status=out.error_status or status)


def raise_for_failure(out: RequestOutput) -> None:
    """Raise :func:`failure`'s error, if any."""
    err = failure(out)
    if err is not None:
        raise err


def finish_reason(out: RequestOutput, family: str = "openai") -> str:
    """``out``'s finish reason in protocol family ``family`` (``"openai"`` or ``"tgi"``)."""
    words = SPELLINGS[family]
    reason = out.finish_reason
    if reason == "stop" and out.stop_reason is None:
        return words["eos"]
    return words.get(reason or "stop", words["stop"])
