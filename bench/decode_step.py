"""Time one decode step of the default model, by batch size: the figures of PERF.md's decode-step tables.

Loads the model through :class:`~mindie_host.host.Host` (the same path as ``mindie-host serve``),
fills ``B`` sequences with ``--context`` tokens of KV, then times ``backend.execute`` on a
decode :class:`~mindie_host.api.ModelInput` of those ``B`` sequences (one new token each),
``--repeat`` times after two warm-up steps, on the main thread. Prints the median ms per step
for each batch size; ``--profile B`` prints torch.profiler's operator table for one step of ``B``.

    python bench/decode_step.py                                   # quantization auto, eager
    python bench/decode_step.py --quantization none               # fp32 (round 1)
    python bench/decode_step.py --compile                         # compiled decode steps
    python bench/decode_step.py --batches 16 --profile 16         # where a B=16 step goes
    python bench/decode_step.py --context 600 --spread 0.75       # contexts 150..1050 (mean 600)
    python bench/decode_step.py --batches 52 --spread 0.75 --mixed-chunk 512   # a chunked-prefill (mixed) step

``--mixed-chunk N`` times mixed steps instead, as chunked prefill (splitfuse) builds them under load: the
``B`` decodes plus an N-token prompt chunk of another sequence that already has N tokens cached.

``--family NAME`` times a random model of that family (``llama``, ``qwen2``, ``qwen3``, ``glm``, ``glm4``,
``gemma3_text``, ``phi3``, ``qwen3_moe``: 8 experts with 2 routed, as many active MLP parameters as the dense
families) at the default model's shape instead (hidden 576, 30 layers, 9 heads of 64, 3 KV heads,
MLP 1536, its tokenizer), built with transformers' own classes into ``--family-dir`` on first use; its weights
are float32, so compare families with ``--quantization none`` (bench/family_speed.py alternates them).

    python bench/decode_step.py --family qwen3 --quantization none --batches 1,16 --context 600
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from mindie_host.api import ModelInput
from mindie_host.testing import loaded_host, server_config


def contexts_of(batch: int, context: int, spread: float) -> list[int]:
    """Cached tokens of each of ``batch`` sequences: ``context`` each, or evenly from ``context * (1 - spread)`` to
    ``context * (1 + spread)`` (mean ``context``), as on a load of varied prompts."""
    if batch == 1 or spread == 0:
        return [context] * batch
    return [max(1, round(context * (1 - spread + 2 * spread * i / (batch - 1)))) for i in range(batch)]


def decode_batch(contexts: list[int], block_size: int, blocks_per_seq: int) -> ModelInput:
    """Sequences of ``contexts`` cached tokens, each bringing one new token."""
    batch = len(contexts)
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(batch)]
    return ModelInput(input_ids=[17] * batch, positions=list(contexts), query_lens=[1] * batch,
                      context_lens=[c + 1 for c in contexts], block_tables=tables,
                      logits_indices=list(range(batch)), row_variants=[-1] * batch)


def mixed_batch(contexts: list[int], chunk: int, block_size: int, blocks_per_seq: int) -> ModelInput:
    """An ``chunk``-token prompt chunk (positions ``chunk .. 2 * chunk - 1`` of a longer prompt) followed by the
    decodes of :func:`decode_batch`: the rows a chunked-prefill step runs."""
    decode = decode_batch(contexts, block_size, blocks_per_seq)
    first = len(contexts)  # the chunk's sequence owns the blocks after the decodes'
    table = list(range(1 + first * blocks_per_seq, 1 + (first + 1) * blocks_per_seq))
    return ModelInput(input_ids=[(7 * t + 11) % 40000 for t in range(chunk)] + decode.input_ids,
                      positions=list(range(chunk, 2 * chunk)) + decode.positions,
                      query_lens=[chunk] + decode.query_lens, context_lens=[2 * chunk] + decode.context_lens,
                      block_tables=[table] + decode.block_tables,
                      logits_indices=[chunk - 1] + [chunk + i for i in decode.logits_indices],
                      row_variants=[-1] + decode.row_variants,
                      prompt_lens=[2 * chunk + 1] + [c // 2 for c in contexts])


#: the default model's shape (SmolLM2-135M)
SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
         "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192}
#: each family: transformers' config and model classes, and what its config sets beyond the shape
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "glm": ("GlmConfig", "GlmForCausalLM", {}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 512, "query_pre_attn_scalar": 64}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    # 8 experts of 768 channels, 2 routed: the active MLP parameters of qwen3's one 1536-channel MLP
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 768, "norm_topk_prob": True}),
}


def family_model(name: str, root: Path) -> Path:
    """A random model of family ``name`` at :data:`SHAPE`, with the default model's tokenizer (built once)."""
    import transformers

    from mindie_host.testing import make_tiny_model

    config, model, keys = FAMILIES[name]
    shape = dict(SHAPE)
    if name == "phi3":  # Phi3Config takes no head_dim: 9 heads of 64 from the hidden size
        shape.pop("head_dim")
    return make_tiny_model(root / name, getattr(transformers, config), getattr(transformers, model), head_scale=1.0,
                           **shape, **keys)


def step_config(model_path: Path | None, max_seqs: int, per_seq: int, block_size: int, **model: Any) -> dict[str, Any]:
    """A config for timing steps of up to ``max_seqs`` sequences of ``per_seq`` blocks each (plus a spare), with
    ``model`` overriding ``ModelConfig`` keys (quantization, dtype, compile, kvCacheDtype)."""
    return server_config(model_path, model={**model, "maxKvBlocks": max(1 + (max_seqs + 1) * per_seq, 65),
                                            "cpuMemSize": 8},
                         schedule={"cacheBlockSize": block_size, "maxBatchSize": max_seqs, "maxPrefillBatchSize": 0},
                         deploy={"maxSeqLen": max(1024, per_seq * block_size)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--spread", type=float, default=0.0,
                    help="contexts spread evenly over context * (1 -/+ spread) instead of all equal (0 to 1)")
    ap.add_argument("--mixed-chunk", type=int, default=0,
                    help="time mixed steps: the decodes plus a prompt chunk of this many tokens after as many cached")
    ap.add_argument("--profile", type=int, help="print torch.profiler's operator table for one step of this batch")
    ap.add_argument("--family", choices=sorted(FAMILIES),
                    help="a random model of this family at the default model's shape instead of the default model")
    ap.add_argument("--family-dir", default="/tmp/mindie-bench-families", help="where --family models are kept")
    ap.add_argument("--model", help="time this model (an HF directory or a GGUF file) instead of the default model")
    args = ap.parse_args(argv)
    model_path = family_model(args.family, Path(args.family_dir)) if args.family else args.model
    batches = [int(b) for b in args.batches.split(",")]
    block_size = 16
    per_seq = -(-(max(contexts_of(2, args.context, args.spread) + [2 * args.mixed_chunk]) + 1) // block_size)
    cfg = step_config(model_path, max(batches) + (1 if args.mixed_chunk else 0), per_seq, block_size,
                      quantization=args.quantization, dtype=args.dtype, compile=args.compile,
                      kvCacheDtype=args.kv_cache_dtype)
    host = loaded_host(cfg)
    backend = host.backend
    if args.compile:  # the decode step compiles in the background: time it once it is in use
        backend.wait_compiled()
    results = {}
    def step_of(b: int) -> ModelInput:
        contexts = contexts_of(b, args.context, args.spread)
        if args.mixed_chunk:
            return mixed_batch(contexts, args.mixed_chunk, block_size, per_seq)
        return decode_batch(contexts, block_size, per_seq)

    for b in batches:
        batch = step_of(b)
        for _ in range(2):
            backend.execute(batch)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            backend.execute(batch)
            times.append((time.perf_counter() - t0) * 1000)
        results[b] = round(statistics.median(times), 2)
        what = f" + a {args.mixed_chunk}-token chunk" if args.mixed_chunk else ""
        print(f"B={b:3d}{what}  context {args.context}: {results[b]:7.2f} ms/step (median of {args.repeat})",
              flush=True)
    if args.profile:
        batch = step_of(args.profile)
        with torch.profiler.profile() as prof:
            backend.execute(batch)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    print(json.dumps({"family": args.family or "default", "model": args.model, "quantization": args.quantization, "compile": args.compile,
                      "context": args.context,
                      "spread": args.spread, "mixed_chunk": args.mixed_chunk,
                      "ms_per_step": results}))
    host.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
