"""int8 weight formats for the ``w8a16`` and ``w8a8`` quantization schemes.

Each class is a callable weight as :func:`~mindie_host.backends.linear.apply_linear`
expects (``weight(x, bias)``), built from an :class:`Int8Matrix` (int8 codes with one
scale per output channel) by :meth:`Platform.prepare_int8
<mindie_host.backends.platform.Platform.prepare_int8>`. None keeps a floating-point copy
of the matrix: a quantised model holds one byte per weight.

- :class:`W8A16Weight`: weight-only; activations stay in the model's dtype.
- :class:`W8A8DynamicWeight`: activations quantised to int8 per token at run time, an
  int8 x int8 -> int32 product (``torch._int_mm``: oneDNN on CPU, cuBLASLt on CUDA), then
  both scales applied to the int32 result.
- :class:`W8A8StaticWeight`: activations quantised with one calibrated scale and offset
  for the whole tensor (msModelSlim's ``W8A8`` layers), the offset compensated by an int32
  ``quant_bias``.

Where no int8 product exists (``_int_mm`` missing, or a CUDA product of few rows, which
cuBLASLt refuses) the same integer product runs in floating point on the int8 values: the
numerics are those of the scheme, only the speed is not.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_matmul, cpu_profile
from .cpu_matmul import LowBitTiles

#: the int8 code range used for symmetric weights and activations
QMAX = 127


@dataclass
class Int8Matrix:
    """A ``[out, in]`` matrix as int8 codes: ``W[r, c] == (codes[r, c] - offset[r]) * scale[r]``.

    ``act`` says how its input is fed to the product: ``"none"`` (weight-only, w8a16),
    ``"dynamic"`` (int8 per token at run time) or ``"static"`` (int8 with the calibrated
    ``input_scale`` / ``input_offset``); ``"float"`` serves the dequantized values. ``bias`` is an output bias the matrix adds itself
    (a norm's bias folded through it), independent of the layer's own bias.
    """

    codes: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out]
    offset: torch.Tensor | None = None  # float32 [out]; None = symmetric
    act: str = "none"
    input_scale: float | None = None
    input_offset: float | None = None
    bias: torch.Tensor | None = None  # float32 [out]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix these codes stand for."""
        q = self.codes.float()
        if self.offset is not None:
            q = q - self.offset[:, None]
        return q * self.scale[:, None]

    def symmetric(self) -> Int8Matrix:
        """The same matrix with zero offsets (an asymmetric one is re-quantised per channel)."""
        if self.offset is None or not bool(self.offset.any()):
            return Int8Matrix(self.codes, self.scale, None, self.act, self.input_scale, self.input_offset, self.bias)
        q = quantize_per_channel(self.dequantize())
        return Int8Matrix(q.codes, q.scale, None, self.act, self.input_scale, self.input_offset, self.bias)

    @staticmethod
    def concat(parts: list[Int8Matrix]) -> Int8Matrix:
        """Stack matrices with the same input size and activation treatment along their rows (fused QKV, gate+up).

        Static activation quantizers that differ are widened to one covering every part's range.
        """
        acts = {p.act for p in parts}
        if len(acts) != 1:
            raise ValueError(f"fused matrices need one activation treatment, got {sorted(acts)}")
        act = parts[0].act
        input_scale, input_offset = parts[0].input_scale, parts[0].input_offset
        if act == "static" and len({(p.input_scale, p.input_offset) for p in parts}) > 1:
            lo = min((-128 - float(p.input_offset or 0)) * float(p.input_scale or 1) for p in parts)
            hi = max((127 - float(p.input_offset or 0)) * float(p.input_scale or 1) for p in parts)
            input_scale = (hi - lo) / 255
            input_offset = float(round(-128 - lo / input_scale))
        offset = None
        if any(p.offset is not None for p in parts):
            offset = torch.cat([p.offset if p.offset is not None else torch.zeros(p.shape[0]) for p in parts])
        bias = None
        if any(p.bias is not None for p in parts):
            bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.shape[0]) for p in parts])
        return Int8Matrix(
            torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), offset, act, input_scale,
            input_offset, bias,
        )


def quantize_per_channel(weight: torch.Tensor, act: str = "none") -> Int8Matrix:
    """Symmetric int8 codes with one scale per output channel (row) of a float ``[out, in]`` matrix."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / QMAX
    codes = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return Int8Matrix(codes.contiguous(), scale, None, act)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and float32 scales ``[rows, 1]`` of a ``[rows, in]`` activation, one scale per row."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / QMAX
    return torch.round(xf / scale).clamp_(-QMAX, QMAX).to(torch.int8), scale


def int_mm_available(device: torch.device) -> bool:
    """Whether torch has an int8 x int8 -> int32 product for this device and runs it natively: on CPU only with
    VNNI or AVX2's 8-bit multiply-add (:attr:`CpuProfile.int8_products
    <mindie_host.backends.cpu_profile.CpuProfile.int8_products>`). ``MINDIE_HOST_INT_MM=0`` turns it off."""
    if os.environ.get("MINDIE_HOST_INT_MM", "1") == "0" or not hasattr(torch, "_int_mm"):
        return False
    if device.type == "cpu":
        return cpu_profile.profile().int8_products is not None
    return device.type == "cuda"


def int8_product(xq: torch.Tensor, wt: torch.Tensor, use_int_mm: bool) -> torch.Tensor:
    """``xq @ wt`` for int8 ``xq [m, k]`` and int8 ``wt [k, n]``, as int32 (or exact-integer float32 in the fallback)."""
    if use_int_mm:
        m = xq.shape[0]
        if xq.device.type == "cuda" and (m <= 16 or m % 8):
            # cuBLASLt's int8 GEMM wants more than 16 rows, in multiples of 8: pad, then drop the padding
            rows = max(32, -(-m // 8) * 8)
            return torch._int_mm(F.pad(xq, (0, 0, 0, rows - m)), wt)[:m]
        return torch._int_mm(xq, wt)
    return xq.float() @ wt.float()


class QuantizedWeight(ABC):
    """A prepared int8 weight: callable as ``weight(x, bias)``; ``shape`` is ``[out, in]``."""

    def __init__(self, matrix: Int8Matrix, device: torch.device) -> None:
        self.out_features, self.in_features = matrix.shape
        self.extra_bias = None if matrix.bias is None else matrix.bias.to(device)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the prepared weight holds."""

    @abstractmethod
    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for a 2-D ``x``, in float32 or ``x``'s dtype."""

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        out = self.product(x.reshape(-1, x.shape[-1])).to(x.dtype).reshape(*lead, self.out_features)
        if self.extra_bias is not None:
            out = out + self.extra_bias.to(out.dtype)
        return out if bias is None else out + bias


class W8A16Weight(QuantizedWeight):
    """int8 weights, one scale per output channel; activations in 16-bit floating point.

    On CPU, products of at most :attr:`kernel_rows` rows (decode) read the int8 codes and scale
    each output: this package's low-bit kernel when it is on (:mod:`~mindie_host.backends.cpu_matmul`),
    else ``_weight_int8pack_mm``; the activations are rounded to the CPU profile's compute dtype
    (bfloat16 with native bf16, else float32). Larger products (prefill, big batches), and every
    product on other devices, widen the codes to the activations' dtype and run the dense GEMM
    (``(x @ q.T) * scale`` is the same sum).
    """

    #: up to this many rows the int8 kernel beats widening the codes for a dense product
    kernel_rows = 16

    def __init__(self, matrix: Int8Matrix, device: torch.device) -> None:
        super().__init__(matrix, device)
        m = matrix.symmetric()
        self.codes = m.codes.to(device).contiguous()
        self.scale = m.scale.to(device=device, dtype=torch.float32)
        self.packed_kernel = device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")
        self.act_dtype = cpu_profile.profile().compute_dtype if device.type == "cpu" else torch.bfloat16
        self.scale_act = self.scale.to(self.act_dtype)
        self.tiles = (LowBitTiles.per_channel(self.codes, self.scale)
                      if device.type == "cpu" and cpu_matmul.loaded() else None)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scale.numel()

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None and x.shape[0] <= self.kernel_rows and cpu_matmul.loaded():
            return self.tiles(x)
        if self.packed_kernel and x.shape[0] <= self.kernel_rows:
            return torch.ops.aten._weight_int8pack_mm(x.to(self.act_dtype).contiguous(), self.codes, self.scale_act)
        return F.linear(x, self.codes.to(x.dtype)) * self.scale.to(x.dtype)


class W8A8DynamicWeight(QuantizedWeight):
    """int8 weights per output channel and int8 activations per token, quantised for each product.

    ``y = (q(x) @ q(W).T) * s_x[:, None] * s_w[None, :]`` with the int8 product in int32.
    """

    def __init__(self, matrix: Int8Matrix, device: torch.device) -> None:
        super().__init__(matrix, device)
        m = matrix.symmetric()
        self.wt = m.codes.to(device).t().contiguous()  # [in, out]: the layout _int_mm takes
        self.scale = m.scale.to(device=device, dtype=torch.float32)
        self.use_int_mm = int_mm_available(device)

    @property
    def nbytes(self) -> int:
        return self.wt.numel() + 4 * self.scale.numel()

    def product(self, x: torch.Tensor) -> torch.Tensor:
        xq, sx = quantize_per_token(x)
        acc = int8_product(xq, self.wt, self.use_int_mm)
        return acc.float() * sx * self.scale


class W8A8StaticWeight(QuantizedWeight):
    """msModelSlim's static ``W8A8``: one calibrated activation scale and offset for the tensor.

    ``q(x) = clamp(round(x / input_scale + input_offset))``; the product is
    ``(q(x) @ q(W).T + quant_bias) * deq_scale`` where ``deq_scale = input_scale * s_w`` and
    ``quant_bias = -input_offset * sum_c q(W)[r, c]`` removes the offset again.
    """

    def __init__(self, matrix: Int8Matrix, device: torch.device) -> None:
        super().__init__(matrix, device)
        m = matrix.symmetric()
        assert m.input_scale is not None
        self.input_scale = float(m.input_scale)
        self.input_offset = float(m.input_offset or 0.0)
        self.wt = m.codes.to(device).t().contiguous()
        self.deq_scale = (m.scale * self.input_scale).to(device=device, dtype=torch.float32)
        self.quant_bias = (-self.input_offset * m.codes.float().sum(dim=1)).to(device)
        self.use_int_mm = int_mm_available(device)

    @property
    def nbytes(self) -> int:
        return self.wt.numel() + 8 * self.deq_scale.numel()

    def product(self, x: torch.Tensor) -> torch.Tensor:
        xq = torch.round(x.float() / self.input_scale + self.input_offset).clamp_(-128, 127).to(torch.int8)
        acc = int8_product(xq, self.wt, self.use_int_mm)
        return (acc.float() + self.quant_bias) * self.deq_scale


class DequantizedWeight(QuantizedWeight):
    """The matrix's dequantized float values (``quantization: none`` on an int8 checkpoint whose
    layers carry a folded bias): the floating-point reference of the checkpoint."""

    def __init__(self, matrix: Int8Matrix, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(matrix, device)
        self.weight = matrix.dequantize().to(device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))


def prepare_int8_weight(matrix: Int8Matrix, device: torch.device, dtype: torch.dtype = torch.float32) -> QuantizedWeight:
    """The weight class for ``matrix``'s activation treatment (``float``: dequantized), on ``device``."""
    if matrix.act == "float":
        return DequantizedWeight(matrix, device, dtype)
    if matrix.act == "none":
        return W8A16Weight(matrix, device)
    if matrix.act == "dynamic":
        return W8A8DynamicWeight(matrix, device)
    if matrix.act == "static":
        return W8A8StaticWeight(matrix, device)
    raise ValueError(f"int8 activation treatment {matrix.act!r} unknown; allowed: none, dynamic, static")
