"""Int8 quantization: the w8a16 / w8a8 schemes, the int8 KV cache, MindIE's (msModelSlim) and
compressed-tensors checkpoint formats, and ``mindie-host quantize``, on a random tiny Llama."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mindie_host.api import EngineRequest, SamplingParams
from mindie_host.backends.base import ModelInput
from mindie_host.backends.int8 import (
    DequantizedWeight,
    Int8Matrix,
    W8A8DynamicWeight,
    W8A8StaticWeight,
    W8A16Weight,
    quantize_per_channel,
)
from mindie_host.backends.kv_int8 import Int8KVCache
from mindie_host.backends.torch.backend import TorchBackend
from mindie_host.cli import main as cli_main
from mindie_host.config import ConfigError, config_from_dict
from mindie_host.models.weights import resolve_model
from mindie_host.quant import msmodelslim
from mindie_host.quant.schemes import QuantizationError
from mindie_host.testing import LoadedHosts, run_engine, server_config

PROMPT = list(range(300, 348))  # 48 tokens: three 16-token blocks


#: the hosts this module loaded, shut down when it ends
_HOSTS = LoadedHosts()
_host = _HOSTS.load


@pytest.fixture(scope="module", autouse=True)
def _shut_hosts_down() -> Iterator[None]:
    yield
    _HOSTS.shutdown()


def _backend(model: Path, **model_cfg: Any) -> Any:
    cfg = {"device": "cpu", "dtype": "float32", **model_cfg}
    return _host(server_config(model, model=cfg)).backend


def _logits(backend: Any) -> torch.Tensor:
    """Teacher-forced logits at every prompt position, then one decode step reading the cache back."""
    n = len(PROMPT)
    prefill = ModelInput(input_ids=PROMPT, positions=list(range(n)), query_lens=[n], context_lens=[n],
                         block_tables=[[1, 2, 3, 4]], logits_indices=list(range(n)), row_variants=[-1])
    decode = ModelInput(input_ids=[7], positions=[n], query_lens=[1], context_lens=[n + 1],
                        block_tables=[[1, 2, 3, 4]], logits_indices=[0], row_variants=[-1])
    return torch.cat([backend.execute(prefill), backend.execute(decode)])


def _agreement(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, max |logit error| relative to the largest reference logit)."""
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    return agree, float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> torch.Tensor:
    return _logits(_backend(tiny_model, quantization="none"))


@pytest.fixture(scope="module")
def quantized_dirs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model through ``mindie-host quantize``: w8a16, w8a8 (per-token) and w8a8 --static."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for name, extra in (("w8a16", []), ("w8a8", []), ("w8a8-static", ["--static"])):
        scheme = name.split("-")[0]
        rc = cli_main(["quantize", "--model", str(tiny_model), "--scheme", scheme, "--out", str(root / name), *extra])
        assert rc == 0
        out[name] = root / name
    return out


# -- the schemes on a floating-point model ------------------------------------------------------
@pytest.mark.parametrize(("settings", "weight_class", "min_agree", "max_err"), [
    ({"quantization": "w8a16"}, W8A16Weight, 0.97, 0.03),
    ({"quantization": "w8a8"}, W8A8DynamicWeight, 0.95, 0.04),
    ({"quantization": "none", "kvCacheDtype": "int8"}, None, 0.95, 0.03),
])
def test_schemes_agree_with_fp32(tiny_model: Path, reference: torch.Tensor, settings: dict[str, str],
                                 weight_class: type | None, min_agree: float, max_err: float) -> None:
    backend = _backend(tiny_model, **settings)
    if weight_class is not None:
        layer = backend.model.layers[0]
        assert all(isinstance(w, weight_class) for w in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down))
    got = _logits(backend)
    agree, err = _agreement(got, reference)
    assert agree >= min_agree and err <= max_err, (agree, err)
    assert not torch.equal(got, reference)  # the scheme really changed the numerics


def test_w8a8_products_are_int8_and_row_independent() -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    x = torch.randn(9, 64)
    weight = W8A8DynamicWeight(quantize_per_channel(w, "dynamic"), torch.device("cpu"))
    assert weight.wt.dtype == torch.int8 and weight.nbytes < w.numel() * 4 / 3
    y = weight(x)
    assert float((y - x @ w.T).abs().max() / (x @ w.T).abs().max()) < 0.03
    # per-token activation scales and an exact int32 product: a row's result does not depend on its batch
    assert torch.equal(weight(x[3:4]), y[3:4])
    weight.use_int_mm = False  # the fallback for platforms without an int8 GEMM: the same numbers
    assert torch.allclose(weight(x), y, rtol=1e-5, atol=1e-5)


def test_int8_kv_cache_bytes_and_round_trip(tiny_model: Path) -> None:
    full = _backend(tiny_model, quantization="none")
    int8 = _backend(tiny_model, quantization="none", kvCacheDtype="int8")
    arch = int8.arch
    assert isinstance(int8.kv_caches[0][0], Int8KVCache) and int8.kv_caches[0][0].codes.dtype == torch.int8
    assert int8.kv_cache_bytes_per_block(16) * 4 * arch.head_dim == full.kv_cache_bytes_per_block(16) * (
        arch.head_dim + 4)
    cache = Int8KVCache((8, 2, 16), torch.float32, torch.device("cpu"))
    kv = torch.randn(3, 2, 16)
    cache.index_copy_(0, torch.tensor([5, 1, 6]), kv)
    back = cache.index_select(0, torch.tensor([1, 5, 6]))
    step = kv.abs().amax(-1, keepdim=True) / 127  # per token and head
    assert bool(((back - kv[[1, 0, 2]]).abs() <= step[[1, 0, 2]] / 2 + 1e-6).all())
    # whole requests, batched, through the engine with the int8 cache
    host = _host(server_config(tiny_model, model={"device": "cpu", "kvCacheDtype": "int8",
                                                        "quantization": "w8a8"}))
    reqs = [EngineRequest(f"r{i}", [5 + i] * (3 + i), SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(4)]
    assert all(len(o.token_ids) == 8 for o in run_engine(host, reqs).values())


# -- configuration errors ----------------------------------------------------------------------
def test_unknown_scheme_is_a_startup_error(tiny_model: Path) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(server_config(tiny_model, model={"quantization": "w4a4"}))
    assert "quantization" in str(err.value) and "w4a4" in str(err.value) and "w8a8" in str(err.value)
    with pytest.raises(ConfigError) as err:
        config_from_dict(server_config(tiny_model, model={"kvCacheDtype": "int4"}))
    assert "int8" in str(err.value)
    with pytest.raises(QuantizationError) as qerr:
        TorchBackend(resolve_model(tiny_model), name="x", quantization="fp8")
    assert "'fp8'" in str(qerr.value) and "w8a16" in str(qerr.value)


def test_quantize_command_refuses_bad_arguments(tiny_model: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["quantize", "--model", str(tiny_model), "--scheme", "w4a16", "--out", str(tmp_path / "a")]) == 2
    assert "w4a16" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert cli_main(["quantize", "--model", str(tiny_model), "--scheme", "w8a16", "--out", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err


# -- mindie-host quantize and MindIE's format ---------------------------------------------------
def test_quantize_writes_mindie_format(tiny_model: Path, quantized_dirs: dict[str, Path]) -> None:
    for name, kind in (("w8a16", "W8A16"), ("w8a8", "W8A8_DYNAMIC"), ("w8a8-static", "W8A8")):
        out = quantized_dirs[name]
        desc = json.loads((out / "quant_model_description.json").read_text())
        assert desc["model_quant_type"] == kind
        assert desc["model.embed_tokens.weight"] == "FLOAT"
        assert desc["model.layers.1.mlp.down_proj.weight"] == kind
        assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
        assert "quantization_config" not in json.loads((out / "config.json").read_text())
        with safe_open(str(out / msmodelslim.WEIGHTS_NAME), framework="pt") as st:
            keys = set(st.keys())
            assert set(desc) - {"model_quant_type", "version"} == keys
            w = st.get_tensor("model.layers.0.self_attn.q_proj.weight")
            assert w.dtype == torch.int8
            if kind == "W8A8":
                assert st.get_tensor("model.layers.0.self_attn.q_proj.quant_bias").dtype == torch.int32
                assert st.get_tensor("model.layers.0.self_attn.q_proj.deq_scale").shape == (w.shape[0],)
                assert st.get_tensor("model.layers.0.self_attn.q_proj.input_offset").shape == (1,)
            else:
                assert st.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").shape == (w.shape[0], 1)
            if kind != "W8A16":  # smoothed norms carry the anti-outlier name
                assert "model.layers.0.input_layernorm.module.weight" in keys
    # the w8a16 codes are the original weights to within half a step of each row's scale
    with safe_open(str(tiny_model / "model.safetensors"), framework="pt") as st:
        original = st.get_tensor("model.layers.1.mlp.up_proj.weight")
    with safe_open(str(quantized_dirs["w8a16"] / msmodelslim.WEIGHTS_NAME), framework="pt") as st:
        codes = st.get_tensor("model.layers.1.mlp.up_proj.weight").float()
        scale = st.get_tensor("model.layers.1.mlp.up_proj.weight_scale")
    assert bool(((codes * scale - original).abs() <= scale / 2 + 1e-7).all())


@pytest.mark.parametrize(("name", "weight_class"), [
    ("w8a16", W8A16Weight), ("w8a8", W8A8DynamicWeight), ("w8a8-static", W8A8StaticWeight),
])
def test_quantized_checkpoints_serve_and_agree(quantized_dirs: dict[str, Path], reference: torch.Tensor,
                                               name: str, weight_class: type) -> None:
    backend = _backend(quantized_dirs[name])  # quantization: auto serves the checkpoint's own layer types
    assert isinstance(backend.model.layers[1].mlp.gate_up, weight_class)
    agree, err = _agreement(_logits(backend), reference)
    assert agree >= 0.95 and err <= 0.05, (agree, err)


def test_none_serves_a_checkpoint_dequantized(quantized_dirs: dict[str, Path]) -> None:
    backend = _backend(quantized_dirs["w8a16"], quantization="none")
    layer = backend.model.layers[0]
    assert not isinstance(layer.attn.qkv, (W8A16Weight, W8A8DynamicWeight))
    # and w8a8 on a w8a16 checkpoint quantizes activations per token
    backend = _backend(quantized_dirs["w8a16"], quantization="w8a8")
    assert isinstance(backend.model.layers[0].mlp.down, W8A8DynamicWeight)


def test_served_over_http(quantized_dirs: dict[str, Path]) -> None:
    from mindie_host.testing import RunningServer

    with RunningServer(server_config(quantized_dirs["w8a8"], model={"kvCacheDtype": "int8"})) as server:
        import httpx

        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hello there",
                                                              "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6


# -- msModelSlim description parsing ------------------------------------------------------------
def test_msmodelslim_description_refuses_unknown_types(tmp_path: Path) -> None:
    desc = {"model_quant_type": "W4A16", "model.layers.0.mlp.up_proj.weight": "W4A16"}
    with pytest.raises(QuantizationError) as err:
        msmodelslim.check_description(desc)
    text = str(err.value)
    assert "model.layers.0.mlp.up_proj.weight" in text and "'W4A16'" in text and "W8A8_DYNAMIC" in text
    with pytest.raises(QuantizationError, match="kv_quant_type"):
        msmodelslim.check_description({"model_quant_type": "W8A8", "kv_quant_type": "C8"})
    (tmp_path / "quant_model_description_w8a8.json").write_text(json.dumps({"model_quant_type": "W8A8"}))
    assert msmodelslim.find_description(tmp_path) == {"model_quant_type": "W8A8"}


def test_msmodelslim_static_layer_and_norm_bias() -> None:
    """A hand-built static W8A8 layer: int64 (float16-model) deq_scale, quant_bias holding a bias, a norm bias."""
    torch.manual_seed(1)
    w = torch.randn(6, 8)
    q = quantize_per_channel(w)
    in_scale, in_offset = 0.02, 3.0
    deq = q.scale * in_scale
    layer_bias = torch.randn(6)
    qbias = torch.round(layer_bias / deq - in_offset * q.codes.float().sum(1)).to(torch.int32)
    deq_bits = deq.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    raw = {
        "model.layers.0.mlp.gate_proj.weight": q.codes,
        "model.layers.0.mlp.gate_proj.input_scale": torch.tensor([in_scale], dtype=torch.float16),
        "model.layers.0.mlp.gate_proj.input_offset": torch.tensor([in_offset], dtype=torch.float16),
        "model.layers.0.mlp.gate_proj.deq_scale": deq_bits,
        "model.layers.0.mlp.gate_proj.quant_bias": qbias,
        "model.layers.0.post_attention_layernorm.module.weight": torch.ones(8),
        "model.layers.0.post_attention_layernorm.module.bias": torch.full((8,), 0.5),
        "model.layers.0.mlp.up_proj.weight": q.codes,
        "model.layers.0.mlp.up_proj.weight_scale": q.scale[:, None],
        "model.layers.0.mlp.up_proj.weight_offset": torch.zeros(6, 1),
    }
    desc = {k: "W8A16" if ".up_proj." in k else "W8A8" for k in raw}
    out = msmodelslim.read(desc, raw)
    m = out["model.layers.0.mlp.gate_proj.weight"]
    assert m.act == "static" and torch.allclose(m.scale, q.scale, rtol=1e-3)
    assert set(raw) == {"model.layers.0.post_attention_layernorm.weight"}  # scales taken, norm renamed
    expected_bias = layer_bias + q.dequantize() @ torch.full((8,), 0.5)
    assert torch.allclose(m.bias, expected_bias, atol=1e-3)
    up = out["model.layers.0.mlp.up_proj.weight"]
    assert up.act == "none" and torch.allclose(up.bias, q.dequantize() @ torch.full((8,), 0.5), atol=1e-4)
    x = torch.randn(4, 8) * 0.5
    y = W8A8StaticWeight(m, torch.device("cpu"))(x)
    assert torch.allclose(y, x @ w.T + expected_bias, atol=0.1)


# -- compressed-tensors -------------------------------------------------------------------------
def _compressed_tensors_copy(tiny_model: Path, out: Path, fmt: str = "int-quantized") -> Path:
    shutil.copytree(tiny_model, out)
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(out / "model.safetensors"), framework="pt") as st:
        for key in st.keys():
            t = st.get_tensor(key)
            if key.startswith("model.layers.") and key.endswith("_proj.weight"):
                q = quantize_per_channel(t)
                tensors[key] = q.codes
                tensors[key.replace(".weight", ".weight_scale")] = q.scale[:, None].to(torch.bfloat16)
            else:
                tensors[key] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True},
        }},
    }
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_compressed_tensors_int8_checkpoint(tiny_model: Path, tmp_path: Path, reference: torch.Tensor) -> None:
    model = _compressed_tensors_copy(tiny_model, tmp_path / "ct")
    backend = _backend(model)
    assert isinstance(backend.model.layers[0].attn.qkv, W8A8DynamicWeight)
    agree, err = _agreement(_logits(backend), reference)
    assert agree >= 0.95 and err <= 0.05, (agree, err)
    assert isinstance(_backend(model, quantization="w8a16").model.layers[0].attn.qkv, W8A16Weight)


def test_compressed_tensors_packed_format_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    model = _compressed_tensors_copy(tiny_model, tmp_path / "ct-packed", fmt="pack-quantized")
    with pytest.raises(QuantizationError) as err:
        TorchBackend(resolve_model(model), name="x").load()
    assert "'pack-quantized'" in str(err.value) and "int-quantized" in str(err.value)


def test_dequantized_weight_keeps_a_folded_bias() -> None:
    m = quantize_per_channel(torch.randn(4, 8))
    m.bias = torch.arange(4.0)
    m.act = "float"
    w = DequantizedWeight(m, torch.device("cpu"), torch.float32)
    x = torch.randn(2, 8)
    assert torch.allclose(w(x), x @ m.dequantize().T + m.bias, atol=1e-5)
    assert isinstance(Int8Matrix.concat([m, m]).bias, torch.Tensor)
