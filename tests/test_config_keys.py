"""No config key is parsed and then dropped: each is read by the server, refused, or reported as having no effect."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mindie_host.config import Config, config_from_dict, default_config_dict
from mindie_host.config.support import NO_EFFECT_KEYS, config_leaves, no_effect, unsupported
from mindie_host.host import Host
from mindie_host.plugins import PluginError
from mindie_host.testing import load_host

ROOT = Path(__file__).resolve().parents[1]


def _attributes_read() -> set[str]:
    """Every attribute name the package and the plugins read (``x.name``), outside the config parser."""
    parser = ROOT / "mindie_host" / "config"  # its checks are not use; support.py (what is refused) is
    files = [p for p in (ROOT / "mindie_host").rglob("*.py") if p.parent != parser or p.name == "support.py"]
    files += [p for p in (ROOT / "plugins").rglob("*.py") if "tests" not in p.parts]
    return {node.attr for path in files for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute)}


#: keys read through a property of their section
READ_THROUGH = {"LogConfig.logLevel": "level"}


def test_every_config_key_is_read_or_reported_as_having_no_effect() -> None:
    read = _attributes_read()
    read |= {key.rsplit(".", 1)[-1] for key, prop in READ_THROUGH.items() if prop in read}
    dropped = []
    for path, _, _ in config_leaves(Config(), Config(), ""):
        name = path.rsplit(".", 1)[-1]
        explained = path in NO_EFFECT_KEYS
        if name not in read and not explained:
            dropped.append(path)
        assert not (name in read and path in NO_EFFECT_KEYS), f"{path} is read somewhere but listed as having no effect"
    assert not dropped, f"config keys parsed and then dropped: {dropped}"


def _config(**changes: object) -> Config:
    data = default_config_dict()
    for dotted, value in changes.items():
        node = data
        *parents, last = dotted.split("__")
        for part in parents:
            node = node[part]
        node[last] = value
    return config_from_dict(data)


def test_keys_without_effect_are_reported() -> None:
    cfg = _config(ServerConfig__interCommTlsCert="other/server.pem")
    notes = no_effect(cfg)
    assert any(n.startswith("ServerConfig.interCommTlsCert is 'other/server.pem': no effect here") for n in notes)
    notes = no_effect(_config(BackendConfig__ModelDeployConfig__ModelConfig=[
        {"modelInstanceType": "StandardMock", "dtype": "bfloat16", "quantization": "none"}]))
    assert notes == [f"BackendConfig.ModelDeployConfig.ModelConfig[0].{key} is {value!r}: no effect here "
                     "(modelInstanceType 'StandardMock' loads no model)"
                     for key, value in (("dtype", "bfloat16"), ("quantization", "none"))]
    # keys beside the TLS files that are read where their mode is on: PD's port and TLS switch (dmi), the
    # multi-node port and TLS switch (multi-node); with the mode off they are reported as the spec scopes them
    scoped = {"ServerConfig__interCommPort": 2000, "ServerConfig__interCommTLSEnabled": False,
              "BackendConfig__interNodeTLSEnabled": False, "BackendConfig__multiNodesInferPort": 2001}
    assert not no_effect(_config(**scoped, ServerConfig__inferMode="dmi", BackendConfig__multiNodesInferEnabled=True))
    notes = no_effect(_config(**scoped))
    assert [n.split(" is ")[0] for n in notes] == ["ServerConfig.interCommTLSEnabled", "ServerConfig.interCommPort",
                                                   "BackendConfig.interNodeTLSEnabled",
                                                   "BackendConfig.multiNodesInferPort"]
    assert "the spec uses it with inferMode 'dmi' only" in notes[0]
    assert not no_effect(config_from_dict(default_config_dict()))


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"ServerConfig__inferMode": "dmi"}, "ServerConfig.interCommTLSEnabled: got true with ServerConfig.inferMode "
         "'dmi'; allowed false"),
        ({"ServerConfig__inferMode": "dmi", "ServerConfig__interCommTLSEnabled": False,
          "BackendConfig__modelInstanceNumber": 2, "BackendConfig__npuDeviceIds": [[0], [1]]},
         "BackendConfig.modelInstanceNumber: got 2 with ServerConfig.inferMode 'dmi'; allowed 1"),
        # a value only a plugin serves, with that plugin not enabled: the plugin and its package are named
        ({"BackendConfig__ScheduleConfig__templateType": "Mix"},
         "BackendConfig.ScheduleConfig.templateType: got 'Mix' without the splitfuse plugin, which serves the Mix "
         "template; add 'splitfuse' to ModelConfig[0].plugin_params' plugin_type (installed by: pip install "
         "mindie-plugin-splitfuse)"),
        ({"BackendConfig__ScheduleConfig__enablePrefixCache": True},
         "BackendConfig.ScheduleConfig.enablePrefixCache: got true without the prefix_cache plugin, which serves "
         "Prefix Cache; add 'prefix_cache' to ModelConfig[0].plugin_params' plugin_type (installed by: pip install "
         "mindie-plugin-prefix-cache)"),
        ({"BackendConfig__ModelDeployConfig__ModelConfig": [{"modelInstanceType": "StandardMock", "worldSize": 2}],
          "BackendConfig__npuDeviceIds": [[0, 1]]},
         "BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize: got 2 with modelInstanceType 'StandardMock'"),
        ({"BackendConfig__ScheduleConfig__policyType": 7},
         "BackendConfig.ScheduleConfig.policyType: got 7 (SJF-MLFQ); allowed 0 (FCFS), 4 (SJF), 5 (LJF) or 6"),
        ({"BackendConfig__ScheduleConfig__splitChunkTokens": 64},
         "BackendConfig.ScheduleConfig.splitChunkTokens: got 64 with templateType 'Standard'; SplitFuse's keys act "
         "only in the Mix template"),
    ],
)
def test_settings_this_host_cannot_honour_are_refused(changes: dict[str, object], expected: str) -> None:
    errors = unsupported(_config(**changes))
    assert any(e.startswith(expected) for e in errors), errors
    with pytest.raises(PluginError, match=re.escape(expected)):
        load_host(Host(_config(**changes)))


def test_a_second_model_entry_is_refused_naming_it(tmp_path: Path) -> None:
    data = default_config_dict()
    models = data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"]
    models.append(dict(models[0], modelName="second"))
    data["BackendConfig"]["ScheduleConfig"]["enablePrefixCache"] = True  # and config validate names the plugin
    expected = "BackendConfig.ModelDeployConfig.ModelConfig[1] (modelName 'second'): this server serves one model"
    with pytest.raises(PluginError, match=re.escape(expected)):
        load_host(Host(config_from_dict(data)))
    (tmp_path / "c.json").write_text(json.dumps(data))
    r = subprocess.run([sys.executable, "-m", "mindie_host.cli", "config", "validate", str(tmp_path / "c.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and expected in r.stdout
    assert "error: BackendConfig.ScheduleConfig.enablePrefixCache: got true without the prefix_cache plugin" in r.stdout
