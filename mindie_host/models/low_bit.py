"""The low-bit forms a GGUF file stores its matrices in, as the kernels take them: 4-bit groups (Q4_0, Q4_1) and 8-bit
groups (Q8_0; Q6_K exactly, as groups of 16), unpacked from a tensor's blocks with the file's exact values.

:mod:`mindie_host.models.weights` finds which matrices a file holds in these forms and reads them
(:func:`~mindie_host.models.weights.low_bit_readers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class FourBitGroups:
    """A matrix stored as 4-bit codes in groups along the input dimension.

    ``weight[r, c] == codes[r, c] * scale[r, c // group_size] + offset[r, c // group_size]``
    (the dequantized values are exactly the GGUF file's). ``codes`` is uint8 in 0..15,
    ``[rows, cols]``; ``scale`` and ``offset`` are float32 ``[rows, cols // group_size]``.
    """

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    group_size: int = 32

    def dequantize(self) -> np.ndarray:
        """The float32 matrix these groups stand for."""
        rows, cols = self.codes.shape
        g = self.codes.reshape(rows, cols // self.group_size, self.group_size).astype(np.float32)
        return (g * self.scale[..., None] + self.offset[..., None]).reshape(rows, cols)

    @staticmethod
    def concat(parts: list[FourBitGroups]) -> FourBitGroups:
        """Stack matrices with the same input size along their rows (fused QKV, gate+up)."""
        return FourBitGroups(
            np.concatenate([p.codes for p in parts]),
            np.concatenate([p.scale for p in parts]),
            np.concatenate([p.offset for p in parts]),
            parts[0].group_size,
        )


@dataclass
class EightBitGroups:
    """A matrix stored as 8-bit codes in groups along the input dimension (GGUF Q8_0: blocks of 32).

    ``weight[r, c] == codes[r, c] * scale[r, c // group_size]`` (the dequantized values are exactly the GGUF
    file's). ``codes`` is int8 ``[rows, cols]``; ``scale`` float32 ``[rows, cols // group_size]``.
    """

    codes: np.ndarray
    scale: np.ndarray
    group_size: int = 32

    def dequantize(self) -> np.ndarray:
        """The float32 matrix these groups stand for."""
        rows, cols = self.codes.shape
        g = self.codes.reshape(rows, cols // self.group_size, self.group_size).astype(np.float32)
        return (g * self.scale[..., None]).reshape(rows, cols)

    @staticmethod
    def concat(parts: list[EightBitGroups]) -> EightBitGroups:
        """Stack matrices with the same input size along their rows (fused QKV, gate+up)."""
        return EightBitGroups(np.concatenate([p.codes for p in parts]), np.concatenate([p.scale for p in parts]),
                              parts[0].group_size)


def eight_bit_from_gguf(tensor: Any) -> EightBitGroups:
    """Unpack a Q8_0 GGUF tensor's blocks: an fp16 scale ``d``, then 32 int8 codes, meaning ``q * d``."""
    rows = int(tensor.shape[1])
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1, 34)
    scale = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = raw[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return EightBitGroups(np.ascontiguousarray(codes), scale, 32)


#: rows of a Q6_K matrix unpacked at a time (bounds the unpacking's temporaries to a few MB per 1,000 columns)
Q6_K_ROWS = 2048


def six_bit_from_gguf(tensor: Any) -> EightBitGroups:
    """Unpack a Q6_K GGUF tensor's blocks as 8-bit groups of 16, exactly.

    A Q6_K block covers 256 inputs: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 scales (one per
    16 inputs) and an fp16 ``d``, meaning ``(d * scale_j) * q`` with ``q`` in -32..31. ``d * scale_j`` is exact in
    float32 (11 by 8 significant bits), so codes ``q`` with that scale per group of 16 give the values gguf's own
    ``dequantize`` gives, bit for bit (the same float32 product)."""
    rows = int(tensor.shape[1])
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1, 210)
    blocks = raw.shape[1]
    codes = np.empty((rows, blocks * 256), dtype=np.int8)
    scale = np.empty((rows, blocks * 16), dtype=np.float32)
    low_shift = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    high_shift = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    for r in range(0, rows, Q6_K_ROWS):
        chunk = raw[r : r + Q6_K_ROWS].reshape(-1, 210)
        n = chunk.shape[0]
        d = chunk[:, 208:210].copy().view(np.float16).astype(np.float32)  # [n, 1]
        scale[r : r + Q6_K_ROWS] = (d * chunk[:, 192:208].copy().view(np.int8).astype(np.float32)).reshape(-1, blocks * 16)
        ql = ((chunk[:, :128].reshape(n, -1, 1, 64) >> low_shift) & np.uint8(0x0F)).reshape(n, -1, 32)
        qh = ((chunk[:, 128:192].reshape(n, -1, 1, 32) >> high_shift) & np.uint8(0x03)).reshape(n, -1, 32)
        q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
        codes[r : r + Q6_K_ROWS] = q.reshape(-1, blocks * 256)
    return EightBitGroups(codes, scale, 16)


def four_bit_from_gguf(tensor: Any) -> FourBitGroups | None:
    """Unpack a Q4_0 or Q4_1 GGUF tensor's blocks; None for any other type.

    A block covers 32 inputs: an fp16 scale ``d`` (Q4_1 adds an fp16 minimum ``m``),
    then 16 bytes whose low nibbles are inputs 0..15 and high nibbles inputs 16..31.
    Q4_0 means ``(q - 8) * d``, Q4_1 means ``q * d + m``.
    """
    import gguf

    kind = tensor.tensor_type
    if kind not in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
        return None
    block_bytes = 18 if kind == gguf.GGMLQuantizationType.Q4_0 else 20
    rows = int(tensor.shape[1])
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1, block_bytes)
    header = block_bytes - 16
    scale = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == gguf.GGMLQuantizationType.Q4_1:
        offset = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        offset = -8.0 * scale
    qs = raw[..., header:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)
    return FourBitGroups(np.ascontiguousarray(codes), scale, offset, 32)
