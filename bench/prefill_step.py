#!/usr/bin/env python3
"""Prefill speed of the default model on this CPU, and the fraction of the compute roofline it reaches.

First it measures what this machine's cores give for one of the model's products (a 512 x 576 x 1536
GEMM, the shape of a 512-token prompt through the gate/up projection) in fp32, bf16 and int8
(``torch._int_mm``). Then it loads the default model (SmolLM2-135M GGUF) three ways and times one
prefill step of ``--lengths`` prompt tokens through ``backend.execute`` (median of ``--repeat``):

* ``auto``: the default, ``quantization: auto`` with prompt rows multiplied in bfloat16 (``PromptRows``);
* ``auto, low-bit prompts``: the same with ``MINDIE_HOST_PROMPT_BF16=0`` (prompt rows through torch's
  int4 kernel, as before issue 24);
* ``auto, int8 prompt rows``: ``MINDIE_HOST_PROMPT_INT8=1`` (prompt rows quantized per group of 32, integer products
  against the file's codes);
* ``none``: fp32 everywhere (MKL), the exact reference path.

The roofline of a prefill is the bf16 GEMM rate over the FLOPs of a token (2 x the layers' matrix
parameters, plus attention at that length); the report gives each run's tokens/s and its fraction of it.

    python bench/prefill_step.py --lengths 128,512,1024
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 MINDIE_HOST_CPU_ISA=avx2 \
        python bench/prefill_step.py --lengths 256,512 --modes auto,int8             # the avx2 profile
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from mindie_host.backends.base import ModelInput
from mindie_host.backends.platform import Platform
from mindie_host.backends.torch.backend import TorchBackend
from mindie_host.models.default import default_model_path
from mindie_host.models.weights import resolve_model


def gemm_rates(repeat: int = 20) -> dict[str, float]:
    """GFLOP/s (GOP/s for int8) of a 512 x 576 x 1536 product per dtype on this machine."""
    m, k, n = 512, 576, 1536
    rates = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
        for _ in range(5):
            a @ w.t()
        t0 = time.perf_counter()
        for _ in range(repeat):
            a @ w.t()
        rates[name] = 2 * m * k * n / ((time.perf_counter() - t0) / repeat) / 1e9
    ai, wi = torch.randint(-127, 127, (m, k), dtype=torch.int8), torch.randint(-127, 127, (k, n), dtype=torch.int8)
    for _ in range(5):
        torch._int_mm(ai, wi)
    t0 = time.perf_counter()
    for _ in range(repeat):
        torch._int_mm(ai, wi)
    rates["int8"] = 2 * m * k * n / ((time.perf_counter() - t0) / repeat) / 1e9
    return {k: round(v, 1) for k, v in rates.items()}


def load(quantization: str, env: dict[str, str], max_len: int) -> TorchBackend:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        backend = TorchBackend(resolve_model(default_model_path()), name="bench", dtype="float32",
                               quantization=quantization, platform=Platform())
        backend.load()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    backend.allocate_kv_cache(-(-max_len // 16) + 1, 16)
    return backend


def flops_per_token(backend: TorchBackend, length: int) -> float:
    """Matrix FLOPs per prompt token: the layers' products, and causal attention at ``length`` on average."""
    arch = backend.model.arch  # type: ignore[union-attr]
    h, i = arch.hidden_size, arch.intermediate_size
    qkv = h * (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    per_layer = 2 * (qkv + arch.num_heads * arch.head_dim * h + 3 * h * i)
    attention = 2 * 2 * arch.num_heads * arch.head_dim * (length / 2)  # QK^T and PV over half the context
    return arch.num_layers * (per_layer + attention)


def time_prefill(backend: TorchBackend, n: int, repeat: int) -> float:
    batch = ModelInput(
        input_ids=[(7 * t + 11) % 40000 for t in range(n)], positions=list(range(n)), query_lens=[n],
        context_lens=[n], block_tables=[list(range(1, -(-n // 16) + 1))], logits_indices=[n - 1],
        row_variants=[-1], prompt_lens=[n])
    for _ in range(2):
        backend.execute(batch)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        backend.execute(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,512,1024")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--modes", default="", help="comma-separated: auto, low-bit, int8, none (default: all)")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    rates = gemm_rates()
    print(json.dumps({"gemm_512x576x1536": rates}), flush=True)
    every: dict[str, tuple[str, str, dict[str, str]]] = {
        "auto": ("auto", "auto", {}),
        "low-bit": ("auto, low-bit prompts", "auto", {"MINDIE_HOST_PROMPT_BF16": "0"}),
        "int8": ("auto, int8 prompt rows", "auto", {"MINDIE_HOST_PROMPT_INT8": "1"}),
        "none": ("none (fp32)", "none", {}),
    }
    modes = [every[key] for key in (a.modes.split(",") if a.modes else every)]
    rows: list[dict[str, Any]] = []
    for label, quantization, env in modes:
        backend = load(quantization, env, max(lengths))
        for n in lengths:
            seconds = time_prefill(backend, n, a.repeat)
            roofline = rates["bf16"] * 1e9 / flops_per_token(backend, n)
            row = {"mode": label, "tokens": n, "ms": round(1000 * seconds, 1), "tok_s": round(n / seconds),
                   "bf16_roofline_tok_s": round(roofline), "fraction": round(n / seconds / roofline, 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        backend.shutdown()


if __name__ == "__main__":
    main()
