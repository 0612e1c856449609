"""Install the example scheduler with pip, serve with it enabled, and watch it reorder the queue.

The package is installed editable into the current environment for this module
and uninstalled afterwards (unless it was installed before the test started).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from mindie_host.testing import make_tiny_llama, server_config

PACKAGE_DIR = Path(__file__).resolve().parents[1]
DIST = "mindie-scheduler-spf"

#: the most tokens of the request that holds the only batch slot while the others queue: its client hangs up as
#: soon as all four wait (the server then aborts it), so this only bounds a very slow machine's wait
BUSY = 6000


@pytest.fixture(scope="module")
def installed() -> Iterator[None]:
    """``pip install -e`` the example (no deps: the host is already here); uninstall when done."""
    try:
        md.distribution(DIST)
        was_installed = True
    except md.PackageNotFoundError:
        was_installed = False
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-e", str(PACKAGE_DIR)],
                   check=True, timeout=300)
    yield
    if not was_installed:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", DIST], check=True, timeout=300)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-spf"), max_position_embeddings=BUSY + 512)


def _config(model: Path, plugin: bool, aging: float = 0) -> dict[str, Any]:
    # one sequence at a time, so the waiting queue's order is the serving order
    cfg = server_config(model, schedule={"maxBatchSize": 1, "maxPrefillBatchSize": 1, "maxIterTimes": BUSY},
                        deploy={"maxSeqLen": BUSY + 256, "maxInputTokenLen": 512},
                        model={"plugin_params": json.dumps({"plugin_type": "shortest_prompt_first"})} if plugin else {},
                        plugins={"shortest_prompt_first": {"agingTokensPerSecond": aging}} if plugin else {})
    return cfg


def _serve_and_order(cfg: dict[str, Any], tmp_path: Path) -> list[str]:
    """Start ``mindie-host serve`` in a fresh process; return the order in which queued requests finish."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    s = cfg["ServerConfig"]
    url, mgmt = f"http://127.0.0.1:{s['port']}", f"http://127.0.0.1:{s['managementPort']}"
    metrics = f"http://127.0.0.1:{s['metricsPort']}/metrics"
    proc = subprocess.Popen([sys.executable, "-m", "mindie_host.cli", "serve", "--config", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else "server exited"
            try:
                if httpx.get(mgmt + "/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.3)
        done: list[str] = []
        sent: dict[str, float] = {}
        finished: dict[str, float] = {}

        busy_running = threading.Event()
        all_queued = threading.Event()

        def watch_queue() -> None:
            """Set ``all_queued`` once the server reports the four requests waiting behind "busy"."""
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and not all_queued.is_set():
                for line in httpx.get(metrics, timeout=10).text.splitlines():
                    if line.startswith("num_requests_waiting") and float(line.rsplit(" ", 1)[1]) >= 4:
                        all_queued.set()
                time.sleep(0.1)

        def send(name: str, words: int, max_tokens: int, delay: float) -> None:
            body = {"model": "tiny", "prompt": "hello " * words, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}
            if name == "busy":  # streamed: its first token says it holds the batch slot
                sent[name] = time.monotonic()
                with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
                    assert r.status_code == 200, r.read()
                    for _ in r.iter_lines():
                        busy_running.set()
                        if all_queued.is_set():
                            break  # hang up: the server aborts it and serves the queue in its policy's order
            else:  # the others arrive in order once "busy" runs (a loaded machine may delay any thread)
                assert busy_running.wait(120), "busy never started"
                time.sleep(delay)
                sent[name] = time.monotonic()
                r = httpx.post(url + "/v1/completions", json=body, timeout=300)
                assert r.status_code == 200, r.text
            finished[name] = time.monotonic()
            done.append(name)

        # "busy" holds the only batch slot while the others queue up: long, short, long, short
        jobs = [("busy", 4, BUSY, 0.0), ("long-1", 300, 16, 0.0), ("short-1", 5, 16, 0.3),
                ("long-2", 300, 16, 0.6), ("short-2", 5, 16, 0.9)]
        with ThreadPoolExecutor(len(jobs) + 1) as pool:
            watcher = pool.submit(watch_queue)
            list(pool.map(lambda j: send(*j), jobs))
            all_queued.set()
            watcher.result()
        assert done[0] == "busy" and finished["busy"] > max(sent.values()), "the queue never formed"
        return done[1:]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_cli_lists_the_installed_plugin(installed: None) -> None:
    out = subprocess.run([sys.executable, "-m", "mindie_host.cli", "plugins", "--json"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    rows = {row["name"]: row for row in json.loads(out)}
    assert rows["shortest_prompt_first"]["package"] == DIST


def test_policy_changes_the_serving_order(installed: None, tiny_model: Path, tmp_path: Path) -> None:
    fcfs = _serve_and_order(_config(tiny_model, plugin=False), tmp_path)
    assert fcfs == ["long-1", "short-1", "long-2", "short-2"]
    spf = _serve_and_order(_config(tiny_model, plugin=True), tmp_path)
    assert spf == ["short-1", "short-2", "long-1", "long-2"]
    # a huge aging rate makes waiting time dominate: first come, first served again
    aged = _serve_and_order(_config(tiny_model, plugin=True, aging=1e9), tmp_path)
    assert aged == fcfs


def test_negative_aging_is_refused(installed: None, tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config(tiny_model, plugin=True, aging=-1)))
    proc = subprocess.run([sys.executable, "-m", "mindie_host.cli", "serve", "--config", str(path)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2
    assert "Plugins.shortest_prompt_first.agingTokensPerSecond: got -1; allowed: float in [0, inf) (greater than or equal to 0)" in proc.stderr
