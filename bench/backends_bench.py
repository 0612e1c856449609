"""Backends side by side: the default model served with backendType ``torch`` and ``ms``.

For each backend a real server (in this process, loopback ports) serves the
default model (SmolLM2-135M-Instruct); for each concurrency level, that many
clients each send ``--requests-per-client`` greedy ``/v1/completions`` requests
of ``--max-tokens`` tokens (``ignore_eos`` so every request generates the same
count). Reported per (backend, concurrency): wall time, requests/s, output
tokens/s and mean request latency.

    python bench/backends_bench.py                                 # torch and ms, concurrency 1 and 16
    python bench/backends_bench.py --backends ms --concurrency 1 4 --max-tokens 16 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx

from mindie_host.testing import RunningServer, server_config

PROMPTS = [
    "Write one sentence about the sea.",
    "What is the capital of France?",
    "Name three colours.",
    "Give me a short tip for learning Python.",
]


async def _client(url: str, model: str, n: int, max_tokens: int, offset: int, latencies: list[float]) -> int:
    tokens = 0
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        for i in range(n):
            body = {"model": model, "prompt": PROMPTS[(offset + i) % len(PROMPTS)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            start = time.perf_counter()
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            latencies.append(time.perf_counter() - start)
            tokens += int(r.json()["usage"]["completion_tokens"])
    return tokens


async def _level(url: str, model: str, concurrency: int, per_client: int, max_tokens: int) -> dict[str, Any]:
    latencies: list[float] = []
    start = time.perf_counter()
    counts = await asyncio.gather(*[_client(url, model, per_client, max_tokens, c, latencies)
                                    for c in range(concurrency)])
    wall = time.perf_counter() - start
    requests = concurrency * per_client
    return {"concurrency": concurrency, "requests": requests, "wall_s": round(wall, 2),
            "req_per_s": round(requests / wall, 3), "output_tok_per_s": round(sum(counts) / wall, 1),
            "mean_latency_s": round(statistics.mean(latencies), 2)}


def run(backends: list[str], levels: list[int], per_client: int, max_tokens: int) -> list[dict[str, Any]]:
    """Serve the default model on each backend and measure each concurrency level."""
    rows: list[dict[str, Any]] = []
    for backend in backends:
        cfg = server_config(None, model={"backendType": backend},
                            schedule={"maxBatchSize": max(levels), "maxPrefillBatchSize": max(levels)})
        with RunningServer(cfg, timeout=600) as server:
            model = server.host.model_name
            asyncio.run(_level(server.url, model, 1, 1, 4))  # warm-up, not reported
            for level in levels:
                row = {"backend": backend, **asyncio.run(_level(server.url, model, level, per_client, max_tokens))}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["torch", "ms"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    rows = run(args.backends, args.concurrency, args.requests_per_client, args.max_tokens)
    print("\n| backend | concurrency | requests | wall s | req/s | output tok/s | mean latency s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['backend']} | {r['concurrency']} | {r['requests']} | {r['wall_s']} | {r['req_per_s']} | "
              f"{r['output_tok_per_s']} | {r['mean_latency_s']} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
