"""Loading: adapters that do not fit the base model are refused naming adapter, key and reason;
``Plugins.multi_lora`` is range-checked at startup."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from mindie_host.api import EngineStartError, PluginError
from mindie_host.testing import load_host, new_host
from multi_lora_helpers import lora_config
from safetensors.torch import load_file, save_file

from mindie_plugin_multi_lora.adapters import AdapterError, ModelDims, load_adapter, read_adapter_list

DIMS = ModelDims(num_layers=2, hidden=64, q=64, kv=32, inter=128)  # the tiny model of conftest
KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"


def mutated(src: Path, dst: Path, edit) -> Path:  # noqa: ANN001
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def test_good_adapter_loads(lora_adapters: dict[str, Path]) -> None:
    ad = load_adapter("alpha", lora_adapters["alpha"], DIMS, 16)
    assert ad.rank == 4 and len(ad.modules) == 7 and len(ad.weights) == 14
    beta = load_adapter("beta", lora_adapters["beta"], DIMS, 16)
    assert beta.modules == ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize(
    ("case", "key_part", "reason"),
    [
        ("wrong_shape", "q_proj.lora_A.weight", "wrong shape"),
        ("wrong_b_shape", "q_proj.lora_B.weight", "wrong shape"),
        ("unknown_module", "lm_head", "unknown module"),
        ("misplaced_module", "self_attn.gate_proj", "unknown module"),
        ("missing_b", "q_proj.lora_B.weight", "missing"),
        ("layer_out_of_range", "layers.7", "does not exist"),
        ("rank_over_max", "lora_A.weight", "exceeds the configured maximum maxLoraRank=4"),
    ],
)
def test_mismatch_is_refused(lora_adapters: dict[str, Path], tmp_path: Path, case: str, key_part: str,
                             reason: str) -> None:
    edits = {
        "wrong_shape": lambda t: t.__setitem__(KEY.format("A"), torch.zeros(4, 65)),
        "wrong_b_shape": lambda t: t.__setitem__(KEY.format("B"), torch.zeros(63, 4)),
        "unknown_module": lambda t: t.__setitem__("base_model.model.lm_head.lora_A.weight", torch.zeros(4, 64)),
        "misplaced_module": lambda t: t.__setitem__(
            "base_model.model.model.layers.0.self_attn.gate_proj.lora_A.weight", torch.zeros(4, 64)),
        "missing_b": lambda t: t.pop(KEY.format("B")),
        "layer_out_of_range": lambda t: t.__setitem__(
            "base_model.model.model.layers.7.mlp.up_proj.lora_A.weight", torch.zeros(4, 64)),
        "rank_over_max": lambda t: None,
    }
    src = lora_adapters["gamma" if case == "rank_over_max" else "alpha"]
    path = mutated(src, tmp_path / case, edits[case])
    with pytest.raises(AdapterError) as info:
        load_adapter("bad-" + case, path, DIMS, 4 if case == "rank_over_max" else 16)
    msg = str(info.value)
    assert "bad-" + case in msg and key_part in info.value.key and reason in msg, msg


def test_missing_files_and_dora(lora_adapters: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="is not a directory"):
        load_adapter("x", tmp_path / "nowhere", DIMS, 16)
    d = tmp_path / "dora"
    shutil.copytree(lora_adapters["alpha"], d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="DoRA"):
        load_adapter("x", d, DIMS, 16)
    (d / "adapter_model.safetensors").unlink()
    cfg["use_dora"] = False
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="adapter_model.safetensors"):
        load_adapter("x", d, DIMS, 16)


def test_adapter_list_relative_paths_and_names(tmp_path: Path) -> None:
    (tmp_path / "lora_adapter.json").write_text(json.dumps({"a": "sub/a", "b": "/abs/b"}))
    assert read_adapter_list(tmp_path) == {"a": str(tmp_path / "sub/a"), "b": "/abs/b"}
    (tmp_path / "lora_adapter.json").write_text(json.dumps({"bad name": "x"}))
    with pytest.raises(AdapterError, match="adapter names must be"):
        read_adapter_list(tmp_path)
    assert read_adapter_list(tmp_path / "empty") == {}


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"maxLoras": 0}, "maxLoras"),
        ({"maxLoras": 1.5}, "maxLoras"),
        ({"maxLoraRank": 1000}, "maxLoraRank"),
        ({"kernel": "fast"}, "kernel"),
        ({"unloadTimeoutS": 0}, "unloadTimeoutS"),
        ({"runtimeUpdates": "yes"}, "runtimeUpdates"),
        ({"adapters": {"a b": "/x"}}, "adapters"),
    ],
)
def test_bad_plugin_config_stops_startup(lora_base: Path, settings: dict, key: str) -> None:
    host = new_host(lora_config(lora_base, **settings))
    with pytest.raises(PluginError) as info:
        load_host(host)
    assert f"Plugins.multi_lora.{key}" in str(info.value) and "allowed" in str(info.value)


def test_bad_adapter_stops_startup_naming_it(lora_base: Path, lora_adapters: dict[str, Path], tmp_path: Path) -> None:
    bad = mutated(lora_adapters["alpha"], tmp_path / "bad", lambda t: t.__setitem__(KEY.format("A"), torch.zeros(4, 9)))
    host = new_host(lora_config(lora_base, adapters={"broken": str(bad)}))
    # with the engine in its own process (the default) the engine's AdapterError reaches startup as the reason
    with pytest.raises((AdapterError, EngineStartError)) as info:
        load_host(host)
    assert "'broken'" in str(info.value) and KEY.format("A") in str(info.value) and "wrong shape" in str(info.value)
