"""Management plane, Prometheus metrics and logging, against the real server over HTTP."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mindie_host import hookimpl
from mindie_host.api import HostContext
from mindie_host.config import LogConfig, config_from_dict
from mindie_host.host import Host
from mindie_host.logs import setup_logging
from mindie_host.server import metrics as m
from mindie_host.server.management import static_config
from mindie_host.testing import RunningServer, server_config

EXPECTED_HISTOGRAM_BUCKETS = {
    "time_to_first_token_seconds": ["0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5",
                                    "0.75", "1", "2.5", "5", "7.5", "10", "+Inf"],
    "time_per_output_token_seconds": ["0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5",
                                      "0.75", "1", "2.5", "+Inf"],
    "e2e_request_latency_seconds": ["1", "2.5", "5", "10", "15", "20", "30", "40", "50", "60", "+Inf"],
    "request_prompt_tokens": ["10", "50", "100", "200", "500", "1000", "2000", "5000", "10000", "+Inf"],
    "request_generation_tokens": ["10", "50", "100", "200", "500", "1000", "2000", "5000", "10000", "+Inf"],
}
SPEC_COUNTERS = {
    "request_received_total": "Number of requests received so far.",
    "request_success_total": "Number of requests proceed successfully so far.",
    "request_failed_total": "Number of requests failed so far.",
    "num_preemptions_total": "Cumulative number of preemption from the engine.",
    "prompt_tokens_total": "Number of prefill tokens processed.",
    "generation_tokens_total": "Number of generation tokens processed.",
}
SPEC_GAUGES = {
    "num_requests_running": "Number of requests currently running on NPU.",
    "num_requests_waiting": "Number of requests waiting to be processed.",
    "num_requests_swapped": "Number of requests swapped to CPU.",
    "avg_prompt_throughput_toks_per_s": "Average prefill throughput in tokens/s.",
    "avg_generation_throughput_toks_per_s": "Average generation throughput in tokens/s.",
    "failed_request_perc": "Requests failure rate. 1 means 100 percent usage.",
    "npu_cache_usage_perc": "NPU KV-cache usage. 1 means 100 percent usage.",
    "cpu_cache_usage_perc": "CPU KV-cache usage. 1 means 100 percent usage.",
    "npu_prefix_cache_hit_rate": "NPU prefix cache block hit rate.",
}


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as {sample name: value} (single-series metrics only; buckets keyed by le)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + (f"[{s.labels['le']}]" if "le" in s.labels else "")
            values[key] = s.value
    return values


def complete(url: str, prompt: str = "Hello there", max_tokens: int = 4, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


# -- probes ----------------------------------------------------------------------------------------
def test_probes_answer_with_empty_bodies(tiny_server: RunningServer) -> None:
    for path in ("/health", "/v2/health/live", "/v2/health/ready"):
        r = httpx.get(tiny_server.management_url + path, timeout=30)
        assert r.status_code == 200, path
        assert r.content == b"", path


def test_probes_are_not_on_the_business_port(tiny_server: RunningServer) -> None:
    assert httpx.get(tiny_server.url + "/v2/health/ready", timeout=30).status_code == 404
    assert httpx.get(tiny_server.url + "/stopService", timeout=30).status_code == 404
    assert httpx.get(tiny_server.management_url + "/metrics", timeout=30).status_code == 404


@pytest.mark.parametrize("path", ["/health/timed", "/health/timed-1", "/health/timed-200", "/health/timed-600"])
def test_timed_health_probe_runs_the_pipeline(tiny_server: RunningServer, path: str) -> None:
    before = tiny_server.host.stats().get("requests_received", 0)
    r = httpx.get(tiny_server.management_url + path, timeout=60)
    assert r.status_code == 200
    assert r.json() == {"status": "healthy"}
    assert tiny_server.host.stats().get("requests_received", 0) > before  # a real generation went through


@pytest.mark.parametrize("bad", ["0", "601", "abc", "-5", "1.5", "99999"])
def test_timed_health_probe_rejects_bad_timeouts(tiny_server: RunningServer, bad: str) -> None:
    r = httpx.get(f"{tiny_server.management_url}/health/timed-{bad}", timeout=30)
    assert r.status_code == 400
    assert r.json()["field"] == "TIMEOUT"
    assert "[1, 600]" in r.json()["error"]


class _BlockStartup:
    """A test plugin that holds model startup until released (readiness must stay false meanwhile)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    @hookimpl
    def mindie_host_startup(self, ctx: HostContext) -> None:
        self.release.wait(120)


def test_readiness_is_false_until_the_model_is_loaded(tiny_model: Path) -> None:
    blocker = _BlockStartup()
    server = RunningServer(server_config(tiny_model), plugins=[(blocker, "block_startup")])
    starter = threading.Thread(target=server.start, daemon=True)
    starter.start()
    try:
        deadline = time.monotonic() + 60
        live = None
        while time.monotonic() < deadline:
            try:
                live = httpx.get(server.management_url + "/v2/health/live", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert live is not None and live.status_code == 200
        for path in ("/v2/health/ready", "/health"):
            r = httpx.get(server.management_url + path, timeout=5)
            assert r.status_code == 503
            assert "not ready" in r.json()["error"]
        timed = httpx.get(server.management_url + "/health/timed-2", timeout=30)
        assert timed.status_code == 503
        assert timed.json()["status"] == "unhealthy"
        inference = complete(server.url)
        assert inference.status_code == 503
        blocker.release.set()
        starter.join(120)
        assert httpx.get(server.management_url + "/v2/health/ready", timeout=5).status_code == 200
        assert complete(server.url).status_code == 200
    finally:
        blocker.release.set()
        server.stop()


# -- config and status ---------------------------------------------------------------------------
def test_v1_config_has_the_spec_fields(tiny_server: RunningServer) -> None:
    r = httpx.get(tiny_server.management_url + "/v1/config", timeout=30)
    assert r.status_code == 200
    cfg = tiny_server.config
    assert r.json() == {
        "modelName": "tiny",
        "maxSeqLen": cfg.deploy.maxSeqLen,
        "npuMemSize": cfg.model.npuMemSize,
        "cpuMemSize": cfg.model.cpuMemSize,
        "worldSize": cfg.model.worldSize,
        "maxOutputLen": cfg.schedule.maxIterTimes,
        "cacheBlockSize": cfg.schedule.cacheBlockSize,
        # beyond the spec: what the MS controller needs for total_slots_num / total_block_num
        "maxBatchSize": cfg.schedule.maxBatchSize,
        "totalBlockNum": r.json()["totalBlockNum"],
        # beyond the spec: the MS controller reads it to know a server can take a PD role
        "inferMode": "standard",
    }
    assert r.json()["totalBlockNum"] > 0


def test_v1_config_full_redacts_the_api_key(tiny_model: Path) -> None:
    host = Host(config_from_dict(server_config(tiny_model, server={"apiKey": "sk-very-secret"})))
    body = static_config(host, full=True)
    assert body["config"]["ServerConfig"]["apiKey"] == "******"
    assert "sk-very-secret" not in str(body)
    assert body["config"]["ServerConfig"]["maxLinkNum"] == 1000


def test_v1_status_reports_free_slots_and_blocks(tiny_server: RunningServer) -> None:
    tiny_server.wait_idle()
    r = httpx.get(tiny_server.management_url + "/v1/status", timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert body["service"] == {"roleStatus": "RoleReady", "currentRole": "none"}
    assert body["resource"]["availSlotsNum"] == tiny_server.config.schedule.maxBatchSize
    assert body["resource"]["availBlockNum"] == int(tiny_server.host.stats()["kv_blocks_total"])
    assert "peers" not in body


# -- metrics -------------------------------------------------------------------------------------
def test_metrics_json_has_the_spec_shape(tiny_server: RunningServer) -> None:
    assert complete(tiny_server.url, max_tokens=5).status_code == 200
    tiny_server.wait_idle()
    r = httpx.get(tiny_server.management_url + "/metrics-json", timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert body["resultType"] == "vector"
    names = [item["metric"][0]["__name__"] for item in body["result"]]
    assert names[:5] == ["TTFT", "TBT", "waitingInferRequestNum", "processingInferRequestNum", "remainBlocks"]
    s = tiny_server.config.server
    for item in body["result"]:
        assert len(item["metric"]) == 1
        assert item["metric"][0]["job"] == "node"
        assert item["metric"][0]["instance"] == f"{s.managementIpAddress}:{s.managementPort}"
        assert isinstance(item["value"], str)
    values = {item["metric"][0]["__name__"]: float(item["value"]) for item in body["result"]}
    assert values["TTFT"] > 0  # a request has finished, so the rolling average has data
    assert values["TBT"] > 0
    assert values["waitingInferRequestNum"] == 0
    assert values["processingInferRequestNum"] == 0
    assert values["remainBlocks"] == tiny_server.host.stats()["kv_blocks_total"]


def test_prometheus_metrics_match_the_spec(tiny_server: RunningServer) -> None:
    before = scrape(tiny_server.metrics_url)
    assert complete(tiny_server.url, max_tokens=6, ignore_eos=True).status_code == 200
    tiny_server.wait_idle()
    r = httpx.get(tiny_server.metrics_url + "/metrics", timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name, doc in {**SPEC_COUNTERS, **SPEC_GAUGES}.items():
        assert f"# HELP {name} {doc}\n" in text
        kind = "counter" if name in SPEC_COUNTERS else "gauge"
        assert f"# TYPE {name} {kind}\n" in text
        assert f'\n{name}{{model_name="tiny"}} ' in text
    for name, les in EXPECTED_HISTOGRAM_BUCKETS.items():
        assert f"# TYPE {name} histogram\n" in text
        lines = [ln for ln in text.splitlines() if ln.startswith(name + "_")]
        assert lines[0].startswith(f'{name}_count{{model_name="tiny"}} ')
        assert lines[1].startswith(f'{name}_sum{{model_name="tiny"}} ')
        got = [ln.split('le="')[1].split('"')[0] for ln in lines[2:]]
        assert got == les
        assert all(ln.startswith(f'{name}_bucket{{model_name="tiny",le="') for ln in lines[2:])
        assert not any(ln.endswith(".0") for ln in lines if "_bucket" in ln)
    assert "_created" not in text
    after = scrape(tiny_server.metrics_url)
    assert after["request_success_total"] >= before["request_success_total"] + 1
    assert after["request_received_total"] >= before["request_received_total"] + 1
    assert after["generation_tokens_total"] >= before["generation_tokens_total"] + 6
    assert after["request_generation_tokens_count"] >= before["request_generation_tokens_count"] + 1
    assert after["request_generation_tokens_bucket[10]"] >= before["request_generation_tokens_bucket[10]"] + 1
    assert after["time_per_output_token_seconds_count"] >= before["time_per_output_token_seconds_count"] + 5
    assert after["e2e_request_latency_seconds_count"] >= before["e2e_request_latency_seconds_count"] + 1
    assert after["mindie_host_kv_blocks_used"] == 0
    assert after["mindie_host_kv_blocks_total"] > 0


def test_prometheus_metrics_can_be_switched_off(tiny_server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIES_SERVICE_MONITOR_MODE", "0")
    r = httpx.get(tiny_server.metrics_url + "/metrics", timeout=30)
    assert r.status_code == 500
    assert r.json()["error"] == "Environment variable MIES_SERVICE_MONITOR_MODE is not set."


def test_model_label_joins_several_models(tiny_model: Path) -> None:
    cfg = server_config(tiny_model)
    second = dict(cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0], modelName="other")
    cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"].append(second)
    assert m.model_label(Host(config_from_dict(cfg))) == "tiny&other"
    assert [m.format_value(v) for v in (1.0, 2.5, float("inf"), 0.0, 10000.0)] == ["1", "2.5", "+Inf", "0", "10000"]


class _PluginGauge:
    @hookimpl
    def mindie_host_metrics(self, ctx: HostContext) -> dict[str, float]:
        return {"npu_prefix_cache_hit_rate": 0.25, "my_plugin_gauge": 7.0}


def test_plugin_gauges_reach_both_exporters(tiny_server: RunningServer) -> None:
    plugin = _PluginGauge()
    tiny_server.host.plugins.pm.register(plugin, name="test_gauge")
    try:
        values = scrape(tiny_server.metrics_url)
        assert values["npu_prefix_cache_hit_rate"] == 0.25
        assert values["my_plugin_gauge"] == 7.0
        body = httpx.get(tiny_server.management_url + "/metrics-json", timeout=30).json()
        extra = {item["metric"][0]["__name__"]: item["value"] for item in body["result"][5:]}
        assert extra["my_plugin_gauge"] == "7"
    finally:
        tiny_server.host.plugins.pm.unregister(plugin)


# -- stopService ---------------------------------------------------------------------------------
def test_stop_service_drains_then_stops(tiny_model: Path) -> None:
    server = RunningServer(server_config(tiny_model, server={"engineProcess": False})).start()  # holds the backend
    backend = server.host.backend
    assert backend is not None
    original = backend.execute
    gate = threading.Event()
    gate.set()

    def held(batch: Any) -> Any:
        gate.wait(60)
        return original(batch)

    backend.execute = held  # type: ignore[method-assign]
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["response"] = complete(server.url, max_tokens=40, ignore_eos=True)

    try:
        gate.clear()  # the backend waits: the request below stays in flight
        worker = threading.Thread(target=long_request)
        worker.start()
        deadline = time.monotonic() + 30
        while server.host.stats().get("num_active_requests", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        r = httpx.get(server.management_url + "/stopService", timeout=30)
        assert r.status_code == 200
        assert r.content == b""
        refused = complete(server.url)
        assert refused.status_code == 503
        assert "stopped" in refused.text
        assert httpx.get(server.management_url + "/v2/health/ready", timeout=5).status_code == 503
        gate.set()
        worker.join(60)
        assert result["response"].status_code == 200
        assert result["response"].json()["usage"]["completion_tokens"] == 40
        assert server._thread is not None
        server._thread.join(60)
        assert not server._thread.is_alive()  # the server exited by itself
    finally:
        gate.set()
        server.stop()


# -- logging -------------------------------------------------------------------------------------
def test_logs_carry_request_ids_and_no_prompt_text(tiny_server: RunningServer, tmp_path: Path) -> None:
    log_file = tmp_path / "mindie.log"
    root = logging.getLogger("mindie_host")
    saved = (list(root.handlers), root.level, root.propagate)
    setup_logging(LogConfig(logLevel="Info", logPath=str(log_file), logFileSize=1, logFileNum=2), to_stderr=False)
    secret = "purple elephants juggle seventeen quantum marmalades"
    try:
        r = httpx.post(tiny_server.url + "/v1/completions", json={"model": "tiny", "prompt": secret, "max_tokens": 3},
                       headers={"X-Request-Id": "req-abc-123"}, timeout=60)
        assert r.status_code == 200
        assert r.headers["x-request-id"] == "req-abc-123"
        bad = httpx.post(tiny_server.url + "/v1/completions", json={"model": "tiny", "prompt": secret,
                                                                    "max_tokens": -1}, timeout=60)
        assert bad.status_code == 422
        auto_id = bad.headers["x-request-id"]
        # the access line is written once the response has been sent, so it may land just after the client returns
        deadline = time.time() + 10
        while time.time() < deadline:
            for handler in root.handlers:
                handler.flush()
            if log_file.exists() and f"[req={auto_id}]" in log_file.read_text():
                break
            time.sleep(0.05)
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
        root.propagate = saved[2]
    text = log_file.read_text()
    assert secret not in text
    assert "purple" not in text
    lines = [ln for ln in text.splitlines() if "/v1/completions" in ln]
    assert any("[req=req-abc-123]" in ln and "-> 200" in ln for ln in lines)
    assert any(f"[req={auto_id}]" in ln and "-> 422" in ln for ln in lines)
    assert all("[req=-]" not in ln for ln in lines)


def test_log_file_rotates_by_size(tmp_path: Path) -> None:
    log_file = tmp_path / "rot" / "server.log"
    root = logging.getLogger("mindie_host")
    saved = (list(root.handlers), root.level, root.propagate)
    setup_logging(LogConfig(logLevel="Warning", logPath=str(log_file), logFileSize=1, logFileNum=2), to_stderr=False)
    try:
        logging.getLogger("mindie_host.test").info("not at INFO")
        for i in range(3500):
            logging.getLogger("mindie_host.test").warning("line %d %s", i, "x" * 1000)
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
        root.propagate = saved[2]
    files = sorted(p.name for p in log_file.parent.iterdir())
    assert files == ["server.log", "server.log.1", "server.log.2"]
    assert all(p.stat().st_size <= 1024 * 1024 + 2000 for p in log_file.parent.iterdir())
    assert "not at INFO" not in log_file.read_text()


def test_json_log_format_carries_the_request_id(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from mindie_host.logs import RequestIdFilter, bind_request_id, make_formatter, reset_request_id

    monkeypatch.setenv("MINDIE_HOST_LOG_FORMAT", "json")
    formatter = make_formatter()
    token = bind_request_id("rid-42")
    try:
        record = logging.LogRecord("mindie_host.server", logging.INFO, __file__, 1, "POST %s -> %d", ("/x", 200), None)
        RequestIdFilter().filter(record)
    finally:
        reset_request_id(token)
    data = json.loads(formatter.format(record))
    assert data["request_id"] == "rid-42"
    assert data["message"] == "POST /x -> 200"
    assert data["level"] == "INFO"
