"""Speed and memory of the quantization schemes: engine tokens/s at c=1/16/64, weight bytes and peak RSS.

Each variant runs in its own process (so peak RSS is its own), loads the model with the
torch backend on the CPU (eager, no compile), and drives the engine in-process: ``c``
requests of a ``--prompt``-token prompt are added at once and run to ``--tokens`` new
tokens each (greedy, ignore_eos). tokens/s is generated tokens over the wall time from
the first step to the last (prefill included).

    python bench/quant_speed.py                       # the default model, every variant
    python bench/quant_speed.py --variants fp32,w8a8 --conc 1,16
    python bench/quant_speed.py --kernels             # one layer's four products per kernel, ms
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32", "quantization": "none"},
    "bf16": {"dtype": "bfloat16", "quantization": "none"},
    "gguf-auto": {"dtype": "float32", "quantization": "auto"},
    "w8a16": {"dtype": "float32", "quantization": "w8a16"},
    "w8a8": {"dtype": "float32", "quantization": "w8a8"},
    "fp32+kv-int8": {"dtype": "float32", "quantization": "none", "kvCacheDtype": "int8"},
    "w8a8+kv-int8": {"dtype": "float32", "quantization": "w8a8", "kvCacheDtype": "int8"},
}


def tensor_bytes(obj: Any, seen: set[int] | None = None, depth: int = 0) -> int:
    """Bytes of every distinct tensor reachable from ``obj`` through attributes, lists and dicts."""
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 6:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen, depth + 1) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return sum(tensor_bytes(v, seen, depth + 1) for v in vars(obj).values())
    return 0


def run_one(name: str, model: str | None, conc: list[int], prompt: int, tokens: int) -> dict[str, Any]:
    """Load one variant and measure it (runs in the child process)."""
    from mindie_host.api import EngineRequest, SamplingParams
    from mindie_host.testing import loaded_host, server_config

    cfg = server_config(model, model={"device": "cpu", "cpuMemSize": 2, **VARIANTS[name]},
                        schedule={"maxBatchSize": max(conc), "maxPrefillBatchSize": max(conc),
                                  "maxPrefillTokens": 8192})
    host = loaded_host(cfg)
    backend = host.backend
    weights = tensor_bytes([backend.model.layers, backend.model.lm_head_linear, backend.model.embed])
    result: dict[str, Any] = {"variant": name, "weight_bytes": weights,
                              "kv_bytes_per_token": backend.kv_cache_bytes_per_block(16) // 16, "runs": {}}
    llm = host.llm
    for c in [1, *conc]:  # the first c=1 run warms up and is dropped
        reqs = [EngineRequest(f"{c}-{i}-{time.monotonic_ns()}", [(1000 + 37 * i + j) % 40000 for j in range(prompt)],
                              SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)) for i in range(c)]
        for r in reqs:
            llm.add_request(r)
        generated = 0
        start = time.perf_counter()
        while llm.has_work():
            for out in llm.step():
                generated += len(out.token_ids) if out.finished else 0
        wall = time.perf_counter() - start
        result["runs"][str(c)] = {"tokens_per_s": c * tokens / wall, "wall_s": wall}
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def kernels(rows: tuple[int, ...] = (1, 16, 64), repeat: int = 50) -> None:
    """ms for one decoder layer's four products of the default model (576 hidden, 1536 MLP, 3 KV heads of 64),
    per kernel: fp32 ``F.linear``, w8a16 (``_weight_int8pack_mm``), w8a8 (per-token quantization + ``_int_mm``)."""
    import torch
    import torch.nn.functional as F

    from mindie_host.backends.int8 import W8A8DynamicWeight, W8A16Weight, quantize_per_channel

    torch.manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    dense = [torch.randn(o, i) for o, i in shapes]
    cpu = torch.device("cpu")
    kinds: dict[str, list[Any]] = {
        "fp32": [lambda x, w=w: F.linear(x, w) for w in dense],
        "w8a16": [W8A16Weight(quantize_per_channel(w), cpu) for w in dense],
        "w8a8": [W8A8DynamicWeight(quantize_per_channel(w, "dynamic"), cpu) for w in dense],
    }
    print("| kernel | " + " | ".join(f"{m} rows, ms" for m in rows) + " |")
    print("| --- | " + " | ".join("---" for _ in rows) + " |")
    for name, fns in kinds.items():
        cells = []
        for m in rows:
            xs = [torch.randn(m, i) for _, i in shapes]
            for f, x in zip(fns, xs):
                f(x)
            start = time.perf_counter()
            for _ in range(repeat):
                for f, x in zip(fns, xs):
                    f(x)
            cells.append(f"{(time.perf_counter() - start) / repeat * 1e3:.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF directory or .gguf (default: the default model)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--conc", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--kernels", action="store_true", help="time one layer's products per kernel instead")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.kernels:
        kernels()
        return 0
    conc = [int(c) for c in args.conc.split(",")]
    if args.one:
        print(json.dumps(run_one(args.one, args.model, conc, args.prompt, args.tokens)))
        return 0
    rows = []
    for name in args.variants.split(","):
        if name not in VARIANTS:
            ap.error(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
        cmd = [sys.executable, __file__, "--one", name, "--conc", args.conc, "--prompt", str(args.prompt),
               "--tokens", str(args.tokens)] + (["--model", args.model] if args.model else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr)
    head = " | ".join(f"c={c} tok/s" for c in conc)
    print(f"| variant | weights MB | KV bytes/token | peak RSS MB | {head} |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in conc) + " |")
    for r in rows:
        speeds = " | ".join(f"{r['runs'][str(c)]['tokens_per_s']:.1f}" for c in conc)
        print(f"| {r['variant']} | {r['weight_bytes'] / 1e6:.0f} | {r['kv_bytes_per_token']} | "
              f"{r['peak_rss_bytes'] / 1e6:.0f} | {speeds} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
