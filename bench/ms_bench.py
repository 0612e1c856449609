"""MindIE MS benchmarks: the coordinator's overhead, and cache_affinity against round_robin.

``overhead``: one server (a small random Llama with the default tokenizer, so the server's own time is
short and the coordinator's share shows) behind a coordinator, all real processes (``Cluster``).

* latency: ``--requests`` sequential ``POST /generate`` with ``max_new_tokens`` 1 over kept-alive
  connections, alternating direct and through the coordinator; reports p50 of each and the p50 of the
  paired differences (the added latency per request);
* throughput: ``-c`` clients in flight (default 64) sending ``--tput-requests`` requests of
  ``--tput-tokens`` tokens (``ignore_eos``), direct and through the coordinator in turn, ``--rounds``
  times; reports every run's requests/s and the ratio of the medians.

``affinity``: two servers on the default model (``--dtype``) with the ``prefix_cache`` plugin, a multi-turn chat load
(``--conversations`` in parallel, ``--turns`` each, a distinct ~``--system-tokens`` system prompt per
conversation, ``--max-tokens`` per answer), once through a coordinator with ``cache_affinity`` and once
with ``round_robin`` (each run uses its own conversations, so neither finds the other's prefixes
cached). TTFT is measured on the streamed turns after the first; reports p50 and p99.

Run::

    python bench/ms_bench.py overhead --requests 300 -c 64 --tput-requests 640
    python bench/ms_bench.py affinity --conversations 6 --turns 3 --system-tokens 400 --max-tokens 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from mindie_host.file_modes import write_file
from mindie_host.ms.cluster import Cluster
from mindie_host.ms.coordinator.config import default_coordinator_dict
from mindie_host.ms.coordinator.instances import instance_id
from mindie_host.testing import free_port, make_tiny_llama, server_config


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


# -- overhead ----------------------------------------------------------------------------------------------------
def overhead(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="ms-bench-"))
    model = make_tiny_llama(work / "tiny")
    cfg = server_config(model, schedule={"maxBatchSize": 64, "maxPrefillBatchSize": 64, "maxPrefillTokens": 8192},
                        server={"maxLinkNum": 1000})
    coord = {"digs_scheduler_config": {"algorithm_type": "round_robin"}, "log_info": {"log_level": "WARNING"}}
    with Cluster(work / "cluster", 1, server_config=cfg, coordinator=coord) as cluster:
        direct, via = cluster.server_url(0), cluster.url
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 1}}
        lat: dict[str, list[float]] = {"direct": [], "coordinator": []}
        with httpx.Client(timeout=60) as client:
            for _ in range(20):  # warm-up
                client.post(direct + "/generate", json=body)
                client.post(via + "/generate", json=body)
            for _ in range(args.requests):
                for name, url in (("direct", direct), ("coordinator", via)):
                    t0 = time.perf_counter()
                    r = client.post(url + "/generate", json=body)
                    lat[name].append(time.perf_counter() - t0)
                    assert r.status_code == 200, r.text
        diffs = [v - d for d, v in zip(lat["direct"], lat["coordinator"])]
        print(f"latency p50 direct {1e3 * statistics.median(lat['direct']):.2f} ms, coordinator "
              f"{1e3 * statistics.median(lat['coordinator']):.2f} ms", file=sys.stderr, flush=True)
        runs: dict[str, list[float]] = {"direct": [], "coordinator": []}
        for _ in range(args.rounds):  # alternating, so a slow spell of the machine hits both
            for name, url in (("direct", direct), ("coordinator", via)):
                runs[name].append(asyncio.run(throughput(url, args.concurrency, args.tput_requests, args.tput_tokens)))
                print(f"throughput {name}: {runs[name][-1]:.2f} req/s", file=sys.stderr, flush=True)
    medians = {name: statistics.median(v) for name, v in runs.items()}
    return {
        "latency_ms": {"direct_p50": 1e3 * statistics.median(lat["direct"]),
                       "coordinator_p50": 1e3 * statistics.median(lat["coordinator"]),
                       "added_p50": 1e3 * statistics.median(diffs), "added_p90": 1e3 * pct(diffs, 0.9)},
        "throughput_req_s": runs, "throughput_median_req_s": medians,
        "throughput_ratio": medians["coordinator"] / medians["direct"],
    }


async def throughput(url: str, concurrency: int, total: int, tokens: int) -> float:
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": tokens, "ignore_eos": True}}
    remaining = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            r = await client.post(url + "/generate", json=body)
            assert r.status_code == 200, r.text

    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        remaining = 8
        await asyncio.gather(*(worker(client) for _ in range(4)))  # warm-up: 8 requests
        remaining = total
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return total / (time.perf_counter() - t0)


# -- affinity ----------------------------------------------------------------------------------------------------
LONG_DEADLINES = {"first_token_timeout": 900, "infer_timeout": 1800}  # a loaded CPU can take minutes per turn
TOPICS = ["volcanoes", "tea", "trains", "bees", "glaciers", "violins", "deserts", "comets", "coral", "bridges",
          "owls", "maps", "salt", "clocks", "rivers", "kites"]


def system_prompt(seed: str, words: int) -> str:
    return f"You are assistant {seed}. " + " ".join(f"Rule {n} of {seed}: answer briefly and kindly." for n in
                                                     range(words // 8))


async def conversation(client: httpx.AsyncClient, url: str, model: str, seed: str, topic: str, turns: int,
                       max_tokens: int, words: int) -> list[float]:
    messages = [{"role": "system", "content": system_prompt(seed, words)},
                {"role": "user", "content": f"Tell me about {topic}."}]
    ttfts = []
    for turn in range(turns):
        t0 = time.perf_counter()
        first = None
        text = ""
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                delta = json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
                if first is None and delta:
                    first = time.perf_counter() - t0
                text += delta
        if turn > 0 and first is not None:
            ttfts.append(first)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Tell me more."}]
    return ttfts


async def chat_load(url: str, model: str, tag: str, args: argparse.Namespace) -> list[float]:
    async with httpx.AsyncClient(timeout=600) as client:
        results = await asyncio.gather(*(
            conversation(client, url, model, f"{tag}-{n}", TOPICS[n % len(TOPICS)], args.turns, args.max_tokens,
                         args.system_tokens)
            for n in range(args.conversations)))
    return [t for r in results for t in r]


def start_coordinator(work: Path, algorithm: str) -> tuple[subprocess.Popen[bytes], str, str]:
    cfg = default_coordinator_dict()
    cfg["digs_scheduler_config"]["algorithm_type"] = algorithm
    cfg["log_info"]["log_level"] = "WARNING"
    cfg["exception_config"].update(LONG_DEADLINES)
    port, manage = free_port(), free_port()
    cfg["http_config"].update(predict_port=str(port), manage_port=str(manage))
    path = work / f"coordinator-{algorithm}.json"
    write_file(path, json.dumps(cfg))  # 0640: what the file-mode check accepts
    proc = subprocess.Popen([sys.executable, "-m", "mindie_host.cli", "coordinator", "--config", str(path)])
    manage_url = f"http://127.0.0.1:{manage}"
    for _ in range(200):
        try:
            httpx.get(manage_url + "/v1/startup")
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}", manage_url


def affinity(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="ms-bench-"))
    sched = {"maxBatchSize": 16, "maxPrefillBatchSize": 16, "maxPrefillTokens": 8192, "maxIterTimes": 256,
             "enablePrefixCache": True}
    model_cfg = {"plugin_params": json.dumps({"plugin_type": "prefix_cache"}), "maxKvBlocks": 512,
                 "dtype": args.dtype}
    cfg = server_config(None, model=model_cfg,
                        schedule=sched, deploy={"maxSeqLen": 4096, "maxInputTokenLen": 3800})
    model = cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelName"]
    out: dict[str, Any] = {}
    with Cluster(work / "cluster", 2, server_config=cfg, coordinator={
            "digs_scheduler_config": {"algorithm_type": "cache_affinity"}, "exception_config": LONG_DEADLINES}) \
            as cluster:
        status = json.loads((cluster.workdir / "logs/cluster_status_output.json").read_text())
        instances = [{"id": instance_id(s["ip"], s["port"]), "ip": s["ip"], "port": s["port"],
                      "metric_port": s["metric_port"], "model_name": s["model_name"], "static_info": s["static_info"],
                      "dynamic_info": s["dynamic_info"]} for s in status["server"]]
        proc, rr_url, rr_manage = start_coordinator(work, "round_robin")
        try:
            r = httpx.post(rr_manage + "/v1/instances/refresh",
                           json={"ids": [i["id"] for i in instances], "instances": instances})
            assert r.status_code == 200
            asyncio.run(chat_load(cluster.url, model, "warm", argparse.Namespace(**{**vars(args), "turns": 1,
                                                                                 "conversations": 2})))
            for name, url in (("round_robin", rr_url), ("cache_affinity", cluster.url)):
                t0 = time.perf_counter()
                ttfts = asyncio.run(chat_load(url, model, name, args))
                out[name] = {"ttft_p50_ms": 1e3 * statistics.median(ttfts), "ttft_p99_ms": 1e3 * pct(ttfts, 0.99),
                             "turns_measured": len(ttfts), "wall_s": time.perf_counter() - t0}
        finally:
            proc.terminate()
            proc.wait(timeout=20)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--requests", type=int, default=300)
    o.add_argument("-c", "--concurrency", type=int, default=64)
    o.add_argument("--tput-requests", type=int, default=640)
    o.add_argument("--tput-tokens", type=int, default=16)
    o.add_argument("--rounds", type=int, default=3, help="alternating direct / coordinator throughput runs")
    a = sub.add_parser("affinity")
    a.add_argument("--conversations", type=int, default=8)
    a.add_argument("--turns", type=int, default=4)
    a.add_argument("--max-tokens", type=int, default=16)
    a.add_argument("--system-tokens", type=int, default=600, help="about this many words of system prompt")
    a.add_argument("--dtype", default="auto", help="servers' dtype (bfloat16: ~1 GB per server instead of ~3 GB)")
    args = p.parse_args(argv)
    result = overhead(args) if args.cmd == "overhead" else affinity(args)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
