"""Accuracy of the int8 schemes against the fp32 reference: perplexity and teacher-forced top-1 agreement.

The text is fixed and local: the docstrings of a list of Python standard-library modules
(different from the calibration text of ``mindie-host quantize``). It is cut into chunks of
``--chunk`` tokens; each chunk runs as one prefill through the torch backend (so the KV cache,
int8 or not, is written and read back by attention), and every position's next-token
distribution is compared with the fp32 reference's.

    python bench/quant_accuracy.py                  # the default model (SmolLM2-135M GGUF)
    python bench/quant_accuracy.py --model DIR --json out.json

Variants: fp32 (``quantization: none``, the reference), ``auto`` (the GGUF file's own
4/8-bit path, with prompt rows in bfloat16 as served by default, and with them through the low-bit
kernel too), w8a16 and w8a8 quantized at load (no calibration), w8a16 and w8a8 checkpoints
written by ``mindie-host quantize`` (w8a8 calibrated and smoothed), and ``kvCacheDtype: int8``, and
the GGUF path with a bf16 KV cache (the benchmark config: prompt attention with bf16 products), and an accuracy
study of int8 activations for prompt rows (llama.cpp's q8_0 rounding, emulated in float32).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mindie_host.backends.base import ModelInput
from mindie_host.backends.platform import Platform
from mindie_host.backends.torch.backend import TorchBackend
from mindie_host.models.default import default_model_path
from mindie_host.models.weights import resolve_model
from mindie_host.quant.quantize import quantize_model
from mindie_host.tokenizer import load_tokenizer

TEXT_MODULES = ("json", "argparse", "collections", "functools", "itertools", "pathlib", "subprocess", "threading",
                "logging", "unittest", "dataclasses", "typing", "textwrap", "string", "re", "datetime", "heapq",
                "bisect", "random", "statistics", "shutil", "tempfile", "csv", "zipfile", "email", "http.client")


def eval_text() -> str:
    """The fixed evaluation text: standard-library module docstrings, in a fixed order."""
    parts = []
    for name in TEXT_MODULES:
        doc = importlib.import_module(name).__doc__
        if doc:
            parts.append(doc.strip())
    return "\n\n".join(parts)


def run_logits(path: str | Path, chunks: list[list[int]], **backend_kw: Any) -> list[torch.Tensor]:
    """Float32 logits at every position of every chunk (each chunk one prefill, its rows marked as prompt tokens).

    ``env`` in ``backend_kw`` sets environment variables while the model loads (its weight formats are chosen then);
    ``emulate_int8_prompts`` rounds the prompt rows' activations as :func:`q8_activations` does before each product
    with a bfloat16 prompt copy (an accuracy study: no kernel computes that yet).
    """
    env = backend_kw.pop("env", {})
    if backend_kw.pop("emulate_int8_prompts", False):
        from mindie_host.backends import linear

        saved_product = linear.prompt_product
        linear.prompt_product = lambda x, w: F.linear(q8_activations(x), w.float()).to(torch.bfloat16)
        try:
            return run_logits(path, chunks, **backend_kw, env=env)
        finally:
            linear.prompt_product = saved_product
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        backend = TorchBackend(resolve_model(path), name="eval", dtype="float32", platform=Platform(), **backend_kw)
        backend.load()
        backend.load_cpu_kernels()  # the C++ kernels the server builds at start-up: measure the path it serves
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    block = 16
    blocks = -(-max(len(c) for c in chunks) // block)
    backend.allocate_kv_cache(blocks + 1, block)
    out = []
    for chunk in chunks:
        n = len(chunk)
        out.append(backend.execute(ModelInput(
            input_ids=chunk, positions=list(range(n)), query_lens=[n], context_lens=[n],
            block_tables=[list(range(1, blocks + 1))], logits_indices=list(range(n)), row_variants=[-1],
            prompt_lens=[n],
        )).float())
    backend.shutdown()
    return out


def q8_activations(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """``x`` rounded as llama.cpp's q8_0 rounds the activations of its integer products: per row and group of
    ``group`` values, a scale ``max|x| / 127`` and codes ``round(x / scale)``; returned as ``codes * scale``."""
    xs = x.float().reshape(x.shape[0], -1, group)
    scale = xs.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return (torch.round(xs * inverse).clamp(-127, 127) * scale).reshape(x.shape)


def compare(ref: list[torch.Tensor], got: list[torch.Tensor], chunks: list[list[int]]) -> dict[str, float]:
    """Perplexity of the text, top-1 agreement with the reference and mean KL(ref || got), over all positions."""
    nll, agree, kl, count = 0.0, 0, 0.0, 0
    for r, g, ids in zip(ref, got, chunks):
        target = torch.tensor(ids[1:])
        lg = torch.log_softmax(g[:-1], dim=-1)
        lr = torch.log_softmax(r[:-1], dim=-1)
        nll += float(-lg.gather(1, target[:, None]).sum())
        agree += int((g[:-1].argmax(-1) == r[:-1].argmax(-1)).sum())
        kl += float((lr.exp() * (lr - lg)).sum())
        count += len(ids) - 1
    return {"perplexity": math.exp(nll / count), "top1_agreement": agree / count, "kl": kl / count,
            "positions": count}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF directory or .gguf (default: the default model)")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=4096, help="evaluation tokens at most")
    ap.add_argument("--alpha", type=float, default=0.5, help="w8a8 smoothing strength for the quantize command")
    ap.add_argument("--only", help="run only the variants whose label contains this text (and the fp32 reference)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    model = Path(args.model) if args.model else default_model_path()
    source = resolve_model(model)
    ids = list(load_tokenizer(source).encode(eval_text(), add_special_tokens=False))[: args.tokens]
    chunks = [ids[i : i + args.chunk] for i in range(0, len(ids), args.chunk) if len(ids[i : i + args.chunk]) > 1]
    print(f"model {model.name}: {len(ids)} tokens in {len(chunks)} chunks of up to {args.chunk}", file=sys.stderr)
    ref = run_logits(model, chunks, quantization="none")
    rows: dict[str, dict[str, float]] = {"fp32 (quantization: none)": compare(ref, ref, chunks)}
    with tempfile.TemporaryDirectory() as tmp:
        w8a16_dir, w8a8_dir = Path(tmp) / "w8a16", Path(tmp) / "w8a8"
        quantize_model(model, "w8a16", w8a16_dir)
        quantize_model(model, "w8a8", w8a8_dir, alpha=args.alpha)
        variants: list[tuple[str, Path, dict[str, Any]]] = [
            ("bf16 KV cache (kvCacheDtype: bfloat16)", model, {"quantization": "none", "kv_cache_dtype": "bfloat16"}),
            ("int8 KV cache (kvCacheDtype: int8)", model, {"quantization": "none", "kv_cache_dtype": "int8"}),
            ("w8a16 at load", model, {"quantization": "w8a16"}),
            ("w8a16 checkpoint (mindie-host quantize)", w8a16_dir, {"quantization": "auto"}),
            ("w8a8 at load (no smoothing)", model, {"quantization": "w8a8"}),
            (f"w8a8 checkpoint (mindie-host quantize, alpha {args.alpha})", w8a8_dir, {"quantization": "auto"}),
            ("w8a8 checkpoint + int8 KV cache", w8a8_dir, {"quantization": "auto", "kv_cache_dtype": "int8"}),
        ]
        if source.kind == "gguf":
            variants[:0] = [
                ("GGUF path (quantization: auto; prompt rows bf16, the default)", model, {"quantization": "auto"}),
                ("GGUF path, prompt rows through the low-bit kernel (MINDIE_HOST_PROMPT_BF16=0)", model,
                 {"quantization": "auto", "env": {"MINDIE_HOST_PROMPT_BF16": "0"}}),
                ("GGUF path with a bf16 KV cache (bench/configs/peers.json)", model,
                 {"quantization": "auto", "kv_cache_dtype": "bfloat16"}),
                ("GGUF path, prompt rows' activations rounded to int8 per group of 32 (emulated, llama.cpp's q8_0)",
                 model, {"quantization": "auto", "emulate_int8_prompts": True}),
                ("GGUF path, prompt rows in int8 groups of 32 (MINDIE_HOST_PROMPT_INT8=1)", model,
                 {"quantization": "auto", "env": {"MINDIE_HOST_PROMPT_INT8": "1"}}),
            ]
        for label, path, kw in variants:
            if args.only and args.only not in label:
                continue
            rows[label] = compare(ref, run_logits(path, chunks, **kw), chunks)
            print(f"{label}: {rows[label]}", file=sys.stderr)
    base = rows["fp32 (quantization: none)"]["perplexity"]
    print("| variant | perplexity | vs fp32 | top-1 agreement | KL |")
    print("| --- | --- | --- | --- | --- |")
    for label, r in rows.items():
        print(f"| {label} | {r['perplexity']:.3f} | {100 * (r['perplexity'] / base - 1):+.2f}% | "
              f"{100 * r['top1_agreement']:.1f}% | {r['kl']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(model), "tokens": len(ids), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
