"""Where a varied load's time goes, step by step: the engine in this process, driven as bench/varied_load.py drives a server.

``--conc`` requests are kept in flight (a new one joins as one finishes) out of ``4 x --conc`` prompts of
:func:`varied_load.make_prompts` (the same distinct summarisation prompts, chat-templated, greedy, up to
``--max-tokens`` tokens each), with ``bench/configs/peers.json`` (``--config``) as the server would load it, the
decode step compiled first when the config says ``compile: true``. Every forward pass (``backend.execute``) is timed
and sorted by what it held: decode rows only (a full batch of at least 16, or fewer) or prompt rows beside decode
rows. For each class: steps, seconds, rows and rows/s, so a change to one kind of step shows where it lands on
the load without a server, a client or another process sharing the cores.

    python bench/step_mix.py --conc 16
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 MINDIE_HOST_CPU_ISA=avx2 \\
        python bench/step_mix.py --conc 64 --out bench/results/step_mix_avx2_c64.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from varied_load import make_prompts  # noqa: E402

from mindie_host.api import EngineRequest, SamplingParams  # noqa: E402
from mindie_host.testing import loaded_host  # noqa: E402


def step_class(decode_rows: int, prompt_rows: int) -> str:
    """The class a forward pass falls in, by the rows it held."""
    kind = "decode only" if prompt_rows == 0 else "prompt + decode"
    return f"{kind}, {'16 or more' if decode_rows >= 16 else 'fewer than 16'} decode rows"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conc", type=int, default=16, help="requests in flight")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="the prompts' seed (bench/varied_load.py's)")
    ap.add_argument("--config", default=str(ROOT / "bench" / "configs" / "peers.json"))
    ap.add_argument("--out", help="write the summary (and every step's rows and seconds) here as JSON")
    args = ap.parse_args(argv)
    host = loaded_host(json.loads(Path(args.config).read_text()))
    llm, backend = host.llm, host.llm.backend
    if not backend.wait_compiled(1800):
        raise SystemExit("the decode step's compile did not finish in 30 minutes")
    steps: list[tuple[int, int, float]] = []
    execute = backend.execute

    def timed(batch: Any) -> Any:
        start = time.perf_counter()
        out = execute(batch)
        seconds = time.perf_counter() - start
        prompt_lens = batch.prompt_lens or [0] * batch.num_seqs
        decode = sum(1 for q, p, c in zip(batch.query_lens, prompt_lens, batch.context_lens) if q == 1 and c > p)
        steps.append((decode, sum(batch.query_lens) - decode, seconds))
        return out

    backend.execute = timed
    prompts = [host.tokenizer.encode(host.apply_chat_template([{"role": "user", "content": p}]),
                                     add_special_tokens=False)
               for p in make_prompts(4 * args.conc, seed=args.seed)]
    waiting, live, generated = list(range(len(prompts))), set(), 0
    start = time.perf_counter()
    while waiting or live:
        while waiting and len(live) < args.conc:
            i = waiting.pop(0)
            live.add(f"r{i}")
            llm.add_request(EngineRequest(f"r{i}", prompts[i], SamplingParams(max_tokens=args.max_tokens)))
        for out in llm.step():
            if out.finished:
                live.discard(out.request_id)
                generated += len(out.token_ids)
    wall = time.perf_counter() - start
    host.shutdown()
    classes: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0, 0])
    for decode, prompt, seconds in steps:
        c = classes[step_class(decode, prompt)]
        c[0] += 1
        c[1] += seconds
        c[2] += decode
        c[3] += prompt
    forward = sum(s[2] for s in steps)
    print(f"conc {args.conc}: {wall:.1f} s, {generated} tokens generated ({generated / wall:.1f} tok/s), "
          f"{sum(s[1] for s in steps)} prompt rows, {len(steps)} forward passes, {forward:.1f} s in them")
    summary = {}
    for name, (n, seconds, decode, prompt) in sorted(classes.items()):
        summary[name] = {"steps": n, "seconds": round(seconds, 2), "mean_ms": round(1000 * seconds / n, 1),
                         "decode_rows": decode, "prompt_rows": prompt,
                         "rows_per_s": round((decode + prompt) / seconds, 1)}
        print(f"  {name:42s} {n:5d} steps {seconds:7.1f} s (mean {1000 * seconds / n:6.1f} ms), "
              f"{decode:6d} decode + {prompt:6d} prompt rows, {(decode + prompt) / seconds:6.1f} rows/s")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "conc": args.conc, "wall_s": round(wall, 2), "generated": generated, "classes": summary,
            "steps": [[d, p, round(s, 5)] for d, p, s in steps]}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
