#!/usr/bin/env python3
"""How much arithmetic a bench/peers.py varied-load run asked for, and what the CPU's float32 rate allows.

For the median run of each concurrency in a ``bench/peers.py`` results file, it rebuilds that run's prompts
(``bench/varied_load.py``'s generator, the seed found by the run's prompt-length statistics), counts their tokens
with the default model's tokenizer and chat template, and adds up the floating-point operations the model needs:
the decoder's products for every prompt and generated token (2 x the layers' weights), the LM head once per
generated token, and causal attention (scores and weighted values over the context). It prints the run's
effective rate (operations over wall time) and the tokens/s the run would reach if every operation ran at
``--rate`` GFLOP/s, the float32 product rate of the same CPU profile (``--gemm`` measures torch's float32 GEMM
in this process, so run it under the profile's switches, for example through ``bench/cpu_profiles.py``'s
``avx2`` environment):

    python bench/load_flops.py bench/results/peers_avx2_issue35_s9_r3.json --profile avx2 --gemm

Generated tokens are the run's tokens/s times its wall time; the chat template's tokens are counted as the server
renders them (system prompt included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from cpu_profiles import PROFILES, run_as  # noqa: E402


def model_shape() -> dict[str, int]:
    """The default model's dimensions, from its GGUF header as the loader reads it."""
    from mindie_host.models.default import default_model_path
    from mindie_host.models.gguf_files import base_config, read_info

    cfg = base_config(read_info(default_model_path()), "llama")
    return {"hidden": cfg["hidden_size"], "layers": cfg["num_hidden_layers"], "heads": cfg["num_attention_heads"],
            "kv_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"], "ffn": cfg["intermediate_size"],
            "vocab": cfg["vocab_size"]}


def layer_weights(s: dict[str, int]) -> int:
    """Weights of one decoder layer's products: Q, K, V, O and the gated MLP."""
    q = s["hidden"] * s["heads"] * s["head_dim"]
    kv = 2 * s["hidden"] * s["kv_heads"] * s["head_dim"]
    return q + kv + q + 3 * s["hidden"] * s["ffn"]


def request_flops(s: dict[str, int], prompt: int, generated: int) -> tuple[float, float]:
    """(prompt operations, generated-token operations) of one request."""
    per_token = 2.0 * layer_weights(s) * s["layers"]
    attention = 4.0 * s["heads"] * s["head_dim"] * s["layers"]  # scores and weighted values, per context position
    prompt_ops = prompt * per_token + attention * prompt * (prompt + 1) / 2
    head = 2.0 * s["hidden"] * s["vocab"]
    generated_ops = generated * (per_token + head) + attention * sum(prompt + i for i in range(generated))
    return prompt_ops, generated_ops


def passage_words(prompts: list[str]) -> float:
    """The mean length in words of the prompts' passages (what bench/varied_load.py reports as prompt_words)."""
    from varied_load import INSTRUCTION

    return statistics.fmean(len(p.split()) - len(INSTRUCTION.split()) for p in prompts)


def gemm_rate(threads: int | None) -> float:
    """torch's float32 GEMM rate here, GFLOP/s (the best of three shapes of the default model's prompt products)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    best = 0.0
    for m, k, n in ((512, 576, 1536), (512, 1536, 576), (2048, 2048, 2048)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(15):
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
        best = max(best, 2 * m * k * n / statistics.median(times) / 1e9)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a bench/peers.py results file with a varied load")
    ap.add_argument("--system", default="mindie/varied")
    ap.add_argument("--peer", default="llama/varied", help="the results key to compare the ceiling with")
    ap.add_argument("--rate", type=float, help="float32 GFLOP/s to price the operations at")
    ap.add_argument("--gemm", action="store_true", help="measure torch's float32 GEMM rate here for --rate")
    ap.add_argument("--threads", type=int, help="torch threads for --gemm (default: torch's)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="native")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    run_as(PROFILES[args.profile])
    from varied_load import make_prompts

    from mindie_host.models.default import default_model_path
    from mindie_host.models.weights import resolve_model
    from mindie_host.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(default_model_path()))
    shape = model_shape()
    rate = gemm_rate(args.threads) if args.gemm else args.rate
    data = json.loads(Path(args.results).read_text())["results"]
    rows: list[dict[str, Any]] = []
    for conc, run in sorted(data[args.system].items(), key=lambda kv: int(kv[0])):
        n = run["n"]
        runs = run["runs"] if isinstance(run.get("runs"), int) else len(run.get("runs") or [None])
        # the median run's seed: the one whose prompts have the run's mean length in words
        seed = min(range(runs), key=lambda sd: abs(passage_words(make_prompts(n, sd)) - run["prompt_words"]["mean"]))
        prompts = make_prompts(n, seed)
        lengths = [len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                                      add_generation_prompt=True),
                                        add_special_tokens=False)) for p in prompts]
        generated = run["out_tok_s"] * run["wall_s"]
        per_request = generated / n
        ops = [request_flops(shape, t, round(per_request)) for t in lengths]
        prompt_ops, generated_ops = sum(o[0] for o in ops), sum(o[1] for o in ops)
        total = prompt_ops + generated_ops
        row: dict[str, Any] = {
            "conc": int(conc), "seed": seed, "requests": n, "prompt_tokens_mean": round(statistics.mean(lengths)),
            "generated_tokens": round(generated), "gflop": round(total / 1e9), "prompt_share": round(prompt_ops / total, 2),
            "wall_s": run["wall_s"], "tok_s": run["out_tok_s"], "effective_gflop_s": round(total / 1e9 / run["wall_s"], 1),
        }
        if rate:
            ceiling = generated / (total / 1e9 / rate)
            row.update({"rate_gflop_s": round(rate, 1), "tok_s_at_rate": round(ceiling, 1)})
            peer = data.get(args.peer, {}).get(conc)
            if peer:
                row["peer_tok_s"] = peer["out_tok_s"]
                row["ratio_at_rate"] = round(ceiling / peer["out_tok_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"shape": shape, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
