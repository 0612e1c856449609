"""Load test: N concurrent streaming connections (default 1,000) on loopback against a real server.

Starts ``mindie-host serve`` on the default model (SmolLM2-135M-Instruct) in a
subprocess with the default ``maxLinkNum`` (1000) and ``maxBatchSize`` (200), opens
every connection at once (each a streaming ``/v1/chat/completions`` request), and
reports:

* served: streams that ended normally (``finish_reason`` and ``[DONE]``);
* rejected: refused up front with 503/429 (``maxLinkNum`` and its queue);
* errors: anything else (transport errors, other statuses, streams cut short);
* peak RSS of the server process (Linux ``VmHWM``);
* leaked blocks: ``mindie_host_kv_blocks_used`` from ``/metrics`` once all is done.

Exit status 0 only with zero errors and zero leaked blocks.

    python bench/load_1000.py                       # the full run: 1,000 connections
    python bench/load_1000.py --connections 200 --max-tokens 8
    python bench/load_1000.py --url http://127.0.0.1:1025 --metrics-url http://127.0.0.2:1027 --model NAME
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mindie_host.config import default_config_dict
from mindie_host.file_modes import write_file
from mindie_host.testing import free_port

PROMPTS = [
    "Write one sentence about the sea.",
    "What is the capital of France?",
    "Name three colours.",
    "Give me a short tip for learning Python.",
    "Describe a cat in a few words.",
]


@dataclass
class Tally:
    served: int = 0
    rejected: int = 0
    errors: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)

    def error(self, text: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(text)


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def write_config(directory: Path, model_path: str | None, max_batch: int, cpu_mem: int) -> tuple[Path, dict]:
    cfg = default_config_dict()
    s = cfg["ServerConfig"]
    s.update({"ipAddress": "127.0.0.1", "managementIpAddress": "127.0.0.1", "port": free_port(),
              "managementPort": free_port(), "metricsPort": free_port(), "httpsEnabled": False})
    model = cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    model["cpuMemSize"] = cpu_mem
    if model_path:
        model["modelWeightPath"] = model_path
    cfg["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] = max_batch
    cfg["BackendConfig"]["ScheduleConfig"]["maxPrefillBatchSize"] = min(50, max_batch)
    cfg["LogConfig"]["logPath"] = str(directory / "server.log")
    path = directory / "config.json"
    write_file(path, json.dumps(cfg, indent=2))  # 0640: what the file-mode check accepts
    return path, cfg


class RssWatcher(threading.Thread):
    """Polls the server's peak resident set size (VmHWM) from /proc."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_kb = 0
        self.stop_flag = threading.Event()

    def read(self) -> None:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    self.peak_kb = max(self.peak_kb, int(line.split()[1]))
        except OSError:
            pass

    def run(self) -> None:
        while not self.stop_flag.wait(0.2):
            self.read()


async def one_stream(client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int, tally: Tally) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": max_tokens, "stream": True, "temperature": 0}
    start = time.perf_counter()
    first: float | None = None
    finish = None
    done = False
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code in (429, 503):
                await r.aread()
                tally.rejected += 1
                return
            if r.status_code != 200:
                tally.error(f"status {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    tally.error(f"stream error: {chunk['error']}")
                    return
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                if choice.get("delta", {}).get("content"):
                    tally.tokens += 1
                    if first is None:
                        first = time.perf_counter()
                finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as exc:
        tally.error(f"{type(exc).__name__}: {exc}")
        return
    if done and finish:
        tally.served += 1
        tally.latency.append(time.perf_counter() - start)
        if first is not None:
            tally.ttft.append(first - start)
    else:
        tally.error(f"stream ended without finish/[DONE] (finish={finish}, done={done})")


async def run_load(url: str, model: str, connections: int, max_tokens: int, timeout: float) -> tuple[Tally, float]:
    tally = Tally()
    limits = httpx.Limits(max_connections=connections + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=60), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one_stream(client, url, model, i, max_tokens, tally) for i in range(connections)))
        wall = time.perf_counter() - t0
    return tally, wall


def blocks_in_use(metrics_url: str) -> float:
    for line in httpx.get(metrics_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("mindie_host_kv_blocks_used{"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def wait_ready(mgmt_url: str, proc: subprocess.Popen[bytes] | None, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(mgmt_url + "/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not become ready")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-batch-size", type=int, default=200, help="ScheduleConfig.maxBatchSize of the server")
    ap.add_argument("--cpu-mem", type=int, default=1, help="ModelConfig.cpuMemSize (GB of KV cache on CPU)")
    ap.add_argument("--model-path", help="weights to serve (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per-request read timeout, seconds")
    ap.add_argument("--url", help="bench a running server instead of starting one")
    ap.add_argument("--metrics-url", help="its metrics URL (for the leaked-block check)")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="model name to request")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    raise_fd_limit()

    proc: subprocess.Popen[bytes] | None = None
    watcher: RssWatcher | None = None
    tmp = tempfile.TemporaryDirectory(prefix="mindie-load-")
    try:
        if args.url:
            url, metrics_url = args.url, args.metrics_url
        else:
            path, cfg = write_config(Path(tmp.name), args.model_path, args.max_batch_size, args.cpu_mem)
            s = cfg["ServerConfig"]
            url = f"http://127.0.0.1:{s['port']}"
            metrics_url = f"http://127.0.0.1:{s['metricsPort']}"
            args.model = cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelName"]
            proc = subprocess.Popen(
                [sys.executable, "-m", "mindie_host.cli", "serve", "--config", str(path)], cwd=tmp.name,
                stdout=subprocess.DEVNULL, stderr=open(Path(tmp.name) / "stderr.txt", "wb"),
                preexec_fn=raise_fd_limit, env={**os.environ, "MIES_SERVICE_MONITOR_MODE": "1"},
            )
            watcher = RssWatcher(proc.pid)
            watcher.start()
            wait_ready(f"http://127.0.0.1:{s['managementPort']}", proc)
        tally, wall = asyncio.run(run_load(url, args.model, args.connections, args.max_tokens, args.timeout))
        leaked = float("nan")
        if metrics_url:
            deadline = time.monotonic() + 30
            leaked = blocks_in_use(metrics_url)
            while leaked and time.monotonic() < deadline:
                time.sleep(0.5)
                leaked = blocks_in_use(metrics_url)
        if watcher is not None:
            watcher.read()
        report = {
            "connections": args.connections,
            "max_tokens": args.max_tokens,
            "served": tally.served,
            "rejected": tally.rejected,
            "errors": tally.errors,
            "leaked_blocks": leaked,
            "peak_rss_mb": round(watcher.peak_kb / 1024, 1) if watcher else None,
            "wall_s": round(wall, 2),
            "output_tokens": tally.tokens,
            "output_tok_per_s": round(tally.tokens / wall, 1) if wall else 0.0,
            "ttft_p50_s": round(pct(tally.ttft, 0.5), 3),
            "ttft_p99_s": round(pct(tally.ttft, 0.99), 3),
            "latency_mean_s": round(statistics.fmean(tally.latency), 3) if tally.latency else None,
            "error_samples": tally.error_samples,
        }
        if args.json:
            print(json.dumps(report))
        else:
            for key, value in report.items():
                print(f"{key:>18}: {value}")
        ok = tally.errors == 0 and leaked == 0
        return 0 if ok else 1
    finally:
        if watcher is not None:
            watcher.stop_flag.set()
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
        tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
