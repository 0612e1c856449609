"""Device/platform abstraction shared by the torch-based backends (CPU, CUDA, and Ascend NPU in a plugin).

A :class:`Platform` names a device, reports its memory, names the distributed
backend (gloo, NCCL, HCCL) and provides the few operators a platform may want to
replace with fused kernels: RMSNorm, rotary embedding and attention over the
paged KV cache. The model code in :mod:`mindie_host.backends.torch.model` calls
only these, so the Ascend plugin reuses the model unchanged with its own
operators (the role vllm-ascend's Platform class plays for vLLM).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..models.weights import EightBitGroups
from . import cpu_attention, cpu_layer_ops, cpu_matmul, cpu_profile
from .cpu_attention import decode_attention
from .int8 import Int8Matrix, prepare_int8_weight
from .linear import (
    FourBitWeight,
    Int8Weight,
    LazyDense,
    LowBitWeight,
    PackedWeight,
    PromptRows,
    ReferenceWeight,
    apply_linear,
    batch_invariant,
    bf16_gated_mlp,
    gated_activation,
    low_bit_kernels_available,
    mkl_packing_available,
    prompt_bf16_enabled,
    prompt_copy_budget,
    prompt_int8_enabled,
)

log = logging.getLogger("mindie_host.backends.platform")

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..models.weights import FourBitGroups
    from .base import ModelInput


def _low_bit_weight(stored: FourBitGroups | EightBitGroups, dense: Any) -> Int8Weight | FourBitWeight:
    """The file's low-bit form ``stored`` as the weight that multiplies it (its tiles built here), with ``dense``
    (None in batch-invariant mode) for products above the low-bit kernel's rows."""
    return Int8Weight(stored, dense) if isinstance(stored, EightBitGroups) else FourBitWeight(stored, dense)


@dataclass
class AttentionMetadata:
    """Per-step tensors describing where each new token goes and what it attends to.

    Built once per step and shared by every layer.
    """

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    gather_index: torch.Tensor  # [B, max_ctx] cache slots of each sequence's context (padded with 0)
    attn_mask: torch.Tensor | None  # [B, 1, max_q, max_ctx] bool (True = attend); None when not needed
    pad_index: torch.Tensor | None  # [T] flat index of each new token in the [B * max_q] padded layout
    num_seqs: int
    max_query_len: int
    max_context_len: int
    query_lens: list[int]
    context_lens: list[int]
    #: platform-specific per-step inputs added by :meth:`Platform.prepare_step` (block tables, int32 slots ...)
    extra: dict[str, Any] = field(default_factory=dict)
    #: whether each sequence's query is prompt tokens (empty: none is). A prompt token is computed with the prompt
    #: rows' arithmetic even when it comes alone (the last token of a prompt a prefix cache held, a one-token chunk),
    #: so its bits do not depend on how the prompt was chunked or cached
    prompt_queries: list[bool] = field(default_factory=list)

    def is_prompt_query(self, i: int) -> bool:
        """Whether sequence ``i``'s query is prompt tokens (see :attr:`prompt_queries`)."""
        return bool(self.prompt_queries) and self.prompt_queries[i]


class Platform:
    """CPU by default. Subclasses override the device facts and, optionally, the operators."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        """Whether this platform's device can be used in this process."""
        return True

    def device(self) -> torch.device:
        """The torch device tensors live on."""
        return torch.device(self.device_type)

    def bind_device(self, index: int) -> None:  # noqa: B027 - optional hook
        """Use device ``index`` of this platform from now on, in this process (a tensor-parallel rank's
        device). The CPU has one device: every rank shares it."""

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory; on the CPU "free" is Linux's MemAvailable where it exists."""
        import os

        try:
            with open("/proc/meminfo") as f:
                fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.count(":") == 1}
            return fields["MemAvailable"], fields["MemTotal"]
        except (OSError, KeyError, ValueError, IndexError):
            pass
        pages = os.sysconf("SC_PHYS_PAGES")
        avail = os.sysconf("SC_AVPHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
        return avail * size, pages * size

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

    def default_dtype(self) -> torch.dtype:
        """The weight dtype used when the config says ``auto``."""
        return torch.float32

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's K (or V) cache tensor. The default is slot-major ``[num_slots, KV, D]``;
        paged-attention kernels usually want ``[num_blocks, block_size, KV, D]`` (same memory, viewed)."""
        return (num_blocks * block_size, num_kv_heads, head_dim)

    def prepare_step(self, meta: AttentionMetadata, batch: ModelInput, block_size: int) -> AttentionMetadata:
        """Add what this platform's operators need beyond the generic metadata (block tables, int32 lengths)
        to ``meta.extra``; called once per step, before the layers run. The default adds nothing."""
        return meta

    # -- operators ------------------------------------------------------------------
    #: whether this model's low-bit matrices keep bfloat16 copies for prompt rows (:meth:`plan_prompt_copies`)
    prompt_copies = True

    def plan_prompt_copies(self, copy_bytes: int) -> None:
        """Decide, for the model about to be prepared, whether its low-bit matrices keep a bfloat16 copy for prompt
        rows: only while the copies (``copy_bytes``, 2 bytes a weight) fit the budget
        (:func:`~mindie_host.backends.linear.prompt_copy_budget`); over it prompt rows run through the low-bit
        kernel, as on CPUs without native bfloat16, and the weights stay in the file's low-bit form only. Logs the
        choice once."""
        if self.device_type != "cpu" or not copy_bytes or not low_bit_kernels_available():
            self.prompt_copies = True
            return
        budget = prompt_copy_budget()
        if prompt_int8_enabled():
            self.prompt_copies = False
            log.info("low-bit matrices: prompt rows in int8 groups of 32 (%s), weights kept only in the file's "
                     "low-bit form", cpu_profile.profile().int8_products)
            return
        if not prompt_bf16_enabled():
            self.prompt_copies = False
            log.info("low-bit matrices: prompt rows through the low-bit kernel (no bfloat16 copies on this CPU "
                     "profile)")
            return
        self.prompt_copies = copy_bytes <= budget
        mib = f"{copy_bytes / (1 << 20):.0f} MiB"
        if self.prompt_copies:
            log.info("low-bit matrices: prompt rows through bfloat16 copies (%s, within MINDIE_HOST_PROMPT_COPY_MIB "
                     "%d)", mib, budget >> 20)
        else:
            log.info("low-bit matrices: prompt rows through the low-bit kernel, weights kept only in the file's "
                     "low-bit form (bfloat16 copies would take %s, over MINDIE_HOST_PROMPT_COPY_MIB %d)",
                     mib, budget >> 20)

    def prepare_linear(self, weight: torch.Tensor | LazyDense,
                       stored: FourBitGroups | EightBitGroups | None = None) -> Any:
        """Turn a ``[out, in]`` weight into whatever :meth:`linear` wants (packed, quantized...).

        On x86 CPUs with MKL, fp32 weights are also pre-packed for a few batch-size
        buckets: MKL's packed GEMM is about twice as fast as the plain one for the
        4-64 row products of batched decode. ``stored`` says how the model file holds
        the matrix when it is below 16 bits (its 4-bit or 8-bit groups); on CPU, products
        then read that low-bit form through this package's kernel (:mod:`mindie_host.backends.linear`),
        with a bfloat16 copy for prompt rows where the CPU profile has native bf16
        (:mod:`~mindie_host.backends.cpu_profile`) and the model's copies fit their budget
        (:meth:`plan_prompt_copies`). Without the kernel they multiply the file's exact values
        in float32, with the activations rounded as the kernel rounds them (:class:`ReferenceWeight`): torch's own
        low-bit CPU kernels run as slow reference loops without AVX-512 and round every output to bf16 with it.

        ``weight`` may be a :class:`~mindie_host.backends.linear.LazyDense` (with ``stored``): it is read only where
        the dense values are kept (a prompt copy, a fallback), so a matrix served from its low-bit form alone is
        never dequantized."""
        def dense() -> torch.Tensor:
            return weight() if isinstance(weight, LazyDense) else weight

        if self.device_type != "cpu" or weight.dtype != torch.float32:
            return dense()
        if stored is None or not low_bit_kernels_available():
            return PackedWeight(dense()) if mkl_packing_available() else dense()
        prompt_copy = prompt_bf16_enabled() and self.prompt_copies
        if batch_invariant():  # one kernel per kind of token at every row count: low-bit, and bf16 for prompts
            low: LowBitWeight | None = None
            if prompt_int8_enabled():  # int8 prompt rows: the low-bit form serves every row, kernel on or off
                low = _low_bit_weight(stored, None)
                if low.use_int8_prompts():
                    return low
            if not cpu_matmul.loaded():
                if not prompt_copy:
                    return PackedWeight(dense()) if mkl_packing_available() else dense()
                low = ReferenceWeight(dense())
            elif low is None:  # else the weight built above serves (its groups int8 rows cannot take: Q6_K's 16)
                low = _low_bit_weight(stored, None)
            if prompt_copy:
                low.keep_prompt_copy(dense())
            return low
        if not cpu_matmul.loaded():
            return PackedWeight(dense()) if mkl_packing_available() else dense()
        # the dense copy serves only products above the low-bit kernel's rows: pack just those buckets
        max_rows = (Int8Weight if isinstance(stored, EightBitGroups) else FourBitWeight).max_rows
        buckets = tuple(b for b in PackedWeight.BUCKETS if b > max_rows)
        packed: Any = PackedWeight(dense(), buckets) if mkl_packing_available() and buckets else dense()
        return _low_bit_weight(stored, packed)

    def prepare_int8(self, matrix: Int8Matrix, dtype: torch.dtype = torch.float32) -> Any:
        """Turn an int8 matrix of the ``w8a16`` / ``w8a8`` schemes into a weight :meth:`linear` calls
        (:mod:`mindie_host.backends.int8`); a platform with its own int8 kernels overrides this."""
        return prepare_int8_weight(matrix, self.device(), dtype)

    def linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None,
               prompt_rows: PromptRows | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` for a weight made by :meth:`prepare_linear` or :meth:`prepare_int8`.

        ``prompt_rows`` marks the rows that are prompt tokens (:class:`~mindie_host.backends.linear.PromptRows`);
        a platform may multiply those differently, as long as each row's result does not depend on the others.
        """
        return apply_linear(weight, x, bias, prompt_rows)

    def gated_mlp(self, x: torch.Tensor, gate_up: Any, down: Any, prompt_rows: PromptRows | None = None,
                  add: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """``down(silu(gate) * up)`` for weights made by :meth:`prepare_linear`, ``gate_up`` giving ``[gate | up]``:
        a gated MLP without biases. Prompt rows of low-bit matrices stay in bfloat16 throughout
        (:func:`~mindie_host.backends.linear.bf16_gated_mlp`); otherwise two :meth:`linear` products.

        ``add(name, input, output)`` (``name`` ``"gate_up"`` or ``"down"``), when given, returns a product's output
        with something added to it (per-row linear deltas); rows it leaves alone keep the bits they get without it.
        """
        fused = None if add is not None else bf16_gated_mlp(x, gate_up, down, prompt_rows)
        if fused is not None:
            return fused
        gu = self.linear(x, gate_up, prompt_rows=prompt_rows)
        if add is not None:
            gu = add("gate_up", x, gu)
        act = gated_activation(gu, x, gate_up, down, prompt_rows)
        d = self.linear(act, down, prompt_rows=prompt_rows)
        return d if add is None else add("down", act, d)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension (on CPU in one pass of :mod:`~mindie_host.backends.cpu_layer_ops`)."""
        h = cpu_layer_ops.add_rms_norm(x, None, weight, eps)
        return h if h is not None else F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``x + residual`` (``x`` itself when ``residual`` is None) and its RMSNorm: a decoder layer's residual add
        and the norm after it. The sum may be written into ``x``'s storage: the caller must not use ``x`` after.

        On CPU both are one pass of :mod:`~mindie_host.backends.cpu_layer_ops`, unless a subclass brings its own
        :meth:`rms_norm`, which then serves.
        """
        if type(self).rms_norm is Platform.rms_norm:
            h = cpu_layer_ops.add_rms_norm(x, residual, weight, eps)
            if h is not None:
                return x, h
        if residual is not None:
            x = x + residual
        return x, self.rms_norm(x, weight, eps)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply rotary embedding (HF's rotate-half convention). q: [T, H, D], k: [T, KV, D], cos/sin: [T, 1, D].

        On CPU one pass of :mod:`~mindie_host.backends.cpu_layer_ops` (the same bits as torch's operators)."""
        rotated = cpu_layer_ops.rope(q, k, cos, sin)
        return rotated if rotated is not None else (_rope(q, cos, sin), _rope(k, cos, sin))

    def write_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Store the new tokens' K and V at their slots. Caches are [num_slots, KV, D]."""
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

    def attention_dtype(self, cache_dtype: torch.dtype) -> torch.dtype:
        """The dtype attention computes in over a cache of ``cache_dtype``.

        On CPU, float32: torch's CPU attention in bfloat16 ran about 6x slower than in float32 for a
        decode step here (bench/PERF.md, "bf16 KV cache: attention in float32 on CPU"), so a 16-bit
        cache is read back to float32 (the gather moves half the bytes; the products run at fp32 speed).
        """
        return torch.float32 if cache_dtype in (torch.bfloat16, torch.float16) else cache_dtype

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        """Masked attention of ``q [B, H, q, D]`` over ``k, v [B, KV, ctx, D]`` (grouped heads when KV < H)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])

    def paged_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Causal attention of the new tokens over each sequence's cached context.

        q: [T, H, D] -> returns [T, H, D]. Queries of different lengths are padded to the longest
        and run as one batch when that at most doubles the rows (a wave of short prompts); otherwise
        (decodes next to a long prefill chunk) they run ragged.
        """
        if self.device_type == "cpu" and batch_invariant():
            if meta.query_lens:
                return self._per_sequence_attention(q, k_cache, v_cache, meta, scale)
            if meta.max_query_len == 1 and meta.attn_mask is not None and cpu_attention.loaded(k_cache):
                # a compiled decode step (tensors only): each sequence over exactly its context, in the kernel
                context_lens = meta.attn_mask.reshape(meta.num_seqs, -1).sum(1)
                out = cpu_attention.decode_attention_op(q, k_cache, v_cache, meta.gather_index, context_lens, scale)
                return out.to(q.dtype)
        if meta.pad_index is not None and ragged(meta.num_seqs, meta.max_query_len, q.shape[0]):
            return self._ragged_attention(q, k_cache, v_cache, meta, scale)
        num_seqs, max_q = meta.num_seqs, meta.max_query_len
        heads, dim = q.shape[1], q.shape[2]
        dt = self.attention_dtype(k_cache.dtype)
        keys = gather_slots(k_cache, meta.gather_index).transpose(1, 2).to(dt)  # [B, KV, ctx, D]
        values = gather_slots(v_cache, meta.gather_index).transpose(1, 2).to(dt)
        if meta.pad_index is None:
            qb = q.view(num_seqs, max_q, heads, dim)
        else:
            qb = q.new_zeros(num_seqs * max_q, heads, dim)
            qb[meta.pad_index] = q
            qb = qb.view(num_seqs, max_q, heads, dim)
        out = self.attention(
            qb.transpose(1, 2).to(keys.dtype), keys, values, meta.attn_mask, scale
        )  # [B, H, max_q, D]
        out = out.transpose(1, 2).reshape(num_seqs * max_q, heads, dim).to(q.dtype)
        if meta.pad_index is not None:
            out = out[meta.pad_index]
        return out

    def _per_sequence_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Each sequence's attention on its own, over exactly its own context (batch-invariant mode).

        A batched kernel's reductions depend on the batch (how it splits work across threads, how
        far contexts are padded), so a token's attention output, and in the end a greedy request's
        tokens, would change with the other requests in the step. Run alone, each sequence sees
        the same shapes as when it is the only one served (bench/PERF.md, "Batch invariance").
        """
        heads, dim = q.shape[1], q.shape[2]
        out = torch.empty_like(q)
        single = self._single_token_rows(q, k_cache, meta)
        if single is not None:  # one query token each: all of them in one kernel call (cpu_attention)
            rows, seqs, ctx_lens = single
            got = decode_attention(q if rows is None else q[rows], k_cache, v_cache,
                                   meta.gather_index if seqs is None else meta.gather_index[seqs], ctx_lens, scale)
            if got is not None:
                if rows is None:
                    return got.to(q.dtype)
                out[rows] = got.to(q.dtype)
            else:
                single = None
        start = 0
        for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            prompt = meta.is_prompt_query(i)
            if n == 1 and not prompt and single is not None:  # done above
                start += n
                continue
            out[start : start + n] = self._one_sequence(q[start : start + n], k_cache, v_cache,
                                                        meta.gather_index[i, :ctx], scale, prompt)
            start += n
        return out.reshape(q.shape[0], heads, dim)

    def _one_sequence(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, scale: float,
        prompt: bool = False,
    ) -> torch.Tensor:
        """Attention of one sequence's ``n`` newest tokens ``q [n, H, D]`` over its context (cache ``slots``, in
        order): row ``r`` sits at position ``ctx - n + r`` and sees keys ``0 .. ctx - n + r``. On a CPU with the
        attention kernels, prompt tokens (``prompt``, or any query of several tokens) go through
        :func:`cpu_attention.prompt_attention` (in place over the cache, only the visible keys), one token alone
        too: a prompt row gets the same bits however its prompt was chunked; otherwise torch's attention over the
        gathered context with a causal mask."""
        n, ctx = q.shape[0], slots.shape[0]
        if (n > 1 or prompt) and self.device_type == "cpu" and type(k_cache) is torch.Tensor and k_cache.dim() == 3 \
                and q.dtype == torch.float32 and cpu_attention.enabled():
            got = cpu_attention.prompt_attention(q, k_cache, v_cache, slots, scale)
            if got is not None:
                return got
        dt = self.attention_dtype(k_cache.dtype)
        mask = None
        if n > 1:
            mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n).view(1, 1, n, ctx)
        o = self.attention(
            q.transpose(0, 1).unsqueeze(0).to(dt),  # [1, H, n, D]
            gather_slots(k_cache, slots).transpose(0, 1).unsqueeze(0).to(dt),  # [1, KV, ctx, D]
            gather_slots(v_cache, slots).transpose(0, 1).unsqueeze(0).to(dt),
            mask,
            scale,
        )
        return o[0].transpose(0, 1).to(q.dtype)

    @staticmethod
    def _single_token_rows(
        q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor] | None:
        """For the decode-attention kernel: the flat rows and sequence indices of the sequences with one query
        token (None for each when that is every sequence) and their context lengths; None when there are none
        or the cache is not a plain CPU tensor. Built at the first layer and kept in ``meta.extra``."""
        if type(k_cache) is not torch.Tensor or k_cache.dim() != 3 or q.dtype != torch.float32 \
                or not cpu_attention.enabled():
            return None
        if "single_token_rows" not in meta.extra:
            lens = meta.query_lens
            seqs = [i for i, n in enumerate(lens) if n == 1 and not meta.is_prompt_query(i)]  # decode rows
            entry = None
            if len(seqs) == len(lens):
                entry = (None, None, torch.tensor(meta.context_lens, dtype=torch.long))
            elif seqs:
                starts = torch.tensor(lens, dtype=torch.long).cumsum(0) - torch.tensor(lens, dtype=torch.long)
                index = torch.tensor(seqs, dtype=torch.long)
                entry = (starts[index], index, torch.tensor([meta.context_lens[i] for i in seqs], dtype=torch.long))
            meta.extra["single_token_rows"] = entry
        return meta.extra["single_token_rows"]

    def _ragged_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Attention for a batch whose query lengths differ (prefill chunks next to decodes).

        Padding every sequence to the longest query would cost ``num_seqs x max_q x ctx``;
        instead the single-token queries (decodes) run as one batch and each longer
        query runs on its own, each over only its own context.
        """
        heads, dim = q.shape[1], q.shape[2]
        dt = self.attention_dtype(k_cache.dtype)
        out = torch.empty_like(q)
        starts = [0]
        for n in meta.query_lens:
            starts.append(starts[-1] + n)
        singles = [i for i, n in enumerate(meta.query_lens) if n == 1]
        if singles:
            ctx = max(meta.context_lens[i] for i in singles)
            sel = torch.tensor(singles, device=q.device)
            slots = meta.gather_index[sel, :ctx]
            rows = torch.tensor([starts[i] for i in singles], device=q.device)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) < torch.tensor(
                [meta.context_lens[i] for i in singles], device=q.device).unsqueeze(1)
            o = self.attention(
                q[rows].unsqueeze(2).to(dt),  # [b, H, 1, D]
                gather_slots(k_cache, slots).transpose(1, 2).to(dt),  # [b, KV, ctx, D]
                gather_slots(v_cache, slots).transpose(1, 2).to(dt),
                mask.view(len(singles), 1, 1, ctx),
                scale,
            )
            out[rows] = o.squeeze(2).to(q.dtype)
        for i, n in enumerate(meta.query_lens):
            if n == 1:
                continue
            ctx = meta.context_lens[i]
            out[starts[i] : starts[i] + n] = self._one_sequence(q[starts[i] : starts[i] + n], k_cache, v_cache,
                                                                meta.gather_index[i, :ctx], scale)
        return out.reshape(q.shape[0], heads, dim)


def ragged(num_seqs: int, max_query_len: int, tokens: int) -> bool:
    """Whether a step of sequences with different query lengths runs its attention sequence by sequence
    (:meth:`Platform.paged_attention`): when padding every query to the longest would more than double the
    rows (a prompt chunk beside decodes). Such a step needs no padded ``attn_mask``."""
    return num_seqs * max_query_len > 2 * tokens


def gather_slots(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache[index]`` for a slot-major cache, via ``index_select`` (about 3x faster on CPU than
    advanced indexing for the per-layer K/V gather)."""
    return cache.index_select(0, index.reshape(-1)).view(*index.shape, *cache.shape[1:])


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class CudaPlatform(Platform):
    """NVIDIA GPUs through CUDA; NCCL for tensor parallelism."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def bind_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def memory_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    #: attention kernels used, in torch's order of preference. cuDNN's is left out: it builds an
    #: execution plan for every new shape (tens of ms each), and a serving step's context length
    #: changes every step (bench/PERF.md, round 3)
    ATTENTION_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")

    def attention_dtype(self, cache_dtype: torch.dtype) -> torch.dtype:
        """The cache's own dtype: CUDA's attention kernels are fastest in 16-bit."""
        return cache_dtype

    def __init__(self) -> None:
        from torch.nn.attention import SDPBackend

        self._sdpa_backends = [getattr(SDPBackend, b) for b in self.ATTENTION_BACKENDS]

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(self._sdpa_backends):
            return super().attention(q, k, v, mask, scale)


PLATFORMS: dict[str, type[Platform]] = {"cpu": Platform, "cuda": CudaPlatform}


def select_platform(device: str = "auto") -> Platform:
    """The platform for a config ``device`` value: ``auto`` prefers CUDA when present."""
    if device == "auto":
        return CudaPlatform() if CudaPlatform.is_available() else Platform()
    cls = PLATFORMS.get(device)
    if cls is None:
        hint = " (Ascend NPUs: backendType 'atb', pip install mindie-plugin-backends-atb[npu])" if device == "npu" else ""
        raise RuntimeError(
            f"device {device!r} is not served by the torch backend; allowed: auto, {', '.join(PLATFORMS)}{hint}"
        )
    if not cls.is_available():
        raise RuntimeError(f"device {device!r} was requested but is not available in this process")
    return cls()
