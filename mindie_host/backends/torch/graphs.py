"""Decode steps replayed from captured CUDA graphs.

A decode step of a small model on a GPU is launch-bound: a few hundred kernels of
a few microseconds each, queued one by one from Python. Capturing the whole step
(every layer and the LM head) once as a CUDA graph and replaying it turns that
into one launch. A graph fixes its tensor shapes and addresses, so steps are
padded to a few *buckets*: the batch up to the next of :data:`BATCH_BUCKETS`, the
longest context up to a power of two (at least :data:`MIN_CONTEXT_BUCKET`). Each
bucket owns its static input tensors; a step copies its inputs into them,
pads the rest, and replays.

Padded rows are harmless by construction: their token id and position are 0,
their new K/V go to a *scratch slot* that no sequence owns (the backend
allocates one spare cache block for it), and they attend only to slot 0, so no
real sequence's cache or output changes.

Where graphs cannot be captured (the CPU), :class:`DecodeGraphs` runs the same
padded static step eagerly, which is how its padding is tested without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("mindie_host.backends.torch.graphs")

#: batch sizes a decode step is padded up to
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
#: the smallest context bucket; larger ones are powers of two
MIN_CONTEXT_BUCKET = 128

#: the captured function: (ids, positions, logits rows, slot mapping, gather index, mask) -> logits
StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def context_bucket(context_len: int) -> int:
    """The padded context length for a step whose longest context is ``context_len``."""
    bucket = MIN_CONTEXT_BUCKET
    while bucket < context_len:
        bucket *= 2
    return bucket


def batch_bucket(num_seqs: int) -> int | None:
    """The padded batch size for ``num_seqs`` sequences (``None`` above the largest bucket)."""
    for bucket in BATCH_BUCKETS:
        if bucket >= num_seqs:
            return bucket
    return None


@dataclass
class _Bucket:
    """One captured shape: its static inputs, its output and (on CUDA) its graph."""

    ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    rows: torch.Tensor  # [B] = arange(B): every row's logits
    slots: torch.Tensor  # [B] where each row's new K/V go
    gather: torch.Tensor  # [B, C] cache slots of each row's context
    mask: torch.Tensor  # [B, 1, 1, C] which of those each row attends to
    out: torch.Tensor | None = None
    graph: Any = None


class DecodeGraphs:
    """Decode steps of up to ``max_seqs`` sequences and ``max_context`` tokens, padded to buckets and
    replayed from CUDA graphs (captured on first use, or ahead with :meth:`capture`).

    ``step`` is the whole decode step from tensors to float logits; ``scratch_slot`` is a KV-cache
    slot that no sequence uses; ``use_graphs`` is false on devices without CUDA graphs, where the
    padded step runs eagerly.
    """

    def __init__(
        self,
        step: StepFn,
        device: torch.device,
        scratch_slot: int,
        max_seqs: int,
        max_context: int,
        use_graphs: bool,
    ) -> None:
        self.step = step
        self.device = device
        self.scratch_slot = scratch_slot
        self.max_seqs = max_seqs
        self.max_context = max_context
        self.use_graphs = use_graphs
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.failed: set[tuple[int, int]] = set()  # buckets whose capture ran out of device memory
        self.pool: Any = None
        self.replays = 0  # steps served from a bucket (for stats and tests)

    def covers(self, num_seqs: int, context_len: int) -> bool:
        """Whether a decode step of this size can run from a bucket."""
        rows, ctx = batch_bucket(num_seqs), context_bucket(context_len)
        return rows is not None and rows <= self.max_seqs and ctx <= self.max_context and (rows, ctx) not in self.failed

    def capture(self, num_seqs: int, context_len: int) -> None:
        """Capture (ahead of need) the bucket that serves steps of this size."""
        self._bucket(num_seqs, context_len)

    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        gather_index: torch.Tensor,
        attn_mask: torch.Tensor,
    ) -> torch.Tensor | None:
        """Logits ``[num_seqs, vocab]`` of one decode step (each sequence brings one token), or ``None``
        when its bucket could not be captured (the caller then runs the step unpadded)."""
        n, ctx = gather_index.shape
        b = self._bucket(n, ctx)
        if b is None:
            return None
        b.ids.zero_()
        b.ids[:n].copy_(ids)
        b.positions.zero_()
        b.positions[:n].copy_(positions)
        b.slots.fill_(self.scratch_slot)
        b.slots[:n].copy_(slot_mapping)
        b.gather.zero_()
        b.gather[:n, :ctx].copy_(gather_index)
        b.mask.zero_()
        b.mask[:n, :, :, :ctx].copy_(attn_mask)
        b.mask[n:, :, :, 0] = True  # padded rows attend to slot 0 only, so their softmax stays finite
        self.replays += 1
        if b.graph is not None:
            b.graph.replay()
            assert b.out is not None
            return b.out[:n]
        return self._call(b)[:n]

    # -- buckets ------------------------------------------------------------------------
    def _call(self, b: _Bucket) -> torch.Tensor:
        return self.step(b.ids, b.positions, b.rows, b.slots, b.gather, b.mask)

    def _bucket(self, num_seqs: int, context_len: int) -> _Bucket | None:
        key = (batch_bucket(num_seqs) or num_seqs, context_bucket(context_len))
        found = self.buckets.get(key)
        if found is not None or key in self.failed:
            return found
        rows, ctx = key
        dev = self.device
        b = _Bucket(
            ids=torch.zeros(rows, dtype=torch.long, device=dev),
            positions=torch.zeros(rows, dtype=torch.long, device=dev),
            rows=torch.arange(rows, device=dev),
            slots=torch.full((rows,), self.scratch_slot, dtype=torch.long, device=dev),
            gather=torch.zeros(rows, ctx, dtype=torch.long, device=dev),
            mask=torch.zeros(rows, 1, 1, ctx, dtype=torch.bool, device=dev),
        )
        b.mask[:, :, :, 0] = True  # while capturing, every row is a padded row
        if self.use_graphs:
            try:
                with torch.inference_mode():
                    self._capture(b)
            except torch.OutOfMemoryError:
                # the KV cache took most of the device; steps of this size run eagerly, unpadded
                log.warning("no device memory to capture the decode graph for %d sequences x %d tokens", *key)
                self.failed.add(key)
                torch.cuda.empty_cache()
                return None
        self.buckets[key] = b
        return b

    def _capture(self, b: _Bucket) -> None:
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm up off the capture (lazy inits, kernel selection)
            for _ in range(2):
                self._call(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            b.out = self._call(b)
        b.graph = graph
