#!/usr/bin/env python3
"""Greedy output with a draft-token proposer on is token-identical to output with it off (issue 38, lossless).

Starts each system of ``bench/spec_bench.py`` in turn on the default model and sends the same ``--prompts``
(default 200) varied prompts (``bench/varied_load.py``) as greedy completions of ``--max-tokens`` tokens
(``ignore_eos``), at concurrency 1 and 16; every output's tokens are compared with the same prompt's
output from the reference system at concurrency 1 (``off`` for ``llma`` and ``draft``; ``fp32`` for
``self-spec``). Systems: ``off``, ``llma`` and ``fp32``, ``self-spec`` as in spec_bench.py, and ``draft``:
``off`` plus ``draft_model`` with the default model as its own draft (the batch-invariant target of every
default config, where token identity is guaranteed by the numerics; at ``quantization: none`` the float32
products are not row-invariant in the last bits, so rare near-ties may differ with or without drafts).

    python bench/spec_identity.py --systems off,llma,draft --prompts 200
    python bench/spec_identity.py --systems fp32,self-spec
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spec_bench  # noqa: E402
from varied_load import make_prompts  # noqa: E402

REFERENCE = {"llma": "off", "draft": "off", "self-spec": "fp32"}


def config(system: str) -> dict[str, Any]:
    if system != "draft":
        return spec_bench.mindie_config(system)
    cfg = spec_bench.mindie_config("off")
    model = cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    plugins = json.loads(model["plugin_params"])["plugin_type"] + ",draft_model"
    model["plugin_params"] = json.dumps({"plugin_type": plugins})
    cfg["Plugins"] = {"draft_model": {"modelWeightPath": "", "quantization": "auto"}}
    return cfg


def complete(url: str, prompt: str, max_tokens: int) -> list[str]:
    r = httpx.post(url + "/v1/completions", timeout=600, json={
        "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["logprobs"]["tokens"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="off,llma,draft,fp32,self-spec")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--conc", default="1,16")
    ap.add_argument("--no-compile", action="store_true",
                    help="eager decode steps (the default config's batch invariance: c=16 must equal c=1)")
    ap.add_argument("--out", help="a JSON file for the report and every output")
    a = ap.parse_args()
    spec_bench.COMPILE = not a.no_compile
    prompts = make_prompts(a.prompts, seed=7)
    outputs: dict[str, dict[int, list[list[str]]]] = {}
    for system in a.systems.split(","):
        server = spec_bench.start_mindie(system, None, config(system))
        url = server.url
        try:
            for c in (int(x) for x in a.conc.split(",")):
                with ThreadPoolExecutor(c) as pool:
                    outputs.setdefault(system, {})[c] = list(pool.map(
                        lambda p, u=url: complete(u, p, a.max_tokens), prompts))
                counters = spec_bench.spec_counters(server)
                print(system, c, "done", counters, file=sys.stderr, flush=True)
        finally:
            server.stop()
    report: dict[str, str] = {}
    for system, by_conc in outputs.items():
        ref_system = REFERENCE.get(system, system)
        for c, outs in by_conc.items():
            for ref_c in sorted({1, c}):  # against the reference alone, and at the same concurrency
                ref = outputs.get(ref_system, {}).get(ref_c)
                if ref is None or (ref_system == system and ref_c == c):
                    continue
                differ = [i for i, (o, r) in enumerate(zip(outs, ref)) if o != r]
                report[f"{system} c={c} vs {ref_system} c={ref_c}"] = (
                    f"{len(outs) - len(differ)}/{len(outs)} identical" + (f" (prompts {differ} differ)" if differ else ""))
    if a.out:
        Path(a.out).write_text(json.dumps({"report": report, "outputs": outputs}, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
