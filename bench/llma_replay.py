#!/usr/bin/env python3
"""How much could reference copy (``llma``) gain on a load at c=1, and which proposer rule gets closest?

Greedy decoding is deterministic and speculation never changes its tokens, so one run of the plain engine gives
every output; a proposer can then be replayed against it offline: each step it proposes from the tokens so far,
the drafts that equal the next output tokens are accepted, the target's own token follows. What varies between
rules is only how many steps a request takes and how many verification rows each step carries. The replay prices
a step with ``m`` drafts from ``--costs`` (a step's cost against a plain step, by row count, as
``bench/verify_step.py`` measures it; the default is its latest two-thread table in bench/PERF.md) and a prompt from
``--prefill`` (plain steps per prompt token: 0.45 s of prefill per 600 tokens at ~19 ms a step), and reports the
predicted tokens/s ratio to plain decoding (TTFT included, as ``bench/spec_bench.py`` counts it).

Rules replayed: the plugin's :class:`~mindie_plugin_llma.NgramIndex` with and without its copy cursor, the old
k rule (one more than accepted, at most k) and the current one (doubling after a fully accepted run), with and
without the cap of two drafts on matches of at most two tokens, several
n-gram ranges; and an **oracle**: at each step the occurrence of the longest suffix n-gram whose continuation
matches the output furthest, with exactly the accepted drafts verified (no wasted row). No n-gram proposer can
beat the oracle on these outputs at these costs: it bounds what reference copy can give on the load.

    python bench/llma_replay.py --generate              # the outputs (default model, in process), then the table
    python bench/llma_replay.py --outputs OUT.json      # replay saved outputs
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "plugins" / "llma"))

MAX_TOKENS = {"copy": 256, "varied": 128}
DEFAULT_COSTS = "1:1.10,2:1.09,4:1.24,8:1.96"  # bench/PERF.md, "Verification rows share the cache walk", avx512


def generate(path: Path, n: int, seeds: int) -> None:
    """The default config's greedy outputs (``bench/configs/peers.json`` without compile) on both loads."""
    from copy_load import make_prompts as copy_prompts
    from spec_steps import eager_peers_host
    from varied_load import make_prompts as varied_prompts

    from mindie_host.api import EngineRequest, SamplingParams
    from mindie_host.testing import run_engine

    host = eager_peers_host(False)
    out: dict[str, Any] = {}
    for load, make in (("copy", copy_prompts), ("varied", varied_prompts)):
        for seed in range(seeds):
            for i, prompt in enumerate(make(n, seed)):
                text = host.apply_chat_template([{"role": "user", "content": prompt}])
                ids = host.tokenize(text, add_special_tokens=False)
                req = EngineRequest(f"{load}{seed}_{i}", ids, SamplingParams(max_tokens=MAX_TOKENS[load], temperature=0))
                got = run_engine(host, [req])[req.request_id]
                out[req.request_id] = {"load": load, "prompt": ids, "output": list(got.token_ids)}
                print(req.request_id, len(ids), len(got.token_ids), file=sys.stderr, flush=True)
    host.shutdown()
    path.write_text(json.dumps(out))


class Costs:
    """A step's cost in plain steps by its draft count, linear between the measured points and past the last."""

    def __init__(self, spec: str) -> None:
        self.points = [(0, 1.0)] + sorted((int(m), float(c)) for m, c in (p.split(":") for p in spec.split(",")))

    def __call__(self, m: int) -> float:
        pts = self.points
        for (a, ca), (b, cb) in zip(pts, pts[1:]):
            if m <= b:
                return ca + (cb - ca) * (m - a) / (b - a)
        (a, ca), (b, cb) = pts[-2], pts[-1]
        return cb + (cb - ca) / (b - a) * (m - b)


def replay(outputs: dict[str, Any], load: str, costs: Costs, prefill: float,
           new_proposer: Callable[[], Any]) -> tuple[float, float, int]:
    """(predicted tokens/s ratio to plain decoding, acceptance rate, drafts verified) of one rule on ``load``."""
    plain = spec = 0.0
    drafted = accepted = 0
    for d in outputs.values():
        if d["load"] != load:
            continue
        prompt, out = d["prompt"], d["output"]
        pre = len(prompt) * prefill
        plain += pre + len(out) - 1
        spec += pre
        proposer = new_proposer()
        tokens = prompt + out[:1]
        pos = 1
        while pos < len(out):
            room = len(out) - pos - 1
            drafts = proposer.propose(tokens, out, pos, room) if room else []
            a = 0
            while a < len(drafts) and drafts[a] == out[pos + a]:
                a += 1
            tokens += out[pos : pos + a + 1]
            pos += a + 1
            spec += costs(len(drafts))
            drafted += len(drafts)
            accepted += a
            if drafts:
                proposer.outcome(len(drafts), a)
    return plain / spec, accepted / max(drafted, 1), drafted


class PluginRule:
    """The plugin's index and a k rule: ``double`` (the plugin's) or ``plus-one`` (before the copy cursor)."""

    def __init__(self, min_n: int, max_n: int, k_max: int, cursor: bool, rule: str, short: int = 0) -> None:
        from mindie_plugin_llma import NgramIndex

        self.index = NgramIndex(min_n, max_n, short, 2)  # matches of at most ``short`` tokens: 2 drafts
        self.k = self.k_max = k_max
        self.cursor, self.rule = cursor, rule

    def propose(self, tokens: list[int], out: list[int], pos: int, room: int) -> list[int]:
        return self.index.propose(tokens, min(self.k, room))

    def outcome(self, proposed: int, accepted: int) -> None:
        from mindie_plugin_llma import next_k

        if self.cursor:
            self.index.accepted(accepted)
        if self.rule == "double":
            self.k = next_k(self.k_max, proposed, accepted)  # the plugin's own rule
        else:
            self.k = min(self.k_max, accepted + 1)


class Oracle:
    """The best any n-gram proposer could do: the occurrence that matches the output furthest, no wasted rows."""

    def __init__(self, min_n: int, max_n: int, k_max: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)
        self.k_max = k_max

    @staticmethod
    def best_occurrence(tokens: list[int], out: list[int], pos: int, room: int, n: int) -> tuple[int, int]:
        """(how many of the next ``room`` output tokens follow it, where it ends) of the earliest occurrence of the
        suffix n-gram whose continuation matches the output furthest; (-1, -1) when the n-gram never occurred."""
        end = len(tokens) - 1
        suffix = tokens[end + 1 - n :]
        best, best_end = -1, -1
        for e in range(n - 1, end):
            if tokens[e + 1 - n : e + 1] == suffix:
                a = 0
                while a < room and e + 1 + a <= end and tokens[e + 1 + a] == out[pos + a]:
                    a += 1
                if a > best:
                    best, best_end = a, e
        return best, best_end

    def propose(self, tokens: list[int], out: list[int], pos: int, room: int) -> list[int]:
        room = min(room, self.k_max)
        for n in self.sizes:
            best, _ = self.best_occurrence(tokens, out, pos, room, n)
            if best > 0:
                return out[pos : pos + best]
        return []

    def outcome(self, proposed: int, accepted: int) -> None:
        pass


class BestOccurrence(Oracle):
    """Half the oracle: the occurrence that matches the output furthest, drafts as many as the plugin's k rule says
    (rows past the accepted ones are wasted, as the plugin wastes them)."""

    def __init__(self, min_n: int, max_n: int, k_max: int) -> None:
        super().__init__(min_n, max_n, k_max)
        self.k = k_max

    def propose(self, tokens: list[int], out: list[int], pos: int, room: int) -> list[int]:
        room = min(room, self.k)
        for n in self.sizes:
            _, e = self.best_occurrence(tokens, out, pos, room, n)
            if e >= 0:
                return tokens[e + 1 : min(e + 1 + room, len(tokens))]
        return []

    def outcome(self, proposed: int, accepted: int) -> None:
        from mindie_plugin_llma import next_k

        self.k = next_k(self.k_max, proposed, accepted)


class NoWastedRows(PluginRule):
    """The other half: the plugin's occurrence and k, but only the drafts that will be accepted are verified."""

    def propose(self, tokens: list[int], out: list[int], pos: int, room: int) -> list[int]:
        drafts = super().propose(tokens, out, pos, room)
        self.proposed = len(drafts)
        a = 0
        while a < len(drafts) and drafts[a] == out[pos + a]:
            a += 1
        return drafts[:a]

    def outcome(self, proposed: int, accepted: int) -> None:
        super().outcome(self.proposed, accepted)  # the plugin's state moves as if it had verified them all


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", default="/tmp/llma_replay_outputs.json", help="the greedy outputs (JSON)")
    ap.add_argument("--generate", action="store_true", help="make --outputs first (default model, in process)")
    ap.add_argument("-n", type=int, default=8, help="prompts per load and seed")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0.. of each load (spec_bench.py's runs use 0, 1, 2)")
    ap.add_argument("--costs", default=DEFAULT_COSTS, help="drafts:step cost against a plain step, comma-separated")
    ap.add_argument("--prefill", type=float, default=23 / 600, help="plain steps per prompt token")
    args = ap.parse_args()
    path = Path(args.outputs)
    if args.generate:
        generate(path, args.n, args.seeds)
    outputs = json.loads(path.read_text())
    costs = Costs(args.costs)
    rules: list[tuple[str, Callable[[], Any]]] = [
        ("before: latest occurrence, n-grams 3..2, k=4, +1 rule", lambda: PluginRule(2, 3, 4, False, "plus-one")),
        ("latest occurrence, n-grams 3..1, k=8, doubling", lambda: PluginRule(1, 3, 8, False, "double")),
        ("cursor, n-grams 3..2, k=8, doubling", lambda: PluginRule(2, 3, 8, True, "double")),
        ("cursor, n-grams 3..1, k=8, doubling", lambda: PluginRule(1, 3, 8, True, "double")),
        ("**plugin now: cursor, n-grams 3..1, k=8, doubling, matches of <= 2 tokens: 2 drafts**",
         lambda: PluginRule(1, 3, 8, True, "double", short=2)),
        ("cursor, n-grams 3..1, k=16, doubling, matches of <= 2 tokens: 2 drafts",
         lambda: PluginRule(1, 3, 16, True, "double", short=2)),
        ("cursor, n-grams 3..1, k=16, doubling", lambda: PluginRule(1, 3, 16, True, "double")),
        ("cursor, n-grams 5..1, k=8, doubling", lambda: PluginRule(1, 5, 8, True, "double")),
        ("half oracle: the best occurrence, the plugin's k rule (k=8)", lambda: BestOccurrence(1, 3, 8)),
        ("half oracle: the plugin's occurrence and k, no wasted row", lambda: NoWastedRows(1, 3, 8, True, "double", 2)),
        ("oracle, n-grams 3..2, k<=16", lambda: Oracle(2, 3, 16)),
        ("oracle, n-grams 3..1, k<=16", lambda: Oracle(1, 3, 16)),
        ("oracle, n-grams 3..1, k<=64", lambda: Oracle(1, 3, 64)),
    ]
    print("| rule | load | predicted x off | acceptance | drafts |\n| --- | --- | --- | --- | --- |")
    for load in ("copy", "varied"):
        for name, make in rules:
            ratio, rate, drafted = replay(outputs, load, costs, args.prefill, make)
            print(f"| {name} | {load} | {ratio:.2f} | {rate:.2f} | {drafted} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
