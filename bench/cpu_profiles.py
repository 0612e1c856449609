"""The environment that makes a benchmark run as on another kind of CPU, for the scripts under bench/.

``avx2``: torch's instruction-set switches (read when torch loads: ATen's kernels, oneDNN and MKL as on an
AVX2 CPU without AVX-512) and mindie-host's avx2 profile (its avx2 kernels and float32 dtypes). The
servers a script starts inherit it.
"""

from __future__ import annotations

import os
import sys

#: torch as on an AVX2 CPU
TORCH_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}

#: each profile's environment: torch's switches and mindie-host's profile
PROFILES: dict[str, dict[str, str]] = {"native": {}, "avx2": {**TORCH_AVX2, "MINDIE_HOST_CPU_ISA": "avx2"}}


def run_as(env: dict[str, str]) -> None:
    """Re-execute this script with ``env`` added unless it already runs with it (torch reads it only at start)."""
    if any(os.environ.get(k) != v for k, v in env.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})
