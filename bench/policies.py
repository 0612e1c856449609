#!/usr/bin/env python3
"""Every scheduling policy on the same varied load: TTFT p50/p99, TPOT p99 and output tokens/s, side by side.

For each policy the real server starts on the default model (SmolLM2-135M-Instruct) with
``maxBatchSize`` ``--batch`` and a KV pool capped at ``--kv-blocks`` blocks of 16 tokens, so that the
batch is full and the pool runs dry under load: admission order (``prefillPolicyType``, ``policyType``),
the running batch's order and the preemption victims (``decodePolicyType``) then decide who waits.
``bench/varied_load.py``'s closed-loop load (distinct documentation passages of log-normal length,
``--max-tokens`` streamed greedy tokens each, ``-c`` at a time) runs against it. Rounds alternate the
order of the policies; the table gives each metric's median over rounds, with the preemption count.

A quiet machine is needed for figures (a run of the seven policies at c=64 and n=128 takes about an
hour on 2 cores). Run::

    python bench/policies.py -c 64 -n 128 --rounds 2 --json

and a short sanity run::

    python bench/policies.py -c 8 -n 8 --max-tokens 16 --rounds 1 --policies fcfs skip-join-mlfq
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx

from mindie_host.testing import RunningServer, server_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from varied_load import make_prompts, run  # noqa: E402

#: label -> the ScheduleConfig values that select the policy
POLICIES: dict[str, dict[str, int]] = {
    "fcfs": {},
    "state": {"prefillPolicyType": 1, "decodePolicyType": 1},
    "mlfq": {"prefillPolicyType": 3, "decodePolicyType": 3},
    "priority": {"prefillPolicyType": 2, "decodePolicyType": 2},
    "sjf": {"policyType": 4},
    "ljf": {"policyType": 5},
    "skip-join-mlfq": {"policyType": 6},
}
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms", "out_tok_s", "preemptions", "errors")


def config(policy: dict[str, int], batch: int, kv_blocks: int) -> dict[str, Any]:
    schedule = {"maxBatchSize": batch, "maxPrefillBatchSize": batch, "maxPrefillTokens": 8192, "maxIterTimes": 512,
                "cacheBlockSize": 16, **policy}
    return server_config(None, schedule=schedule, model={"maxKvBlocks": kv_blocks},
                         deploy={"maxSeqLen": 2048, "maxInputTokenLen": 1800})


def one_policy(label: str, args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    with RunningServer(config(POLICIES[label], args.batch, args.kv_blocks), timeout=600) as server:
        name = server.host.model_name
        httpx.post(server.url + "/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2},
                   timeout=300).raise_for_status()  # warm-up
        before = server.host.stats().get("preemptions", 0.0)
        result = asyncio.run(run(server.url, name, args.n, args.c, args.max_tokens, prompts))
        result["preemptions"] = server.host.stats().get("preemptions", 0.0) - before
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policies", nargs="+", choices=sorted(POLICIES), default=list(POLICIES))
    p.add_argument("-n", type=int, default=128, help="requests per run")
    p.add_argument("-c", type=int, default=64, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="maxBatchSize (and maxPrefillBatchSize)")
    p.add_argument("--kv-blocks", type=int, default=384,
                   help="maxKvBlocks: the pool, in blocks of 16 tokens (384: 6,144 tokens, 16 x 384)")
    p.add_argument("--rounds", type=int, default=2, help="runs of every policy; each round reverses the order")
    p.add_argument("--seed", type=int, default=0, help="which prompts (bench/varied_load.py)")
    p.add_argument("--json", action="store_true", help="also print every run as a JSON line")
    args = p.parse_args(argv)
    prompts = make_prompts(args.n, args.seed)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in args.policies}
    for r in range(args.rounds):
        for label in args.policies if r % 2 == 0 else reversed(args.policies):
            result = one_policy(label, args, prompts)
            runs[label].append(result)
            if args.json:
                print(json.dumps({"policy": label, "round": r, **result}), flush=True)
    print(f"n={args.n} c={args.c} max_tokens={args.max_tokens} maxBatchSize={args.batch} "
          f"maxKvBlocks={args.kv_blocks}; medians over {args.rounds} round(s)")
    print(f"{'policy':<16}" + "".join(f"{m:>14}" for m in METRICS))
    for label, results in runs.items():
        cells = [statistics.median(float(x[m] or 0.0) for x in results) for m in METRICS]
        print(f"{label:<16}" + "".join(f"{v:>14.1f}" for v in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
