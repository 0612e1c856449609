"""Structured decoding engines side by side: the builtin hand-written JSON decoder against llguidance.

For a few JSON schemas (near the builtin decoder's subset, so both enforce about the same thing) it measures,
on the default model's tokenizer (49,152 tokens):

* tokenizer preparation (once per server): builtin ``build_vocab`` vs llguidance ``make_tokenizer``;
* compile time per request: ``JsonConstraint.for_schema`` vs ``compile_grammar`` + ``GrammarConstraint``;
* per-token mask time: one call of the constraint (allowed ids of the next token), along random walks
  through the allowed tokens, median and p99 over all steps of ``--walks`` walks per schema.

    python bench/structured_bench.py [--walks 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from mindie_host.models.default import default_model_path
from mindie_host.models.weights import resolve_model
from mindie_host.structured import llg
from mindie_host.structured.json_grammar import Grammar, JsonConstraint
from mindie_host.structured.spec import StructuredSpec
from mindie_host.structured.vocab import build_vocab
from mindie_host.tokenizer import load_tokenizer

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                              "age": {"type": "integer"}, "ok": {"type": "boolean"}},
             "required": ["name", "age", "ok"], "additionalProperties": False},
    "enum+array": {"type": "object", "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "array", "items": {"type": "integer"},
                                                            "maxItems": 8}},
        "required": ["unit", "days"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "tag": {"type": "string",
                                                                                       "maxLength": 30}},
                 "required": ["id", "tag"], "additionalProperties": False},
        "score": {"type": "number"}}, "required": ["user", "score"], "additionalProperties": False},
}


def walk(constraint: Any, eos: set[int], rng: random.Random, steps: int = 200) -> list[float]:
    times = []
    out: list[int] = []
    for _ in range(steps):
        t = time.perf_counter()
        allowed = constraint(out)
        times.append(time.perf_counter() - t)
        if allowed is None:
            break
        allowed = list(allowed)
        tok = rng.choice(allowed)
        if tok in eos:
            break
        out.append(tok)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--walks", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    tok = load_tokenizer(resolve_model(default_model_path()))
    eos = [tok.eos_token_id]

    t = time.perf_counter()
    vocab = build_vocab(tok, eos)
    builtin_prep = time.perf_counter() - t
    t = time.perf_counter()
    lltok = llg.make_tokenizer(tok, eos)
    llg_prep = time.perf_counter() - t
    results: dict[str, Any] = {"tokenizer_prep_s": {"builtin": builtin_prep, "llguidance": llg_prep}, "schemas": {}}
    print(f"tokenizer preparation: builtin {builtin_prep:.2f} s, llguidance {llg_prep:.2f} s")

    for name, schema in SCHEMAS.items():
        row: dict[str, Any] = {}
        for engine in ("builtin", "llguidance"):
            compile_times, step_times = [], []
            for w in range(args.walks):
                t = time.perf_counter()
                if engine == "builtin":
                    g = Grammar()
                    c: Any = JsonConstraint(vocab, g, (("V", g.add(schema)),))
                else:
                    c = llg.GrammarConstraint(lltok, llg.compile_grammar(StructuredSpec("json", schema, "bench")))
                compile_times.append(time.perf_counter() - t)
                step_times += walk(c, set(eos), random.Random(w))
            step_times.sort()
            row[engine] = {
                "compile_ms": statistics.median(compile_times) * 1e3,
                "mask_median_us": statistics.median(step_times) * 1e6,
                "mask_p99_us": step_times[int(0.99 * (len(step_times) - 1))] * 1e6,
                "steps": len(step_times),
            }
            r = row[engine]
            print(f"{name:12s} {engine:10s} compile {r['compile_ms']:8.2f} ms  mask median {r['mask_median_us']:9.1f} us"
                  f"  p99 {r['mask_p99_us']:9.1f} us  ({r['steps']} steps)")
        results["schemas"][name] = row
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
