"""Engine-level request, sampling parameters and streamed output.

These are the types a protocol module produces (an :class:`EngineRequest`) and
consumes (a stream of :class:`RequestOutput`). They are part of the public plugin
API and re-exported from :mod:`mindie_host.api`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


class RequestError(Exception):
    """A request the server refuses. Rendered as a 4xx (or 5xx) in the protocol's own error format.

    ``field`` names the offending body field (dotted path) when there is one.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 422,
        field: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.field = field
        self.error_type = error_type or _default_error_type(status)


def _default_error_type(status: int) -> str:
    return {
        400: "Bad Request",
        401: "Unauthorized",
        404: "NotFoundError",
        408: "Timeout",
        413: "Payload Too Large",
        422: "Input Validation Error",
        424: "Generation Error",
        429: "Too Many Requests",
        500: "Incomplete Generation",
        503: "Service Unavailable",
    }.get(status, "Error")


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` or ``do_sample is False`` means greedy search.
    ``top_k == 0`` and ``top_p == 1.0`` switch those filters off.
    """

    temperature: float = 1.0
    do_sample: bool = False
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token plus k top alternatives
    prompt_logprobs: int | None = None  # logprobs of the prompt tokens (TGI decoder_input_details)
    allowed_token_ids: list[int] | None = None  # restrict the next token (constrained decoding)
    #: token id -> value added to its logit before sampling (OpenAI ``logit_bias``); -100 or less bans the token
    logit_bias: dict[int, float] | None = None

    @property
    def greedy(self) -> bool:
        """True when the next token is always the argmax."""
        return (not self.do_sample) or self.temperature <= 0.0

    @property
    def needs_penalties(self) -> bool:
        """True when any repetition, presence or frequency penalty is active."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass
class KVTransfer:
    """Prefill/decode disaggregation (``inferMode: "dmi"``): where this request's KV goes or comes from.

    ``direction`` ``"export"`` (a P instance): compute the prompt and the first token, then hold
    the prompt's KV blocks, offered to a D instance under ``handle`` (the request id), until the
    KV connector says they were taken or the hold expires. ``"import"`` (a D instance): pull the
    KV that P offered as ``handle`` from the connector address ``source``, then decode from the
    first token on.
    """

    direction: str
    source: str = ""
    handle: str = ""


@dataclass
class EngineRequest:
    """One generation request as the engine sees it, whatever protocol it came from.

    ``prompt_token_ids`` is already tokenized. ``cache_salt`` is folded into
    prefix-cache block hashes so requests whose KV differs never share blocks.
    ``variant`` selects a per-row model variant (``-1``: the base model): the
    engine copies it into :attr:`ModelInput.row_variants` every step and the
    backend's linear-delta provider (``mindie_host_linear_deltas``) reads it; a
    plugin that sets it must also salt ``cache_salt``. ``extensions`` is opaque
    per-request data owned by plugins (keyed by plugin name); the engine never reads it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None
    variant: int = -1
    cache_salt: str | None = None
    priority: int = 3
    arrival_time: float = field(default_factory=time.monotonic)
    timeout: float | None = None
    extensions: dict[str, Any] = field(default_factory=dict)
    #: Called by the engine thread to constrain the next token (e.g. JSON for tool calls).
    #: Receives the generated token ids so far, returns allowed token ids or None. When it also has
    #: ``fork()`` (an independent copy at the same point, or None), the request takes speculative
    #: drafts, checked on a fork; without it the request decodes one token a step.
    logits_constraint: Any = None
    #: Plugin-owned per-request payload for the model backend (e.g. the ``multimodal`` plugin's
    #: images); the engine never looks inside, it hands it to the backend with every step that
    #: computes tokens of this request (:attr:`~mindie_host.backends.base.ModelInput.payloads`).
    payload: Any = None
    #: ``(start, end, key)`` token spans whose KV depends on more than their token ids (an
    #: image's placeholder tokens and the image's content hash); a prefix cache mixes ``key``
    #: into the hash of every block overlapping ``[start, end)``.
    span_keys: list[tuple[int, int, bytes]] | None = None
    #: PD disaggregation: export the KV after the first token (P) or import it (D); None: a mixed instance
    kv_transfer: KVTransfer | None = None


@dataclass
class TokenLogprob:
    """Log probability of one token, with its top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """One increment of a request's output, pushed to the protocol module as tokens are made.

    ``text`` and ``token_ids`` are cumulative; ``new_text`` and ``new_token_ids``
    hold only what this increment adds.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | timeout | error
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    #: the HTTP status of a request the engine refused (a plugin's RequestError at arrival); None: 500
    error_status: int | None = None
    seed: int | None = None
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)


def failed_output(request: EngineRequest, error: str | BaseException) -> RequestOutput:
    """The final output of a request the engine did not take or lost: its message, and a refusal's status."""
    status = error.status if isinstance(error, RequestError) else None
    message = error.message if isinstance(error, RequestError) else str(error)
    return RequestOutput(
        request.request_id, [], "", "", [], len(request.prompt_token_ids),
        finished=True, finish_reason="error", error=message, error_status=status,
    )
