"""Soak test: hostile and normal clients together for ten minutes against a real server.

Starts ``mindie-host serve`` in a subprocess (by default on a tiny random Llama with the
SmolLM2 tokenizer, built in a temporary directory; ``--model-path`` serves real weights)
with ``maxLinkNum`` = 16 and header/body read timeouts of 5 s, then runs
``2 * maxLinkNum`` client loops for ``--duration`` seconds (default 600). Each loop
picks, request after request:

* normal (55 %): ``/v1/completions``, ``max_tokens`` 16, timed (the p99 below);
* stream (10 %): a streamed chat completion read to its end;
* disconnect (10 %): a long stream dropped after two chunks;
* bad body (10 %): broken JSON, a lone surrogate, 100,000-deep nesting, wrong types,
  fan-out beyond ``maxBatchSize``, stop ids outside the vocabulary, a near-zero
  ``repetition_penalty``, a bad Triton binary header;
* slow body (7.5 %): a raw socket that trickles its body (the server answers 408);
* slow headers (7.5 %): a raw socket that trickles its headers (the server closes it).

Before the load, the same normal request runs ``--idle-requests`` times one at a time on
the idle server (the idle p99). Reported: 5xx count (must be 0), transport errors of
normal requests, KV blocks still in use once the server is idle (must be 0), the
server's RSS at the start and at the end, and normal-request p50/p99 under load
against idle. Exit status 0 only with no 5xx, no failed normal request and no leak.

    python bench/soak.py                        # the full run: 600 s
    python bench/soak.py --duration 60 --json   # a short one
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from load_1000 import blocks_in_use, pct, raise_fd_limit, wait_ready, write_config

from mindie_host.file_modes import write_file

MAX_LINK_NUM = 16
SLOW_TIMEOUT_S = 5.0
PROMPTS = ["Write one sentence about the sea.", "What is the capital of France?", "Name three colours.",
           "Give me a short tip for learning Python."]
DEEP = b'{"prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@dataclass
class Tally:
    """Counts over the whole run."""

    kinds: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    normal_failures: list[str] = field(default_factory=list)
    slow_not_cut: int = 0
    latency: list[float] = field(default_factory=list)

    def status(self, kind: str, code: int, text: str = "") -> None:
        self.statuses[code] += 1
        if code >= 500 and len(self.server_errors) < 20:
            self.server_errors.append(f"{kind}: {code} {text[:200]}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def normal_body(model: str, i: int) -> dict:
    return {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 16, "temperature": 0}


def bad_bodies(model: str) -> list[tuple[str, bytes, dict[str, str]]]:
    """(path, raw body, extra headers) of requests that must get a 4xx."""
    js = {"content-type": "application/json"}

    def j(path: str, body: dict) -> tuple[str, bytes, dict[str, str]]:
        return path, json.dumps(body).encode(), js

    triton_head = json.dumps({"inputs": [{"name": "input0", "shape": [2], "datatype": "UINT32",
                                          "parameters": {"binary_data_size": 99}}]}).encode()
    return [
        ("/v1/completions", b'{"model": "x", "prompt": ', js),
        ("/v1/chat/completions", b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}', js),
        ("/v1/completions", DEEP, js),
        j("/v1/completions", {"model": model, "prompt": 5, "max_tokens": "many"}),
        j("/v1/completions", {"model": model, "prompt": ["p"] * 100, "n": 16, "max_tokens": 16}),
        j("/v1/completions", {"model": model, "prompt": "hi", "min_tokens": 3, "stop_token_ids": [10**9]}),
        j("/generate", {"prompt": "hi", "min_tokens": 3, "stop_token_ids": [-7]}),
        j("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": -1}}),
        j("/infer", {"inputs": "", "stream": False}),
        ("/v2/models/x/infer", triton_head + b"\x01\x00", {"Inference-Header-Content-Length": str(len(triton_head))}),
        ("/v2/models/x/infer", triton_head, {"Inference-Header-Content-Length": "9" * 40}),
    ]


async def normal(client: httpx.AsyncClient, url: str, model: str, i: int, tally: Tally) -> None:
    t0 = time.perf_counter()
    try:
        r = await client.post(url + "/v1/completions", json=normal_body(model, i))
    except httpx.HTTPError as exc:
        tally.normal_failures.append(f"{type(exc).__name__}: {exc}")
        return
    tally.status("normal", r.status_code, r.text)
    if r.status_code == 200:
        tally.latency.append(time.perf_counter() - t0)
    elif len(tally.normal_failures) < 20:
        tally.normal_failures.append(f"{r.status_code}: {r.text[:200]}")


async def stream(client: httpx.AsyncClient, url: str, model: str, i: int, tally: Tally, drop_after: int | None) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "stream": True,
            "max_tokens": 200 if drop_after else 16, "ignore_eos": bool(drop_after)}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            tally.status("stream", r.status_code)
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if '"error"' in line[:20]:
                        tally.status("stream-error-event", 500, line)
                if drop_after and chunks >= drop_after:
                    return  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        if not drop_after:
            tally.normal_failures.append(f"stream {type(exc).__name__}: {exc}")


async def bad(client: httpx.AsyncClient, url: str, model: str, rng: random.Random, tally: Tally) -> None:
    path, raw, headers = rng.choice(bad_bodies(model))
    try:
        r = await client.post(url + path, content=raw, headers=headers)
    except httpx.HTTPError:
        return
    tally.status("bad", r.status_code, r.text)


async def slow(host: str, port: int, rng: random.Random, tally: Tally, *, body: bool) -> None:
    """Trickle one byte every 0.5 s; the server must cut the connection within its timeout (+ slack)."""
    payload = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 2}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(payload)).encode() + b"\r\n")
    first, rest = (head + b"\r\n" + payload[:2], payload[2:]) if body else (head[:30], head[30:])
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return
    t0 = time.monotonic()
    got = b""
    try:
        writer.write(first)
        await writer.drain()
        for i in range(len(rest)):
            try:
                chunk = await asyncio.wait_for(reader.read(4096), 0.5)
                if not chunk:
                    break
                got += chunk
                if got.startswith(b"HTTP/1.1 408"):
                    break
            except asyncio.TimeoutError:
                pass
            writer.write(rest[i : i + 1])
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()
    cut = time.monotonic() - t0 < SLOW_TIMEOUT_S + 5
    if body:
        code = int(got[9:12]) if got.startswith(b"HTTP/1.1 ") else 0
        if code:
            tally.status("slow-body", code, got.decode("latin-1"))
        if code != 408:
            cut = False
    if not cut:
        tally.slow_not_cut += 1


async def client_loop(i: int, url: str, host: str, port: int, model: str, deadline: float, tally: Tally) -> None:
    rng = random.Random(i)
    limits = httpx.Limits(max_connections=2, max_keepalive_connections=1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=30), limits=limits) as client:
        n = 0
        while time.monotonic() < deadline:
            n += 1
            kind = rng.choices(["normal", "stream", "disconnect", "bad", "slow_body", "slow_header"],
                               [55, 10, 10, 10, 7.5, 7.5])[0]
            tally.kinds[kind] += 1
            if kind == "normal":
                await normal(client, url, model, i + n, tally)
            elif kind == "stream":
                await stream(client, url, model, i + n, tally, None)
            elif kind == "disconnect":
                await stream(client, url, model, i + n, tally, 2)
            elif kind == "bad":
                await bad(client, url, model, rng, tally)
            else:
                await slow(host, port, rng, tally, body=kind == "slow_body")


async def idle_baseline(url: str, model: str, count: int) -> list[float]:
    out = []
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(count):
            t0 = time.perf_counter()
            r = await client.post(url + "/v1/completions", json=normal_body(model, i))
            r.raise_for_status()
            out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    ap.add_argument("--model-path", help="weights to serve (default: a tiny random Llama built here)")
    ap.add_argument("--idle-requests", type=int, default=100, help="normal requests timed on the idle server")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    raise_fd_limit()
    tmp = tempfile.TemporaryDirectory(prefix="mindie-soak-")
    proc: subprocess.Popen[bytes] | None = None
    try:
        model_path = args.model_path
        if not model_path:
            from mindie_host.testing import make_tiny_llama

            model_path = str(make_tiny_llama(Path(tmp.name) / "tiny"))
        path, cfg = write_config(Path(tmp.name), model_path, 32, 1)
        s = cfg["ServerConfig"]
        s.update({"maxLinkNum": MAX_LINK_NUM, "headerReadTimeoutSeconds": SLOW_TIMEOUT_S,
                  "bodyReadTimeoutSeconds": SLOW_TIMEOUT_S})
        cfg["BackendConfig"]["ModelDeployConfig"].update({"maxSeqLen": 1024, "maxInputTokenLen": 768})
        write_file(path, json.dumps(cfg, indent=2))  # 0640: what the file-mode check accepts
        model = cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelName"]
        url = f"http://127.0.0.1:{s['port']}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "mindie_host.cli", "serve", "--config", str(path)], cwd=tmp.name,
            stdout=subprocess.DEVNULL, stderr=open(Path(tmp.name) / "stderr.txt", "wb"), preexec_fn=raise_fd_limit,
        )
        wait_ready(f"http://127.0.0.1:{s['managementPort']}", proc)
        idle = asyncio.run(idle_baseline(url, model, args.idle_requests))
        rss_start = rss_mb(proc.pid)
        tally = Tally()
        clients = 2 * MAX_LINK_NUM
        t0 = time.monotonic()
        deadline = t0 + args.duration

        async def load() -> None:
            await asyncio.gather(*(client_loop(i, url, "127.0.0.1", s["port"], model, deadline, tally)
                                   for i in range(clients)))

        asyncio.run(load())
        wall = time.monotonic() - t0
        metrics_url = f"http://127.0.0.1:{s['metricsPort']}"
        leaked = blocks_in_use(metrics_url)
        settle = time.monotonic() + 60
        while leaked and time.monotonic() < settle:
            time.sleep(0.5)
            leaked = blocks_in_use(metrics_url)
        rss_end = rss_mb(proc.pid)
        five_xx = sum(n for code, n in tally.statuses.items() if code >= 500)
        report = {
            "model": "tiny random Llama (2 layers, SmolLM2 tokenizer)" if not args.model_path else args.model_path,
            "duration_s": round(wall, 1),
            "clients": clients,
            "max_link_num": MAX_LINK_NUM,
            "requests": dict(tally.kinds),
            "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
            "5xx": five_xx,
            "normal_failures": len(tally.normal_failures),
            "slow_clients_not_cut": tally.slow_not_cut,
            "leaked_blocks": leaked,
            "rss_start_mb": rss_start,
            "rss_end_mb": rss_end,
            "idle_p50_s": round(pct(idle, 0.5), 3),
            "idle_p99_s": round(pct(idle, 0.99), 3),
            "load_p50_s": round(pct(tally.latency, 0.5), 3),
            "load_p99_s": round(pct(tally.latency, 0.99), 3),
            "normal_served": len(tally.latency),
            "samples": tally.server_errors[:5] + tally.normal_failures[:5],
        }
        if args.json:
            print(json.dumps(report))
        else:
            for key, value in report.items():
                print(f"{key:>20}: {value}")
        ok = five_xx == 0 and not tally.normal_failures and leaked == 0 and not tally.slow_not_cut
        return 0 if ok else 1
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
        if os.environ.get("SOAK_KEEP_LOG"):
            print((Path(tmp.name) / "stderr.txt").read_text()[-3000:], file=sys.stderr)
        tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
