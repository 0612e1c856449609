#!/usr/bin/env python3
"""Write a Llama-family model with random weights, in HF format, for benchmarks that need a larger model.

Nothing can be downloaded at run time, so the GPU benchmark builds its model here:
the architecture of a published checkpoint (default: SmolLM2-1.7B, a 1.7B-parameter
Llama) with random weights, saved as safetensors next to the default model's real
tokenizer and chat template. Speed does not depend on the weights' values; the
text is nonsense.

    python bench/make_random_llama.py /tmp/smollm2-1.7b-random --device cuda
    python bench/make_random_llama.py DIR --shape tiny --tokenizer TOKENIZER_DIR
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

SHAPES: dict[str, dict[str, float | int]] = {
    # https://huggingface.co/HuggingFaceTB/SmolLM2-1.7B-Instruct (config.json)
    "smollm2-1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=32, max_position_embeddings=8192, rope_theta=130000.0),
    # Llama-3.2-1B's layer shapes (GQA, 16 layers) on the SmolLM2 vocabulary
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),
    # Llama-3.2-3B's layer shapes (GQA, 28 layers) on the SmolLM2 vocabulary
    "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                     num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),
    # for trying the benchmark on a CPU
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=4096, rope_theta=10000.0),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="directory to write (left alone if it already holds a model)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-1.7b")
    ap.add_argument("--tokenizer", help="HF directory with the tokenizer (default: the default model's)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cpu", help="where to draw the weights (cuda is much faster for large shapes)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(args.out)
    if (out / "config.json").exists():
        print(f"{out} already holds a model")
        return 0
    if args.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from mindie_host.models.default import default_model_path
        from mindie_host.models.weights import resolve_model
        from mindie_host.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolve_model(default_model_path()))
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), tie_word_embeddings=True, rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **SHAPES[args.shape],
    )
    dtype = getattr(torch, args.dtype)
    if args.shape == "llama-3b":  # drawn in the target dtype: a float32 draw would need 13 GB
        torch.set_default_dtype(dtype)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    print(f"wrote {out}: {args.shape}, {params / 1e9:.2f}B parameters, {args.dtype}, {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
