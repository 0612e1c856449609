"""Decode-step time of a mixture of experts at TP2 in its two layouts: every expert's channels split over the ranks
(the default) against whole experts per rank (``ModelConfig.expertParallel``), alternating, several rounds.

The model is a random Qwen3-MoE built with transformers' own classes into ``--model-dir`` on first use: 8 attention
heads of 64 and 4 KV heads (they split in 2), hidden 512, ``--layers`` layers, ``--experts`` experts of
``--expert-size`` channels with 2 routed, float32 (``quantization: none``). Each round runs one child process per
layout (in a rotated order), which loads the model with ``worldSize`` 2 through the server's own path and times
``backend.execute`` on a decode batch of ``B`` sequences of ``--context`` cached tokens (bench/decode_step.py's
batch), ``--repeat`` times after two warm-up steps. Prints each layout's median ms/step per batch size over the
rounds, with its range.

    python bench/moe_parallel.py --rounds 3 --batches 1,16
    python bench/moe_parallel.py --rounds 1 --batches 4 --repeat 5     # a quick sanity run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYOUTS = {"channels": False, "experts": True}


def model(args: argparse.Namespace) -> Path:
    """The bench's random Qwen3-MoE (built once per shape)."""
    import transformers

    from mindie_host.testing import make_tiny_model

    where = Path(args.model_dir) / f"qwen3_moe-{args.layers}x{args.experts}x{args.expert_size}"
    return make_tiny_model(where, transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, head_scale=1.0,
                           hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
                           head_dim=64, num_hidden_layers=args.layers, num_experts=args.experts,
                           num_experts_per_tok=2, moe_intermediate_size=args.expert_size, norm_topk_prob=True,
                           max_position_embeddings=4096)


def child(args: argparse.Namespace) -> None:
    """Load the model at TP2 in layout ``args.child`` and print its ms/step by batch size (one JSON line)."""
    sys.path.insert(0, str(HERE))
    from decode_step import decode_batch

    from mindie_host.testing import loaded_host, server_config

    batches = [int(b) for b in args.batches.split(",")]
    block_size = 16
    per_seq = -(-(args.context + 1) // block_size)
    cfg = server_config(model(args), model={"quantization": "none", "dtype": "float32", "worldSize": 2,
                                            "expertParallel": LAYOUTS[args.child],
                                            "maxKvBlocks": 1 + (max(batches) + 1) * per_seq, "cpuMemSize": 4},
                        schedule={"cacheBlockSize": block_size, "maxBatchSize": max(batches), "maxPrefillBatchSize": 0},
                        deploy={"maxSeqLen": max(1024, per_seq * block_size)})
    cfg["BackendConfig"]["npuDeviceIds"] = [[0, 1]]
    host = loaded_host(cfg)
    results = {}
    try:
        for b in batches:
            batch = decode_batch([args.context] * b, block_size, per_seq)
            for _ in range(2):
                host.backend.execute(batch)
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                host.backend.execute(batch)
                times.append((time.perf_counter() - t0) * 1000)
            results[str(b)] = statistics.median(times)
    finally:
        host.shutdown()
    print(json.dumps(results), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--expert-size", type=int, default=384)
    ap.add_argument("--model-dir", default="/tmp/mindie-bench-moe")
    ap.add_argument("--child", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    model(args)  # built before the first timed child
    passed = list(argv if argv is not None else sys.argv[1:])
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in LAYOUTS}
    order = list(LAYOUTS)
    for r in range(args.rounds):
        for name in order[r % 2:] + order[: r % 2]:  # alternate which layout runs first
            out = subprocess.run([sys.executable, __file__, *passed, "--child", name], check=True,
                                 capture_output=True, text=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    summary = {}
    for name, results in runs.items():
        summary[name] = {}
        for b in args.batches.split(","):
            ms = [run[b] for run in results]
            summary[name][b] = {"median_ms": round(statistics.median(ms), 2), "min": round(min(ms), 2),
                                "max": round(max(ms), 2)}
            print(f"{name:8s} B={b:>3s}: {summary[name][b]['median_ms']:7.2f} ms/step (range {min(ms):.2f} .. "
                  f"{max(ms):.2f} over {len(ms)} rounds)")
    print(json.dumps({"rounds": args.rounds, "context": args.context, "layers": args.layers, "experts": args.experts,
                      "expert_size": args.expert_size, "ms_per_step": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
