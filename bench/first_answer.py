#!/usr/bin/env python3
"""The default config's first answer and the logits behind its first token, as a CPU profile serves them.

Loads the default model in-process (the README's config), prints the CPU profile's log line, the greedy
answer to ``--question`` (chat template, ``--tokens`` tokens) and the three largest logits of the first
generated token, with the gap between the first two: a gap within the path's rounding noise is a tie the
path may break either way. ``--profile avx2`` re-executes with torch's AVX2 switches and
``MINDIE_HOST_CPU_ISA=avx2`` (as ``bench/peers.py --profile avx2``); ``MINDIE_HOST_CPU_KERNELS=0`` and
``MINDIE_HOST_LAYER_OPS=0`` in the environment serve on torch's operators.

    python bench/first_answer.py --profile avx2
    MINDIE_HOST_CPU_KERNELS=0 python bench/first_answer.py --profile avx2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=["native", "avx2"], default="native")
    ap.add_argument("--question", default="What is the capital of France?")
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--quantization", default="auto", help="the model's quantization (none: the fp32 reference)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu_profiles import PROFILES, run_as

    run_as(PROFILES[args.profile])

    from mindie_host.api import EngineRequest, SamplingParams
    from mindie_host.backends.base import ModelInput
    from mindie_host.testing import loaded_host, run_engine, server_config

    host = loaded_host(server_config(None, model={"quantization": args.quantization}))
    tok = host.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": args.question}], tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)
    n, block = len(ids), host.config.schedule.cacheBlockSize
    logits = host.backend.execute(ModelInput(input_ids=ids, positions=list(range(n)), query_lens=[n], context_lens=[n],
                                             block_tables=[list(range(-(-n // block)))], logits_indices=[n - 1],
                                             row_variants=[-1], prompt_lens=[n]))[0]
    top = logits.topk(3)
    answer = run_engine(host, [EngineRequest("q", ids, SamplingParams(max_tokens=args.tokens))])["q"].token_ids
    result = {
        "profile": getattr(host.backend, "cpu", None) and host.backend.cpu.describe(),
        "answer": tok.decode(answer),
        "top3": [[tok.decode([int(i)]), round(float(v), 4)] for v, i in zip(top.values, top.indices)],
        "gap": round(float(top.values[0] - top.values[1]), 4),
    }
    print(json.dumps(result, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
