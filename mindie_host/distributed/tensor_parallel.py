"""Megatron-style tensor parallelism for Llama-family decoders.

A rank of a world of ``N`` holds:

* the Q, K and V rows of its ``1/N`` of the attention heads and KV heads, and the gate and up
  rows of its ``1/N`` of the MLP's intermediate channels (column-parallel: no communication);
* the matching input columns of ``o_proj`` and ``down_proj`` (row-parallel: each rank's
  product is a partial sum, completed by one all-reduce after each);
* its ``ceil(V/N)`` rows of the embedding and of the LM head (vocab-parallel: an embedding
  lookup is masked to the rank's rows and all-reduced; logits are all-gathered);
* its KV heads' share of the KV cache;
* the norms in full.

So a layer costs two all-reduces of ``tokens x hidden`` values, and a step one more for the
embedding and one all-gather of the logits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

#: ``(dim, start, stop)``: the slice of a tensor a rank reads, along ``dim`` (0 = rows, 1 = columns).
Slice = tuple[int, int, int]
#: the :data:`Slice` of a tensor another rank holds whole (an expert of another rank under expert parallelism): this
#: rank does not read it at all
ELSEWHERE: Slice = (-1, 0, 0)


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in a tensor-parallel world, and the collectives of its decoder step.

    ``group`` is the ``torch.distributed`` process group of the world (``None``: the default group);
    ``device_index`` is the rank's device (``BackendConfig.npuDeviceIds``; one CPU serves every rank);
    ``expert_parallel``: a family with routed experts gives each rank ``1/N`` of them whole
    (:meth:`expert_span`) instead of ``1/N`` of every expert's channels (``ModelConfig.expertParallel``).
    """

    rank: int
    world_size: int
    group: Any = None
    device_index: int = 0
    expert_parallel: bool = False

    def span(self, total: int) -> tuple[int, int]:
        """This rank's equal share ``[start, stop)`` of ``total`` items (``total`` divisible by the world size)."""
        per = total // self.world_size
        return self.rank * per, (self.rank + 1) * per

    def expert_span(self, experts: int, index: int) -> Slice | None:
        """Under expert parallelism, the slice this rank reads of a tensor of expert ``index`` of ``experts``: all of
        it (None) when the expert is in this rank's :meth:`span`, :data:`ELSEWHERE` when another rank's."""
        lo, hi = self.span(experts)
        return None if lo <= index < hi else ELSEWHERE

    def vocab_span(self, vocab: int) -> tuple[int, int]:
        """This rank's rows ``[start, stop)`` of a vocabulary of ``vocab`` rows; every rank pads to
        :meth:`vocab_rows` rows, so the last one may hold fewer real rows."""
        per = self.vocab_rows(vocab)
        start = min(self.rank * per, vocab)
        return start, min(start + per, vocab)

    def vocab_rows(self, vocab: int) -> int:
        """Rows each rank holds of a vocabulary of ``vocab`` rows (padding included)."""
        return math.ceil(vocab / self.world_size)

    def local_arch(self, arch: Any) -> Any:
        """``arch`` (a ``LlamaArch``) as this rank sees it: its share of heads, KV heads and MLP channels."""
        n = self.world_size
        return dataclasses.replace(
            arch, num_heads=arch.num_heads // n, num_kv_heads=arch.num_kv_heads // n,
            intermediate_size=arch.intermediate_size // n,
        )

    def slice_of(self, name: str, arch: Any) -> Slice | None:
        """The slice of the HF-named tensor ``name`` this rank holds; ``None``: the whole tensor."""
        hd = arch.head_dim
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            lo, hi = self.span(arch.num_heads)
            return 0, lo * hd, hi * hd
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            lo, hi = self.span(arch.num_kv_heads)
            return 0, lo * hd, hi * hd
        if name.endswith("o_proj.weight"):
            lo, hi = self.span(arch.num_heads)
            return 1, lo * hd, hi * hd
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return (0, *self.span(arch.intermediate_size))
        if name.endswith("down_proj.weight"):
            return (1, *self.span(arch.intermediate_size))
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (0, *self.vocab_span(arch.vocab_size))
        return None

    # -- the collectives of a step -----------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (completes a row-parallel product)."""
        import torch.distributed as dist

        dist.all_reduce(t, group=self.group)
        return t

    def embed(self, ids: torch.Tensor, table: torch.Tensor, vocab: int) -> torch.Tensor:
        """Embeddings of ``ids`` from the rank's rows ``table`` of a vocabulary of ``vocab`` rows."""
        lo, _ = self.vocab_span(vocab)
        local = ids - lo
        inside = (local >= 0) & (local < table.shape[0])
        x = F.embedding(local.clamp(0, table.shape[0] - 1), table) * inside.unsqueeze(-1).to(table.dtype)
        return self.all_reduce(x)

    def gather_logits(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """The full ``[rows, vocab]`` logits from each rank's ``[rows, vocab_rows]`` part."""
        import torch.distributed as dist

        parts = [torch.empty_like(logits) for _ in range(self.world_size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab]


def parallel_errors(arch: Any, world_size: int, key: str) -> list[str]:
    """Why a world of ``world_size`` ranks cannot split ``arch``'s heads, KV heads and MLP; ``key`` names the config key."""
    sizes = {"attention heads": arch.num_heads, "KV heads": arch.num_kv_heads,
             "MLP intermediate channels": arch.intermediate_size}
    bad = [f"{count} {what}" for what, count in sizes.items() if count % world_size]
    if not bad:
        return []
    common = math.gcd(*sizes.values())
    allowed = [d for d in range(1, common + 1) if common % d == 0]
    return [
        f"{key}: got {world_size}; it must divide the model's {', '.join(bad)} (tensor parallelism splits them "
        f"evenly); allowed: {', '.join(map(str, allowed))}"
    ]


class ShardedDeltas:
    """A rank's view of a :class:`~mindie_host.backends.base.LinearDeltas` provider written for the whole model.

    Column-parallel projections (``qkv``, ``gate_up``): the provider computes the full-width delta
    from the (full) input and the rank keeps its rows' columns. Row-parallel ones (``o``,
    ``down``): the rank's input slice is zero-padded to full width, so the provider's delta is this
    rank's partial sum, completed by the all-reduce that follows the projection (exact for deltas
    linear in the input, as LoRA's are).
    """

    def __init__(self, provider: Any, tp: TensorParallel, arch: Any) -> None:
        self.provider = provider
        self.tp = tp
        hd = arch.head_dim
        self.q, self.kv = arch.num_heads * hd, arch.num_kv_heads * hd
        self.inter = arch.intermediate_size
        self.q_span = tuple(x * hd for x in tp.span(arch.num_heads))
        self.kv_span = tuple(x * hd for x in tp.span(arch.num_kv_heads))
        self.i_span = tp.span(arch.intermediate_size)

    def prepare(self, batch: Any) -> None:
        self.provider.prepare(batch)

    def apply(self, name: str, layer: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if name == "qkv":
            full = self.provider.apply(name, layer, x, x.new_zeros(n, self.q + 2 * self.kv))
            q, k, v = full.split([self.q, self.kv, self.kv], dim=-1)
            (qa, qb), (ka, kb) = self.q_span, self.kv_span
            return y + torch.cat([q[:, qa:qb], k[:, ka:kb], v[:, ka:kb]], dim=-1)
        if name == "gate_up":
            gate, up = self.provider.apply(name, layer, x, x.new_zeros(n, 2 * self.inter)).chunk(2, dim=-1)
            lo, hi = self.i_span
            return y + torch.cat([gate[:, lo:hi], up[:, lo:hi]], dim=-1)
        width, (lo, hi) = (self.q, self.q_span) if name == "o" else (self.inter, self.i_span)
        padded = x.new_zeros(n, width)
        padded[:, lo:hi] = x
        return self.provider.apply(name, layer, padded, y)  # this rank's partial delta, summed by the all-reduce
