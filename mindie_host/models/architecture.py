"""Model families: what a checkpoint's ``config.json`` means, how its tensors are named, how they split.

An :class:`Architecture` is one family (Llama, Qwen3, Gemma 3 ...). A plugin returns the families it provides
from ``mindie_host_model_architectures``; the host's own Llama family is registered the same way
(:mod:`mindie_host.models.llama`). Every backend reads a checkpoint through its family:

* :meth:`Architecture.read_config` turns ``config.json`` into a :class:`ModelArch` (the hyper-parameters every
  layer needs), refusing what the family does not serve instead of ignoring it;
* :meth:`Architecture.tensor_pieces` maps each checkpoint tensor to the *canonical* names the model code uses
  (Llama's Hugging Face names: ``model.layers.3.self_attn.q_proj.weight``), splitting fused tensors
  (Phi-3's ``qkv_proj``) into row ranges and skipping what a text model does not use (a vision tower);
* :meth:`Architecture.adapt` changes a canonical tensor once it is read (GLM's rotary rows, Gemma's norm offset),
  so the shared layers serve every family with one convention;
* :meth:`Architecture.shard` says which slice a tensor-parallel rank reads, by canonical name;
* :meth:`Architecture.build_layer` may give the torch backend a decoder layer of the family's own (a mixture of
  experts, latent attention); ``None`` means the backend's dense layer, whose branch-output norms
  :attr:`Architecture.norms` names.

Nothing here imports torch: the MindSpore backend and the quantizer read checkpoints through the same objects.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .rope import SUPPORTED_ROPE_TYPES, Rope, RopeConfigError, rope_from_config

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


class ModelLoadError(RuntimeError):
    """The model path is missing, unreadable or of an unsupported architecture."""


@dataclass
class ModelArch:
    """The hyper-parameters of a decoder, as its family read them from the checkpoint."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"
    #: the family that serves it (:attr:`Architecture.name`)
    architecture: str = "llama"
    #: each layer's kind (``full_attention``, ``sliding_attention``); empty: every layer attends to everything
    layer_types: list[str] = field(default_factory=list)
    #: how many positions a ``sliding_attention`` layer's token sees (itself included)
    sliding_window: int | None = None
    #: a layer kind's own RoPE when the kinds differ (Gemma 3); the others use ``rope_theta`` / ``rope_scaling``
    layer_ropes: dict[str, Rope] = field(default_factory=dict)
    #: the share of each head that rotates
    partial_rotary_factor: float = 1.0
    #: the gated MLP's activation (``silu``, ``gelu_pytorch_tanh``)
    hidden_act: str = "silu"
    #: the factor on ``q . k`` (None: ``head_dim ** -0.5``)
    attention_scale: float | None = None
    #: the embeddings are multiplied by this (Gemma: ``sqrt(hidden_size)``, in the weights' dtype)
    embedding_multiplier: float = 1.0
    #: logits become ``cap * tanh(logits / cap)`` when set
    final_logit_softcapping: float | None = None
    #: logits are multiplied by this
    logit_scale: float = 1.0
    #: what a family's own layers need beyond the fields above
    options: dict[str, Any] = field(default_factory=dict)

    def layer_type(self, layer: int) -> str:
        """Layer ``layer``'s kind (``full_attention`` when the model has one kind)."""
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    def window(self, layer: int) -> int | None:
        """How many positions layer ``layer``'s tokens see (None: all before them)."""
        return self.sliding_window if self.layer_type(layer) == SLIDING_ATTENTION else None


#: The old name, kept for the plugins and scripts that import it.
LlamaArch = ModelArch


@dataclass(frozen=True)
class Piece:
    """Where (part of) a checkpoint tensor goes: canonical ``name``, from rows ``rows`` (None: all of it)."""

    name: str
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class Norms:
    """The canonical names (after ``model.layers.N.``) of a dense layer's RMSNorms.

    ``attn_in`` and ``mlp_in`` normalize each branch's input; ``attn_out`` and ``mlp_out``, when set, its output
    before the residual add (Gemma's and GLM-4's "sandwich" norms).
    """

    attn_in: str = "input_layernorm"
    mlp_in: str = "post_attention_layernorm"
    attn_out: str | None = None
    mlp_out: str | None = None


class Architecture:
    """A model family. Subclass it, set the class attributes, override what the family does differently.

    The defaults read a Llama-shaped ``config.json`` and take the checkpoint's tensors under their own names.
    """

    #: the family's name (``ModelArch.architecture``, log lines)
    name: str = "llama"
    #: the ``config.json`` ``model_type`` values it serves
    model_types: tuple[str, ...] = ()
    #: the GGUF ``general.architecture`` values (llama.cpp's names) of the files it may read; whether a file is its
    #: own, :meth:`gguf_config` says
    gguf_architectures: tuple[str, ...] = ()
    #: llama.cpp block tensor names -> checkpoint names, where the family's differ from the common ones
    #: (:data:`~mindie_host.models.gguf_files.BLOCK_NAMES`)
    gguf_names: dict[str, str] = {}
    #: whether llama.cpp's converter interleaved each head's Q/K rotary rows (its Llama converter does)
    gguf_rotary_permuted: bool = False
    #: whether a GGUF file's matrices below 16 bits may be served as they are stored (their rows as the family
    #: reads them: not when :meth:`from_gguf` or :meth:`adapt` reorders rows)
    gguf_low_bit: bool = True
    #: the RoPE kinds its checkpoints may use
    rope_kinds: tuple[str, ...] = SUPPORTED_ROPE_TYPES
    #: whether it rotates part of each head (``partial_rotary_factor``)
    partial_rotary: bool = False
    #: the gated MLP's activations it serves
    activations: tuple[str, ...] = ("silu",)
    #: the layer kinds it serves
    layer_kinds: tuple[str, ...] = (FULL_ATTENTION, SLIDING_ATTENTION)
    #: ``attention_bias`` when ``config.json`` does not say
    default_attention_bias: bool = False
    #: the dense layer's norms
    norms: Norms = Norms()
    #: config keys that would change the model but are not served: refused when set to anything but these values
    refused_keys: dict[str, Any] = {"mlp_bias": False}

    # -- config ----------------------------------------------------------------------------------------
    def text_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """The language model's part of ``config.json`` (a multimodal checkpoint nests it in ``text_config``)."""
        return cfg

    def read_config(self, cfg: dict[str, Any], directory: Path | None = None) -> ModelArch:
        """The :class:`ModelArch` of ``config.json``'s dict; raises :class:`ModelLoadError` for what is not served.

        ``directory`` holds ``generation_config.json``, whose ``eos_token_id`` wins over ``config.json``'s.
        """
        top, cfg = cfg, self.text_config(cfg)
        where = f"{directory / 'config.json'}" if directory is not None else "config.json"
        for key, allowed in self.refused_keys.items():
            if cfg.get(key, allowed) not in (allowed, None):
                raise ModelLoadError(
                    f"{where}: {key} {cfg[key]!r} is not supported by the {self.name} family (allowed: {allowed!r})"
                )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        act = str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu")
        if act not in self.activations:
            raise ModelLoadError(
                f"{where}: hidden_act {act!r} is not served for the {self.name} family (allowed: "
                f"{', '.join(self.activations)})"
            )
        layer_types, window = self.read_layer_types(cfg, layers, where)
        try:
            rope = rope_from_config(
                cfg, None if not _nested_rope(cfg) else FULL_ATTENTION, self.rope_kinds, self.partial_rotary
            )
            layer_ropes = (
                {
                    kind: rope_from_config(cfg, kind, self.rope_kinds, self.partial_rotary)
                    for kind in sorted(set(layer_types))
                }
                if _nested_rope(cfg)
                else {}
            )
        except RopeConfigError as exc:
            raise ModelLoadError(f"{where}: {exc}") from exc
        eos = _as_list(cfg.get("eos_token_id", top.get("eos_token_id")))
        if directory is not None and (directory / "generation_config.json").exists():
            eos = _as_list(json.loads((directory / "generation_config.json").read_text()).get("eos_token_id")) or eos
        vocab = int(cfg["vocab_size"])
        return ModelArch(
            model_type=str(top.get("model_type", "llama")),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=vocab,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(top.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
            attention_bias=bool(cfg.get("attention_bias", self.default_attention_bias)),
            rope_scaling={"rope_type": rope.rope_type, **rope.params} if rope.rope_type != "default" else None,
            bos_token_id=cfg.get("bos_token_id", top.get("bos_token_id")),
            eos_token_ids=[e for e in eos if 0 <= e < vocab],
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or top.get("torch_dtype") or "float32"),
            architecture=self.name,
            layer_types=layer_types if window is not None else [],
            sliding_window=window,
            layer_ropes=layer_ropes,
            partial_rotary_factor=rope.partial_rotary_factor,
            hidden_act=act,
        )

    def read_layer_types(self, cfg: dict[str, Any], layers: int, where: str) -> tuple[list[str], int | None]:
        """Each layer's kind and the sliding window, as transformers reads them.

        ``sliding_window`` applies unless ``use_sliding_window`` is false; ``layer_types`` names each layer's kind,
        and without it, with a window, the layers from ``max_window_layers`` on slide (Qwen2's rule; 0: all).
        """
        window = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False:
            window = None
        types = cfg.get("layer_types")
        if types is None:
            start = int(cfg.get("max_window_layers") or 0)
            types = [SLIDING_ATTENTION if window is not None and i >= start else FULL_ATTENTION for i in range(layers)]
        types = [str(t) for t in types]
        if len(types) != layers:
            raise ModelLoadError(f"{where}: layer_types has {len(types)} entries for {layers} layers")
        unknown = sorted(set(types) - set(self.layer_kinds))
        if unknown:
            raise ModelLoadError(
                f"{where}: layer_types {unknown} are not served for the {self.name} family "
                f"(allowed: {', '.join(self.layer_kinds)})"
            )
        if SLIDING_ATTENTION not in types:
            window = None
        if window is not None and int(window) < 1:
            raise ModelLoadError(f"{where}: sliding_window {window} must be at least 1")
        return types, None if window is None else int(window)

    # -- GGUF ------------------------------------------------------------------------------------------
    def gguf_config(self, info: Any) -> dict[str, Any] | None:
        """The ``config.json`` dict that GGUF file ``info`` (a :class:`~mindie_host.models.gguf_files.GGUFInfo` of
        one of :attr:`gguf_architectures`) stands for, or None when the file, by its tensors and metadata, is not
        this family's. The default reads no GGUF file."""
        return None

    def gguf_permuted(self, arch: ModelArch) -> bool:
        """Whether the converter interleaved the Q/K rotary rows of this model's GGUF file."""
        return self.gguf_rotary_permuted

    def from_gguf(self, name: str, array: np.ndarray, arch: ModelArch) -> np.ndarray:
        """Checkpoint tensor ``name`` as a GGUF file holds it (whole, or a rank's slice of whole heads) in the
        checkpoint's own form, undoing what llama.cpp's converter changed; :meth:`adapt` runs after it as for a
        checkpoint. The default un-permutes the Q/K rows when :meth:`gguf_permuted`."""
        if self.gguf_permuted(arch) and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight",
                                                       "k_proj.bias")):
            return unpermute_rows(array, array.shape[0] // arch.head_dim)
        return array

    # -- tensors ---------------------------------------------------------------------------------------
    def tensor_pieces(self, name: str, arch: ModelArch) -> list[Piece]:
        """Where checkpoint tensor ``name`` goes: canonical names with their rows; ``[]`` to skip it."""
        return [Piece(name)]

    def adapt(self, name: str, array: np.ndarray, arch: ModelArch) -> np.ndarray:
        """Canonical tensor ``name`` (a rank's slice of it: whole heads, whole norms) after it is read."""
        return array

    def shard(self, name: str, arch: ModelArch, tp: Any) -> tuple[int, int, int] | None:
        """The slice ``(dim, start, stop)`` of canonical tensor ``name`` that rank ``tp`` (a
        :class:`~mindie_host.distributed.tensor_parallel.TensorParallel`) holds; None: all of it."""
        return tp.slice_of(name, arch)

    def parallel_errors(self, arch: ModelArch, world_size: int, key: str) -> list[str]:
        """Why ``world_size`` ranks cannot split this model beyond what every family checks (heads, KV heads,
        MLP channels); empty when they can."""
        return []

    def expert_parallel_errors(self, arch: ModelArch, world_size: int, key: str) -> list[str]:
        """Why ``world_size`` ranks cannot each hold ``1/world_size`` of this model's routed experts whole
        (``ModelConfig.expertParallel``, :attr:`TensorParallel.expert_parallel
        <mindie_host.distributed.tensor_parallel.TensorParallel.expert_parallel>`), beyond the heads and MLP
        channels every family checks; ``key`` names the config key. The default: the family has no routed experts."""
        return [f"{key}: got true, but the {self.name} family has no routed experts to place on the ranks; "
                "allowed: false"]

    def delta_gaps(self, arch: ModelArch) -> dict[str, dict[int, str]]:
        """Where per-row linear deltas (:class:`~mindie_host.backend_api.LinearDeltas`) do not reach: projection
        (``qkv``, ``o``, ``gate_up``, ``down``) -> {layer: why}. Empty (the default): the dense layer takes them at
        every projection of every layer. The torch backend reports it as ``ModelInfo.extra["delta_gaps"]``, so a
        plugin refuses a variant that would need them there (multi_lora: an adapter's MLP on routed experts)."""
        return {}

    def build_layer(self, index: int, arch: ModelArch, weights: Any) -> Any:
        """The torch backend's decoder layer ``index``, made from this rank's canonical tensors ``weights``
        (:class:`~mindie_host.backend_api.ModelWeights`), or None for the backend's dense layer (pre-norm
        attention over the paged KV cache and a gated MLP, with the norms :attr:`norms` names)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}: {', '.join(self.model_types)}>"


def _nested_rope(cfg: dict[str, Any]) -> bool:
    params = cfg.get("rope_parameters")
    return isinstance(params, dict) and any(isinstance(v, dict) for v in params.values())


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row interleaving of a Q or K projection (weight or bias) of ``n_heads`` heads."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def rename_prefixes(name: str, prefixes: Iterable[tuple[str, str]]) -> str | None:
    """``name`` with the first matching ``(old, new)`` prefix replaced; None when no prefix matches."""
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old) :]
    return None


def split_rows(name: str, suffix: str, parts: list[tuple[str, int]]) -> list[Piece] | None:
    """A fused tensor ``...{suffix}`` as consecutive row ranges, one per ``(canonical suffix, rows)`` in ``parts``;
    None when ``name`` does not end with ``suffix``."""
    if not name.endswith(suffix):
        return None
    stem = name[: -len(suffix)]
    pieces, start = [], 0
    for part, rows in parts:
        pieces.append(Piece(stem + part, (start, start + rows)))
        start += rows
    return pieces


class Architectures:
    """The families the registered plugins provide, by model type; asked of the plugins on first use.

    ``provide`` returns the plugins' answers to ``mindie_host_model_architectures`` (one list per plugin, the
    last-registered plugin first, as pluggy calls them): a later plugin's family wins over a builtin's for the
    same model type.
    """

    def __init__(self, provide: Callable[[], Iterable[Iterable[Architecture] | None]]) -> None:
        self._provide = provide
        self._by_type: dict[str, Architecture] | None = None
        self._families: list[Architecture] = []
        self._lock = threading.RLock()  # a family's hook may itself ask the registry

    def reset(self) -> None:
        """Ask the plugins again on next use (a plugin was registered)."""
        with self._lock:
            self._by_type = None

    def _table(self) -> dict[str, Architecture]:
        with self._lock:
            if self._by_type is None:
                table: dict[str, Architecture] = {}
                families: list[Architecture] = []
                for answer in self._provide():
                    for family in answer or []:
                        if family not in families:
                            families.append(family)
                        for model_type in family.model_types:
                            table.setdefault(model_type, family)
                self._by_type, self._families = table, families
            return self._by_type

    def get(self, model_type: str) -> Architecture | None:
        """The family serving ``model_type``, or None."""
        return self._table().get(model_type)

    def families(self) -> list[Architecture]:
        """Every family once, a later-registered plugin's first (the order a GGUF file's family is asked in)."""
        self._table()
        return list(self._families)

    def gguf_architectures(self) -> list[str]:
        """Every GGUF architecture some family reads, sorted."""
        return sorted({a for family in self.families() for a in family.gguf_architectures})

    def model_types(self) -> list[str]:
        """Every model type some family serves, sorted."""
        return sorted(self._table())

    def __contains__(self, model_type: object) -> bool:
        return model_type in self._table()

    @classmethod
    def of(cls, *families: Architecture) -> Architectures:
        """A fixed set of families (tests, scripts)."""
        return cls(lambda: [list(families)])
