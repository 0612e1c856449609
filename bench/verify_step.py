"""What a speculative-decoding verification row costs at c=1, and where that cost goes (issue 38, item 6).

Loads the default model through :class:`~mindie_host.host.Host` (``quantization: auto``, the default
config otherwise), fills one sequence with ``--context`` tokens of KV (a real prompt, so the cache holds real
keys), then times ``backend.execute`` on that sequence's verification step with ``m`` drafts: ``m + 1``
one-token decode rows at consecutive positions over the same block table, exactly as
``mindie_host/engine/step_input.py`` builds them (``m = 0`` is a plain decode step). The row counts are
alternated, ``--repeat`` rounds, each round in a new random order, and the median of each is reported with its
ratio to the plain step and the marginal cost of a draft row as a fraction of a plain step.

``--parts`` also splits the step into the decode attention calls, the attention block's products (Q/K/V and
O), the MLP (its two products and the activation), the LM head and the rest (embedding, norms, rotary, KV
writes, metadata, Python), by timing those calls of the backend's platform and model (wrapped for the
parts rounds only, in their own alternated rounds), and times the engine's verification of the rows
(:meth:`~mindie_host.engine.speculation.Speculator.verify`, greedy) against sampling the one row of a plain
step. ``--isolated`` times each piece alone at the same shapes (layer 0's weights and cache), short calls
alternated finely, which a busy machine disturbs less than whole steps. The machine is shared: read the ratios, not the milliseconds (``--threads 1`` when others hold the cores).

    python bench/verify_step.py                          # context 600, m = 1, 2, 4, 8
    python bench/verify_step.py --parts --repeat 40      # and the split of each row count
    python bench/verify_step.py --compare OLD.so         # this build's kernels against another build's, alternated
    python bench/verify_step.py --isolated --drafts 1,2,3,4,6,8 --threads 1   # each piece alone, by row count

``--compare`` takes a kernel library of another build (``$TORCH_EXTENSIONS_DIR/.../kernels/*.so``, e.g. built
before a change: copy it aside first) and alternates it with this build's in the same rounds and process.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mindie_host.api import ModelInput
from mindie_host.backends import cpu_attention, cpu_extensions
from mindie_host.testing import loaded_host

BLOCK = 16


def prompt_input(context: int, table: list[int]) -> ModelInput:
    """The ``context``-token prompt of the timed sequence (varied token ids), as one prefill."""
    ids = [(37 * t + 101) % 40000 + 10 for t in range(context)]
    return ModelInput(input_ids=ids, positions=list(range(context)), query_lens=[context], context_lens=[context],
                      block_tables=[table], logits_indices=[context - 1], row_variants=[-1], prompt_lens=[context])


def verification_input(context: int, drafts: int, table: list[int]) -> ModelInput:
    """The sequence's last token and ``drafts`` drafts as one-token decode rows at positions ``context ..``."""
    rows = drafts + 1
    return ModelInput(input_ids=[(11 * j + 17) % 40000 + 10 for j in range(rows)],
                      positions=[context + j for j in range(rows)], query_lens=[1] * rows,
                      context_lens=[context + j + 1 for j in range(rows)], block_tables=[table] * rows,
                      logits_indices=list(range(rows)), row_variants=[-1] * rows, prompt_lens=[context] * rows)


class Parts:
    """Accumulated seconds of the wrapped calls, by part (a call inside another wrapped call counts to the outer)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.depth = 0

    def wrap(self, obj: Any, name: str, part: str) -> None:
        """Time ``obj.name`` (a method) into ``part`` through an instance attribute."""
        inner: Callable[..., Any] = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return inner(*args, **kwargs)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t0
                self.depth -= 1

        setattr(obj, name, timed)

    @staticmethod
    def unwrap(obj: Any, name: str) -> None:
        """Drop the wrapper :meth:`wrap` set on ``obj`` (the class's method serves again)."""
        delattr(obj, name)


def engine_verify_seconds(host: Any, logits: torch.Tensor, drafts: int, rounds: int) -> float:
    """Median seconds of the engine's greedy verification of ``drafts + 1`` rows (all drafts accepted: every row
    walked), or of sampling one row for a plain step (``drafts == 0``)."""
    from mindie_host.engine.request import EngineRequest, SamplingParams
    from mindie_host.engine.sequence import Sequence
    from mindie_host.engine.speculation import Drafts

    llm = host.llm
    req = EngineRequest("verify-bench", list(range(10, 600)), SamplingParams(temperature=0.0, max_tokens=64))
    seq = Sequence(1, req, 64)
    rows = logits[: drafts + 1]
    tokens = [int(t) for t in rows[:drafts].argmax(-1)]  # drafts the rows accept
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        if drafts:
            llm.speculator.verify(seq, rows, Drafts(tokens))
        else:
            llm._sample_rows(rows, [seq], [None])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def isolated(host: Any, context: int, table: list[int], rows: list[int], repeat: int, sides: dict[str, Any],
             shuffle: random.Random) -> dict[str, Any]:
    """Median seconds of each piece of a layer (the decode attention over the sequence's cached context, the Q/K/V
    and O products, the gated MLP) and of the LM head, alone at ``rows`` rows, with the model's own weights and
    layer 0's cache, alternated over ``sides`` (kernel builds) in a new random order each round; every side must
    give the same bits."""
    backend = host.backend
    model = backend.model
    plat, layer = model.platform, model.layers[0]
    attn, mlp = layer.attn, layer.mlp
    k_cache, v_cache = backend.kv_caches[0]
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context + max(rows))])
    gen = torch.Generator().manual_seed(0)
    hidden = model.final_norm.shape[0]
    inputs = {m: torch.randn(m, hidden, generator=gen) for m in rows}
    queries = {m: torch.randn(m, attn.num_heads, attn.head_dim, generator=gen) for m in rows}
    pieces: dict[str, Callable[[int], torch.Tensor | None]] = {
        "attention": lambda m: cpu_attention.decode_attention(
            queries[m], k_cache, v_cache, slots[None].expand(m, -1).contiguous(),
            torch.arange(context + 1, context + 1 + m), attn.scale),
        "qkv": lambda m: plat.linear(inputs[m], attn.qkv),
        "o": lambda m: plat.linear(inputs[m], attn.o_proj),
        "mlp": lambda m: plat.gated_mlp(inputs[m], mlp.gate_up, mlp.down),
        "lm_head": lambda m: plat.linear(inputs[m], model.lm_head_linear),
    }
    runs = [(side, piece, m) for side in sides for piece in pieces for m in rows]
    times: dict[tuple[str, str, int], list[float]] = {run: [] for run in runs}
    first: dict[tuple[str, int], torch.Tensor | None] = {}
    with torch.inference_mode():
        for _ in range(repeat):
            for side, piece, m in shuffle.sample(runs, len(runs)):
                with cpu_extensions.using(sides[side], cpu_extensions.turned_off()):
                    t0 = time.perf_counter()
                    out = pieces[piece](m)
                    times[side, piece, m].append(time.perf_counter() - t0)
                if (piece, m) not in first:
                    first[piece, m] = out
                elif out is not None and not torch.equal(out, first[piece, m]):  # type: ignore[arg-type]
                    raise AssertionError(f"{side} gives other bits for {piece} at {m} rows")
    result: dict[str, Any] = {}
    print(f"\npieces alone, median us of {repeat} alternated rounds (x: against the same side's one row)")
    for side in sides:
        print(side)
        result[side] = {}
        for piece in pieces:
            med = {m: statistics.median(times[side, piece, m]) for m in rows}
            result[side][piece] = {m: round(v * 1e6, 1) for m, v in med.items()}
            print(f"  {piece:10}" + "".join(f"  {m}: {med[m] * 1e6:8.1f} ({med[m] / med[rows[0]]:4.2f}x)" for m in rows))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--drafts", default="1,2,4,8", help="draft counts m to time beside the plain step (m = 0)")
    ap.add_argument("--repeat", type=int, default=30, help="alternated rounds")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--parts", action="store_true", help="also split each step into its parts (own rounds)")
    ap.add_argument("--isolated", action="store_true",
                    help="also time each piece alone at 1 + m rows (attention, products, LM head), alternated")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch's (and the kernels') threads; 0: torch's default. On a busy machine 1 keeps a step from "
                         "waiting for a second core the others hold")
    ap.add_argument("--compare", help="another build's kernel library (a .so from TORCH_EXTENSIONS_DIR's kernels "
                                      "folder, e.g. before a change) to alternate with this one in the same rounds")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from decode_step import step_config  # type: ignore[import-not-found]

    counts = [0] + [int(m) for m in args.drafts.split(",")]
    per_seq = -(-(args.context + max(counts) + 2) // BLOCK)
    host = loaded_host(step_config(None, max(counts) + 1, per_seq, BLOCK, quantization=args.quantization))
    backend = host.backend
    table = list(range(1, 1 + per_seq))
    backend.execute(prompt_input(args.context, table))
    steps = {m: verification_input(args.context, m, table) for m in counts}
    for m in counts:  # warm-up
        backend.execute(steps[m])
        backend.execute(steps[m])

    sides = {"this build": cpu_extensions.kernels()}
    if args.compare:
        sides[Path(args.compare).name] = cpu_extensions.load_library(Path(args.compare))
    runs = [(side, m) for side in sides for m in counts]
    times: dict[tuple[str, int], list[float]] = {run: [] for run in runs}
    shuffle = random.Random(0)
    for _ in range(args.repeat):
        for side, m in shuffle.sample(runs, len(runs)):  # a new order each round: no step always follows another
            with cpu_extensions.using(sides[side], cpu_extensions.turned_off()):
                t0 = time.perf_counter()
                backend.execute(steps[m])
                times[side, m].append(time.perf_counter() - t0)
    result: dict[str, Any] = {"context": args.context, "quantization": args.quantization, "repeat": args.repeat,
                              "threads": torch.get_num_threads(), "sides": {}}
    for side in sides:
        med = {m: statistics.median(times[side, m]) for m in counts}
        base = med[0]
        steps_out: dict[int, Any] = {}
        print(f"{side}: context {args.context}, median of {args.repeat} alternated rounds; plain step "
              f"{base * 1e3:.2f} ms")
        for m in counts:
            extra = (med[m] - base) / m / base if m else 0.0
            steps_out[m] = {"ms": round(med[m] * 1e3, 3), "ratio": round(med[m] / base, 3),
                            "per_draft_row": round(extra, 4)}
            print(f"  m={m}: {med[m] * 1e3:7.2f} ms  {med[m] / base:5.2f}x plain  per draft row {extra * 100:5.1f}% "
                  "of plain")
        result["sides"][side] = {"plain_ms": round(base * 1e3, 3), "steps": steps_out}
    if args.compare:
        other = list(sides)[1]
        print(f"this build / {other}, each step's median:")
        ratios = {m: statistics.median(times["this build", m]) / statistics.median(times[other, m]) for m in counts}
        result["this_over_compare"] = {m: round(v, 3) for m, v in ratios.items()}
        print("  " + "  ".join(f"m={m}: {v:.3f}" for m, v in ratios.items()))

    if args.isolated:
        result["isolated_us"] = isolated(host, args.context, table, [1 + m for m in counts], args.repeat, sides,
                                         shuffle)
    if args.parts:
        model, plat = backend.model, backend.model.platform
        wraps = [(plat, "paged_attention", "attention"), (plat, "gated_mlp", "mlp"),
                 (plat, "linear", "qkv_o"), (model, "logits", "lm_head")]
        totals: dict[int, list[float]] = {m: [] for m in counts}
        split: dict[int, dict[str, list[float]]] = {m: defaultdict(list) for m in counts}
        for _ in range(args.repeat):
            for m in shuffle.sample(counts, len(counts)):
                p = Parts()
                for obj, name, part in wraps:
                    p.wrap(obj, name, part)
                t0 = time.perf_counter()
                backend.execute(steps[m])
                total = time.perf_counter() - t0
                for obj, name, _ in wraps:
                    p.unwrap(obj, name)
                totals[m].append(total)
                for part in ("attention", "qkv_o", "mlp", "lm_head"):
                    split[m][part].append(p.seconds[part])
                split[m]["rest"].append(total - sum(p.seconds.values()))
        logits = backend.execute(steps[max(counts)])
        names = ["attention", "qkv_o", "mlp", "lm_head", "rest", "engine_verify"]
        meds: dict[int, dict[str, float]] = {}
        for m in counts:
            meds[m] = {part: statistics.median(v) for part, v in split[m].items()}
            meds[m]["engine_verify"] = engine_verify_seconds(host, logits, m, max(20, args.repeat))
        print("\nparts, median ms of each (wrapped rounds; engine_verify: the engine's verify/sample of the rows)")
        print("m    " + "".join(f"{n:>14}" for n in names))
        for m in counts:
            print(f"{m:<5}" + "".join(f"{meds[m][n] * 1e3:14.3f}" for n in names))
        print("\nmarginal cost of one draft row, by part, as % of the plain step's total (wrapped) time")
        plain_total = statistics.median(totals[0]) + meds[0]["engine_verify"]
        print("m    " + "".join(f"{n:>14}" for n in names) + f"{'sum':>10}")
        result["parts_ms"] = {m: {n: round(meds[m][n] * 1e3, 4) for n in names} for m in counts}
        result["per_draft_row_pct"] = {}
        for m in counts[1:]:
            row = {n: (meds[m][n] - meds[0][n]) / m / plain_total * 100 for n in names}
            result["per_draft_row_pct"][m] = {n: round(v, 2) for n, v in row.items()}
            print(f"{m:<5}" + "".join(f"{row[n]:14.2f}" for n in names) + f"{sum(row.values()):10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))
    host.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
