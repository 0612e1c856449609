#!/usr/bin/env python3
"""PD disaggregation against mixed instances: 1 prefill + 1 decode server against 2 mixed servers.

Both topologies are real processes (``mindie_host.ms.cluster.Cluster``): a controller, a coordinator
and two servers on the default model (SmolLM2-135M-Instruct). The PD pair runs ``inferMode: "dmi"``
with the controller in ``pd_separate`` (``default_p_rate`` 1, ``default_d_rate`` 1) and the
coordinator's ``digs_scheduler`` / ``load_balance``; the mixed pair runs ``inferMode: "standard"``
behind the coordinator's ``load_balance``. Every server gets ``--threads`` compute threads
(``OMP_NUM_THREADS``, default 1) so the two engines do not fight over this machine's cores.

The load mixes two kinds of streamed chat requests, each with its own prompt (text from CPython's
``pydoc_data``, as ``bench/varied_load.py`` draws it), sent closed-loop with ``-c`` in flight:

* **long-in**: a passage of ``--long-words`` words (about 1.3 tokens a word), ``--long-out`` output tokens;
* **long-out**: a passage of ``--short-words`` words, ``--short-out`` output tokens.

Half the requests are of each kind, in a seeded random order; outputs run to their length
(``ignore_eos``). It reports, per topology and per kind, TTFT and TPOT p50 and p99 (TPOT: the
time from the first to the last streamed token over the tokens between), the output tokens per
second of the whole run, and errors; one JSON object per topology on stdout.
The point of PD is that long prefills on P do not stretch the decode steps of the long-out
requests on D: compare their TPOT p99.

Run::

    python bench/pd_bench.py -n 48 -c 8
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from mindie_host.ms.cluster import Cluster
from mindie_host.testing import server_config

MODEL = "SmolLM2-135M-Instruct"
HERE = Path(__file__).resolve().parent


def _varied_load() -> Any:
    """``bench/varied_load.py`` (prompt text and the streamed-request client), loaded by path."""
    spec = importlib.util.spec_from_file_location("varied_load", HERE / "varied_load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VL = _varied_load()


def make_load(n: int, long_words: int, short_words: int, long_out: int, short_out: int,
              seed: int = 0) -> list[tuple[str, str, int]]:
    """``n`` requests (kind, prompt, max_tokens), half of each kind in a seeded random order, every prompt distinct.

    The order is shuffled so that no balancing rule can send one kind to one server by the rhythm of arrivals.
    """
    words = VL.corpus_words()
    kinds = [i % 2 == 0 for i in range(n)]
    random.Random(seed).shuffle(kinds)
    load = []
    stride = (len(words) - long_words) // max(n, 1)
    for i, long_in in enumerate(kinds):
        start = i * stride
        if long_in:
            load.append(("long-in", VL.INSTRUCTION + " ".join(words[start:start + long_words]), long_out))
        else:
            load.append(("long-out", VL.INSTRUCTION + " ".join(words[start:start + short_words]), short_out))
    return load


async def drive(url: str, load: list[tuple[str, str, int]], c: int) -> dict[str, Any]:
    """Send the load closed-loop, ``c`` in flight; timings per kind."""
    kinds = {kind for kind, _, _ in load}
    res = {kind: {"ttft": [], "tpot": [], "tokens": 0, "errors": 0} for kind in kinds}
    sem = asyncio.Semaphore(c)
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=c + 4)) as client:
        async def task(kind: str, prompt: str, max_tokens: int) -> None:
            async with sem:
                await VL.one(client, url, MODEL, prompt, max_tokens, res[kind], {"ignore_eos": True})

        t0 = time.perf_counter()
        await asyncio.gather(*(task(*item) for item in load))
        wall = time.perf_counter() - t0

    def ms(xs: list[float], p: float) -> float | None:
        v = VL.pct(xs, p)
        return None if v is None else round(1000 * v, 1)

    out: dict[str, Any] = {"wall_s": round(wall, 2),
                           "out_tok_s": round(sum(r["tokens"] for r in res.values()) / wall, 1),
                           "errors": sum(r["errors"] for r in res.values())}
    for kind, r in sorted(res.items()):
        out[kind] = {"n": len(r["ttft"]), "ttft_p50_ms": ms(r["ttft"], 50), "ttft_p99_ms": ms(r["ttft"], 99),
                     "tpot_p50_ms": ms(r["tpot"], 50), "tpot_p99_ms": ms(r["tpot"], 99)}
    return out


def cluster_for(topology: str, workdir: Path, threads: int, max_seq: int) -> Cluster:
    """The two-server cluster of one topology ("pd" or "mixed")."""
    schedule = {"maxBatchSize": 32, "maxPrefillBatchSize": 8, "maxIterTimes": 512}
    deploy = {"maxSeqLen": max_seq, "maxInputTokenLen": max_seq - 256}
    env = {"OMP_NUM_THREADS": str(threads)}
    exceptions = {"max_retry": 3, "first_token_timeout": 600, "infer_timeout": 1800}
    if topology == "pd":
        cfg = server_config(None, schedule=schedule, deploy=deploy,
                            server={"inferMode": "dmi", "interCommTLSEnabled": False})
        return Cluster(workdir, 2, server_config=cfg, env=env,
                       coordinator={"digs_scheduler_config": {"deploy_mode": "pd_separate",
                                                              "scheduler_type": "digs_scheduler",
                                                              "algorithm_type": "load_balance"},
                                    "exception_config": exceptions},
                       controller={"deploy_mode": "pd_separate", "default_p_rate": 1, "default_d_rate": 1,
                                   "rank_table_detecting_seconds": 1, "check_role_wait_seconds": 1})
    cfg = server_config(None, schedule=schedule, deploy=deploy)
    return Cluster(workdir, 2, server_config=cfg, env=env,
                   coordinator={"digs_scheduler_config": {"algorithm_type": "load_balance"},
                                "exception_config": exceptions})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=48, help="requests per topology (half of each kind)")
    ap.add_argument("-c", type=int, default=8, help="requests in flight")
    ap.add_argument("--long-words", type=int, default=700)
    ap.add_argument("--short-words", type=int, default=30)
    ap.add_argument("--long-out", type=int, default=8)
    ap.add_argument("--short-out", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="compute threads per server")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--topologies", default="pd,mixed")
    a = ap.parse_args()
    load = make_load(a.n, a.long_words, a.short_words, a.long_out, a.short_out)
    warm = make_load(4, a.long_words, a.short_words, a.long_out, 16)
    warm = [(k, "Once more: " + p, m) for k, p, m in warm]  # distinct from the measured prompts
    for topology in a.topologies.split(","):
        workdir = Path(tempfile.mkdtemp(prefix=f"pd-bench-{topology}-"))
        with cluster_for(topology, workdir, a.threads, a.max_seq_len) as cluster:
            asyncio.run(drive(cluster.url, warm, 2))
            result = drive(cluster.url, load, a.c)
            row = {"topology": topology, "n": a.n, "c": a.c, "threads_per_server": a.threads,
                   **asyncio.run(result)}
        print(json.dumps(row), flush=True)
        print(f"{topology}: {row}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
