"""Prefix cache: TTFT on a long-shared-prefix workload and throughput on a no-shared-prefix one, on and off.

Starts the real server on the default model (SmolLM2-135M-Instruct) twice in one run:
once without plugins, once with ``prefix_cache`` (``enablePrefixCache`` true), and
runs the same two workloads against each:

* ``shared``: few-shot prompts with a ~1,000-token common prefix (``--prefix-tokens``)
  and a different short question each, sent one at a time (streaming); reports TTFT
  p50/p90/mean. The very first request of each run is a warm-up that fills the cache
  and is not counted.
* ``distinct``: ``--distinct`` prompts of ~200 tokens that share nothing (random token
  ids), ``-c`` in flight, ``--max-tokens`` each with ``ignore_eos``; reports output
  tokens/s (the prefix cache can only cost time here: hashing, bookkeeping).

Run::

    python bench/prefix_cache_bench.py --requests 8 --distinct 8 -c 4 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from mindie_host.testing import RunningServer, server_config

FEW_SHOT = (
    "Q: What is the capital of {c}?\nA: The capital of {c} is {k}, a city known for its history, its food and "
    "its museums. Many visitors come every year.\n\n"
)
PAIRS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"), ("Egypt", "Cairo"),
         ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Chile", "Santiago"), ("Greece", "Athens"), ("Norway", "Oslo")]
QUESTIONS = ["Germany", "Canada", "Brazil", "India", "China", "Mexico", "Poland", "Sweden", "Turkey", "Cuba",
             "Ireland", "Austria", "Portugal", "Vietnam", "Nigeria", "Morocco"]


def config(on: bool, block_size: int) -> dict[str, Any]:
    sched: dict[str, Any] = {"cacheBlockSize": block_size, "maxBatchSize": 16, "maxPrefillBatchSize": 16,
                             "maxPrefillTokens": 8192, "maxIterTimes": 256, "enablePrefixCache": on}
    model = {"plugin_params": json.dumps({"plugin_type": "prefix_cache"})} if on else {}
    return server_config(None, model=model, schedule=sched, deploy={"maxSeqLen": 2048, "maxInputTokenLen": 1800})


def shared_prefix(tokenizer: Any, target: int) -> str:
    text, i = "Answer each question the way the examples do.\n\n", 0
    while len(tokenizer.encode(text)) < target:
        c, k = PAIRS[i % len(PAIRS)]
        text += FEW_SHOT.format(c=c if i < len(PAIRS) else f"{c} (again, example {i})", k=k)
        i += 1
    return text


def stream_ttft(url: str, body: dict[str, Any]) -> tuple[float, int]:
    """Seconds to the first streamed token, and the number of token chunks."""
    t0 = time.perf_counter()
    first: float | None = None
    chunks = 0
    with httpx.Client(timeout=600) as client, client.stream("POST", url + "/v1/completions",
                                                            json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunks += 1
            if first is None:
                first = time.perf_counter() - t0
    assert first is not None, "no token streamed"
    return first, chunks


def run_shared(server: RunningServer, prefix: str, n: int) -> list[float]:
    base = {"model": server.host.model_name, "max_tokens": 4, "temperature": 0}
    stream_ttft(server.url, {**base, "prompt": prefix + "Q: What is the capital of Atlantis?\nA:"})  # warm-up
    return [stream_ttft(server.url, {**base, "prompt": prefix + f"Q: What is the capital of {q}?\nA:"})[0]
            for q in QUESTIONS[:n]]


def run_distinct(server: RunningServer, n: int, concurrency: int, max_tokens: int, vocab: int) -> float:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(200)] for _ in range(n)]
    body = {"model": server.host.model_name, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    def one(prompt: list[int]) -> int:
        r = httpx.post(server.url + "/v1/completions", json={**body, "prompt": prompt}, timeout=600)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - t0)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=8, help="shared-prefix requests per run (after one warm-up)")
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--distinct", type=int, default=8, help="no-shared-prefix requests per run")
    p.add_argument("-c", "--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--block-size", type=int, default=128, help="cacheBlockSize (MindIE default 128)")
    p.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = p.parse_args(argv)

    results: dict[str, dict[str, float]] = {}
    for label, on in (("off", False), ("on", True)):
        with RunningServer(config(on, args.block_size), timeout=600) as server:
            prefix = shared_prefix(server.host.tokenizer, args.prefix_tokens)
            ttft = run_shared(server, prefix, args.requests)
            tps = run_distinct(server, args.distinct, args.concurrency, args.max_tokens, server.host.vocab_size)
            stats = server.host.stats()
        results[label] = {
            "prefix_tokens": float(len(server.host.tokenizer.encode(prefix))),
            "ttft_p50_ms": 1000 * statistics.median(ttft),
            "ttft_p90_ms": 1000 * pct(ttft, 0.9),
            "ttft_mean_ms": 1000 * statistics.fmean(ttft),
            "distinct_tok_per_s": tps,
            "hit_rate": stats.get("npu_prefix_cache_hit_rate", 0.0),
        }
    off, on = results["off"], results["on"]
    print(f"shared prefix: {int(on['prefix_tokens'])} tokens, {args.requests} requests one at a time; "
          f"distinct: {args.distinct} x 200-token prompts, c={args.concurrency}, {args.max_tokens} tokens each; "
          f"cacheBlockSize {args.block_size}")
    print(f"{'metric':<28}{'off':>12}{'on':>12}{'on/off':>10}")
    for key in ("ttft_p50_ms", "ttft_p90_ms", "ttft_mean_ms", "distinct_tok_per_s", "hit_rate"):
        ratio = on[key] / off[key] if off[key] else float("nan")
        print(f"{key:<28}{off[key]:>12.2f}{on[key]:>12.2f}{ratio:>10.3f}")
    print(f"TTFT p50 speed-up: {off['ttft_p50_ms'] / on['ttft_p50_ms']:.1f}x; "
          f"no-shared-prefix throughput change: {100 * (on['distinct_tok_per_s'] / off['distinct_tok_per_s'] - 1):+.1f}%")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
