#!/usr/bin/env python3
"""A realistic closed-loop load: every request carries its own summarisation prompt, of varied length.

``../shared/peers/loadgen.py`` cycles through 12 short fixed prompts, which a prefix cache can serve
from memory. Real traffic has distinct prompts of hundreds of tokens. This generator draws each
request's passage from the documentation text that ships with CPython (``pydoc_data.topics``, about
465,000 characters in 79 topics), so it needs nothing from the network and is the same on every
machine with the same Python minor version:

* passage lengths in words follow a log-normal long tail (median ``--median-words``, default 220),
  clipped to ``[--min-words, --max-words]`` (default 40-900); the generator's output reports the
  distribution it drew;
* every passage starts at a different place of the text, so no two requests share more than the
  instruction line (a prefix cache gains nothing beyond it);
* each request asks for ``--max-tokens`` (default 128) output tokens, streamed, greedy, as a chat
  completion, exactly as ``loadgen.py`` sends them; tokens are counted as streamed content chunks;
  ``--ignore-eos`` asks for all of them (``ignore_eos``, which mindie-host and llama-server both take), for
  random-weight models whose EOS falls anywhere.

It prints one JSON line with the same keys as ``loadgen.py`` (output tok/s, req/s, TTFT and TPOT p50
and p99) plus the prompt-length distribution::

    python bench/varied_load.py --url http://127.0.0.1:1025 --model SmolLM2-135M-Instruct -n 64 -c 16

``bench/peers.py --workload varied`` runs it against every system in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import statistics
import time
from typing import Any

import httpx

INSTRUCTION = "Summarise the following passage from the Python documentation in a few sentences.\n\n"


def corpus_words() -> list[str]:
    """The words of CPython's shipped documentation topics, in a fixed order."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[key] for key in sorted(topics))
    return re.findall(r"\S+", text)


def make_prompts(n: int, seed: int = 0, median_words: int = 220, min_words: int = 40,
                 max_words: int = 900) -> list[str]:
    """``n`` distinct summarisation prompts whose passages have long-tailed lengths."""
    words = corpus_words()
    rng = random.Random(seed)
    sigma = 0.75  # the log-normal's spread: about 1 request in 20 is over three times the median
    prompts = []
    heads: set[str] = set()
    stride = max(1, (len(words) - max_words) // max(n, 1))
    for i in range(n):
        length = int(min(max_words, max(min_words, rng.lognormvariate(math.log(median_words), sigma))))
        start = (i * stride + rng.randrange(stride)) % (len(words) - length)
        passage = " ".join(words[start:start + length])
        while passage[:80] in heads:  # the docs repeat some sentences (which, depends on the Python release)
            start = (start + 1) % (len(words) - length)
            passage = " ".join(words[start:start + length])
        heads.add(passage[:80])
        prompts.append(INSTRUCTION + passage)
    return prompts


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
              res: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, **(extra or {})}
    t0 = time.perf_counter()
    first: float | None = None
    last = t0
    n = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            res["errors"] += 1
            await r.aread()
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            try:
                obj = json.loads(data)
            except ValueError:
                continue
            for choice in obj.get("choices", []):
                if (choice.get("delta") or {}).get("content"):
                    n += 1
                    last = time.perf_counter()
                    if first is None:
                        first = last
    if first is None:
        res["errors"] += 1
        return
    res["ttft"].append(first - t0)
    res["tokens"] += n
    if n > 1:
        res["tpot"].append((last - first) / (n - 1))


async def run(url: str, model: str, n: int, c: int, max_tokens: int, prompts: list[str],
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    res: dict[str, Any] = {"ttft": [], "tpot": [], "tokens": 0, "errors": 0}
    sem = asyncio.Semaphore(c)
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=c + 4)) as client:
        async def task(i: int) -> None:
            async with sem:
                await one(client, url, model, prompts[i], max_tokens, res, extra)

        t0 = time.perf_counter()
        await asyncio.gather(*(task(i) for i in range(n)))
        wall = time.perf_counter() - t0

    def ms(xs: list[float], p: float) -> float | None:
        v = pct(xs, p)
        return None if v is None else round(1000 * v, 1)

    lengths = [len(p.split()) - len(INSTRUCTION.split()) for p in prompts[:n]]
    return {"label": "varied", "n": n, "c": c, "wall_s": round(wall, 2), "errors": res["errors"],
            "out_tok_s": round(res["tokens"] / wall, 1), "req_s": round((n - res["errors"]) / wall, 2),
            "ttft_p50_ms": ms(res["ttft"], 50), "ttft_p99_ms": ms(res["ttft"], 99),
            "tpot_p50_ms": ms(res["tpot"], 50), "tpot_p99_ms": ms(res["tpot"], 99),
            "prompt_words": {"mean": round(statistics.fmean(lengths), 1), "p50": pct(lengths, 50),
                             "p90": pct(lengths, 90), "max": max(lengths), "min": min(lengths)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:1025")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-c", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="which prompts: the same seed gives the same prompts")
    ap.add_argument("--median-words", type=int, default=220)
    ap.add_argument("--min-words", type=int, default=40)
    ap.add_argument("--max-words", type=int, default=900)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="ask for every one of --max-tokens tokens (random-weight models: EOS falls anywhere)")
    a = ap.parse_args()
    prompts = make_prompts(a.n, a.seed, a.median_words, a.min_words, a.max_words)
    extra = {"ignore_eos": True} if a.ignore_eos else None
    print(json.dumps(asyncio.run(run(a.url, a.model, a.n, a.c, a.max_tokens, prompts, extra))))


if __name__ == "__main__":
    main()
