"""Weight formats for the matrix products of the torch backends on CPU.

:meth:`Platform.prepare_linear <mindie_host.backends.platform.Platform.prepare_linear>`
turns each ``[out, in]`` weight into one of these, and :meth:`Platform.linear` calls it:

- :class:`PackedWeight`: fp32, plus MKL-packed copies for the 8-64 row products of batched decode;
- :class:`FourBitWeight`: a matrix the GGUF file stores as 4-bit groups (Q4_0, Q4_1), read
  as those groups by this package's low-bit kernel (:mod:`~mindie_host.backends.cpu_matmul`);
- :class:`Int8Weight`: a matrix the file stores as 8-bit groups (Q8_0), read the same way;
- :class:`ReferenceWeight`: a low-bit matrix when that kernel is off: the file's values in float32,
  multiplied as the kernel multiplies them.

Decode of few sequences on CPU is bound by reading weights, so bytes per weight decide
the speed of one-row products; products of many rows are bound by arithmetic. On a CPU with
native bfloat16 (:mod:`~mindie_host.backends.cpu_profile`) the low-bit formats keep a bfloat16
copy for the prompt rows of the default batch-invariant mode (:class:`PromptRows`); elsewhere
prompt rows run through the low-bit kernel too, in float32 (bf16 products there run on a
reference path at a fraction of float32's rate), by the kernel's prompt arithmetic where it has
one (a Q4_0 matrix: :attr:`~mindie_host.backends.cpu_matmul.LowBitTiles.kinds_differ`). Outside batch-invariant mode a dense MKL fp32
copy serves products of many rows. Activations stay in floating point (the profile's compute
dtype: bfloat16 or float32): int8 activations cost too much accuracy on small models (bench/PERF.md).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from . import cpu_extensions, cpu_matmul, cpu_profile
from .cpu_matmul import LowBitTiles

if TYPE_CHECKING:
    from ..models.weights import EightBitGroups, FourBitGroups


def mkl_packing_available() -> bool:
    """Whether MKL's packed GEMM can be used (x86 builds of torch; ``MINDIE_HOST_MKL_PACK=0`` turns it off)."""
    if os.environ.get("MINDIE_HOST_MKL_PACK", "1") == "0":
        return False
    return bool(torch.backends.mkl.is_available()) and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def low_bit_kernels_available() -> bool:
    """Whether the file's low-bit forms are used (``MINDIE_HOST_LOW_BIT=0`` serves every matrix dense in fp32)."""
    return os.environ.get("MINDIE_HOST_LOW_BIT", "1") != "0"


def batch_invariant() -> bool:
    """Whether a low-bit matrix is multiplied by its low-bit kernel at every row count (the default).

    The low-bit kernels give each row the same bits whatever the other rows are, so a greedy
    request's tokens do not depend on what else is in the batch; switching to MKL's fp32 GEMM
    above a row count (``MINDIE_HOST_BATCH_INVARIANT=0``) is faster for long prefills but makes
    the output depend on the batch (bench/PERF.md, "Batch invariance").
    """
    return os.environ.get("MINDIE_HOST_BATCH_INVARIANT", "1") != "0"


#: the default of ``MINDIE_HOST_PROMPT_COPY_MIB``: the default 135M model's copies (about 260 MiB) fit, a 1B
#: model's (about 2.3 GiB) do not
PROMPT_COPY_MIB = 512


def prompt_copy_budget() -> int:
    """The bytes a model's bfloat16 prompt copies of its low-bit matrices may take (``MINDIE_HOST_PROMPT_COPY_MIB``,
    default :data:`PROMPT_COPY_MIB`): over it, no matrix keeps one and prompt rows run through the low-bit kernel,
    so the weights stay in the file's low-bit form only."""
    raw = os.environ.get("MINDIE_HOST_PROMPT_COPY_MIB", str(PROMPT_COPY_MIB))
    try:
        mib = int(raw)
    except ValueError:
        mib = -1
    if mib < 0:
        raise ValueError(f"MINDIE_HOST_PROMPT_COPY_MIB must be a whole number of MiB >= 0; got {raw!r}")
    return mib << 20


class LazyDense:
    """A dense ``[out, in]`` weight that is read only if a weight format needs it (a matrix the file also holds in
    a low-bit form: :meth:`~mindie_host.backends.platform.Platform.prepare_linear` reads it for a bfloat16 prompt
    copy or a dense fallback, never otherwise). Calling it reads it (once)."""

    def __init__(self, read: Any, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._read = read
        self._value: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._read()
        return self._value

    @property
    def read(self) -> bool:
        """Whether the weight was read."""
        return self._value is not None


def prompt_int8_enabled() -> bool:
    """Whether prompt rows of low-bit matrices are multiplied in int8 groups of 32, as llama.cpp multiplies them
    (``MINDIE_HOST_PROMPT_INT8=1``; off by default). Opt-in because the rounding of the activations to int8 changes
    answers: the default model's greedy answer to the README's question goes from "The capital of France is
    Paris." to the "L'Étoile, ..." of issue 35 (bench/PERF.md, "Int8 prompt rows"). Only where the CPU multiplies
    int8 natively (VNNI, or AVX2's 8-bit multiply-add: :attr:`CpuProfile.int8_products`); 1 elsewhere is an error,
    as is any value but 0 and 1."""
    raw = os.environ.get("MINDIE_HOST_PROMPT_INT8", "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"MINDIE_HOST_PROMPT_INT8 must be 0 or 1; got {raw!r}")
    if raw != "1":
        return False
    prof = cpu_profile.profile()
    if prof.int8_products is None:
        raise RuntimeError(f"MINDIE_HOST_PROMPT_INT8=1: the {prof.isa} profile has no native int8 products "
                           f"(allowed there: 0)")
    return True


def prompt_bf16_enabled() -> bool:
    """Whether a low-bit matrix multiplies prompt tokens in bfloat16: on CPUs with native bfloat16 (the avx512
    profile), unless ``MINDIE_HOST_PROMPT_BF16=0`` keeps the low-bit kernel for them too. See :class:`PromptRows`."""
    return (os.environ.get("MINDIE_HOST_PROMPT_BF16", "1") != "0" and cpu_profile.profile().native_bf16
            and not prompt_int8_enabled())


class PromptRows:
    """Which rows of a step's products are prompt tokens (the rest are generated tokens).

    Prompts arrive hundreds of rows at a time, where products are bound by arithmetic: a
    low-bit matrix multiplies those rows with its bfloat16 copy (oneDNN's bf16 GEMM, several
    times the int4 kernel's rate at hundreds of rows, bench/PERF.md), and generated tokens with
    its low-bit kernel, bound by bytes read. Without native bfloat16, a Q4_0 matrix's prompt
    rows go through the low-bit kernel's prompt entry (each weight dequantized, shared by the
    rows) and its generated rows through its factored one (a group's scale applied once to its
    sum): :meth:`~mindie_host.backends.cpu_matmul.LowBitTiles.prompt`. The choice follows the token, never the batch:
    oneDNN's bf16 product gives each row the same bits at any row count from two (a lone row goes
    in beside a copy of itself: :func:`prompt_product`), and a prompt token is a prompt row even
    alone in its step, so a greedy request's output does not depend on what shares its step, how
    its prompt was chunked, or how much of it a prefix cache held.
    """

    def __init__(self, mask: torch.Tensor) -> None:
        #: every row is a prompt token
        self.all = bool(mask.all())
        #: the indices of prompt rows and of generated rows (None when ``all``)
        self.prompt = None if self.all else mask.nonzero().squeeze(1)
        self.generated = None if self.all else (~mask).nonzero().squeeze(1)
        #: the same as slices where the rows are one run (a prompt chunk beside decodes): views, not copies
        self.prompt_rows = _as_slice(self.prompt)
        self.generated_rows = _as_slice(self.generated)

    @staticmethod
    def of(positions: torch.Tensor, query_lens: list[int], prompt_lens: list[int]) -> PromptRows | None:
        """The prompt rows of a step (flat ``positions``); None when it has none or prompt lengths are unknown."""
        if not prompt_lens or all(p <= 0 for p in prompt_lens):
            return None
        limit = torch.repeat_interleave(torch.tensor(prompt_lens), torch.tensor(query_lens)).to(positions.device)
        mask = positions < limit
        return PromptRows(mask) if bool(mask.any()) else None


def prompt_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for prompt rows in bfloat16 (a low-bit matrix's bfloat16 copy), each row with the bits it
    gets at any row count. oneDNN multiplies a lone row by another kernel (a matrix-vector product that sums in
    another order: the default model's down product differed in the last bits), so one row goes in with a copy of
    itself beside it: the last token of a prompt that a prefix cache held gets the bits it gets in the whole prompt."""
    x = x.to(torch.bfloat16)
    if x.shape[0] == 1:
        return F.linear(x.expand(2, -1), weight)[:1]
    return F.linear(x, weight)


def _as_slice(index: torch.Tensor | None) -> torch.Tensor | slice | None:
    """``index`` (ascending row indices) as a slice when its rows are consecutive, else unchanged."""
    if index is None or not len(index):
        return index
    first, last = int(index[0]), int(index[-1])
    return slice(first, last + 1) if last - first + 1 == len(index) else index


def apply_linear(weight: Any, x: torch.Tensor, bias: torch.Tensor | None = None,
                 prompt_rows: PromptRows | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a plain tensor or any weight format of this module (they are callables).

    ``prompt_rows`` says which rows are prompt tokens; only a :class:`LowBitWeight` multiplies them differently.
    """
    if prompt_rows is not None and isinstance(weight, LowBitWeight):
        return weight(x, bias, prompt_rows)
    return weight(x, bias) if callable(weight) else F.linear(x, weight, bias)


def _bf16_gated(x: torch.Tensor, gate_up: Any, down: Any, prompt_rows: PromptRows | None) -> bool:
    """Whether a gated MLP's prompt rows stay in bfloat16 between its two products (see :func:`bf16_gated_mlp`)."""
    return (prompt_rows is not None and x.dim() == 2 and isinstance(gate_up, LowBitWeight)
            and isinstance(down, LowBitWeight) and gate_up.dense is None and down.dense is None
            and gate_up.prompt_weight is not None and down.prompt_weight is not None and cpu_matmul.loaded()
            and cpu_extensions.active("silu_mul") is not None)


def bf16_gated_mlp(x: torch.Tensor, gate_up: Any, down: Any, prompt_rows: PromptRows | None) -> torch.Tensor | None:
    """``down(silu(gate) * up)`` of a step with prompt rows, for low-bit matrices with bfloat16 copies; None
    where that does not apply (no prompt rows, other weight formats, no kernel), for the caller's two products.

    The prompt rows stay in bfloat16 from the gate/up product to the down product's input (the activation is
    one pass of this package's kernel, float32 arithmetic and one rounding, as the down product's bf16 input
    always had), instead of a float32 round trip of the layer's widest tensor. Generated rows are multiplied
    exactly as :meth:`LowBitWeight.__call__` multiplies them, so a generated token's bits do not depend on what
    shares its step.
    """
    if not _bf16_gated(x, gate_up, down, prompt_rows):
        return None
    assert prompt_rows is not None
    prompt = x if prompt_rows.all else x[prompt_rows.prompt_rows]
    act = cpu_matmul.silu_mul(prompt_product(prompt, gate_up.prompt_weight))
    assert act is not None
    out_prompt = prompt_product(act, down.prompt_weight)
    if prompt_rows.all:
        return out_prompt.to(x.dtype)
    out = x.new_empty(x.shape[0], down.shape[0])
    out[prompt_rows.prompt_rows] = out_prompt.to(out.dtype)  # index_put converts no dtype (see _by_kind)
    gate, up = gate_up.small_product(x[prompt_rows.generated_rows]).chunk(2, dim=-1)
    out[prompt_rows.generated_rows] = down.small_product(F.silu(gate) * up).to(out.dtype)
    return out


def gated_activation(gu: torch.Tensor, x: torch.Tensor, gate_up: Any, down: Any,
                     prompt_rows: PromptRows | None) -> torch.Tensor:
    """``silu(gate) * up`` of a gate/up product ``gu`` of ``x``, for a caller that runs the two products itself
    (to add to their outputs): prompt rows rounded as :func:`bf16_gated_mlp` rounds them, so a row whose
    products nothing changed gets the bits it gets there."""
    gate, up = gu.chunk(2, dim=-1)
    act = F.silu(gate) * up
    if _bf16_gated(x, gate_up, down, prompt_rows):
        assert prompt_rows is not None
        rows = slice(None) if prompt_rows.all else prompt_rows.prompt_rows
        prompt_act = cpu_matmul.silu_mul(gu[rows].to(torch.bfloat16))
        assert prompt_act is not None
        act[rows] = prompt_act.to(act.dtype)
    return act


class PackedWeight:
    """An fp32 weight plus MKL-packed copies for batch-size buckets.

    A product whose row count falls in a bucket range is padded up to the bucket
    and runs as a packed GEMM; others (one or two rows, long prefills) use the
    plain weight. Each bucket's copy is as large as the weight, so it is packed on
    the bucket's first product (:meth:`packed_for`), not at load: a server whose
    batches never reach a bucket (or whose decode steps are compiled, which use
    the plain weight) never holds its copy.
    """

    BUCKETS = (8, 16, 32, 64)

    def __init__(self, weight: torch.Tensor, buckets: tuple[int, ...] = BUCKETS) -> None:
        self.weight = weight
        self.buckets = buckets
        #: the packed copies made so far, by bucket
        self.packed: dict[int, torch.Tensor] = {}

    def packed_for(self, bucket: int) -> torch.Tensor:
        """The weight packed for products of ``bucket`` rows, packed now if this is the bucket's first product."""
        packed = self.packed.get(bucket)
        if packed is None:
            packed = self.packed[bucket] = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, bucket)
        return packed

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        # (inductor lowers packed MKL products only for frozen constants, so compiled graphs use F.linear)
        if x.dim() != 2 or rows < 3 or rows > self.buckets[-1] or x.dtype != torch.float32 or torch.compiler.is_compiling():
            return F.linear(x, self.weight, bias)
        bucket = next(b for b in self.buckets if b >= rows)
        if bucket != rows:
            x = F.pad(x, (0, 0, 0, bucket - rows))
        out = torch.ops.mkl._mkl_linear(x.contiguous(), self.packed_for(bucket), self.weight, bias, bucket)
        return out[:rows] if bucket != rows else out


class LowBitWeight:
    """A weight with a low-bit copy for products of at most ``max_rows`` rows and a dense one for the rest.

    The low-bit copy is in this package's kernel's layout (:attr:`tiles`); subclasses say how it is made from the
    model file. Activations are rounded to the CPU profile's compute dtype (:attr:`act_dtype`) and products return
    float32 here. Without the kernel (turned off after load), :meth:`fallback_product` multiplies the same values.
    """

    #: up to this many rows the low-bit kernels are at least as fast as MKL's packed fp32 product (bench/PERF.md)
    max_rows = 16

    def __init__(self, dense: Any, shape: torch.Size | None = None) -> None:
        #: None in batch-invariant mode: every product reads the low-bit copy
        self.dense = dense
        self._shape = shape if shape is not None else dense.shape
        #: batch-invariant mode: a bfloat16 copy for prompt rows (:class:`PromptRows`), or None
        self.prompt_weight: torch.Tensor | None = None
        #: the dtype activations are rounded to (the CPU profile's: bfloat16 with native bf16, else float32)
        self.act_dtype = cpu_profile.profile().compute_dtype
        #: batch-invariant mode: prompt rows in int8 groups (:meth:`int8_product`) instead of a bfloat16 copy
        self.prompt_int8 = False
        self._dequantized: torch.Tensor | None = None
        self._int_values: torch.Tensor | None = None

    def use_int8_prompts(self) -> bool:
        """Multiply prompt rows in int8 groups from now on, where this matrix allows it (low-bit tiles whose
        groups are whole groups of :data:`~mindie_host.backends.cpu_matmul.Q8_GROUP` inputs); returns whether."""
        tiles = self.tiles
        self.prompt_int8 = (tiles is not None and tiles.group_size % cpu_matmul.Q8_GROUP == 0
                            and self.shape[1] % cpu_matmul.Q8_GROUP == 0)
        return self.prompt_int8

    def int8_product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` in float32 for prompt rows: ``x`` quantized per row and group of 32 to int8
        (:func:`~mindie_host.backends.cpu_matmul.quantize_rows`), multiplied by the weights' exact integer codes
        with integer sums, the scales applied per group; each row's bits do not depend on the others. The kernel
        when it is on, else torch with the same bits (:func:`~mindie_host.backends.cpu_matmul.q8_rows_reference`)."""
        assert self.tiles is not None
        rows = cpu_matmul.quantize_rows_kernel(x)
        if not cpu_matmul.q8_rows_loaded() and self._int_values is None:
            self._int_values = self.tiles.int_values()  # the reference's integer weights, kept
        return self.tiles.q8_rows(rows, self._int_values)

    def keep_prompt_copy(self, weight: torch.Tensor) -> None:
        """Keep ``weight`` (the file's values, dense) in bfloat16 for the prompt rows of batch-invariant steps."""
        self.prompt_weight = weight.to(torch.bfloat16).contiguous()

    @property
    def shape(self) -> torch.Size:
        return self._shape

    #: the codes in this package's kernel's layout (:mod:`~mindie_host.backends.cpu_matmul`), or None
    tiles: LowBitTiles | None = None

    def small_product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` from the low-bit copy, ``x`` rounded to :attr:`act_dtype`: the package's kernel when it is on
        (any row count), :meth:`fallback_product` otherwise."""
        if self.tiles is not None and cpu_matmul.loaded():
            return self.tiles(x.to(self.act_dtype))
        return self.fallback_product(x.to(self.act_dtype).contiguous())

    def fallback_product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` in float32 without the kernel: the tiles' exact values, dequantized once and kept."""
        if self._dequantized is None:
            assert self.tiles is not None
            self._dequantized = self.tiles.dequantize()
        return F.linear(x.float(), self._dequantized)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                 prompt_rows: PromptRows | None = None) -> torch.Tensor:
        if self.dense is None:  # batch-invariant: one kernel per kind of token, at every row count
            if prompt_rows is not None and x.dim() == 2 and (self.prompt_weight is not None or self.prompt_int8
                                                              or self._kernel_prompt_rows()):
                out = self._by_kind(x, prompt_rows)
            else:
                out = self.small_product(x.reshape(-1, x.shape[-1])).to(x.dtype)
                out = out.reshape(*x.shape[:-1], out.shape[-1])
            return out if bias is None else out + bias
        if x.dim() != 2 or x.shape[0] > self.max_rows:
            return apply_linear(self.dense, x, bias)
        out = self.small_product(x).to(x.dtype)
        return out if bias is None else out + bias


    def _kernel_prompt_rows(self) -> bool:
        """Whether the low-bit kernel multiplies this matrix's prompt rows by other arithmetic than its generated rows
        (:attr:`~mindie_host.backends.cpu_matmul.LowBitTiles.kinds_differ`), so that a step's rows go by kind."""
        return self.tiles is not None and cpu_matmul.loaded() and self.tiles.kinds_differ

    def _prompt_product(self, x: torch.Tensor) -> torch.Tensor:
        """Prompt rows' ``x @ W.T``: in int8 groups (:meth:`int8_product`), through the bfloat16 copy, or by the
        low-bit kernel's prompt arithmetic (:meth:`~mindie_host.backends.cpu_matmul.LowBitTiles.prompt`)."""
        if self.prompt_int8:
            return self.int8_product(x)
        if self.prompt_weight is None:
            assert self.tiles is not None
            return self.tiles.prompt(x.to(self.act_dtype))
        return prompt_product(x, self.prompt_weight)

    def _by_kind(self, x: torch.Tensor, rows: PromptRows) -> torch.Tensor:
        """Prompt rows through :meth:`_prompt_product`, generated rows through the low-bit kernel."""
        if rows.all:
            return self._prompt_product(x).to(x.dtype)
        assert rows.prompt_rows is not None and rows.generated_rows is not None
        out = x.new_empty(x.shape[0], self.shape[0])
        # a row index (rows not in one run: a recomputed sequence's prompt and generated tokens between others)
        # assigns through index_put, which does not convert dtypes as a slice's copy does
        out[rows.prompt_rows] = self._prompt_product(x[rows.prompt_rows]).to(out.dtype)
        out[rows.generated_rows] = self.small_product(x[rows.generated_rows]).to(out.dtype)
        return out


class FourBitWeight(LowBitWeight):
    """The file's 4-bit groups (Q4_0, Q4_1), multiplied by this package's kernel.

    It reads half a byte per weight: a one-row product of the default model's 30 layers takes
    4.6 ms instead of 15.8 ms in fp32 on two AVX-512 cores.
    """

    def __init__(self, groups: FourBitGroups, dense: Any) -> None:
        super().__init__(dense, torch.Size(groups.codes.shape))
        self.tiles = LowBitTiles.four_bit(torch.from_numpy(groups.codes), torch.from_numpy(groups.scale),
                                          torch.from_numpy(groups.offset), groups.group_size)


class Int8Weight(LowBitWeight):
    """The file's 8-bit groups (Q8_0: int8 codes and a scale per 32 inputs), multiplied by this package's kernel.

    For matrices the file stores as 8-bit blocks, such as the default model's tied embedding / LM
    head: the exact values at a byte per weight (and a scale per 32).
    """

    max_rows = 4

    def __init__(self, groups: EightBitGroups, dense: Any) -> None:
        super().__init__(dense, torch.Size(groups.codes.shape))
        codes = torch.from_numpy(groups.codes)
        scale = torch.from_numpy(groups.scale)
        self.tiles = LowBitTiles(codes, scale, torch.zeros_like(scale), groups.group_size)


class ReferenceWeight(LowBitWeight):
    """A low-bit matrix without the low-bit kernel: the file's exact values dense in float32, generated rows
    multiplied as the kernel multiplies them (activations rounded to the profile's dtype, float32 sums), prompt rows
    through the bfloat16 copy as with the kernel."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(None, weight.shape)
        self._dequantized = weight
