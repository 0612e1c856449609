"""Runtime adapter loading is off by default and, when on, loads only from the allow-listed directory.

Refusals for paths outside that directory are the same whether the path exists or not,
and never echo a path or anything read from a file there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
from mindie_host.testing import RunningServer
from multi_lora_helpers import lora_config


def load(server: RunningServer, name: str, path: str) -> httpx.Response:
    return httpx.post(server.management_url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                      timeout=60)


def test_runtime_loading_is_off_unless_a_directory_is_configured(lora_base: Path, lora_adapters: dict[str, Path]) -> None:
    with RunningServer(lora_config(lora_base)) as server:
        r = load(server, "delta", str(lora_adapters["delta"]))
        assert r.status_code == 403, r.text
        assert r.json()["field"] == "lora_path" and "runtimeAdapterDir" in r.json()["error"]
        assert str(lora_adapters["delta"]) not in r.text
        served = [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]]
        assert "delta" not in served


def test_only_the_allow_listed_directory_is_loaded_from(lora_base: Path, lora_adapters: dict[str, Path],
                                                        tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copytree(lora_adapters["delta"], allowed / "delta")
    # outside the allowed directory: a real adapter, and a config file whose contents must never be echoed
    outside = tmp_path / "outside"
    shutil.copytree(lora_adapters["delta"], outside / "real")
    (outside / "secret").mkdir()
    (outside / "secret" / "adapter_config.json").write_text(json.dumps({"peft_type": "TOPSECRET-42", "r": 2}))
    (allowed / "escape").symlink_to(outside / "real", target_is_directory=True)
    (allowed / "halfway").mkdir()
    (allowed / "halfway" / "adapter_config.json").symlink_to(outside / "secret" / "adapter_config.json")
    with RunningServer(lora_config(lora_base, runtimeAdapterDir=str(allowed))) as server:
        refusals = [
            load(server, "a1", str(outside / "real")),  # exists, outside
            load(server, "a2", str(outside / "secret")),  # exists, holds a config with a telling peft_type
            load(server, "a3", str(tmp_path / "nowhere")),  # does not exist, outside
            load(server, "a4", "../outside/real"),  # relative, climbing out
            load(server, "a5", "escape"),  # a link inside that points outside
            load(server, "a6", "halfway"),  # a config file inside that links to one outside
            load(server, "a7", str(allowed)),  # the directory itself is not an adapter
        ]
        for r in refusals:
            assert r.status_code == 403, r.text
            assert r.json()["field"] == "lora_path"
            assert "TOPSECRET" not in r.text and str(tmp_path) not in r.text and "outside" not in r.text
        # an existing and a missing path outside get the very same answer: nothing tells them apart
        assert refusals[0].json() == refusals[2].json() == refusals[1].json()
        # inside the directory, relative or absolute, loads and serves
        r = load(server, "delta", "delta")
        assert r.status_code == 200, r.text
        r = load(server, "delta2", str(allowed / "delta"))
        assert r.status_code == 200, r.text
        served = [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]]
        assert {"delta", "delta2"} <= set(served) and not {"a1", "a2", "a3", "a4", "a5", "a6", "a7"} & set(served)
        r = httpx.post(server.url + "/v1/completions", json={"model": "delta", "prompt": "hi", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200, r.text
