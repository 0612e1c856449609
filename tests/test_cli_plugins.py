"""The `mindie-host` command (config init/validate, plugins) and the plugin manager's rules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mindie_host import hookimpl
from mindie_host.config import config_from_dict, default_config_dict
from mindie_host.plugins import PluginError, PluginHost, describe_installed


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mindie_host.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_config_init_then_validate(tmp_path: Path) -> None:
    r = cli("config", "init", str(tmp_path / "config.json"))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["Version"] == "1.0.0" and "BackendConfig" in data
    r = cli("config", "validate", str(tmp_path / "config.json"))
    assert r.returncode == 0 and "valid" in r.stdout
    data["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] = 0
    (tmp_path / "bad.json").write_text(json.dumps(data))
    r = cli("config", "validate", str(tmp_path / "bad.json"))
    assert r.returncode == 1
    assert "maxBatchSize" in r.stdout and "[1, 5000]" in r.stdout


def test_enabled_plugin_missing_names_the_pip_package(tmp_path: Path) -> None:
    data = default_config_dict()
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["plugin_params"] = json.dumps(
        {"plugin_type": "no_such_plugin"})
    with pytest.raises(PluginError, match="no_such_plugin.*not installed"):
        PluginHost().enable_from_config(config_from_dict(data))
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["backendType"] = "atb"
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["plugin_params"] = ""
    cfg = config_from_dict(data)
    host = PluginHost()
    try:
        host.enable_from_config(cfg)
    except PluginError as exc:  # atb plugin not installed: the hint names the package
        assert "pip install mindie-plugin-backends-atb" in str(exc)
    (tmp_path / "c.json").write_text(json.dumps(data))
    r = cli("plugins", "--config", str(tmp_path / "c.json"))
    assert "atb" in r.stdout


def test_plugins_command_lists_builtin() -> None:
    r = cli("plugins", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert rows[0]["name"] == "builtin" and rows[0]["enabled"]


def test_hookimpl_without_spec_fails_loudly() -> None:
    class Typo:
        @hookimpl
        def mindie_host_plan_stepp(self, ctx, state):  # misspelt hook name
            return None

    host = PluginHost()
    host.register(Typo(), "typo")
    with pytest.raises(PluginError, match="plugin 'typo': unknown hook 'mindie_host_plan_stepp'"):
        host.enable_from_config(config_from_dict(default_config_dict()))


def test_enabled_plugin_wins_over_builtin(tiny_model: Path) -> None:
    """A registered plugin's firstresult hook replaces the builtin policy (same door as builtins)."""
    from mindie_host.api import EngineRequest, SamplingParams, order_fcfs
    from mindie_host.testing import loaded_host, run_engine, server_config

    class LastComeFirst:
        @hookimpl
        def mindie_host_order_waiting(self, ctx, waiting):
            return list(reversed(order_fcfs(waiting)))

    host = loaded_host(server_config(tiny_model, schedule={"maxBatchSize": 1, "maxPrefillBatchSize": 1}),
                       plugins=[(LastComeFirst(), "lcfs")])
    order = []
    llm = host.llm
    for i in range(3):
        llm.add_request(EngineRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))
    while llm.has_work():
        order += [o.request_id for o in llm.step() if o.finished]
    assert order == ["r2", "r1", "r0"]
    assert run_engine(host, [])  == {}


def test_plugins_command_lists_hooks_and_parameters() -> None:
    """`mindie-host plugins` shows each plugin's hooks and the `Plugins.<name>` keys its Params declares."""
    r = cli("plugins", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert "mindie_host_add_routes" in rows["builtin"]["hooks"]
    spf = rows["shortest_prompt_first"]
    assert spf["hooks"] == ["mindie_host_order_waiting"]
    assert spf["params"] == {"agingTokensPerSecond": {"type": "float in [0, inf)", "default": 0.0, "required": False}}
    text = cli("plugins").stdout
    assert "param:  Plugins.shortest_prompt_first.agingTokensPerSecond (float in [0, inf), default 0.0)" in text


def test_config_validate_checks_plugin_params(tmp_path: Path) -> None:
    """`mindie-host config validate` validates an enabled plugin's Params and names the plugin and key."""
    data = default_config_dict()
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["plugin_params"] = json.dumps(
        {"plugin_type": "shortest_prompt_first"})
    data["Plugins"] = {"shortest_prompt_first": {"agingTokensPerSecond": "fast", "colour": 1}}
    (tmp_path / "c.json").write_text(json.dumps(data))
    r = cli("config", "validate", str(tmp_path / "c.json"))
    assert r.returncode == 1
    assert "Plugins.shortest_prompt_first.colour: not a parameter of plugin 'shortest_prompt_first'" in r.stdout
    data["Plugins"] = {"shortest_prompt_first": {"agingTokensPerSecond": "fast"}}
    (tmp_path / "c.json").write_text(json.dumps(data))
    r = cli("config", "validate", str(tmp_path / "c.json"))
    assert r.returncode == 1
    assert "Plugins.shortest_prompt_first.agingTokensPerSecond: got 'fast'; allowed: float" in r.stdout
    data["Plugins"] = {"shortest_prompt_first": {"agingTokensPerSecond": 5}}
    (tmp_path / "c.json").write_text(json.dumps(data))
    r = cli("config", "validate", str(tmp_path / "c.json"))
    assert r.returncode == 0, r.stdout


OLD_FORM_PLUGIN = '''
from mindie_host import hookimpl


@hookimpl
def mindie_host_validate_config(config, model_config):
    return []


@hookimpl
def mindie_host_startup(ctx, host):
    host.model_name
'''

RENAMED_CONTEXT_PLUGIN = '''
from mindie_host.api import SchedulingContext, hookimpl


@hookimpl
def mindie_host_plan_step(ctx: SchedulingContext, state):
    return None
'''


def _install_in(site: Path, name: str, source: str) -> None:
    """A real plugin distribution in ``site`` (its module and its dist-info with the entry point), found by entry
    points when ``site`` is on the path."""
    (site / f"{name}.py").write_text(source)
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[mindie_host.plugins]\n{name} = {name}\n")


def test_a_plugin_written_for_contract_2_fails_at_load_with_one_message(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed plugin whose hooks take contract 2's config/model_config/host is refused when it is enabled:
    one error naming the plugin, each hook, what replaces the argument and the migration section, no traceback;
    one that imports a context class contract 3 renamed is refused the same way."""
    import os

    site = tmp_path / "site"
    site.mkdir()
    _install_in(site, "old_form", OLD_FORM_PLUGIN)
    _install_in(site, "renamed_ctx", RENAMED_CONTEXT_PLUGIN)
    data = default_config_dict()
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["plugin_params"] = json.dumps(
        {"plugin_type": "old_form"})
    (tmp_path / "c.json").write_text(json.dumps(data))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "mindie_host.cli", "config", "validate", str(tmp_path / "c.json")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1
    errors = [line for line in r.stdout.splitlines() if line.startswith("error")]
    assert errors == [
        "error: plugin 'old_form' was written for an older plugin contract (this host speaks contract 3): "
        "mindie_host_startup takes host (read ctx.host); mindie_host_validate_config takes config, model_config "
        "(read ctx.config, read ctx.model); see docs/plugins.md, 'Migrating to contract 3'"
    ], r.stdout
    assert "Traceback" not in r.stdout + r.stderr and "pluggy" not in r.stdout + r.stderr

    monkeypatch.syspath_prepend(str(site))
    assert describe_installed("old_form").error == errors[0].removeprefix("error: ")  # `mindie-host plugins` says so
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["plugin_params"] = json.dumps(
        {"plugin_type": "renamed_ctx"})
    with pytest.raises(PluginError) as caught:
        PluginHost().enable_from_config(config_from_dict(data))
    assert str(caught.value) == (
        "plugin 'renamed_ctx' (renamed_ctx) failed to import: mindie_host.api.SchedulingContext is EngineContext "
        "since plugin contract 3 (one context class per shape); see docs/plugins.md, 'Migrating to contract 3'")
