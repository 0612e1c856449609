"""Rotary position embedding settings of Llama-family checkpoints, and the frequencies they give.

``config.json`` states RoPE in one of two forms:

- transformers 5 writes ``rope_parameters: {"rope_type", "rope_theta", ...}``;
- older checkpoints have a top-level ``rope_theta`` and an optional ``rope_scaling: {"type" | "rope_type", ...}``.

:func:`rope_from_config` reads either into one :class:`Rope`. The kinds the Llama family uses are
served: ``default``, ``linear`` (position interpolation), ``dynamic`` (NTK-aware, recomputed from the
sequence's length once it passes ``max_position_embeddings``), ``yarn`` and ``llama3``; a family may allow
``longrope`` (Phi-3: short or long per-frequency factors, by whether the sequence passes
``original_max_position_embeddings``) and a partial rotary embedding (``partial_rotary_factor``: only the first
part of each head rotates). Any other kind is refused at load time
(:class:`~mindie_host.models.weights.ModelLoadError`) instead of being served with the wrong positions. The
arithmetic follows the published methods as transformers implements them, so the same checkpoint gives the same
tokens here and in ``generate``.

Some families give each kind of layer its own RoPE (Gemma 3: ``rope_parameters`` keyed by layer type);
:func:`rope_from_config` reads one of them with ``layer_type``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
#: every kind this module computes (a family names the ones its checkpoints may use)
ALL_ROPE_TYPES = (*SUPPORTED_ROPE_TYPES, "longrope")
#: keys a rope dict may hold that change nothing for the kinds above (transformers writes some of them)
_NEUTRAL_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_KEYS = {
    "default": set(),
    # (transformers ignores original_max_position_embeddings for these two kinds, and so does this server)
    "linear": {"factor", "original_max_position_embeddings"},
    "dynamic": {"factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
    "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
    "longrope": {"factor", "original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"},
}
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": (), "llama3": ("factor",),
             "longrope": ("short_factor", "long_factor")}


class RopeConfigError(ValueError):
    """The checkpoint's RoPE settings are of a kind this server does not serve, or malformed."""


@dataclass
class Rope:
    """One model's rotary embedding: base ``theta``, kind and that kind's parameters."""

    theta: float = 10000.0
    rope_type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)
    #: the model's ``max_position_embeddings`` (dynamic NTK scales from it; yarn/llama3 default to it)
    max_position_embeddings: int = 2048
    #: the share of each head that rotates (the first ``rotary_dim`` values; the rest pass through)
    partial_rotary_factor: float = 1.0

    @property
    def dynamic(self) -> bool:
        """True when the frequencies depend on the sequence's length (dynamic NTK, longrope)."""
        return self.rope_type in ("dynamic", "longrope")

    @property
    def length_threshold(self) -> int:
        """A sequence longer than this gets other frequencies (:attr:`dynamic` kinds only)."""
        if self.rope_type == "longrope":
            return int(self.params.get("original_max_position_embeddings") or self.max_position_embeddings)
        return self.max_position_embeddings

    def rotary_dim(self, head_dim: int) -> int:
        """How many values of each head rotate (even; ``head_dim`` unless the rotation is partial)."""
        return int(head_dim * self.partial_rotary_factor)

    def inv_freq(self, head_dim: int, seq_len: int | None = None) -> np.ndarray:
        """Inverse frequencies (float64, ``rotary_dim // 2``); ``seq_len`` matters for the :attr:`dynamic` kinds."""
        dim = self.rotary_dim(head_dim)
        exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
        base = self.theta
        p = self.params
        if self.rope_type == "dynamic":
            factor = float(p["factor"])
            length = max(seq_len or self.max_position_embeddings, self.max_position_embeddings)
            base = base * ((factor * length / self.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        inv = 1.0 / (base**exponents)
        if self.rope_type == "linear":
            return inv / float(p["factor"])
        if self.rope_type == "llama3":
            return _llama3(inv, p, self.max_position_embeddings)
        if self.rope_type == "yarn":
            return _yarn(inv, dim, base, self._yarn_factor(), p, self.max_position_embeddings)
        if self.rope_type == "longrope":
            long = seq_len is not None and seq_len > self.length_threshold
            factors = np.asarray(p["long_factor" if long else "short_factor"], dtype=np.float64)
            if factors.shape != inv.shape:
                raise RopeConfigError(f"longrope factors have {factors.size} values; the rotary dimension "
                                      f"{dim} needs {inv.size}")
            return inv / factors
        return inv

    def _yarn_factor(self) -> float:
        factor = self.params.get("factor")
        if factor is None:
            original = self.params.get("original_max_position_embeddings") or self.max_position_embeddings
            return self.max_position_embeddings / float(original)
        return float(factor)

    @property
    def attention_scaling(self) -> float:
        """The factor yarn and longrope multiply cos and sin by (1.0 for the other kinds)."""
        if self.rope_type == "longrope":
            return self._longrope_scaling()
        if self.rope_type != "yarn":
            return 1.0
        p = self.params
        if p.get("attention_factor") is not None:
            return float(p["attention_factor"])
        factor = self._yarn_factor()

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if p.get("mscale") and p.get("mscale_all_dim"):
            return mscale(factor, float(p["mscale"])) / mscale(factor, float(p["mscale_all_dim"]))
        return mscale(factor)

    def _longrope_scaling(self) -> float:
        p = self.params
        if p.get("attention_factor") is not None:
            return float(p["attention_factor"])
        original = self.length_threshold
        factor = float(p["factor"]) if p.get("factor") is not None else self.max_position_embeddings / original
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3(inv: np.ndarray, p: dict[str, Any], max_pos: int) -> np.ndarray:
    """Llama 3.1's scaling: long wavelengths divided by ``factor``, short kept, a smooth ramp between."""
    factor = float(p["factor"])
    low = float(p.get("low_freq_factor", 1.0))
    high = float(p.get("high_freq_factor", 4.0))
    old_ctx = float(p.get("original_max_position_embeddings") or max_pos)
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = np.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (1 - smooth) * inv / factor + smooth * inv
    in_band = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return np.where(in_band, mid, scaled)


def _yarn(inv: np.ndarray, dim: int, base: float, factor: float, p: dict[str, Any], max_pos: int) -> np.ndarray:
    """YaRN: interpolate the low frequencies by ``factor``, keep the high ones, ramp linearly between."""
    original = float(p.get("original_max_position_embeddings") or max_pos)
    beta_fast = float(p.get("beta_fast") or 32)
    beta_slow = float(p.get("beta_slow") or 1)

    def dim_for(rotations: float) -> float:  # the dimension that turns ``rotations`` times over ``original``
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # weight of the unscaled (extrapolated) frequency
    return (inv / factor) * (1.0 - keep) + inv * keep


def rope_from_config(cfg: dict[str, Any], layer_type: str | None = None,
                     kinds: tuple[str, ...] = SUPPORTED_ROPE_TYPES, partial: bool = False) -> Rope:
    """The RoPE settings of an HF ``config.json`` dict, in either form; raises :class:`RopeConfigError`.

    ``layer_type`` picks one entry of per-layer-type ``rope_parameters`` (Gemma 3's ``sliding_attention`` /
    ``full_attention``); ``kinds`` are the RoPE kinds the family serves, and ``partial`` whether it rotates
    part of each head (``partial_rotary_factor`` below 1).
    """
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    params = cfg.get("rope_parameters")
    if params is None:  # the older form
        params = dict(cfg.get("rope_scaling") or {})
        if cfg.get("rope_theta") is not None:
            params.setdefault("rope_theta", cfg["rope_theta"])
    elif not isinstance(params, dict):
        raise RopeConfigError(f"rope_parameters must be an object, got {type(params).__name__}")
    else:
        params = dict(params)
        nested = any(isinstance(v, dict) for v in params.values())
        if nested and layer_type is None:
            raise RopeConfigError("per-layer-type rope_parameters are not supported by Llama-family models")
        if nested:
            if not isinstance(params.get(layer_type), dict):
                raise RopeConfigError(f"rope_parameters has no entry for layer type {layer_type!r} (it has "
                                      f"{sorted(params)})")
            params = dict(params[layer_type])
        if "rope_theta" not in params and cfg.get("rope_theta") is not None:
            params["rope_theta"] = cfg["rope_theta"]
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in kinds:
        raise RopeConfigError(f"unsupported rope_type {rope_type!r}; supported: {list(kinds)}")
    prf = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if prf is not None and float(prf) != 1.0 and not partial:
        raise RopeConfigError(f"partial_rotary_factor {prf} is not supported (Llama-family models rotate all of "
                              "each head)")
    if rope_type == "longrope" and cfg.get("original_max_position_embeddings") is not None:
        params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]  # transformers' rule
    unknown = sorted(set(params) - _NEUTRAL_KEYS - _KEYS[rope_type])
    if unknown:
        raise RopeConfigError(f"rope_type {rope_type!r} does not take {unknown}; it takes {sorted(_KEYS[rope_type])}")
    for key in _REQUIRED.get(rope_type, ()):
        if params.get(key) is None:
            raise RopeConfigError(f"rope_type {rope_type!r} needs {key!r}")
    theta = float(params.get("rope_theta") if params.get("rope_theta") is not None else 10000.0)
    extra = {k: v for k, v in params.items() if k not in _NEUTRAL_KEYS}
    return Rope(theta=theta, rope_type=rope_type, params=extra, max_position_embeddings=max_pos,
                partial_rotary_factor=float(prf) if prf is not None else 1.0)


def rope_of(arch: Any, layer_type: str | None = None) -> Rope:
    """The :class:`Rope` of a :class:`~mindie_host.models.weights.ModelArch`: its ``layer_ropes`` entry for
    ``layer_type`` when it has one, else the model's (``rope_theta``, ``rope_scaling``, ``partial_rotary_factor``)."""
    own = getattr(arch, "layer_ropes", {}).get(layer_type) if layer_type is not None else None
    if own is not None:
        return own
    scaling = dict(arch.rope_scaling or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    return Rope(theta=float(arch.rope_theta), rope_type=rope_type, params=scaling,
                max_position_embeddings=int(arch.max_position_embeddings),
                partial_rotary_factor=float(getattr(arch, "partial_rotary_factor", 1.0)))
