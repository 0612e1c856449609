"""Device/platform abstraction shared by the torch-based backends (CPU, CUDA, and Ascend NPU in a plugin).

A :class:`Platform` names a device, reports its memory, names the distributed
backend (gloo, NCCL, HCCL) and provides the few operators a platform may want to
replace with fused kernels: RMSNorm, rotary embedding and attention over the
paged KV cache. The model code in :mod:`mindie_host.backends.torch.model` calls
only these, so the Ascend plugin reuses the model unchanged with its own
operators (the role vllm-ascend's Platform class plays for vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        import os

        pages = os.sysconf("SC_PHYS_PAGES")
        avail = os.sysconf("SC_AVPHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
        return avail * size, pages * size

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

    def default_dtype(self) -> torch.dtype:
        """The weight dtype used when the config says ``auto``."""
        return torch.float32

    # -- operators ------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension."""
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply rotary embedding (HF's rotate-half convention). q: [T, H, D], k: [T, KV, D], cos/sin: [T, 1, D]."""
        return _rope(q, cos, sin), _rope(k, cos, sin)

    def write_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Store the new tokens' K and V at their slots. Caches are [num_slots, KV, D]."""
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

    def paged_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Causal attention of the new tokens over each sequence's cached context.

        q: [T, H, D] -> returns [T, H, D].
        """
        num_seqs, max_q = meta.num_seqs, meta.max_query_len
        heads, dim = q.shape[1], q.shape[2]
        keys = k_cache[meta.gather_index].transpose(1, 2)  # [B, KV, ctx, D]
        values = v_cache[meta.gather_index].transpose(1, 2)
        if meta.pad_index is None:
            qb = q.view(num_seqs, max_q, heads, dim)
        else:
            qb = q.new_zeros(num_seqs * max_q, heads, dim)
            qb[meta.pad_index] = q
            qb = qb.view(num_seqs, max_q, heads, dim)
        out = F.scaled_dot_product_attention(
            qb.transpose(1, 2).to(keys.dtype),
            keys,
            values,
            attn_mask=meta.attn_mask,
            scale=scale,
            enable_gqa=keys.shape[1] != heads,
        )  # [B, H, max_q, D]
        out = out.transpose(1, 2).reshape(num_seqs * max_q, heads, dim).to(q.dtype)
        if meta.pad_index is not None:
            out = out[meta.pad_index]
        return out


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

    def memory_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


PLATFORMS: dict[str, type[Platform]] = {"cpu": Platform, "cuda": CudaPlatform}


def select_platform(device: str = "auto") -> Platform:
    """The platform for a config ``device`` value: ``auto`` prefers CUDA when present."""
    if device == "auto":
        return CudaPlatform() if CudaPlatform.is_available() else Platform()
    cls = PLATFORMS.get(device)
    if cls is None:
        raise RuntimeError(f"device {device!r} is not served by the torch backend; allowed: auto, {', '.join(PLATFORMS)}")
    if not cls.is_available():
        raise RuntimeError(f"device {device!r} was requested but is not available in this process")
    return cls()
