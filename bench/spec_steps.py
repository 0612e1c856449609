#!/usr/bin/env python3
"""Where a c=1 run's time goes with and without ``llma``: the engine's steps timed in process, by row count.

Loads ``bench/configs/peers.json`` (eager decode steps: ``compile`` off) in this process, with or without the
``llma`` plugin, runs ``bench/varied_load.py``'s prompts one at a time (greedy, 128 tokens) and times every call
of the backend's ``execute``: prompt steps apart, decode steps by their row count (1 + the drafts verified).
Prints the engine's wall time, the time inside ``execute`` and outside it, and the median step time per row count:
the cost of a verification row as the engine pays it (``bench/verify_step.py`` measures the same on the model
alone).

    python bench/spec_steps.py off
    python bench/spec_steps.py llma
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


def eager_peers_host(llma: bool, **schedule: Any) -> Any:
    """``bench/configs/peers.json`` loaded in this process with eager decode steps (``compile`` off), with the
    ``llma`` plugin when asked, and ``schedule`` over its ScheduleConfig."""
    from mindie_host.testing import loaded_host

    cfg = json.loads((ROOT / "bench" / "configs" / "peers.json").read_text())
    model = cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    model["compile"] = False
    if llma:
        model["plugin_params"] = json.dumps({"plugin_type": "prefix_cache,splitfuse,llma"})
    cfg["BackendConfig"]["ScheduleConfig"].update(schedule)
    return loaded_host(cfg)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["off", "llma"])
    ap.add_argument("-n", type=int, default=8, help="prompts")
    ap.add_argument("--seed", type=int, default=0, help="varied_load.py's seed")
    args = ap.parse_args()

    from varied_load import make_prompts

    from mindie_host.api import EngineRequest, SamplingParams

    host = eager_peers_host(args.mode == "llma")
    execute = host.backend.execute
    steps: list[tuple[int, bool, float]] = []  # (rows, has a prompt row, seconds)

    def timed(inp: Any, *a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        out = execute(inp, *a, **kw)
        steps.append((len(inp.input_ids), any(q > 1 for q in inp.query_lens), time.perf_counter() - t))
        return out

    host.backend.execute = timed
    wall = 0.0
    for i, prompt in enumerate(make_prompts(args.n, args.seed)):
        ids = host.tokenize(host.apply_chat_template([{"role": "user", "content": prompt}]), add_special_tokens=False)
        t = time.perf_counter()
        host.llm.add_request(EngineRequest(f"r{i}", ids, SamplingParams(max_tokens=128, temperature=0)))
        while host.llm.has_work():
            host.llm.step()
        wall += time.perf_counter() - t
    host.shutdown()
    inside = sum(dt for *_, dt in steps)
    prompt_s = sum(dt for _, has_prompt, dt in steps if has_prompt)
    print(f"{args.mode}: wall {wall:.2f} s, in execute {inside:.2f} s (prompt steps {prompt_s:.2f} s), "
          f"outside {wall - inside:.2f} s, {len(steps)} steps")
    by_rows: dict[int, list[float]] = defaultdict(list)
    for rows, has_prompt, dt in steps:
        if not has_prompt:
            by_rows[rows].append(dt)
    plain = sorted(by_rows.get(1, [0.0]))[len(by_rows.get(1, [0.0])) // 2]
    for rows in sorted(by_rows):
        v = sorted(by_rows[rows])
        med = v[len(v) // 2]
        print(f"  {rows} rows: {len(v)} steps, median {med * 1000:.1f} ms"
              + (f" ({med / plain:.2f}x a one-row step)" if plain else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
