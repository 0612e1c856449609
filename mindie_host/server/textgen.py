"""What the TGI, vLLM and MindIE-native protocol modules share.

* :func:`parse_tgi_parameters`: the TGI-style ``parameters`` object (TGI 0.9.4
  and MindIE ``/infer``, ``/infer_token``) with the spec's ranges;
* prompt inputs (text or a list of text parts), adapter checks, finish reasons;
* :func:`primed`: start a generation before the HTTP response begins, so errors
  found at submission (busy id, server not ready) still get a proper status;
* :func:`pick_generate_protocol`: the ``POST /generate`` dispatch rule shared by
  TGI and vLLM (``inputs`` means TGI, ``prompt`` means vLLM).

This module has no hook implementations.
"""

from __future__ import annotations

import random
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..content import MEDIA_TYPES, media_text
from ..engine.request import EngineRequest, RequestError, RequestOutput, SamplingParams
from ..host_state import CacheSlot
from .outcome import failure, finish_reason
from .params import build_sampling
from .validation import INT32_MAX, Fields, check_seed, check_text_size

if TYPE_CHECKING:
    from ..host_protocol import Host

#: TGI's ``adapter_id`` charset and length (spec §1.3).
ADAPTER_ID_RE = re.compile(r"^[A-Za-z0-9._/-]{1,256}$")
#: The most sequences one ``best_of`` request may sample (our limit; the spec has no best_of).
MAX_BEST_OF = 16
#: The most alternatives ``top_n_tokens`` may ask for per step.
MAX_TOP_N_TOKENS = 20
#: Request ids given by clients (``id``): non-empty, at most 256 characters.
MAX_ID_LEN = 256


@dataclass
class TextGenParams:
    """A parsed TGI-style ``parameters`` object."""

    sampling: SamplingParams
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool = False
    truncate: int | None = None
    best_of: int = 1
    top_n_tokens: int = 0
    adapter_id: str | None = None
    priority: int = 3
    timeout: float | None = None
    seed_given: bool = False


def random_seed() -> int:
    """A seed for requests that did not send one, reported back in ``details.seed``."""
    return random.randint(1, (1 << 63) - 1)


def parse_tgi_parameters(host: Host, raw: Any, *, native: bool = False, prefix: str = "parameters.") -> TextGenParams:
    """Validate a TGI-style ``parameters`` object (``null`` means "not sent").

    ``native`` selects the MindIE ``/infer`` table (adds ``priority`` and
    ``timeout``; no ``stop``, ``truncate``, ``adapter_id``, ``best_of``...).
    Unknown keys are ignored, as TGI does.
    """
    f = Fields(raw, prefix, nullable=True)
    values = {
        "temperature": f.float("temperature", lo=1e-6, lo_open=True),
        "top_k": f.int("top_k", lo=0, hi=INT32_MAX, lo_open=True),
        "top_p": f.float("top_p", lo=1e-6, hi=1.0, lo_open=True, hi_open=True),
        "typical_p": f.float("typical_p", lo=0.0, hi=1.0, lo_open=True),
        "repetition_penalty": f.float("repetition_penalty", lo=0.0, lo_open=True),
    }
    do_sample = f.bool("do_sample", None)
    max_new_tokens = f.int("max_new_tokens", 20, lo=0, hi=INT32_MAX, lo_open=True)
    seed = check_seed(f, "seed", zero_allowed=False)
    f.bool("watermark", False)  # accepted, not supported (spec)
    details = bool(f.bool("details", False))
    out = TextGenParams(sampling=SamplingParams(), details=details, seed_given=seed is not None)
    stop: list[str] = []
    if native:
        out.priority = f.int("priority", 5, lo=1, hi=5) or 5
        timeout = f.int("timeout", None, lo=0, hi=3600, lo_open=True)
        out.timeout = float(timeout) if timeout is not None else None
    else:
        values["frequency_penalty"] = f.float("frequency_penalty", lo=-2.0, hi=2.0)
        stop = f.stop_list("stop", max_items=1024, item_max=1024, total_max=32768, str_max=1024)
        out.decoder_input_details = bool(f.bool("decoder_input_details", False))
        out.return_full_text = bool(f.bool("return_full_text", False))
        out.truncate = f.int("truncate", None, lo=0, hi=INT32_MAX, lo_open=True)
        out.best_of = f.int("best_of", 1, lo=1, hi=MAX_BEST_OF) or 1
        out.top_n_tokens = f.int("top_n_tokens", 0, lo=0, hi=MAX_TOP_N_TOKENS) or 0
        adapter = f.str("adapter_id", "None")
        if adapter is not None and not ADAPTER_ID_RE.match(adapter):
            raise RequestError(
                f"{f.name('adapter_id')} must be 1-256 characters of [A-Za-z0-9._/-], got {adapter!r}",
                field=f.name("adapter_id"),
            )
        out.adapter_id = adapter
        if f.raw("grammar") is not None:
            raise RequestError(f"{f.name('grammar')} is not supported", field=f.name("grammar"))
    out.sampling = build_sampling(
        host,
        values,
        do_sample,
        seed=seed if seed is not None else random_seed(),
        max_tokens=max_new_tokens,
        stop=stop,
        logprobs=None if native else out.top_n_tokens,
    )
    if out.best_of > 1 and out.sampling.greedy:
        raise RequestError(
            f"{f.name('best_of')} > 1 needs sampling: set do_sample true (or temperature/top_k/top_p)",
            field=f.name("best_of"),
        )
    return out


def text_input(value: Any, field: str) -> str:
    """A prompt given as a string, or as a list of ``{"type": "text", "text": ...}`` parts (text-only model)."""
    if isinstance(value, str):
        check_text_size(value, field)
        return value
    if isinstance(value, list) and value:
        parts = []
        for i, item in enumerate(value):
            name = f"{field}[{i}]"
            if not isinstance(item, dict):
                raise RequestError(f"{name} must be an object", field=name)
            kind = item.get("type", "text")
            if kind in MEDIA_TYPES:  # a plugin's placeholder text, or a 422 (mindie_host.content)
                parts.append(media_text(kind, item, name))
                continue
            if kind != "text":
                raise RequestError(f"{name}.type {kind!r} is not supported by this text-only model", field=f"{name}.type")
            text = item.get("text")
            if not isinstance(text, str) or not text:
                raise RequestError(f"{name}.text must be a non-empty string", field=f"{name}.text")
            parts.append(text)
        joined = "".join(parts)
        check_text_size(joined, field)
        return joined
    if value is None:
        raise RequestError(f"{field} is required", field=field)
    raise RequestError(f"{field} must be a non-empty string or a list of text parts", field=field)


def client_id(body: dict[str, Any], key: str = "id") -> str | None:
    """An optional client-given request id (used as the engine request id, so ``stopInfer`` can find it)."""
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_ID_LEN:
        raise RequestError(f"{key} must be a string of 1-{MAX_ID_LEN} characters", field=key)
    return value


def check_adapter(host: Host, req: EngineRequest, adapter: str | None, field: str) -> None:
    """404 when an adapter was named but no plugin resolved it (``"None"`` or the base model mean none).

    A plugin that resolves it puts its own entry in ``req.extensions`` (or a variant in ``req.variant``).
    """
    if adapter in (None, "None", host.model_name) or req.variant >= 0 or req.extensions:
        return
    raise RequestError(
        f"adapter {adapter!r} is not loaded (served: {host.served_model_names})", status=404, field=field
    )


def tgi_finish_reason(out: RequestOutput) -> str:
    """TGI/MindIE finish reasons: ``length``, ``eos_token``, ``stop_sequence`` (also for a stopped request)."""
    return finish_reason(out, "tgi")


#: the tokenizer's special token ids, per host
SPECIAL_IDS: CacheSlot[set[int]] = CacheSlot("special token ids")


def special_ids(host: Host) -> set[int]:
    """The tokenizer's special token ids (cached on the host)."""
    return host.caches.get_or_make(SPECIAL_IDS, lambda: _special_ids(host))


def _special_ids(host: Host) -> set[int]:
    ids = set(getattr(host.tokenizer, "all_special_ids", []) or [])
    if host.info is not None:
        ids.update(host.info.eos_token_ids)
    return ids


def eos_id(host: Host) -> int:
    """The model's first end-of-sequence id (the token shown on a stream's closing event)."""
    if host.info is not None and host.info.eos_token_ids:
        return host.info.eos_token_ids[0]
    return int(getattr(host.tokenizer, "eos_token_id", 0) or 0)


def closing_token_id(host: Host, out: RequestOutput) -> int:
    """Token id for a final event that brought no new token: EOS, or the last generated token."""
    if out.finish_reason == "stop" and out.stop_reason is None:
        return eos_id(host)
    if isinstance(out.stop_reason, int):
        return out.stop_reason
    return out.token_ids[-1] if out.token_ids else eos_id(host)




async def primed(gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """Wait for ``gen``'s first output, then return an iterator over all of it.

    Errors raised at submission, or a failed first output, surface here (before a
    streamed response starts) as :class:`RequestError`;
    closing the returned iterator closes ``gen``, which aborts the request.
    """
    first = await gen.__anext__()
    err = failure(first)
    if err is not None:  # failed at once (e.g. the engine refused it): answer with an HTTP error
        await gen.aclose()  # type: ignore[attr-defined]
        raise err

    async def rest() -> AsyncIterator[RequestOutput]:
        try:
            yield first
            async for item in gen:
                yield item
        finally:
            await gen.aclose()  # type: ignore[attr-defined]

    return rest()


def pick_generate_protocol(body: dict[str, Any]) -> str:
    """``POST /generate`` is shared: ``inputs`` means TGI, ``prompt`` means vLLM; both or neither is a 422."""
    has_inputs, has_prompt = "inputs" in body, "prompt" in body
    if has_inputs and has_prompt:
        raise RequestError(
            "body has both inputs (TGI) and prompt (vLLM); send exactly one of them", field="inputs,prompt"
        )
    if has_inputs:
        return "tgi"
    if has_prompt:
        return "vllm"
    raise RequestError("body needs inputs (TGI) or prompt (vLLM)", field="inputs,prompt")
