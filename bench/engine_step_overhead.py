"""The engine's own work per step: the CPU time of ``LLMEngine.step()`` minus that of the backend's forward pass.

``bench/decode_step.py`` times ``backend.execute`` alone; this script times what the engine loop adds around
it (expiring, scheduling, the policy hooks, block allocation, input building, sampling, stop rules,
detokenization, outputs). A tiny random Llama keeps the forward pass short. ``B`` requests of a short prompt
decode ``--tokens`` tokens each; the figure is the median, over the decode steps where all ``B`` run, of the
step's CPU time less the forward pass's (µs), for greedy requests and for seeded sampling with a stop string
(which adds the sampler's and the stop rule's work). Torch runs on ``--threads`` threads (default 1), so all
the work is on the engine's thread and its CPU time (``time.thread_time``) does not count the time other
processes of a shared machine take the core away, as wall time would. Contention still slows the thread (caches,
the core's sibling), and only ever upwards, so each figure is the least of ``--repeat`` runs' medians.

    python bench/engine_step_overhead.py                       # B = 1, 16, 64
    python bench/engine_step_overhead.py --batches 32 --tokens 200 --repeat 3

The C++ kernels only change the forward pass, which is not counted; ``MINDIE_HOST_CPU_KERNELS=0`` avoids their
build when comparing two checkouts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mindie_host.api import EngineRequest, SamplingParams
from mindie_host.testing import loaded_host, make_tiny_llama, server_config


class ForwardClock:
    """Wraps ``backend.execute`` to add up the CPU time of the forward passes."""

    def __init__(self, backend: Any) -> None:
        self.execute = backend.execute
        self.spent = 0.0
        backend.execute = self

    def __call__(self, batch: Any) -> Any:
        t0 = time.thread_time()
        try:
            return self.execute(batch)
        finally:
            self.spent += time.thread_time() - t0


def overhead_us(host: Any, clock: ForwardClock, batch: int, tokens: int, sampled: bool) -> float:
    """Median µs of engine CPU time per decode step of ``batch`` sequences."""
    llm = host.llm
    for i in range(batch):
        params = (
            SamplingParams(
                max_tokens=tokens, ignore_eos=True, do_sample=True, temperature=0.8, top_k=40, seed=i, stop=["\n\n\n\n"]
            )
            if sampled
            else SamplingParams(max_tokens=tokens, ignore_eos=True)
        )
        llm.add_request(EngineRequest(f"r{i}", [1, 504, 3458, 314, 260 + i, 1831, 30], params))
    samples = []
    while llm.has_work():
        forward, t0 = clock.spent, time.thread_time()
        outputs = llm.step()
        cpu = time.thread_time() - t0 - (clock.spent - forward)
        if len(outputs) == batch and not any(o.finished for o in outputs) and len(outputs[0].token_ids) > 1:
            samples.append(cpu * 1e6)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=100, help="tokens each request decodes")
    ap.add_argument("--repeat", type=int, default=3, help="runs per batch size; the least of their medians")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: all work on the engine's thread)")
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "mindie-bench-tiny-llama"))
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    model = make_tiny_llama(args.model_dir)
    host = loaded_host(
        server_config(
            model,
            schedule={"maxBatchSize": max(batches), "maxPrefillBatchSize": 0},
            model={"maxKvBlocks": max(batches) * 16 + 1},
        )
    )
    clock = ForwardClock(host.llm.backend)
    result: dict[str, dict[int, float]] = {"greedy": {}, "sampled": {}}
    for kind in result:
        for b in batches:
            runs = [overhead_us(host, clock, b, args.tokens, kind == "sampled") for _ in range(args.repeat)]
            result[kind][b] = round(min(runs), 1)
            print(
                f"{kind:8s} B={b:3d}: {result[kind][b]:8.1f} us of engine CPU time per decode step "
                f"(runs: {', '.join(f'{r:.0f}' for r in runs)})",
                flush=True,
            )
    print(json.dumps({"tokens": args.tokens, "threads": args.threads, "overhead_us": result}))
    host.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
