"""The layers decoder families share, in plain torch over the paged KV cache.

A decoder layer is a callable ``layer(x, pending, step) -> (x, pending)``: ``x`` is the residual stream and
``pending`` the last branch's output, which the next norm adds to it (so the add and the norm run as one platform
operator, :meth:`~mindie_host.backends.platform.Platform.add_rms_norm`). :class:`DecoderLayer` is the pre-norm layer
of every dense family: :class:`Attention` (fused QKV product, optional per-head q/k RMSNorm, full or partial
rotary, an optional sliding window) and :class:`GatedMLP`, with optional norms on each branch's output. A family
with other blocks (a mixture of experts, latent attention) builds its layers from these classes and its own,
through :meth:`~mindie_host.models.architecture.Architecture.build_layer`; a block only has to take ``(h, step)``
and return its output, complete on every rank (``step.tp`` reduces partial sums), and an attention block to say
its cache's shape (:attr:`Attention.kv_spec`).

Every operator that a platform may fuse goes through :class:`~mindie_host.backends.platform.Platform`, so the
CPU kernels and the Ascend platform serve every family that uses these layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..int8 import Int8Matrix
from .window import windowed_attention

if TYPE_CHECKING:
    from ...distributed.tensor_parallel import TensorParallel
    from ...models.architecture import Architecture, ModelArch
    from ..base import LinearDeltas
    from ..linear import PromptRows
    from ..platform import AttentionMetadata, Platform

#: the activations of a gated MLP, by ``hidden_act`` (``silu`` runs as the platform's fused MLP)
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class KVSpec(NamedTuple):
    """One layer's cache: ``heads`` KV heads of ``k_dim`` key and ``v_dim`` value values per token."""

    heads: int
    k_dim: int
    v_dim: int


@dataclass
class Step:
    """What every layer of one forward step shares."""

    platform: Platform
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    #: each RoPE's ``(cos, sin)`` rows for this step's tokens, ``[T, 1, rotary_dim]``, by the layers' ``rope_key``
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]
    deltas: LinearDeltas | None = None
    prompt_rows: PromptRows | None = None
    tp: TensorParallel | None = None
    #: metadata for attention over a sliding window, by window (made by the first layer that needs it)
    windows: dict[int, AttentionMetadata] = field(default_factory=dict)


class ModelWeights:
    """A model's canonical tensors while its layers are built: each taken once, in the model's dtype and device.

    ``weights`` holds each tensor, or a reader that reads it when it is taken (a float32 array or tensor: a
    streaming loader, :func:`~mindie_host.models.weights.weight_readers`), so a model is read one tensor at a time,
    each turned into the form it is served in before the next is read. ``stored`` says, by name, how the model file
    holds its low-bit matrices (4-bit or 8-bit groups, or a :class:`~mindie_host.models.weights.LowBitReader` of
    them) or which are served in int8 (:class:`~mindie_host.backends.int8.Int8Matrix`); :meth:`linear` hands them to
    the platform, which reads a low-bit matrix's dense values only where it keeps them.
    """

    def __init__(
        self,
        weights: dict[str, Any],
        platform: Platform,
        dtype: torch.dtype,
        stored: dict[str, Any] | None = None,
    ) -> None:
        self.weights = weights
        self.platform = platform
        self.dtype = dtype
        self.device = platform.device()
        self.stored = stored or {}
        #: dense tensors read while preparing a product that a later :meth:`tensor` takes (:meth:`linear` ``keep``)
        self.kept: dict[str, torch.Tensor] = {}

    def has(self, name: str) -> bool:
        """Whether tensor ``name`` is there (and not taken yet)."""
        return name in self.weights or name in self.kept or isinstance(self.stored.get(name), Int8Matrix)

    def tensor(self, name: str) -> torch.Tensor:
        """Take tensor ``name``, in the model's dtype on its device."""
        if name in self.kept:
            self.weights.pop(name, None)
            return self.kept.pop(name)
        if name not in self.weights:
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        value = self.weights.pop(name)
        if callable(value):
            value = value()
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(np.require(value, requirements="W"))  # GGUF floats are read-only maps
        return value.to(device=self.device, dtype=self.dtype).contiguous()

    def drop(self, name: str) -> None:
        """Take tensor ``name`` (if the checkpoint has it) without reading it: nothing serves it."""
        self.weights.pop(name, None)
        self.kept.pop(name, None)
        self.stored.pop(name, None)

    def optional(self, name: str) -> torch.Tensor | None:
        """Take tensor ``name`` if the checkpoint has it."""
        return self.tensor(name) if name in self.weights or name in self.kept else None

    def biases(self, *names: str) -> torch.Tensor | None:
        """The biases ``names`` stacked (a fused product's), or None when the checkpoint has none of them."""
        present = [n for n in names if n in self.weights]
        if not present:
            return None
        if len(present) != len(names):
            raise KeyError(f"the checkpoint has {present} but not {sorted(set(names) - set(present))}")
        return torch.cat([self.tensor(n) for n in names]) if len(names) > 1 else self.tensor(names[0])

    def low_bit_bytes(self) -> int:
        """What bfloat16 copies of every low-bit matrix would take (2 bytes a weight)."""
        from ...models.weights import EightBitGroups, FourBitGroups, LowBitReader

        total = 0
        for form in self.stored.values():
            if isinstance(form, LowBitReader):
                total += 2 * form.rows * form.cols
            elif isinstance(form, FourBitGroups | EightBitGroups):
                total += 2 * form.codes.size
        return total

    def low_bit(self, *names: str) -> Any:
        """Take the low-bit forms of ``names`` stacked by rows (read now), or None unless all have one of one kind."""
        from ...models.weights import EightBitGroups, FourBitGroups, LowBitReader

        if not all(n in self.stored and not isinstance(self.stored[n], Int8Matrix) for n in names):
            return None
        def kind(f: Any) -> tuple[str, int]:
            return (f.kind if isinstance(f, LowBitReader) else "int4" if isinstance(f, FourBitGroups) else "int8",
                    f.group_size)

        if len({kind(self.stored[n]) for n in names}) > 1:  # (stacked matrices share one kind and group size: Q8_0 beside Q6_K does not stack)
            return None
        forms = []
        for n in names:  # one at a time: each read's temporaries go before the next
            form = self.stored.pop(n)
            forms.append(form() if isinstance(form, LowBitReader) else form)
        if all(isinstance(f, FourBitGroups) for f in forms):
            return FourBitGroups.concat(forms) if len(forms) > 1 else forms[0]
        if all(isinstance(f, EightBitGroups) for f in forms):
            return EightBitGroups.concat(forms) if len(forms) > 1 else forms[0]
        return None

    def linear(self, *names: str, keep: bool = False) -> Any:
        """One prepared product for these ``[out, in]`` matrices stacked by rows (fused QKV, gate and up).

        A matrix the file holds low-bit is handed to the platform with its dense values unread
        (:class:`~mindie_host.backends.linear.LazyDense`): they are read only if the platform keeps them. ``keep``
        (one name) leaves a dense tensor read here for a later :meth:`tensor` (a tied embedding), and the name
        untaken when nothing read it."""
        int8 = [self.stored.get(n) for n in names]
        if all(isinstance(m, Int8Matrix) for m in int8):  # the w8a16 / w8a8 schemes
            for n in names:
                self.stored.pop(n)
            matrix = Int8Matrix.concat(int8) if len(int8) > 1 else int8[0]  # type: ignore[arg-type]
            return self.platform.prepare_int8(matrix, self.dtype)  # type: ignore[arg-type]
        from ..linear import LazyDense

        def dense() -> torch.Tensor:
            out = (torch.cat([self.tensor(n) for n in names]) if len(names) > 1 else self.tensor(names[0])).contiguous()
            if keep:
                self.kept[names[0]] = out
            return out

        form = self.low_bit(*names)
        if form is None:
            return self.platform.prepare_linear(dense(), None)
        lazy = LazyDense(dense, self.dtype)
        prepared = self.platform.prepare_linear(lazy, form)
        if not lazy.read and not keep:
            for n in names:
                self.weights.pop(n, None)  # served from the low-bit form alone: never read
        return prepared

    def left(self) -> list[str]:
        """Names of the tensors no layer took."""
        return sorted(set(self.weights) | set(self.kept)
                      | {n for n, m in self.stored.items() if isinstance(m, Int8Matrix)})


class Attention:
    """Self-attention of one layer over the paged KV cache.

    One fused Q/K/V product (with its bias when the checkpoint has one), an optional RMSNorm of each query and key
    head (``q_norm`` / ``k_norm``: Qwen3, Gemma 3), rotary embedding of the first ``rotary_dim`` values of each head
    with the tables ``rope_key`` names, the new keys and values written to the cache, attention over the cached
    context (only its last ``window`` positions when set), and the output product (row-parallel under tensor
    parallelism: reduced over the ranks, its bias added once).
    """

    def __init__(
        self,
        *,
        layer: int,
        qkv: Any,
        o_proj: Any,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        qkv_bias: torch.Tensor | None = None,
        o_bias: torch.Tensor | None = None,
        rope_key: str = "",
        rotary_dim: int | None = None,
        window: int | None = None,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        norm_eps: float = 1e-6,
    ) -> None:
        self.layer = layer
        self.qkv, self.qkv_bias, self.o_proj, self.o_bias = qkv, qkv_bias, o_proj, o_bias
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = scale
        self.rope_key = rope_key
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.window = window
        self.q_norm, self.k_norm, self.norm_eps = q_norm, k_norm, norm_eps

    @property
    def kv_spec(self) -> KVSpec:
        """The shape of this layer's cache."""
        return KVSpec(self.num_kv_heads, self.head_dim, self.head_dim)

    def __call__(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        plat, n, d = step.platform, h.shape[0], self.head_dim
        qkv = plat.linear(h, self.qkv, self.qkv_bias, step.prompt_rows)
        if step.deltas is not None:
            qkv = step.deltas.apply("qkv", self.layer, h, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, d)
        k = k.view(n, self.num_kv_heads, d)
        v = v.view(n, self.num_kv_heads, d)
        if self.q_norm is not None:
            q = plat.rms_norm(q.reshape(-1, d), self.q_norm, self.norm_eps).view(n, self.num_heads, d)
        if self.k_norm is not None:
            k = plat.rms_norm(k.reshape(-1, d), self.k_norm, self.norm_eps).view(n, self.num_kv_heads, d)
        cos, sin = step.rope[self.rope_key]
        if self.rotary_dim == d:
            q, k = plat.rotary(q, k, cos, sin)
        else:  # partial: the first rotary_dim values of each head rotate, the rest pass through
            rd = self.rotary_dim
            qr, kr = plat.rotary(q[..., :rd], k[..., :rd], cos, sin)
            q, k = torch.cat([qr, q[..., rd:]], dim=-1), torch.cat([kr, k[..., rd:]], dim=-1)
        k_cache, v_cache = step.kv_caches[self.layer]
        plat.write_kv(k_cache, v_cache, k, v, step.meta)
        if self.window is None:
            attn = plat.paged_attention(q, k_cache, v_cache, step.meta, self.scale)
        else:
            attn = windowed_attention(plat, q, k_cache, v_cache, step.meta, step.windows, self.window, self.scale)
        attn = attn.reshape(n, self.q_size)
        o = plat.linear(attn, self.o_proj, prompt_rows=step.prompt_rows)
        if step.deltas is not None:
            o = step.deltas.apply("o", self.layer, attn, o)
        if step.tp is not None:  # row-parallel: each rank holds a partial sum
            o = step.tp.all_reduce(o)
        return o if self.o_bias is None else o + self.o_bias


class GatedMLP:
    """``down(act(gate(h)) * up(h))`` with gate and up as one product; row-parallel ``down`` under tensor
    parallelism. SiLU runs as the platform's fused MLP; other activations as two platform products around torch's."""

    def __init__(self, *, layer: int, gate_up: Any, down: Any, act: str = "silu") -> None:
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not served; allowed: {', '.join(ACTIVATIONS)}")
        self.layer, self.gate_up, self.down, self.act = layer, gate_up, down, act
        self.act_fn = ACTIVATIONS[act]

    def _add(self, step: Step) -> Any:
        deltas = step.deltas
        if deltas is None:
            return None
        return lambda name, x, y: deltas.apply(name, self.layer, x, y)

    def __call__(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        plat, add = step.platform, self._add(step)
        if self.act == "silu":
            d = plat.gated_mlp(h, self.gate_up, self.down, step.prompt_rows, add)
        else:
            gu = plat.linear(h, self.gate_up, prompt_rows=step.prompt_rows)
            if add is not None:
                gu = add("gate_up", h, gu)
            gate, up = gu.chunk(2, dim=-1)
            act = self.act_fn(gate) * up
            d = plat.linear(act, self.down, prompt_rows=step.prompt_rows)
            if add is not None:
                d = add("down", act, d)
        return d if step.tp is None else step.tp.all_reduce(d)


class DecoderLayer:
    """A pre-norm decoder layer: ``x += attn(norm(x))``, then ``x += mlp(norm(x))``.

    ``attn_out`` / ``mlp_out``, when set, normalize a branch's output before its residual add (Gemma's and
    GLM-4's sandwich norms). ``attn`` and ``mlp`` are any callables ``(h, step) -> output``.
    """

    def __init__(
        self,
        *,
        attn: Any,
        mlp: Any,
        attn_in: torch.Tensor,
        mlp_in: torch.Tensor,
        eps: float,
        attn_out: torch.Tensor | None = None,
        mlp_out: torch.Tensor | None = None,
    ) -> None:
        self.attn, self.mlp = attn, mlp
        self.attn_in, self.mlp_in, self.attn_out, self.mlp_out = attn_in, mlp_in, attn_out, mlp_out
        self.eps = eps

    @property
    def kv_spec(self) -> KVSpec:
        """The shape of this layer's cache (its attention block's)."""
        return self.attn.kv_spec  # type: ignore[no-any-return]

    def __call__(self, x: torch.Tensor, pending: torch.Tensor | None, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        plat = step.platform
        x, h = plat.add_rms_norm(x, pending, self.attn_in, self.eps)
        o = self.attn(h, step)
        if self.attn_out is not None:
            o = plat.rms_norm(o, self.attn_out, self.eps)
        x, h = plat.add_rms_norm(x, o, self.mlp_in, self.eps)
        d = self.mlp(h, step)
        if self.mlp_out is not None:
            d = plat.rms_norm(d, self.mlp_out, self.eps)
        return x, d


def rope_key(arch: ModelArch, layer: int) -> str:
    """The RoPE tables layer ``layer`` uses: its kind's own (``arch.layer_ropes``), or the model's (``""``)."""
    kind = arch.layer_type(layer)
    return kind if kind in arch.layer_ropes else ""


def dense_attention(arch: ModelArch, layer: int, w: ModelWeights) -> Attention:
    """Layer ``layer``'s :class:`Attention` from the canonical ``self_attn.{q,k,v,o}_proj`` tensors (biases and
    ``q_norm`` / ``k_norm`` when the checkpoint has them)."""
    from ...models.rope import rope_of

    p = f"model.layers.{layer}.self_attn."
    key = rope_key(arch, layer)
    return Attention(
        layer=layer,
        qkv=w.linear(*(p + f"{x}_proj.weight" for x in "qkv")),
        qkv_bias=w.biases(*(p + f"{x}_proj.bias" for x in "qkv")),
        o_proj=w.linear(p + "o_proj.weight"),
        o_bias=w.optional(p + "o_proj.bias"),
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        scale=arch.attention_scale if arch.attention_scale is not None else arch.head_dim**-0.5,
        rope_key=key,
        rotary_dim=rope_of(arch, key or None).rotary_dim(arch.head_dim),
        window=arch.window(layer),
        q_norm=w.optional(p + "q_norm.weight"),
        k_norm=w.optional(p + "k_norm.weight"),
        norm_eps=arch.rms_norm_eps,
    )


def dense_mlp(arch: ModelArch, layer: int, w: ModelWeights) -> GatedMLP:
    """Layer ``layer``'s :class:`GatedMLP` from the canonical ``mlp.{gate,up,down}_proj`` tensors."""
    p = f"model.layers.{layer}.mlp."
    return GatedMLP(
        layer=layer,
        gate_up=w.linear(p + "gate_proj.weight", p + "up_proj.weight"),
        down=w.linear(p + "down_proj.weight"),
        act=arch.hidden_act,
    )


def dense_layer(family: Architecture, arch: ModelArch, layer: int, w: ModelWeights) -> DecoderLayer:
    """A dense family's layer ``layer``: :func:`dense_attention`, :func:`dense_mlp` and the norms
    ``family.norms`` names."""
    p, norms = f"model.layers.{layer}.", family.norms
    return DecoderLayer(
        attn=dense_attention(arch, layer, w),
        mlp=dense_mlp(arch, layer, w),
        attn_in=w.tensor(p + norms.attn_in + ".weight"),
        mlp_in=w.tensor(p + norms.mlp_in + ".weight"),
        attn_out=None if norms.attn_out is None else w.tensor(p + norms.attn_out + ".weight"),
        mlp_out=None if norms.mlp_out is None else w.tensor(p + norms.mlp_out + ".weight"),
        eps=arch.rms_norm_eps,
    )
