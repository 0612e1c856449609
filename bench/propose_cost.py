#!/usr/bin/env python3
"""What asking for drafts costs a step that gets none: ``Speculator.propose`` timed with 64 decoding sequences.

Above ``llma``'s ``maxBatchSize`` the plugin answers at once, so a large batch pays only the engine's side: one
``DraftRequest`` per decoding sequence and the hook call. Loads ``bench/configs/peers.json`` (eager) with ``llma``
and ``maxBatchSize`` 64 in process, decodes 64 requests of 40 prompt tokens and 48 output tokens together, and
prints the time inside ``propose`` against the run's wall time.

    python bench/propose_cost.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    from spec_steps import eager_peers_host

    from mindie_host.api import EngineRequest, SamplingParams

    host = eager_peers_host(True, maxBatchSize=64)
    llm = host.llm
    speculator = llm.speculator
    propose = speculator.propose
    calls: list[tuple[int, float]] = []  # (sequences in the step, seconds in propose)

    def timed(plan: Any) -> Any:
        t = time.perf_counter()
        out = propose(plan)
        calls.append((len(plan.scheduled), time.perf_counter() - t))
        return out

    speculator.propose = timed
    for i in range(64):
        llm.add_request(EngineRequest(f"r{i}", list(range(100 + i, 140 + i)),
                                      SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)))
    t0 = time.perf_counter()
    steps = 0
    while llm.has_work():
        llm.step()
        steps += 1
    wall = time.perf_counter() - t0
    host.shutdown()
    full = sorted(dt for n, dt in calls if n >= 60)
    inside = sum(dt for _, dt in calls)
    print(f"{steps} steps in {wall:.2f} s; propose {inside * 1000:.1f} ms in all ({inside / wall:.2%}), "
          f"median {full[len(full) // 2] * 1e6:.0f} us at 60+ sequences" if full else "no step of 60+ sequences")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
