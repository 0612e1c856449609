"""Decode steps of each dense family against the Llama path at the same shape, alternating, several rounds.

Each round runs ``bench/decode_step.py --family F`` once per family, each in a fresh process, in a rotated order
(so no family always runs first or last on a machine whose load drifts), and keeps each run's median ms/step per
batch size. Prints, per family and batch size, the median over the rounds, its range, and tokens/s as a share of
the Llama path's.

    python bench/family_speed.py --rounds 3 --batches 1,16 --context 600
    python bench/family_speed.py --families llama,qwen3 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def one_run(family: str, args: argparse.Namespace) -> dict[str, float]:
    """One ``decode_step.py`` process: ms/step by batch size."""
    cmd = [
        sys.executable,
        str(HERE / "decode_step.py"),
        "--family",
        family,
        "--quantization",
        "none",
        "--batches",
        args.batches,
        "--context",
        str(args.context),
        "--repeat",
        str(args.repeat),
        "--kv-cache-dtype",
        args.kv_cache_dtype,
        "--family-dir",
        args.family_dir,
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    line = [ln for ln in out.splitlines() if ln.startswith("{")][-1]
    return {str(b): float(ms) for b, ms in json.loads(line)["ms_per_step"].items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="llama,qwen2,qwen3,glm,glm4,gemma3_text,phi3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--kv-cache-dtype", default="bfloat16")
    ap.add_argument("--family-dir", default="/tmp/mindie-bench-families")
    args = ap.parse_args(argv)
    families = args.families.split(",")
    runs: dict[str, list[dict[str, float]]] = {f: [] for f in families}
    for r in range(args.rounds):
        order = families[r % len(families) :] + families[: r % len(families)]
        for family in order:
            runs[family].append(one_run(family, args))
            print(f"round {r + 1} {family}: {runs[family][-1]}", flush=True)
    base = {b: statistics.median(run[b] for run in runs["llama"]) for b in runs["llama"][0]} if "llama" in runs else {}
    print("\nfamily        B   ms/step (median, range)   tokens/s vs llama")
    table = {}
    for family in families:
        for b in runs[family][0]:
            values = [run[b] for run in runs[family]]
            med = statistics.median(values)
            share = base[b] / med if b in base else float("nan")
            table.setdefault(family, {})[b] = {
                "median_ms": med,
                "min_ms": min(values),
                "max_ms": max(values),
                "tokens_per_s_vs_llama": round(share, 3),
            }
            print(f"{family:12s} {b:>3s}   {med:7.2f} ({min(values):.2f}-{max(values):.2f})          {share:6.1%}")
    print(
        json.dumps(
            {"rounds": args.rounds, "context": args.context, "kv_cache_dtype": args.kv_cache_dtype, "results": table}
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
