"""Greedy determinism under load: N greedy requests at concurrency C against the same requests run one at a time.

Serves the default model (SmolLM2-135M GGUF) with the default config (``quantization: auto``)
unless ``--model`` names another, runs every distinct prompt alone (one request in flight),
then sends ``--requests`` requests (the prompts repeated) with ``--concurrency`` in flight, and
counts the requests whose tokens are identical to the lone run's. Prints one JSON line.

    python bench/batch_invariance.py --requests 200 --concurrency 32 --max-tokens 24
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from mindie_host.testing import RunningServer, server_config

#: prompts of different lengths, so batched prefills pad and decodes sit next to prefills
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each one is prime.",
    "def fibonacci(n):",
    "Once upon a time, in a kingdom far away, there lived a",
    "Translate to German: The weather is nice today and we are going for a walk in the park.",
    "Q: What is 17 times 23?\nA:",
    "The three laws of thermodynamics are",
    "Explain how a transformer neural network processes a sentence, step by step, for a beginner.",
    "import numpy as np\nimport torch\n\n# a function that",
    "My favourite recipe for pancakes needs",
    "In 1969, the first humans",
    "Here is a short story about a robot who learns to paint:",
    "SELECT name, age FROM users WHERE",
    "The quick brown fox",
    "Dear hiring manager, I am writing to apply for the position of",
    "Photosynthesis is the process by which",
    "A list of the planets in order from the sun: Mercury,",
    "Why is the sky blue? Give a detailed physical explanation including Rayleigh scattering.",
    "1, 1, 2, 3, 5, 8,",
    "The best way to learn a new language is",
    "To be or not to be,",
    "An email to my landlord about the broken heating:",
    "Summary of the French revolution in two sentences:",
    "The recipe calls for two cups of flour, one egg, and",
]


def complete(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", timeout=600, json={
        "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 0,
    })
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"]}


def run(url: str, requests: int, concurrency: int, max_tokens: int, prompts: list[str]) -> dict[str, Any]:
    """Lone runs of each distinct prompt, then the loaded run; returns the counts and timings."""
    t0 = time.perf_counter()
    alone = {p: complete(url, p, max_tokens) for p in prompts}
    t_alone = time.perf_counter() - t0
    batch = [prompts[i % len(prompts)] for i in range(requests)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        loaded = list(pool.map(lambda p: complete(url, p, max_tokens), batch))
    t_loaded = time.perf_counter() - t0
    same = sum(out == alone[p] for p, out in zip(batch, loaded))
    return {"requests": requests, "concurrency": concurrency, "max_tokens": max_tokens,
            "distinct_prompts": len(prompts), "identical": same, "alone_s": round(t_alone, 1),
            "loaded_s": round(t_loaded, 1),
            "loaded_tokens_per_s": round(requests * max_tokens / t_loaded, 1)}


def prefill_ms(url: str, words: int, repeats: int = 3) -> float:
    """Median time of a lone request whose long prompt is prefilled and one token made (ms)."""
    prompt = " ".join(f"word{i % 50}" for i in range(words))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        complete(url, prompt, 1)
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[len(times) // 2] * 1000, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many distinct prompts")
    ap.add_argument("--prefill-words", type=int, default=0,
                    help="also time a lone prefill of this many words (about 2.8 tokens a word)")
    ap.add_argument("--model", default=None, help="model path (default: the default model)")
    ap.add_argument("--config", default="{}", help='JSON overrides for server_config, e.g. {"model": {...}}')
    args = ap.parse_args()
    overrides = json.loads(args.config)
    cfg = server_config(args.model, **overrides)
    with RunningServer(cfg, timeout=900) as server:
        result = run(server.url, args.requests, args.concurrency, args.max_tokens, PROMPTS[: args.prompts])
        print(json.dumps(result), file=sys.stderr, flush=True)  # the main figure, even if what follows fails
        if args.prefill_words:
            result["prefill_words"] = args.prefill_words
            result["prefill_ms"] = prefill_ms(server.url, args.prefill_words)
    result["config"] = overrides
    result["batch_invariant"] = os.environ.get("MINDIE_HOST_BATCH_INVARIANT", "1") != "0"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
