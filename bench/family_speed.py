"""Decode steps of each dense family against the Llama path at the same shape, alternating, several rounds.

Each round runs ``bench/decode_step.py --family F`` once per family, each in a fresh process, in a rotated order
(so no family always runs first or last on a machine whose load drifts), and keeps each run's median ms/step per
batch size. Prints, per family and batch size, the median over the rounds, its range, and tokens/s as a share of
the Llama path's.

    python bench/family_speed.py --rounds 3 --batches 1,16 --context 600
    python bench/family_speed.py --families llama,qwen3 --rounds 5

On a shared VM, step times drift by 20-50% between processes minutes apart (other tenants' memory traffic), more
than the families differ. ``--paired`` measures each family against the Llama path in one process instead: both
models loaded side by side, their decode steps timed alternately (Llama, family, family, Llama, ...) ``--repeat``
times, so drift hits both alike. It reports the median of the per-pair ratios (Llama's ms over the family's: the
family's tokens/s as a share of Llama's) with its interquartile range.

    python bench/family_speed.py --paired --families qwen2,qwen3,glm,glm4,gemma3_text,phi3,qwen3_moe --repeat 60
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


def paired(family: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """In this process: ``family`` and the Llama path at the same shape, decode steps timed alternately; per batch
    size the median ms of each and the quartiles of the per-pair ratio (Llama's ms / the family's)."""
    import time

    sys.path.insert(0, str(HERE))
    from decode_step import contexts_of, decode_batch, family_model, step_config

    from mindie_host.testing import loaded_host

    batches = [int(b) for b in args.batches.split(",")]
    block_size = 16
    per_seq = -(-(args.context + 1) // block_size)
    backends = {}
    hosts = []
    for name in ("llama", family):
        cfg = step_config(family_model(name, Path(args.family_dir)), max(batches), per_seq, block_size,
                          quantization="none", kvCacheDtype=args.kv_cache_dtype)
        hosts.append(loaded_host(cfg))
        backends[name] = hosts[-1].backend
    out = {}
    for b in batches:
        step = decode_batch(contexts_of(b, args.context, 0.0), block_size, per_seq)
        for backend in backends.values():
            for _ in range(3):
                backend.execute(step)
        times: dict[str, list[float]] = {"llama": [], family: []}
        for i in range(args.repeat):
            for name in (("llama", family) if i % 2 == 0 else (family, "llama")):
                t0 = time.perf_counter()
                backends[name].execute(step)
                times[name].append((time.perf_counter() - t0) * 1000)
        ratios = sorted(a / f for a, f in zip(times["llama"], times[family]))
        q1, q2, q3 = statistics.quantiles(ratios, n=4)
        out[str(b)] = {"llama_ms": round(statistics.median(times["llama"]), 2),
                       "family_ms": round(statistics.median(times[family]), 2),
                       "share": round(q2, 3), "share_q1": round(q1, 3), "share_q3": round(q3, 3)}
    for host in hosts:
        host.shutdown()
    return out


def main_paired(families: list[str], args: argparse.Namespace) -> int:
    """``--paired``: each family against the Llama path, one fresh process per family."""
    table = {}
    for family in families:
        if family == "llama":
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "--pair-one", family, "--batches", args.batches,
               "--context", str(args.context), "--repeat", str(args.repeat), "--kv-cache-dtype", args.kv_cache_dtype,
               "--family-dir", args.family_dir]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        table[family] = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
        for b, r in table[family].items():
            print(f"{family:12s} B={b:>3s}  llama {r['llama_ms']:7.2f} ms  {family} {r['family_ms']:7.2f} ms  "
                  f"tokens/s vs llama {r['share']:6.1%} (IQR {r['share_q1']:.1%}-{r['share_q3']:.1%})", flush=True)
    print(json.dumps({"paired": True, "repeat": args.repeat, "context": args.context,
                      "kv_cache_dtype": args.kv_cache_dtype, "results": table}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="llama,qwen2,qwen3,glm,glm4,gemma3_text,phi3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--kv-cache-dtype", default="bfloat16")
    ap.add_argument("--family-dir", default="/tmp/mindie-bench-families")
    ap.add_argument("--paired", action="store_true",
                    help="each family against the Llama path in one process, steps alternated (see above)")
    ap.add_argument("--pair-one", help=argparse.SUPPRESS)  # --paired's per-family child process
    args = ap.parse_args(argv)
    if args.pair_one:
        print(json.dumps(paired(args.pair_one, args)))
        return 0
    families = args.families.split(",")
    if args.paired:
        return main_paired(families, args)
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
