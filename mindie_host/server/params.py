"""Sampling parameters from request fields, following the spec's do_sample rules (§4.1).

* ``do_sample`` true: sample; false: greedy.
* ``do_sample`` absent: ``temperature == 0`` is greedy; otherwise any of
  ``temperature``, ``top_k`` or ``top_p`` sent turns sampling on (the rest come
  from defaults); none of them sent is greedy.

Defaults for parameters not sent come from ``ModelConfig`` (our extension keys
``temperature``, ``top_k`` ...), then the model's ``generation_config.json``,
then the spec's 1.0.RC2 table (temperature 1.0, top_k 0, top_p 1.0, penalties off).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine.request import RequestError, SamplingParams
from ..host_state import CacheSlot

if TYPE_CHECKING:
    from ..host_protocol import Host

SAMPLING_KEYS = ("temperature", "top_k", "top_p")
SPEC_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "typical_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


#: the model's generation_config.json sampling defaults, per host
SAMPLING_DEFAULTS: CacheSlot[dict[str, Any]] = CacheSlot("the model's sampling defaults")


def model_defaults(host: Host) -> dict[str, Any]:
    """Sampling defaults of the served model (cached on the host)."""
    return host.caches.get_or_make(SAMPLING_DEFAULTS, lambda: _read_defaults(host))


def _read_defaults(host: Host) -> dict[str, Any]:
    defaults = dict(SPEC_DEFAULTS)
    weight_path = host.model_config.modelWeightPath
    gen = Path(weight_path) / "generation_config.json" if weight_path else None
    if gen is not None and gen.is_file():
        try:
            data = json.loads(gen.read_text())
            defaults.update({k: data[k] for k in SPEC_DEFAULTS if data.get(k) is not None})
        except (OSError, ValueError):
            pass
    for key in SPEC_DEFAULTS:
        value = getattr(host.model_config, key, None)
        if value is not None:
            defaults[key] = value
    return defaults


def build_sampling(host: Host, values: dict[str, Any], do_sample: bool | None = None, **extra: Any) -> SamplingParams:
    """Make :class:`SamplingParams` from validated request values (only the keys that were sent)."""
    values = {k: v for k, v in values.items() if v is not None}
    if do_sample is None:
        if values.get("temperature") == 0:
            sample = False
        elif any(k in values for k in SAMPLING_KEYS):
            sample = True
        else:  # the request says nothing: ModelConfig.do_sample when set, else greedy
            sample = bool(host.model_config.do_sample)
    else:
        sample = do_sample
    merged = {**model_defaults(host), **values}
    if merged.get("top_k", 0) < 0:  # vLLM's -1 means "off"
        merged["top_k"] = 0
    params = SamplingParams(
        do_sample=sample and merged["temperature"] > 0,
        temperature=float(merged["temperature"]),
        top_k=int(merged["top_k"]),
        top_p=float(merged["top_p"]),
        typical_p=float(merged["typical_p"]),
        min_p=float(merged["min_p"]),
        repetition_penalty=float(merged["repetition_penalty"]),
        presence_penalty=float(merged["presence_penalty"]),
        frequency_penalty=float(merged["frequency_penalty"]),
    )
    check_stop_token_ids(host, extra.get("stop_token_ids"))
    for key, value in extra.items():
        if value is not None:
            setattr(params, key, value)
    return params


def copy_sampling(params: SamplingParams, seed_offset: int = 0) -> SamplingParams:
    """An independent copy for a sibling choice (OpenAI ``n``, TGI ``best_of``): the one place a
    sibling's seed is derived (the request's seed shifted by the choice's index)."""
    copy = replace(params, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids))
    if seed_offset and copy.seed is not None:
        copy.seed = (copy.seed + seed_offset) & 0xFFFF_FFFF_FFFF_FFFF or 1
    return copy


def check_stop_token_ids(host: Host, ids: list[int] | None, field: str = "stop_token_ids") -> None:
    """Stop token ids must be in the model's vocabulary: an id the model can never emit is refused (422)."""
    info = getattr(host, "info", None)
    if not ids or info is None:
        return
    vocab = info.vocab_size
    for i, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise RequestError(
                f"{field}[{i}] must be a token id in [0, {vocab - 1}] (the model's vocabulary), got {token}",
                field=f"{field}[{i}]",
            )
