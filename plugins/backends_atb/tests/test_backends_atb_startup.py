"""backendType "atb" without an NPU: registration, CLI listing, config validation, memory sizing, clear refusal.

No machine these tests run on has torch_npu or an Ascend NPU; the memory tests
inject the device's (free, total) facts, the model itself is real.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import torch
from mindie_plugin_backends_atb.backend import AtbBackend, KvBudgetError
from mindie_plugin_backends_atb.platform import NpuPlatform, NpuUnavailable, load_torch_npu
from standin_torch_npu import StandInTorchNpu

from mindie_host.api import BackendContext, PluginError, config_from_dict, hookimpl, resolve_model
from mindie_host.backend_api import Platform
from mindie_host.testing import RunningServer, load_host, make_tiny_llama, new_host, plugin_manager, server_config

GIB = 1 << 30


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("atb-startup-tiny"))


def _cfg(path: Path, **model: Any) -> dict[str, Any]:
    return server_config(path, model={"backendType": "atb", **model})


def test_backends_atb_and_ms_listed_by_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "mindie_host.cli", "plugins", "--json"], capture_output=True,
                         text=True, check=True, timeout=120)
    rows = {row["name"]: row for row in json.loads(out.stdout)}
    assert rows["atb"]["package"] == "mindie-plugin-backends-atb"
    assert rows["ms"]["package"] == "mindie-plugin-backends-ms"


def test_backends_atb_entry_point_registers_backend_type(tiny_path: Path) -> None:
    plugins = plugin_manager(_cfg(tiny_path))
    assert "atb" in plugins.registered_names()
    assert "atb" in plugins.backend_types()


def test_backends_atb_without_torch_npu_fails_at_startup_with_install_hint(tiny_path: Path) -> None:
    """Here torch_npu is not installed: Host.load (and the real server) refuse with what is missing and how."""
    host = new_host(_cfg(tiny_path))
    with pytest.raises(NpuUnavailable) as info:
        load_host(host)
    message = str(info.value)
    assert "torch_npu" in message
    assert "pip install mindie-plugin-backends-atb[npu]" in message and "CANN" in message
    with pytest.raises(NpuUnavailable, match="torch_npu"):
        RunningServer(_cfg(tiny_path)).start()


def test_backends_atb_torch_npu_present_but_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """An importable torch_npu (injected module object) with no visible NPU is refused, naming the check."""

    class NoNpu:
        @staticmethod
        def is_available() -> bool:
            return False

    monkeypatch.setattr(torch, "npu", NoNpu, raising=False)
    with pytest.raises(NpuUnavailable, match=r"no Ascend NPU is visible.*npu-smi"):
        load_torch_npu(importer=lambda name: ModuleType(name))


@pytest.mark.parametrize(
    ("model", "plugins", "needle"),
    [
        ({"device": "cpu"}, {}, "ModelConfig.device"),
        ({"dtype": "float32"}, {}, "ModelConfig.dtype"),
        ({"quantization": "w8a16"}, {}, "ModelConfig.quantization"),
        ({"kvCacheDtype": "int8"}, {}, "ModelConfig.kvCacheDtype"),
        ({"compile": True}, {}, "ModelConfig.compile"),
        ({}, {"atb": {"memoryFraction": 1.5}}, "Plugins.atb.memoryFraction"),
        ({}, {"atb": {"bogus": 1}}, "Plugins.atb.bogus"),
    ],
)
def test_backends_atb_config_validation(tiny_path: Path, model: dict[str, Any], plugins: dict[str, Any],
                                        needle: str) -> None:
    cfg = server_config(tiny_path, model={"backendType": "atb", **model}, plugins=plugins)
    host = new_host(cfg)
    with pytest.raises(PluginError, match=needle.replace(".", r"\.")):
        load_host(host)


def test_backends_atb_valid_config_passes_validation(tiny_path: Path) -> None:
    cfg = config_from_dict(server_config(tiny_path, model={"backendType": "atb", "dtype": "bfloat16",
                                                           "npuMemSize": 4}, plugins={"atb": {"memoryFraction": 0.5}}))
    assert plugin_manager(cfg).validate(cfg) == []


def test_backends_atb_platform_facts() -> None:
    platform = NpuPlatform(StandInTorchNpu(), mem_get_info=lambda: (3 * GIB, 32 * GIB))
    assert isinstance(platform, Platform)
    assert (platform.name, platform.device_type, platform.dist_backend) == ("npu", "npu", "hccl")
    assert platform.memory_info() == (3 * GIB, 32 * GIB)
    assert platform.default_dtype() == torch.float16
    assert platform.kv_cache_shape(10, 128, 8, 64) == (10, 128, 8, 64)
    assert not NpuPlatform.is_available()  # no torch_npu on this machine


def _sized_backend(path: Path, free: int, total: int, fraction: float = 0.8) -> AtbBackend:
    platform = NpuPlatform(StandInTorchNpu(), device_type="cpu", mem_get_info=lambda: (free, total))
    backend = AtbBackend(resolve_model(path), name="t", dtype="float32", platform=platform, memory_fraction=fraction)
    backend.load()
    return backend


def test_backends_atb_memory_sizing_from_npu_mem_size(tiny_path: Path) -> None:
    """npuMemSize=N gives N GiB; -1 gives memoryFraction of free memory; more than free is refused."""
    backend = _sized_backend(tiny_path, free=10 * GIB, total=32 * GIB, fraction=0.5)
    assert backend.available_kv_memory(4) == 4 * GIB
    assert backend.available_kv_memory(-1) == 5 * GIB
    with pytest.raises(KvBudgetError, match=r"npuMemSize is 12 GiB but the NPU has 10\.00 GiB free"):
        backend.available_kv_memory(12)
    per_block = backend.kv_cache_bytes_per_block(128)
    arch = backend.arch
    assert per_block == 2 * arch.num_layers * 128 * arch.num_kv_heads * arch.head_dim * 4


class StandInAtbPlugin:
    """Serves backendType "atb" with the real AtbBackend/NpuPlatform on the CPU, whose torch_npu is the STAND-IN
    module and whose device memory is injected; registered under the name "atb" in place of the entry point."""

    def __init__(self, path: Path, free: int, total: int) -> None:
        self.path, self.free, self.total = path, free, total

    @hookimpl
    def mindie_host_model_backend(self, ctx: BackendContext, backend_type: str) -> AtbBackend | None:
        if backend_type != "atb":
            return None
        platform = NpuPlatform(StandInTorchNpu(), device_type="cpu", mem_get_info=lambda: (self.free, self.total))
        return AtbBackend(resolve_model(self.path), name=ctx.model.modelName, dtype="float32", platform=platform)


def test_backends_atb_host_refuses_npu_mem_size_beyond_free(tiny_path: Path) -> None:
    """Through Host.load: ModelInfo.device is 'npu', so the host budgets npuMemSize (not cpuMemSize)."""
    config = config_from_dict(_cfg(tiny_path, npuMemSize=2))
    config.server.engineProcess = False  # the test reads host.info after the refusal, in this process
    host = new_host(config)
    host.plugins.register(StandInAtbPlugin(tiny_path, free=1 * GIB, total=2 * GIB), "atb")
    with pytest.raises(KvBudgetError, match="npuMemSize is 2 GiB"):
        load_host(host)
    assert host.info is not None and host.info.device == "npu"


def test_backends_atb_serves_openai_through_standin_ops(tiny_path: Path) -> None:
    """The whole server on AtbBackend + NpuPlatform with STAND-IN torch_npu ops (CPU): same text as torch."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    with RunningServer(server_config(tiny_path)) as server:
        expect = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    cfg = _cfg(tiny_path, npuMemSize=1)
    with RunningServer(cfg, plugins=[(StandInAtbPlugin(tiny_path, free=4 * GIB, total=8 * GIB), "atb")]) as server:
        assert server.host.info.device == "npu"  # the model info the (engine process's) atb backend gave
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expect


def test_backends_atb_platform_family_and_torch_hint() -> None:
    """CPU, CUDA and NPU platforms share one abstraction; the torch backend points device 'npu' to atb."""
    from mindie_host.backend_api import CudaPlatform, select_platform

    assert (CudaPlatform.name, CudaPlatform.dist_backend) == ("cuda", "nccl")
    assert (Platform.name, Platform.dist_backend) == ("cpu", "gloo")
    assert issubclass(NpuPlatform, Platform) and issubclass(CudaPlatform, Platform)
    assert CudaPlatform().kv_cache_shape(4, 16, 2, 8) == (64, 2, 8)  # torch's slot-major layout
    with pytest.raises(RuntimeError, match=r"backendType 'atb'.*mindie-plugin-backends-atb\[npu\]"):
        select_platform("npu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="not available"):
            select_platform("cuda")
