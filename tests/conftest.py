"""Shared fixtures: a tiny random Llama (real tokenizer), a real server on free ports, the CPU kernels' variants."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mindie_host.testing import RunningServer, make_tiny_llama, server_config


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama in HF format with the SmolLM2 tokenizer (one copy per session, shared with the
    plugins' tests that use the same model: ``plugins/*/tests/conftest.py``)."""
    return make_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama-shared")


@pytest.fixture(scope="session")
def tiny_server(tiny_model: Path) -> Iterator[RunningServer]:
    """One shared server on the tiny model, default config (FCFS, no plugins)."""
    with RunningServer(server_config(tiny_model)) as server:
        yield server


@pytest.fixture(scope="module")
def default_server() -> Iterator[RunningServer]:
    """The default model (SmolLM2-135M-Instruct), shared by a module's slow tests.

    Module-scoped so that its memory is given back before the next module: the suite stays under 8 GB.
    """
    with RunningServer(server_config(None)) as server:
        yield server


@pytest.fixture(scope="session")
def cpu_variants() -> dict[str, Any]:
    """Every variant of the CPU kernels this machine executes (portable, avx2, avx512 on x86-64; portable, neon on
    aarch64), built once, side by side."""
    from mindie_host.backends import cpu_extensions

    return cpu_extensions.load_variants()


def variants_of_this_architecture() -> list[str]:
    """The kernel variants built for this machine's architecture (portable, avx2, avx512 on x86-64; portable and
    neon on aarch64): the ones :func:`cpu_variant` runs or, where this CPU cannot execute one, skips."""
    import platform

    from mindie_host.backends import cpu_profile

    arch = cpu_profile.CpuFeatures(platform.machine(), frozenset()).arch
    return [isa for isa in cpu_profile.ISAS if cpu_profile.ARCH.get(isa, arch) == arch]


@pytest.fixture(scope="module", params=variants_of_this_architecture())
def cpu_variant(request: pytest.FixtureRequest, cpu_variants: dict[str, Any]) -> Iterator[Any]:
    """Each kernel variant in turn, active and forced as the CPU profile (``MINDIE_HOST_CPU_ISA``); skipped where
    this CPU cannot execute it."""
    from mindie_host.backends import cpu_extensions

    kernels = cpu_variants.get(request.param)
    if kernels is None:
        pytest.skip(f"this CPU does not execute the {request.param} kernels (or there is no compiler)")
    with pytest.MonkeyPatch.context() as env, cpu_extensions.using(kernels):
        env.setenv("MINDIE_HOST_CPU_ISA", request.param)
        yield kernels
