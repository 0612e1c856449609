#!/usr/bin/env python3
"""Tensor parallelism on CPU: TP1 against TP2 with equal total threads, and peak RSS per rank.

Serves a random Llama of SmolLM2-135M's size (576 hidden, 30 layers, 1536 MLP, its vocabulary)
with 8 attention heads and 4 KV heads, since the default model's 9 and 3 do not split in 2; fp32
and ``quantization: none``, so both runs do the same arithmetic. It runs with ``worldSize`` 1 and
2 in the engine process, one after the other, and
drives each with the peers' streaming chat load generator (``../shared/peers/loadgen.py``) at
c=1 and c=16. Each rank gets ``cores / worldSize`` compute threads (mindie_host/distributed/ranks.py),
so both runs use every core and no more. Peak RSS (``VmHWM``) is read per process after the run.

    python bench/tp_bench.py                 # worlds 1,2 at c=1,16; writes bench/results/tp.json
    python bench/tp_bench.py --model default --worlds 1,3   # the default model: TP3 (9 heads, 3 KV heads)
    python bench/tp_bench.py --allreduce     # gloo all-reduce latency between 2 processes (the TP model's alpha)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (bench/peers.py: server start-up and the load generator)

ROOT = Path(__file__).resolve().parent.parent


def config(world: int, model: str) -> dict:
    name, path = ("SmolLM2-135M-Instruct", "") if model == "default" else ("tp-bench", model)
    return {
        "ServerConfig": {"engineProcess": True},
        "BackendConfig": {
            "npuDeviceIds": [list(range(world))],
            "ModelDeployConfig": {"ModelConfig": [{
                "modelName": name, "modelWeightPath": path, "backendType": "torch",
                "worldSize": world, "dtype": "float32", "quantization": "none",
            }]},
            "ScheduleConfig": {"cacheBlockSize": 16},
        },
    }


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(stat[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def peak_rss_mib(pid: int) -> dict[str, float]:
    """Peak RSS of each process of the server: the front end, the engine process (rank 0), the other ranks."""
    out = {}
    for p in tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
        role = "front end" if p == pid else ("rank" if b"multiprocessing" in cmd else "other")
        out[f"{role} {p}"] = round(kib / 1024, 1)
    return out


def _allreduce_rank(rank: int, address: str, sizes: list[int], out: object) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=2)
    result = {}
    for n in sizes:
        t = torch.ones(n)
        for _ in range(20):
            dist.all_reduce(t)
        start = time.perf_counter()
        for _ in range(200):
            dist.all_reduce(t)
        result[n] = (time.perf_counter() - start) / 200 * 1e6
    if rank == 0:
        out.put(result)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def allreduce_latency() -> dict[int, float]:
    """Microseconds per gloo all-reduce of n float32 values between 2 processes (1 thread each)."""
    import multiprocessing

    from mindie_host.distributed.ranks import local_address

    ctx = multiprocessing.get_context("spawn")
    queue, address = ctx.Queue(), local_address()
    sizes = [576, 16 * 576, 64 * 576, 512 * 576]
    procs = [ctx.Process(target=_allreduce_rank, args=(r, address, sizes, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=120)
    for p in procs:
        p.join(30)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--conc", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--allreduce", action="store_true", help="only measure gloo all-reduce latency")
    ap.add_argument("--model", default="/tmp/mindie-tp-bench-llama",
                    help="an HF directory (written here first if absent), or 'default'")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tp.json"))
    args = ap.parse_args()
    if args.allreduce:
        for n, us in allreduce_latency().items():
            print(f"all-reduce of {n} float32 ({n * 4 / 1024:.1f} KiB) between 2 processes: {us:.0f} us")
        return 0
    if args.model != "default" and not Path(args.model, "config.json").exists():
        from mindie_host.testing import make_tiny_llama

        make_tiny_llama(args.model, hidden_size=576, num_layers=30, num_heads=8, num_kv_heads=4,
                        intermediate_size=1536)
    model = args.model
    args.dtype = args.device = args.model = None
    args.logs = None
    results: dict[str, dict] = {}
    for world in [int(w) for w in args.worlds.split(",")]:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(config(world, model), f)
        args.config = f.name
        started = time.monotonic()
        proc, url, _ = peers.start_mindie(args)
        name = "SmolLM2-135M-Instruct" if model == "default" else "tp-bench"
        ready = time.monotonic() - started
        row: dict = {"ready_s": round(ready, 1), "load": {}}
        try:
            for conc in [int(c) for c in args.conc.split(",")]:
                n = {1: 8, 16: 48}.get(conc, 4 * conc)
                row["load"][conc] = peers.run_load(url, name, conc, n, args.max_tokens)
                print(f"TP{world} c={conc}: {json.dumps(row['load'][conc])}", flush=True)
            row["peak_rss_mib"] = peak_rss_mib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(60)
            os.unlink(f.name)
        results[f"TP{world}"] = row
        print(f"TP{world}: ready in {ready:.1f} s; peak RSS MiB {row['peak_rss_mib']}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cores": os.cpu_count(), "model": model, "results": results}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
