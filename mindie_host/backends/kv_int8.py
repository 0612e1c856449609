"""``kvCacheDtype: int8``: a KV cache of int8 codes with one scale per token and KV head.

:class:`Int8KVCache` stands where a ``[num_slots, KV, D]`` cache tensor stands and answers
the two calls the paged-attention code makes on one
(:meth:`Platform.write_kv <mindie_host.backends.platform.Platform.write_kv>` and
:func:`~mindie_host.backends.platform.gather_slots`): ``index_copy_`` quantizes the new
tokens' K or V on write (each head's ``D`` values share the scale ``absmax / 127``), and
``index_select`` dequantizes the gathered slots into the model's dtype for attention. A slot
costs ``D + 4`` bytes per head instead of ``4 D`` (fp32) or ``2 D`` (bf16).
"""

from __future__ import annotations

import torch

from .int8 import QMAX


class Int8KVCache:
    """One layer's K (or V) cache in int8, with a float32 scale per slot and KV head."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        if len(shape) != 3:
            raise ValueError(f"the int8 KV cache needs a slot-major [slots, KV, D] layout, got shape {shape}")
        self.codes = torch.zeros(shape, dtype=torch.int8, device=device)
        self.scales = torch.zeros(shape[:2], dtype=torch.float32, device=device)
        #: the dtype the cache reads back in (the model's); writes accept any float dtype
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @staticmethod
    def bytes_per_slot(num_kv_heads: int, head_dim: int) -> int:
        """Bytes one slot (one token of one layer's K or V) takes."""
        return num_kv_heads * (head_dim + 4)

    def index_copy_(self, dim: int, index: torch.Tensor, source: torch.Tensor) -> Int8KVCache:
        """Quantize ``source [T, KV, D]`` and store it at slots ``index``."""
        if dim != 0:
            raise ValueError("the int8 KV cache is written by slot (dim 0)")
        x = source.float()
        scale = x.abs().amax(dim=-1).clamp_min(1e-8) / QMAX  # [T, KV]
        codes = torch.round(x / scale.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
        self.codes.index_copy_(0, index, codes)
        self.scales.index_copy_(0, index, scale)
        return self

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """The slots ``index`` dequantized, ``[len(index), KV, D]`` in the model's dtype."""
        if dim != 0:
            raise ValueError("the int8 KV cache is read by slot (dim 0)")
        codes = self.codes.index_select(0, index)
        scales = self.scales.index_select(0, index)
        return (codes.to(self.dtype) * scales.unsqueeze(-1).to(self.dtype)).to(self.dtype)
