"""What this CPU does natively, read at run time, and what the torch backend computes with on it.

The C++ kernels come in three variants (:mod:`~mindie_host.backends.cpu_extensions`): ``portable``
(the architecture's baseline: x86-64 with SSE2, aarch64, anything else), ``avx2`` (x86-64-v3: AVX2,
FMA, F16C, BMI1/2) and ``avx512`` (x86-64-v4 with AVX512-BF16), and a fourth that is never chosen by
detection: ``neon`` (aarch64: the low-bit product in hand-written NEON, checked only under qemu so far,
so only ``MINDIE_HOST_CPU_ISA=neon`` selects it; an Arm CPU gets ``portable``). The dtypes follow from the same
features: bfloat16 arithmetic (the prompt rows' bf16 products, bf16 activations of the low-bit
products) only where the CPU multiplies bf16 natively (AVX512-BF16 or AMX), since elsewhere torch
runs it on a reference path at a fraction of float32's rate; int8 products (``torch._int_mm``, the
w8a8 schemes) only with VNNI or AVX2's 8-bit multiply-add; float32 otherwise.

The features come from ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on Arm), read once.
``MINDIE_HOST_CPU_ISA=portable|avx2|avx512|neon`` forces the whole profile, kernels and dtypes alike, as a
CPU of that kind would get it; it wins over detection. An unknown value, or a variant this CPU
cannot execute, is an error at start-up (never an illegal instruction later).
"""

from __future__ import annotations

import functools
import logging
import os
import platform as _platform
from dataclasses import dataclass

import torch

log = logging.getLogger("mindie_host.backends")

#: the kernel variants, from the baseline up
ISAS = ("portable", "avx2", "avx512", "neon")

#: variants detection never picks: only ``MINDIE_HOST_CPU_ISA`` selects them (not yet run on a real CPU of theirs)
OPT_IN = frozenset({"neon"})

#: the architecture (``platform.machine()``) each variant but portable is built for
ARCH = {"avx2": "x86_64", "avx512": "x86_64", "neon": "aarch64"}

#: the environment variable that forces a profile
ENV = "MINDIE_HOST_CPU_ISA"

#: /proc/cpuinfo flags each x86 variant needs (x86-64-v3 for avx2; x86-64-v4, AVX512-BF16 and AVX512-VNNI for avx512)
REQUIRED_FLAGS = {
    "avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}),
    "avx512": frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "avx512f", "avx512bw",
                         "avx512cd", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni"}),
    "neon": frozenset({"asimd"}),
}


@dataclass(frozen=True)
class CpuFeatures:
    """The machine's architecture (``platform.machine()``) and its CPU's feature flags."""

    machine: str
    flags: frozenset[str]

    @property
    def arch(self) -> str:
        """The machine's name as :data:`ARCH` spells it (``amd64`` is ``x86_64``, ``arm64`` is ``aarch64``)."""
        return self.machine.lower().replace("amd64", "x86_64").replace("arm64", "aarch64")

    @property
    def x86(self) -> bool:
        return self.arch == "x86_64"

    def runs(self, isa: str) -> bool:
        """Whether this CPU can execute the kernel variant ``isa``."""
        if isa == "portable":
            return True
        return self.arch == ARCH[isa] and REQUIRED_FLAGS[isa] <= self.flags

    def best(self) -> str:
        """The fastest variant this CPU executes that detection may pick (never one of :data:`OPT_IN`)."""
        return next(isa for isa in reversed(ISAS) if isa not in OPT_IN and self.runs(isa))


def read_features(cpuinfo: str = "/proc/cpuinfo") -> CpuFeatures:
    """This machine's CPU features (no flags where ``cpuinfo`` cannot be read: the portable variant)."""
    flags: set[str] = set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    flags.update(value.split())
                    break
    except OSError:
        pass
    return CpuFeatures(_platform.machine(), frozenset(flags))


@functools.lru_cache(maxsize=1)
def features() -> CpuFeatures:
    """:func:`read_features` of this machine, read once."""
    return read_features()


@dataclass(frozen=True)
class CpuProfile:
    """The kernel variant and compute dtypes for a CPU.

    ``isa``: the kernels' variant; ``forced``: set by ``MINDIE_HOST_CPU_ISA`` rather than detected.
    """

    isa: str
    forced: bool
    features: CpuFeatures

    @property
    def native_bf16(self) -> bool:
        """Whether bfloat16 arithmetic runs natively (the avx512 profile: AVX512-BF16, and AMX where present)."""
        return self.isa == "avx512"

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of prompt rows' products and of the low-bit products' activations."""
        return torch.bfloat16 if self.native_bf16 else torch.float32

    @property
    def int8_products(self) -> str | None:
        """How int8 x int8 products run natively: ``"vnni"``, ``"avx2"`` (8-bit multiply-add), or None."""
        if self.isa in ("portable", "neon"):
            return None
        vnni = {"avx512_vnni", "avx_vnni", "amx_int8"} & self.features.flags
        return "vnni" if self.isa == "avx512" or (vnni and not self.forced) else "avx2"

    def slow_dtype(self, dtype: torch.dtype) -> bool:
        """Whether arithmetic in ``dtype`` is slow on this profile (16-bit floats without native bf16)."""
        return dtype in (torch.bfloat16, torch.float16) and not self.native_bf16

    def describe(self) -> str:
        """One line: what was chosen and why."""
        flags = self.features.flags
        seen = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags)
        if self.forced:
            why = f"{ENV}={self.isa}"
        elif self.features.x86:
            why = f"detected on {self.features.machine}: {seen or 'no AVX2'}"
        else:  # Arm and the rest: the portable kernels, built for the architecture's baseline
            why = f"detected on {self.features.machine}: the avx2 and avx512 kernels are x86-64 only"
            if self.features.runs("neon"):
                why += f", neon is opt-in ({ENV}=neon)"
        dtype = ("bfloat16 prompt products and low-bit activations (native bf16)" if self.native_bf16
                 else "float32 prompt rows and low-bit activations (no native bf16)")
        int8 = {"vnni": "int8 products with VNNI", "avx2": "int8 products with AVX2's 8-bit multiply-add",
                None: "int8 products in floating point"}[self.int8_products]
        return f"CPU profile {self.isa} ({why}): {self.isa} kernels, {dtype}, {int8}"


def profile() -> CpuProfile:
    """This process's profile: ``MINDIE_HOST_CPU_ISA`` when set, else the best variant the CPU runs.

    Raises ValueError for an unknown value and RuntimeError for a variant this CPU cannot execute.
    """
    return _profile(os.environ.get(ENV, "").strip().lower())


@functools.lru_cache(maxsize=8)
def _profile(forced: str) -> CpuProfile:
    cpu = features()
    if not forced:
        return CpuProfile(cpu.best(), False, cpu)
    if forced not in ISAS:
        raise ValueError(f"{ENV}={forced!r} is not a kernel variant; allowed: {', '.join(ISAS)}")
    if not cpu.runs(forced):
        arch = ARCH[forced]
        missing = (sorted(REQUIRED_FLAGS[forced] - cpu.flags) if cpu.arch == arch
                   else [f"an {arch.replace('_', '-')} CPU, not {cpu.machine}"])
        raise RuntimeError(f"{ENV}={forced}: this CPU cannot execute the {forced} kernels (it lacks "
                           f"{', '.join(missing)}); allowed here: "
                           f"{', '.join(isa for isa in ISAS if cpu.runs(isa))}")
    return CpuProfile(forced, True, cpu)


_logged: set[CpuProfile] = set()


def log_profile(chosen: CpuProfile | None = None) -> CpuProfile:
    """Log the profile's line (once per profile and process) and return it."""
    chosen = chosen or profile()
    if chosen not in _logged:
        _logged.add(chosen)
        log.info("%s", chosen.describe())
    return chosen
