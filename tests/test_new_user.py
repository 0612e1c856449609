"""What a new user hits first (issue 15, points 9-12, 15, 16): the README's commands, installs, the CLI, docs."""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import logging
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import mindie_host
import mindie_host.api
from mindie_host.cli import build_config, parser
from mindie_host.config import config_from_dict
from mindie_host.engine.sequence import SequenceView
from mindie_host.logs import setup_logging
from mindie_host.plugins import PluginHost
from mindie_host.testing import server_config

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def readme_block(name: str) -> str:
    """The fenced block after ``<!-- ci:NAME`` in README.md (what .ci/run runs)."""
    match = re.search(rf"^<!-- ci:{name}\b[^\n]*\n```[a-z]*\n(.*?)\n```", README, re.S | re.M)
    assert match, f"README.md has no ci:{name} block"
    return match.group(1).strip()


# -- 9: CI runs the README's two commands in a fresh virtual environment ------------------------------------------
def test_ci_runs_exactly_the_readme_commands_in_a_fresh_venv() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r'-m venv "\$WORK/venv"', ci) and 'source "$WORK/venv/bin/activate"' in ci
    for name in ("serve", "test", "clients"):
        readme_block(name)  # present
        assert f"readme_block {name}" in ci
    assert 'bash -c "$SERVE_CMD"' in ci and 'bash -c "$TEST_CMD"' in ci and 'bash -c "$CLIENTS_CMD"' in ci
    # the extraction .ci/run does gives the same text as the README shows
    awk = re.search(r"readme_block\(\) \{.*?\n\}\n", ci, re.S)
    assert awk
    for name in ("serve", "test", "clients"):
        out = subprocess.run(["bash", "-c", awk.group(0) + f"readme_block {name}"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == readme_block(name)
    assert readme_block("serve").endswith("mindie-host serve")
    assert "python -m pytest -q" in readme_block("test")
    # a readiness wait, one real request, a SIGTERM and a clean-stop check; pytest's status is the script's
    assert "/v2/health/ready" in ci and "/v1/chat/completions" in ci and "kill -TERM" in ci
    assert "set -euo pipefail" in ci and ci.rstrip().endswith('bash -c "$TEST_CMD"')


def _installed_by_install_script() -> tuple[set[str], set[str]]:
    """(distributions installed with their dependencies, distributions installed with --no-deps)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    with_deps = list(project["dependencies"]) + project["optional-dependencies"]["test"] + \
        project["optional-dependencies"]["bench"]
    no_deps: list[str] = []
    for line in (ROOT / "scripts" / "install-dev.sh").read_text().splitlines():
        if "pip install" not in line or line.lstrip().startswith("#"):
            continue
        words = [w.strip('"') for w in line.split("pip install", 1)[1].split("||")[0].split()]
        names = [w for w in words if not w.startswith(("-", "$", ".", '"$')) and w]
        (no_deps if "--no-deps" in words else with_deps).extend(names)
    for pyproject in list(ROOT.glob("plugins/*/pyproject.toml")) + list(ROOT.glob("examples/plugins/*/pyproject.toml")):
        no_deps.append(tomllib.loads(pyproject.read_text())["project"]["name"])
    return set(with_deps), set(no_deps)


def _closure(requirements: set[str]) -> set[str]:
    """Normalized names of ``requirements`` and everything they pull in (as installed here)."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        key = (_norm(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        if _installed(req.name):
            for sub in md.requires(req.name) or []:
                todo.extend((Requirement(sub), e) for e in set(req.extras) | {""})
    return {name for name, _ in seen}


def _installed(name: str) -> bool:
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_test_import_is_installed_by_the_install_script() -> None:
    with_deps, no_deps = _installed_by_install_script()
    provided = _closure(with_deps) | {_norm(Requirement(n).name) for n in no_deps}
    local = {p.stem for p in ROOT.rglob("*.py")} | {p.name for p in ROOT.rglob("*") if (p / "__init__.py").exists()}
    by_module = md.packages_distributions()
    missing: dict[str, str] = {}
    files = list((ROOT / "tests").glob("*.py")) + list(ROOT.glob("plugins/*/tests/*.py")) + \
        list(ROOT.glob("examples/**/tests/*.py"))
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in local:
                    continue
                dists = by_module.get(top)
                assert dists, f"{path.name} imports {top!r}, which no installed distribution provides"
                if not any(_norm(d) in provided for d in dists):
                    missing[top] = f"{path.relative_to(ROOT)} (distribution {dists[0]})"
    assert not missing, f"imported by tests but not installed by scripts/install-dev.sh / the test extra: {missing}"


# -- 10: the README gives the CPU and the CUDA torch commands -------------------------------------------------------
def test_readme_gives_cpu_and_cuda_torch_commands() -> None:
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in README
    assert re.search(r"pip install torch==2\.13\.0 --index-url https://download\.pytorch\.org/whl/cu\d+", README)
    assert "local CPU wheel" in README  # why the bare command gives a CPU build on the build machine
    for name in ("serve", "test"):  # the two commands CI runs keep working on this machine
        assert readme_block(name).startswith("pip install torch==2.13.0 && ")


# -- 11: the clients' install line does not downgrade huggingface_hub -----------------------------------------------
def test_readme_client_install_line_changes_no_installed_package(tmp_path: Path) -> None:
    line = readme_block("clients")
    install_dev = (ROOT / "scripts" / "install-dev.sh").read_text()
    changed: list[str] = []
    for i, command in enumerate(c.strip() for c in line.split("&&")):
        assert command.startswith("pip install "), command
        args = command.split()[2:]
        # install-dev.sh (the test command) installs the clients the same way
        assert command.replace("pip install ", "$PY -m pip install -q ") in install_dev
        report = tmp_path / f"report{i}.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                        *[a.strip('"') for a in args]], check=True, capture_output=True, timeout=300)
        for item in json.loads(report.read_text())["install"]:
            name, version = item["metadata"]["name"], item["metadata"]["version"]
            if _installed(name) and md.version(name) != version:
                changed.append(f"{name} {md.version(name)} -> {version}")
    assert not changed, f"the README's client install line would change installed packages: {changed}"
    assert _installed("text-generation") and _installed("huggingface_hub")


# -- 12: a port in use is reported before the model loads -----------------------------------------------------------
def test_port_in_use_fails_before_loading_with_one_line(tiny_model: Path, tmp_path: Path) -> None:
    cfg = server_config(tiny_model)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    port = cfg["ServerConfig"]["managementPort"]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "mindie_host.cli", "serve", "--config", str(path)],
                              capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - t0
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("mindie-host: "), proc.stderr
    assert f"127.0.0.1:{port} (management) is already in use" in lines[0]
    assert "loading weights" not in proc.stderr and "Traceback" not in proc.stderr  # nothing was loaded
    assert elapsed < 60


# -- 15: plugin loggers, the hookimpl import path, SequenceView's fields documented -----------------------------------
def test_a_plugin_packages_own_logger_reaches_the_host_log(tmp_path: Path) -> None:
    cfg = server_config(None, model={"plugin_params": json.dumps({"plugin_type": "multi_lora"})})
    cfg["LogConfig"] = {"logLevel": "Info", "logPath": str(tmp_path / "host.log"), "logFileSize": 20, "logFileNum": 2}
    config = config_from_dict(cfg)
    host_logger, plugin_logger = logging.getLogger("mindie_host"), logging.getLogger("mindie_plugin_multi_lora")
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in (host_logger, plugin_logger)]
    try:
        setup_logging(config.LogConfig, to_stderr=False)
        PluginHost().enable_from_config(config)
        plugin_logger.info("adapter registry says hello")
        logging.getLogger("mindie_plugin_multi_lora.registry").warning("a module logger of the plugin")
        for handler in host_logger.handlers:
            handler.flush()
        text = (tmp_path / "host.log").read_text()
        assert "INFO mindie_plugin_multi_lora [req=-] adapter registry says hello" in text
        assert "WARNING mindie_plugin_multi_lora.registry [req=-] a module logger of the plugin" in text
    finally:
        for lg, handlers, level, propagate in saved:
            for h in list(lg.handlers):
                lg.removeHandler(h)
                if h not in handlers:
                    h.close()
            for h in handlers:
                lg.addHandler(h)
            lg.setLevel(level)
            lg.propagate = propagate


def test_plugin_docs_name_one_hookimpl_path_and_every_sequenceview_field() -> None:
    assert mindie_host.api.hookimpl is mindie_host.hookimpl  # the old path keeps working
    guide = (ROOT / "docs" / "plugins.md").read_text()
    assert "from mindie_host.api import hookimpl" in guide
    docs = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("plugins/*/README.md"),
            *ROOT.glob("examples/plugins/*/README.md")]
    stale = [str(p.relative_to(ROOT)) for p in docs if "from mindie_host import hookimpl" in p.read_text()]
    assert not stale, f"docs still show the other import path: {stale}"
    fields = set(SequenceView.__annotations__) | {
        name for name, value in vars(SequenceView).items() if isinstance(value, property)}
    assert {"seq_id", "num_computed", "num_uncomputed", "is_prefill"} <= fields
    undocumented = sorted(f for f in fields if not re.search(rf"^\| `{f}` \|", guide, re.M))
    assert not undocumented, f"SequenceView fields missing from docs/plugins.md: {undocumented}"


# -- 16: MIES_CONFIG_JSON_PATH, and the monitor-mode deviation in the user docs ---------------------------------------
def test_serve_reads_MIES_CONFIG_JSON_PATH(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_file, flag_file = tmp_path / "env.json", tmp_path / "flag.json"
    env_file.write_text(json.dumps({"ServerConfig": {"port": 18080}}))
    flag_file.write_text(json.dumps({"ServerConfig": {"port": 18081}}))
    monkeypatch.setenv("MIES_CONFIG_JSON_PATH", str(env_file))
    config = build_config(parser().parse_args(["serve"]))
    assert config.server.port == 18080 and config.source_path == str(env_file)
    config = build_config(parser().parse_args(["serve", "--config", str(flag_file)]))  # --config wins
    assert config.server.port == 18081
    monkeypatch.delenv("MIES_CONFIG_JSON_PATH")
    assert build_config(parser().parse_args(["serve"])).server.port == 1025


def test_monitor_mode_default_is_documented_as_a_deviation() -> None:
    text = (ROOT / "docs" / "operating.md").read_text()
    section = text[text.index("**`MIES_SERVICE_MONITOR_MODE`: a deviation from the spec.**"):][:1200]
    assert "MIES_SERVICE_MONITOR_MODE=1" in section and "Why:" in section
    assert "MIES_SERVICE_MONITOR_MODE=0" in section  # how to get MindIE's behaviour
