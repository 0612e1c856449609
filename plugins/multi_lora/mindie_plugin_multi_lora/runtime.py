"""The LoRA runtime a backend calls inside its forward pass: slot pools and batched kernels.

Every target module has a weight pool with one *slot* per resident adapter:
``A`` pools hold ``[slots, group*R, in]`` per layer (the modules that share an
input — q/k/v, gate/up — are stacked so one matmul shrinks them all) and ``B``
pools hold ``[slots, R, out]`` per module, with the adapter's scaling folded in. ``R`` is
``maxLoraRank``; an adapter of lower rank fills its first ``r`` rows and leaves the
rest zero, so mixed ranks share one shape.

Each step :meth:`LoraRuntime.prepare` turns the batch's per-sequence slot
indices into per-token selections, then each ``apply_*`` adds every token's own
``x A_s^T B_s`` to the base projection (Punica's BGMV/SGMV, S-LoRA's
unmerged ``xW + xAB``). Three kernels, same result:

* ``grouped`` (the default on CPU): tokens are gathered by slot into a padded
  ``[slots, m, in]`` block, one ``bmm`` shrinks them through their own slot's A,
  one ``bmm`` per module expands through their own B, and ``index_add_`` puts the
  deltas back (a padded BGMV: only each token's own adapter is computed).

* ``masked`` (the default on accelerators, where few large kernels beat many
  small ones): one GEMM shrinks ``x`` against the A rows of
  all slots in play, a per-token one-hot mask keeps each token's own slot (base
  tokens keep nothing), and one GEMM per module expands through the stacked B.
  No loop over adapters and no per-token weight gathers.
* ``segment`` (long prefills): tokens of one sequence are contiguous, so runs of
  consecutive tokens on the same slot are multiplied by that slot's A and B
  directly (Punica's SGMV), skipping base-only runs; ``auto`` picks it when runs
  are long (prefills of long prompts).

Neither merges weights into the base model nor splits the batch: the base
projection runs once over all tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .adapters import MODULES, LoraAdapter, ModelDims

#: Groups of modules that read the same input, in the order the fused base projections lay them out.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
KERNELS = ("auto", "grouped", "masked", "segment")


@dataclass
class _Step:
    """Per-step selection state built by :meth:`LoraRuntime.prepare`."""

    kernel: str
    sel: torch.Tensor | None = None  # slots in play (None = every slot, in order)
    k: int = 0  # number of slots in play
    mask: torch.Tensor | None = None  # masked: [n, k] one-hot (None: every token on the one slot in play)
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # segment: (start, end, slot)
    rows: torch.Tensor | None = None  # grouped: [k * m] token index per padded row
    valid: torch.Tensor | None = None  # grouped: [k, m, 1] 1 for real rows, 0 for padding (None: no padding)
    m: int = 0  # grouped: rows per slot


class LoraRuntime:
    """Slot pools for ``slots`` resident adapters of rank <= ``max_rank``, plus the batched kernels."""

    def __init__(
        self,
        dims: ModelDims,
        slots: int,
        max_rank: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        kernel: str = "auto",
        segment_min_run: int = 64,
    ) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.dims = dims
        self.slots = slots
        self.rank = max_rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.kernel = kernel
        self.segment_min_run = segment_min_run
        L, R = dims.num_layers, max_rank
        self.a_pool: dict[str, torch.Tensor] = {}
        self.b_pool: dict[str, torch.Tensor] = {}
        self.out_sizes: dict[str, list[int]] = {}
        for group, modules in GROUPS.items():
            fin = dims.features(modules[0])[0]
            self.a_pool[group] = torch.zeros(L, slots, len(modules) * R, fin, device=self.device, dtype=dtype)
            self.out_sizes[group] = [dims.features(m)[1] for m in modules]
            for m in modules:
                self.b_pool[m] = torch.zeros(L, slots, R, dims.features(m)[1], device=self.device, dtype=dtype)
        self._step: _Step | None = None
        #: bumped whenever a slot's weights change (the host re-sends the runtime to tensor-parallel ranks)
        self.version = 0
        self.steps = 0
        self.max_slots_in_step = 0
        self.max_kinds_in_step = 0  # distinct adapters plus the base model, in one step

    # -- slots -----------------------------------------------------------------------------
    def write_slot(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy ``adapter`` into ``slot`` (zero-padding its rank to ``R``); modules it lacks stay zero."""
        self.clear_slot(slot)
        R = self.rank
        for (layer, module), (a, b) in adapter.weights.items():
            group = next(g for g, ms in GROUPS.items() if module in ms)
            j = GROUPS[group].index(module)
            r = a.shape[0]
            self.a_pool[group][layer, slot, j * R : j * R + r].copy_(a.to(self.dtype))
            self.b_pool[module][layer, slot, :r].copy_(b.t().to(self.dtype))
        self.version += 1

    def clear_slot(self, slot: int) -> None:
        """Zero every pool row of ``slot``."""
        for pool in [*self.a_pool.values(), *self.b_pool.values()]:
            pool[:, slot].zero_()
        self.version += 1

    def pool_bytes(self) -> int:
        """Device memory held by the pools."""
        return sum(t.numel() * t.element_size() for t in [*self.a_pool.values(), *self.b_pool.values()])

    # -- per step ------------------------------------------------------------------------------
    def prepare(self, batch: object) -> None:
        """Build the per-token slot selection for one step (``batch`` is a ``ModelInput``)."""
        seq_slots: list[int] = list(batch.row_variants)  # type: ignore[attr-defined]
        q_lens: list[int] = list(batch.query_lens)  # type: ignore[attr-defined]
        n = sum(q_lens)
        runs: list[tuple[int, int, int]] = []
        pos = 0
        for slot, q in zip(seq_slots, q_lens):
            if slot >= 0:
                if runs and runs[-1][2] == slot and runs[-1][1] == pos:
                    runs[-1] = (runs[-1][0], pos + q, slot)
                else:
                    runs.append((pos, pos + q, slot))
            pos += q
        active = sorted({s for s in seq_slots if s >= 0})
        self.steps += 1
        self.max_slots_in_step = max(self.max_slots_in_step, len(active))
        self.max_kinds_in_step = max(self.max_kinds_in_step, len(active) + (1 if -1 in seq_slots else 0))
        kernel = self.kernel
        if kernel == "auto":
            covered = sum(e - s for s, e, _ in runs)
            if runs and covered // len(runs) >= self.segment_min_run:
                kernel = "segment"
            else:
                kernel = "grouped" if self.device.type == "cpu" else "masked"
        if kernel == "segment":
            self._step = _Step("segment", runs=runs)
        elif kernel == "grouped":
            self._step = self._prepare_grouped(runs, active)
        else:
            self._step = self._prepare_masked(runs, active, n)

    def _prepare_masked(self, runs: list[tuple[int, int, int]], active: list[int], n: int) -> _Step:
        # gather only the slots in play when that saves real work; else multiply by every slot
        use_all = 2 * len(active) > self.slots
        chosen = list(range(self.slots)) if use_all else active
        col = {s: i for i, s in enumerate(chosen)}
        k = len(chosen)
        mask: torch.Tensor | None = None
        if not (len(runs) == 1 and runs[0][1] - runs[0][0] == n and not use_all):  # else: one slot, every token
            token_col = torch.full((n,), k, dtype=torch.long)  # base tokens land in a spare column, dropped
            for s, e, slot in runs:
                token_col[s:e] = col[slot]
            onehot = torch.zeros(n, k + 1, dtype=self.dtype)
            onehot[torch.arange(n), token_col] = 1.0
            mask = onehot[:, :k].to(self.device, non_blocking=True)
        sel = None if use_all else torch.tensor(chosen, dtype=torch.long, device=self.device)
        return _Step("masked", sel=sel, k=k, mask=mask)

    def _prepare_grouped(self, runs: list[tuple[int, int, int]], active: list[int]) -> _Step:
        per_slot: dict[int, list[int]] = {s: [] for s in active}
        for s, e, slot in runs:
            per_slot[slot].extend(range(s, e))
        m = max(len(v) for v in per_slot.values())
        rows: list[int] = []
        valid: list[float] = []
        for slot in active:
            tokens = per_slot[slot]
            pad = m - len(tokens)
            rows.extend(tokens + [tokens[0]] * pad)
            valid.extend([1.0] * len(tokens) + [0.0] * pad)
        padded = any(v == 0.0 for v in valid)
        k = len(active)
        use_all = k == self.slots
        return _Step(
            "grouped",
            sel=None if use_all else torch.tensor(active, dtype=torch.long, device=self.device),
            k=k,
            rows=torch.tensor(rows, dtype=torch.long, device=self.device),
            valid=torch.tensor(valid, dtype=self.dtype, device=self.device).view(k, m, 1) if padded else None,
            m=m,
        )

    # -- kernels ----------------------------------------------------------------------------
    def _apply(self, group: str, layer: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        step = self._step
        if step is None:
            return out
        if step.kernel == "segment":
            return self._apply_segments(step, group, layer, x, out)
        if step.kernel == "grouped":
            return self._apply_grouped(step, group, layer, x, out)
        return self._apply_masked(step, group, layer, x, out)

    def _apply_masked(self, step: _Step, group: str, layer: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        modules, sizes = GROUPS[group], self.out_sizes[group]
        G, R, k, n = len(modules), self.rank, step.k, x.shape[0]
        a = self.a_pool[group][layer]  # [slots, G*R, in]
        if step.sel is not None:
            a = a.index_select(0, step.sel)
        t = F.linear(x, a.reshape(k * G * R, a.shape[-1]))  # [n, k*G*R]: shrink through every slot in play
        if step.mask is not None:
            t = (t.view(n, k, G * R) * step.mask.view(n, k, 1)).view(n, k * G * R)
        t4 = t.view(n, k, G, R)
        off = 0
        for j, (module, size) in enumerate(zip(modules, sizes)):
            b = self.b_pool[module][layer]  # [slots, R, out]
            if step.sel is not None:
                b = b.index_select(0, step.sel)
            tj = t4[:, :, j].reshape(n, k * R) if G > 1 else t
            out[:, off : off + size].addmm_(tj, b.reshape(k * R, size))
            off += size
        return out

    def _apply_grouped(self, step: _Step, group: str, layer: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        modules, sizes = GROUPS[group], self.out_sizes[group]
        R, k, m = self.rank, step.k, step.m
        assert step.rows is not None
        a = self.a_pool[group][layer]  # [slots, G*R, in]
        if step.sel is not None:
            a = a.index_select(0, step.sel)
        xg = x.index_select(0, step.rows).view(k, m, x.shape[-1])
        t = torch.bmm(xg, a.transpose(1, 2))  # [k, m, G*R]: each token through its own slot's A
        if step.valid is not None:
            t = t * step.valid
        off = 0
        for j, (module, size) in enumerate(zip(modules, sizes)):
            b = self.b_pool[module][layer]  # [slots, R, out]
            if step.sel is not None:
                b = b.index_select(0, step.sel)
            delta = torch.bmm(t[:, :, j * R : (j + 1) * R], b)  # [k, m, out]
            out[:, off : off + size].index_add_(0, step.rows, delta.view(k * m, size))
            off += size
        return out

    def _apply_segments(self, step: _Step, group: str, layer: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        modules, sizes = GROUPS[group], self.out_sizes[group]
        R = self.rank
        a_all = self.a_pool[group][layer]
        for start, end, slot in step.runs:
            t = F.linear(x[start:end], a_all[slot])  # [m, G*R]
            off = 0
            for j, (module, size) in enumerate(zip(modules, sizes)):
                out[start:end, off : off + size].addmm_(t[:, j * R : (j + 1) * R], self.b_pool[module][layer, slot])
                off += size
        return out

    def apply(self, name: str, layer: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` plus each token's adapter delta for projection ``name`` (``"qkv"``, ``"o"``, ``"gate_up"``,
        ``"down"``: the core's :class:`~mindie_host.api.LinearDeltas` seam); fused projections get every
        member's delta."""
        return self._apply(name, layer, x, out)

assert all(m in MODULES for ms in GROUPS.values() for m in ms)
