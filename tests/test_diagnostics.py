"""MIES_PROFILER_MODE and MIES_MEMORY_DETECTOR_MODE: a torch profiler trace of the engine's first steps (Chrome trace
format) and a memory report, in the documented folder under the log path, on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindie_host.api import EngineRequest, SamplingParams
from mindie_host.config import ConfigError, config_from_dict, default_config_dict
from mindie_host.testing import loaded_host, run_engine, server_config


def test_a_trace_of_two_steps_and_a_memory_report_appear_and_parse(tiny_model: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in {"MIES_PROFILER_MODE": "1", "MINDIE_HOST_PROFILER_STEPS": "2",
                       "MIES_MEMORY_DETECTOR_MODE": "1", "MINDIE_HOST_MEMORY_REPORT_STEPS": "2"}.items():
        monkeypatch.setenv(var, value)
    cfg = server_config(tiny_model)
    cfg["LogConfig"]["logPath"] = str(tmp_path / "logs" / "mindservice.log")
    host = loaded_host(cfg)
    try:
        folder = tmp_path / "logs" / "profiler"  # MINDIE_HOST_PROFILER_DIR's default, beside the log file
        assert not list(folder.glob("trace_*.json"))  # nothing before the first steps
        run_engine(host, [EngineRequest("r", list(range(300, 320)), SamplingParams(max_tokens=5, ignore_eos=True))])
        steps = int(host.llm.counters["steps"])
        blocks = host.llm.kv.num_blocks
    finally:
        host.shutdown()
    assert steps == 5  # the prompt's step and 4 decode steps
    (trace,) = folder.glob("trace_*.json")
    events = json.loads(trace.read_text())["traceEvents"]
    marks = sorted(e["name"] for e in events if e.get("name", "").startswith("engine step"))
    assert marks == ["engine step 1", "engine step 2"]  # two steps, no more
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the model's operators inside them
    (report,) = folder.glob("memory_*.jsonl")
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert [x["event"] for x in lines] == ["engine built", "after step 2", "after step 4"]
    assert all(x["rss_bytes"] > 0 and x["peak_rss_bytes"] >= x["rss_bytes"] for x in lines)
    assert all(x["kv_cache"]["blocks_total"] == blocks and x["kv_cache"]["bytes_per_block"] > 0 for x in lines)
    assert lines[0]["kv_cache"]["blocks_used"] == 0 and lines[1]["kv_cache"]["blocks_used"] == 2  # 21-22 tokens
    assert lines[1]["requests"]["num_running"] == 1 and lines[0]["swap_space"] is None


@pytest.mark.parametrize(("var", "value", "allowed"), [
    ("MIES_PROFILER_MODE", "on", "0 (off) or 1 (on)"), ("MIES_MEMORY_DETECTOR_MODE", "2", "0 (off) or 1 (on)"),
    ("MINDIE_HOST_PROFILER_STEPS", "0", "an integer in [1, 100000]"),
    ("MINDIE_HOST_MEMORY_REPORT_STEPS", "1.5", "an integer in [1, 1000000000]"),
])
def test_a_bad_value_stops_startup(var: str, value: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(default_config_dict(), environ={var: value})
    assert err.value.key == var and err.value.allowed == allowed
