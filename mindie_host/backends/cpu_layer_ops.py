"""The elementwise steps of a decoder layer on CPU (``layer_ops.cpp``): residual add + RMSNorm, and RoPE.

torch runs each as a chain of operators, each a pass over the step's rows with a tensor of its own;
the kernel does each in one pass (bench/PERF.md). The rotation gives the same bits as torch's
operators; the RMSNorm differs from torch's only in the order of its sum of squares. Each row is
computed on its own, so a row's result does not depend on what shares its step.

The backend builds it at start-up with the other kernels (:meth:`TorchBackend.load_cpu_kernels
<mindie_host.backends.torch.backend.TorchBackend.load_cpu_kernels>`); until then, without a
compiler, with ``MINDIE_HOST_CPU_KERNELS=0`` or ``MINDIE_HOST_LAYER_OPS=0``, inside a compiled
graph, or for tensors it does not take, the callers here return None and
:class:`~mindie_host.backends.platform.Platform` uses torch's operators.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from . import cpu_extensions

__all__ = ["add_rms_norm", "enabled", "kernel", "loaded", "rope"]


def kernel() -> Any:
    """The active CPU kernels when this one may run (building them the first time), or None."""
    return cpu_extensions.kernels() if enabled() else None


def loaded() -> bool:
    """Whether the kernel is built and on (never builds it)."""
    return enabled() and cpu_extensions.active("layer_ops") is not None


def enabled() -> bool:
    """Whether the kernel may be used: C++ kernels on, and not ``MINDIE_HOST_LAYER_OPS=0`` (torch's operators, to
    compare against)."""
    return cpu_extensions.enabled() and os.environ.get("MINDIE_HOST_LAYER_OPS", "1") != "0"


def _usable(*tensors: torch.Tensor) -> bool:
    return (loaded() and not torch.compiler.is_compiling()
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
    """``x += residual`` (in place; skipped when None) and the RMSNorm of the result, for ``[T, n]`` float32 ``x``;
    None where the kernel does not apply (then nothing is written)."""
    parts = (x, weight) if residual is None else (x, residual, weight)
    if not _usable(*parts) or x.dim() != 2 or not x.is_contiguous() or x.requires_grad:
        return None
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        return None
    return cpu_extensions.active("layer_ops").add_rms_norm(x, residual, weight.contiguous(), eps)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rotary embedding (rotate-half) of ``q [T, H, D]`` and ``k [T, KV, D]`` with ``cos``, ``sin`` of ``T * D``
    values each, as new contiguous tensors; None where the kernel does not apply."""
    if not _usable(q, k, cos, sin) or q.dim() != 3 or k.dim() != 3:
        return None
    t, _, d = q.shape
    if cos.numel() != t * d or sin.numel() != t * d:
        return None
    if not all(x.stride(2) == 1 and x.stride(1) == d for x in (q, k)):  # each row's heads contiguous
        return None
    qo, ko = cpu_extensions.active("layer_ops").rope(q, k, cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous())
    return qo, ko
