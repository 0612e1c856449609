"""Multi-LoRA throughput: base-only vs mixed-adapter request mixes on one server, side by side.

Builds ``--adapters`` random PEFT-format adapters (rank ``--rank``, all seven target
modules) for the default model (SmolLM2-135M-Instruct) unless ``--model`` is given,
starts the real server with the ``multi_lora`` plugin (``maxLoras`` = number of
adapters), and runs the same closed-loop load three times:

* ``base``: 100% base model;
* ``half``: 50% base, 50% spread over the adapters;
* ``uniform``: uniform over the adapters.

Each run sends ``-n`` completions with ``-c`` in flight, greedy, ``ignore_eos`` and a
fixed ``--max-tokens``; it reports output tokens/s (wall clock) and output tokens per
CPU-second of this process (server and client share it; robust when the machine is
shared), each with its ratio to the base run (medians over ``--rounds``).
Run::

    python bench/multi_lora_bench.py -n 48 -c 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

from mindie_host.api import resolve_model
from mindie_host.backend_api import load_arch
from mindie_host.models.default import default_model_path
from mindie_host.testing import RunningServer, server_config

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "What is the capital of France and why is it famous?",
    "Give me a recipe for pancakes.",
    "Summarize the plot of Hamlet.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish, French and German.",
]
MODULES = {
    "q_proj": ("self_attn", "hidden", "q"),
    "k_proj": ("self_attn", "hidden", "kv"),
    "v_proj": ("self_attn", "hidden", "kv"),
    "o_proj": ("self_attn", "q", "hidden"),
    "gate_proj": ("mlp", "hidden", "inter"),
    "up_proj": ("mlp", "hidden", "inter"),
    "down_proj": ("mlp", "inter", "hidden"),
}


def write_adapter(directory: Path, arch: Any, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for ``arch``."""
    directory.mkdir(parents=True, exist_ok=True)
    dims = {"hidden": arch.hidden_size, "q": arch.num_heads * arch.head_dim,
            "kv": arch.num_kv_heads * arch.head_dim, "inter": arch.intermediate_size}
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(arch.num_layers):
        for module, (parent, fin, fout) in MODULES.items():
            stem = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, dims[fin], generator=g) / dims[fin] ** 0.5
            tensors[f"{stem}.lora_B.weight"] = torch.randn(dims[fout], rank, generator=g) * 0.01
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
              "bias": "none", "task_type": "CAUSAL_LM"}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


async def run_load(url: str, models: list[str], n: int, c: int, max_tokens: int) -> dict[str, float]:
    """Closed loop: ``n`` requests, ``c`` in flight; ``models[i]`` is request i's model."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    tokens = 0
    errors = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens, errors
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            body = {"model": models[i], "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            r = await client.post(url + "/v1/completions", json=body)
            if r.status_code != 200:
                errors += 1
                continue
            tokens += r.json()["usage"]["completion_tokens"]

    t0, cpu0 = time.perf_counter(), time.process_time()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(c)))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"out_tok_s": tokens / elapsed, "out_tok_per_cpu_s": tokens / cpu, "seconds": elapsed,
            "tokens": float(tokens), "errors": float(errors)}


def mixes(n: int, names: list[str], base: str) -> dict[str, list[str]]:
    """The three request mixes: every request's model, in send order."""
    return {
        "base": [base] * n,
        "half": [base if i % 2 == 0 else names[(i // 2) % len(names)] for i in range(n)],
        "uniform": [names[i % len(names)] for i in range(n)],
    }


def step_bench(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per-kernel forward-step cost without HTTP or scheduling: one decode step of ``-c`` sequences and one
    prefill step of ``-c`` 12-token prompts, per mix; median process CPU time (single thread), as a ratio to base."""
    from mindie_plugin_multi_lora.adapters import ModelDims, load_adapter
    from mindie_plugin_multi_lora.runtime import LoraRuntime

    from mindie_host.api import ModelInput
    from mindie_host.backends.torch.backend import TorchBackend

    torch.set_num_threads(1)
    model_path = args.model or str(default_model_path())
    backend = TorchBackend(resolve_model(model_path), name="bench", dtype="float32")
    info = backend.load()
    c, q = args.c, 12
    backend.allocate_kv_cache(c * 8 + 1, 16)
    dims = ModelDims.from_info(info)
    arch = load_arch(resolve_model(model_path))
    k = args.adapters
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        adapters = [load_adapter(f"l{i}", write_adapter(Path(tmp) / f"l{i}", arch, args.rank, i), dims, args.rank)
                    for i in range(k)]
    mixes_ = {"base": [-1] * c, "half": [-1 if i % 2 == 0 else (i // 2) % k for i in range(c)],
              "uniform": [i % k for i in range(c)]}
    tables = [[i * 8 + j for j in range(8)] for i in range(c)]
    shapes = {
        "decode": lambda a: ModelInput([5] * c, [40] * c, [1] * c, [41] * c, tables, list(range(c)), a),
        "prefill": lambda a: ModelInput([5] * (c * q), list(range(q)) * c, [q] * c, [q] * c, tables,
                                        [q * (i + 1) - 1 for i in range(c)], a),
    }
    out: dict[str, dict[str, float]] = {}
    for kernel in ("grouped", "masked", "segment"):
        runtime = LoraRuntime(dims, k, args.rank, kernel=kernel)
        for slot, adapter in enumerate(adapters):
            runtime.write_slot(slot, adapter)
        backend.set_linear_deltas(runtime)
        for shape, make in shapes.items():
            times: dict[str, list[float]] = {m: [] for m in mixes_}
            for _ in range(5):
                for mix, slots in mixes_.items():
                    batch = make(slots)
                    backend.execute(batch)
                    t0 = time.process_time()
                    for _ in range(3):
                        backend.execute(batch)
                    times[mix].append((time.process_time() - t0) / 3)
            med = {m: statistics.median(v) for m, v in times.items()}
            out[f"{kernel}/{shape}"] = {m: med["base"] / med[m] for m in ("half", "uniform")}
            out[f"{kernel}/{shape}"]["base_ms"] = med["base"] * 1000
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="base model path (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("-n", type=int, default=48, help="requests per mix")
    ap.add_argument("-c", type=int, default=16, help="requests in flight")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kernel", default="auto", choices=["auto", "masked", "segment"])
    ap.add_argument("--rounds", type=int, default=1, help="repeat the three mixes, interleaved")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    ap.add_argument("--steps", action="store_true",
                    help="instead: forward-step cost per kernel (decode and prefill), CPU time, no server")
    args = ap.parse_args(argv)
    if args.steps:
        result = step_bench(args)
        if args.json:
            print(json.dumps(result))
        else:
            print(f"step throughput vs base (CPU time, 1 thread), {args.adapters} adapters of rank {args.rank}, "
                  f"{args.c} sequences")
            print(f"{'kernel/step':<18}{'base ms':>10}{'half':>8}{'uniform':>9}")
            for key, r in result.items():
                print(f"{key:<18}{r['base_ms']:>10.1f}{r['half']:>8.2f}{r['uniform']:>9.2f}")
        return 0

    model_path = args.model or str(default_model_path())
    arch = load_arch(resolve_model(model_path))
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        names = [f"lora{i}" for i in range(args.adapters)]
        adapters = {name: str(write_adapter(Path(tmp) / name, arch, args.rank, i)) for i, name in enumerate(names)}
        cfg = server_config(
            args.model or None,
            model={"plugin_params": json.dumps({"plugin_type": "multi_lora"})},
            schedule={"maxBatchSize": max(32, args.c), "maxPrefillBatchSize": args.c},
            plugins={"multi_lora": {"adapters": adapters, "maxLoras": args.adapters, "maxLoraRank": args.rank,
                                    "kernel": args.kernel}},
        )
        with RunningServer(cfg, timeout=600) as server:
            base = server.host.model_name
            plan = mixes(args.n, names, base)
            asyncio.run(run_load(server.url, [base] * args.c, args.c, args.c, 4))  # warm-up
            results: dict[str, list[dict[str, float]]] = {k: [] for k in plan}
            for _ in range(args.rounds):
                for mix, models in plan.items():
                    results[mix].append(asyncio.run(run_load(server.url, models, args.n, args.c, args.max_tokens)))
            device = server.host.info.device if server.host.info else "?"
    summary = {
        mix: {
            "out_tok_s": statistics.median(r["out_tok_s"] for r in runs),
            "out_tok_per_cpu_s": statistics.median(r["out_tok_per_cpu_s"] for r in runs),
            "errors": sum(r["errors"] for r in runs),
        }
        for mix, runs in results.items()
    }
    base = summary["base"]
    for s in summary.values():
        s["vs_base"] = s["out_tok_s"] / base["out_tok_s"] if base["out_tok_s"] else 0.0
        s["cpu_vs_base"] = s["out_tok_per_cpu_s"] / base["out_tok_per_cpu_s"] if base["out_tok_per_cpu_s"] else 0.0
    if args.json:
        print(json.dumps({"device": device, "args": vars(args), "results": summary}))
    else:
        print(f"device={device} adapters={args.adapters} rank={args.rank} n={args.n} c={args.c} "
              f"max_tokens={args.max_tokens} kernel={args.kernel} rounds={args.rounds}")
        print(f"{'mix':<10}{'out tok/s':>12}{'vs base':>10}{'tok/CPU-s':>12}{'vs base':>10}{'errors':>8}")
        for mix, s in summary.items():
            print(f"{mix:<10}{s['out_tok_s']:>12.1f}{s['vs_base']:>10.2f}{s['out_tok_per_cpu_s']:>12.1f}"
                  f"{s['cpu_vs_base']:>10.2f}{int(s['errors']):>8}")
    return 0 if all(s["errors"] == 0 for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
