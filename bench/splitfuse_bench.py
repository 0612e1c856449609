"""SplitFuse: decode smoothness while long prompts arrive, Standard template vs ``splitfuse`` (Mix), side by side.

Starts the real server on the default model (SmolLM2-135M-Instruct) twice in one run:
``Standard`` (no plugin) and ``splitfuse`` (``templateType`` Mix, ``enableSplit``,
``splitChunkTokens`` = ``--chunk``, ``splitStartBatchSize`` 0). Each run:

* ``--decoders`` streaming requests with short prompts generate ``--decode-tokens``
  tokens each (``ignore_eos``), all starting at t=0;
* ``--long`` streaming requests with ~``--long-tokens``-token prompts arrive every
  ``--gap`` seconds from t=``--first`` on, generating 8 tokens each.

Reports the decoders' TPOT (every gap between consecutive streamed tokens) p50/p99,
the long prompts' TTFT, and output tokens/s over the whole run.

Run::

    python bench/splitfuse_bench.py --decoders 4 --decode-tokens 64 --long 4 --gap 1.5 --chunk 256
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


def config(on: bool, chunk: int) -> dict[str, Any]:
    sched: dict[str, Any] = {"maxBatchSize": 16, "maxPrefillBatchSize": 16, "maxPrefillTokens": 8192,
                             "maxIterTimes": 512}
    model: dict[str, Any] = {}
    if on:
        sched.update({"templateType": "Mix", "enableSplit": True, "splitChunkTokens": chunk,
                      "splitStartBatchSize": 0})
        model = {"plugin_params": json.dumps({"plugin_type": "splitfuse"})}
    return server_config(None, model=model, schedule=sched, deploy={"maxSeqLen": 2048, "maxInputTokenLen": 1800})


def stream_times(url: str, body: dict[str, Any], delay: float) -> list[float]:
    """Sleep ``delay``, send, and return [send time, token 1 time, token 2 time, ...] (perf_counter)."""
    time.sleep(delay)
    times = [time.perf_counter()]
    with httpx.Client(timeout=900) as client, client.stream("POST", url + "/v1/completions",
                                                            json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                times.append(time.perf_counter())
    return times


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run(server: RunningServer, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(1)
    vocab = server.host.vocab_size
    name = server.host.model_name
    jobs: list[tuple[str, dict[str, Any], float]] = []
    for i in range(args.decoders):
        jobs.append(("decode", {"model": name, "prompt": f"Story {i}: once upon a time", "temperature": 0,
                                "max_tokens": args.decode_tokens, "ignore_eos": True}, 0.0))
    for i in range(args.long):
        prompt = [rng.randrange(100, vocab - 100) for _ in range(args.long_tokens)]
        jobs.append(("long", {"model": name, "prompt": prompt, "temperature": 0, "max_tokens": 8,
                              "ignore_eos": True}, args.first + i * args.gap))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: stream_times(server.url, j[1], j[2]), jobs))
    wall = time.perf_counter() - t0
    tpot = [b - a for (kind, _, _), t in zip(jobs, results) if kind == "decode" for a, b in zip(t[1:], t[2:])]
    ttft = [t[1] - t[0] for (kind, _, _), t in zip(jobs, results) if kind == "long"]
    tokens = sum(len(t) - 1 for t in results)
    return {
        "tpot_p50_ms": 1000 * statistics.median(tpot),
        "tpot_p99_ms": 1000 * pct(tpot, 0.99),
        "tpot_max_ms": 1000 * max(tpot),
        "long_ttft_mean_ms": 1000 * statistics.fmean(ttft),
        "long_ttft_max_ms": 1000 * max(ttft),
        "tok_per_s": tokens / wall,
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--long", type=int, default=4)
    p.add_argument("--long-tokens", type=int, default=1000)
    p.add_argument("--first", type=float, default=1.0, help="arrival of the first long prompt (s)")
    p.add_argument("--gap", type=float, default=1.5, help="seconds between long-prompt arrivals")
    p.add_argument("--chunk", type=int, default=256, help="splitChunkTokens")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    results = {}
    for label, on in (("standard", False), ("splitfuse", True)):
        with RunningServer(config(on, args.chunk), timeout=600) as server:
            # warm-up: one short request so both runs start from a loaded, exercised model
            httpx.post(server.url + "/v1/completions", json={"model": server.host.model_name, "prompt": "hi",
                                                             "max_tokens": 2}, timeout=300).raise_for_status()
            results[label] = run(server, args)
    off, on = results["standard"], results["splitfuse"]
    print(f"{args.decoders} decoders x {args.decode_tokens} tokens; {args.long} prompts of {args.long_tokens} "
          f"tokens arriving every {args.gap}s from t={args.first}s; splitChunkTokens {args.chunk}")
    print(f"{'metric':<22}{'standard':>12}{'splitfuse':>12}{'ratio':>9}")
    for key in off:
        print(f"{key:<22}{off[key]:>12.1f}{on[key]:>12.1f}{on[key] / off[key]:>9.3f}")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
