#!/usr/bin/env python3
"""Speculative decoding, measured (issue 38): plugin off vs ``llma`` vs ``draft_model`` in the same run, beside llama-server.

Every system serves the default model on the same loads, one after another in one run:

* ``off``: ``bench/configs/peers.json`` (the peers' configuration: compiled decode, prefix cache, splitfuse);
* ``llma``: the same plus the ``llma`` plugin (defaults: k=4, n-grams 3..2, drafts while <= 8 sequences decode);
* ``fp32``: the same model at ``quantization: none``, no plugin (the float32 target alone);
* ``self-spec``: ``fp32`` plus ``draft_model`` with the same GGUF read in its low-bit form (``quantization: auto``)
  as the draft: self-speculation; compare it with ``fp32`` (the issue's 1.3x target) and with ``off``
  (``quantization: auto``, what users run by default);
* ``llama``: llama-server (``$LLAMA_SERVER``), ``-np`` = concurrency; ``llama-md``: the same with the same GGUF
  as its draft model (``-md``, ``--draft-max 4``); ``llama-lookup``: its n-gram lookup (``--spec-type`` ngram
  where the build has it; skipped otherwise).

Loads, each at every concurrency (``--conc``, default 1,16,64): ``varied`` (``bench/varied_load.py``'s
summarisation prompts, 128 output tokens) and ``copy`` (``bench/copy_load.py``: rename a variable in 200-800
tokens of standard-library code, 256 output tokens). Requests are closed-loop, non-streaming, greedy chat
completions; tokens/s is the completion tokens the server reports (``usage``) over the wall time of the run
(TTFT included). For mindie-host systems the run also reads ``/metrics-json`` before and after, for the drafts
proposed and accepted (acceptance rate, mean tokens per verified step).

    python bench/spec_bench.py --systems off,llma,fp32,self-spec --conc 1,16,64 --runs 3
    LLAMA_SERVER=/path/to/llama-server python bench/spec_bench.py --systems off,llma,llama,llama-md,llama-lookup

``--runs N`` alternates the systems N times (A, B, C, A, B, C, ...) and reports each figure's median and range.
Results go to ``bench/results/spec_bench.json``; the table goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from copy_load import make_prompts as copy_prompts  # noqa: E402
from peers import compiles_on_cpu, wait_compiled, wait_ready  # noqa: E402
from varied_load import make_prompts as varied_prompts  # noqa: E402

from mindie_host.testing import free_port, private_copy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
N_FOR_CONC = {1: 8, 16: 48, 64: 128}
MAX_TOKENS = {"varied": 128, "copy": 256}
LABELS = {
    "off": "mindie-host (peers.json, quantization auto)",
    "llma": "mindie-host + llma",
    "fp32": "mindie-host, quantization none (float32)",
    "self-spec": "mindie-host, quantization none + draft_model (its own Q4 GGUF)",
    "llama": "llama-server",
    "llama-md": "llama-server -md (same GGUF as draft)",
    "llama-lookup": "llama-server n-gram lookup",
}


#: ``--no-compile``: eager decode steps (quick sanity runs; the measurements keep peers.json's compiled ones)
COMPILE = True
#: ``--plugins``: config.json ``Plugins`` sections given on the command line (e.g. the llma plugin's k)
PLUGINS: dict[str, dict[str, Any]] = {}


def mindie_config(system: str) -> dict[str, Any]:
    cfg = json.loads((ROOT / "bench" / "configs" / "peers.json").read_text())
    model = cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    model["compile"] = model.get("compile", False) and COMPILE
    plugins = json.loads(model["plugin_params"])["plugin_type"].split(",")
    if system == "llma":
        plugins.append("llma")
    if system in ("fp32", "self-spec"):
        model["quantization"] = "none"
    if system == "self-spec":
        plugins.append("draft_model")
        cfg["Plugins"] = {"draft_model": {"modelWeightPath": "", "quantization": "auto"}}
    for name in plugins:
        if name in PLUGINS:
            cfg.setdefault("Plugins", {}).setdefault(name, {}).update(PLUGINS[name])
    model["plugin_params"] = json.dumps({"plugin_type": ",".join(plugins)})
    return cfg


class Server:
    """One system's server: its business URL, and the management URL for mindie-host."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, model: str, management: str | None) -> None:
        self.proc, self.url, self.model, self.management = proc, url, model, management

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_mindie(system: str, logs: str | None, cfg: dict[str, Any] | None = None) -> Server:
    """mindie-host with ``system``'s config (:func:`mindie_config`), or ``cfg``."""
    port, mport, xport = free_port(), free_port(), free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg if cfg is not None else mindie_config(system), f)
    config = private_copy(f.name)
    log: Any = open(Path(logs) / f"{system}.log", "w") if logs else tempfile.NamedTemporaryFile(  # noqa: SIM115
        prefix=f"mindie-{system}-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "mindie_host.cli", "serve", "--host", "127.0.0.1", "--port",
                             str(port), "--management-port", str(mport), "--metrics-port", str(xport), "--config",
                             config], stdout=subprocess.DEVNULL, stderr=log)
    wait_ready(f"http://127.0.0.1:{mport}/v2/health/ready", proc)
    if compiles_on_cpu(config, None):
        wait_compiled(Path(log.name), proc)
    return Server(proc, f"http://127.0.0.1:{port}", "SmolLM2-135M-Instruct", f"http://127.0.0.1:{mport}")


def llama_binary() -> str | None:
    return os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")


def start_llama(system: str, slots: int) -> Server | None:
    binary = llama_binary()
    if not binary:
        return None
    from mindie_host.models.default import default_model_path

    gguf = str(default_model_path())
    extra: list[str] = []
    help_text = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
    # newer llama.cpp renamed --draft-max/--draft-min to --spec-draft-n-max/--spec-draft-n-min
    n_max, n_min = ("--spec-draft-n-max", "--spec-draft-n-min") if "--spec-draft-n-max" in help_text else (
        "--draft-max", "--draft-min")
    if system == "llama-md":
        extra = ["-md", gguf, n_max, "4", n_min, "1"]
        if "draft-simple" in help_text:  # newer llama.cpp: no speculation unless a --spec-type names it
            extra += ["--spec-type", "draft-simple"]
    elif system == "llama-lookup":
        if "ngram-simple" not in help_text:
            return None  # this build has no n-gram speculation in the server
        extra = ["--spec-type", "ngram-simple", n_max, "4"]
        if "--spec-ngram-simple-size-n" in help_text:  # llma's longest n-gram (3) and k (4), not 12 and 48
            extra += ["--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "4"]
    port = free_port()
    proc = subprocess.Popen([binary, "-m", gguf, "--port", str(port), "-t", "2", "-np", str(slots), "-c",
                             str(slots * 4096), "--jinja", *extra], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_ready(f"http://127.0.0.1:{port}/health", proc)
    return Server(proc, f"http://127.0.0.1:{port}", "default", None)


def spec_counters(server: Server) -> dict[str, float]:
    if server.management is None:
        return {}
    body = httpx.get(server.management + "/metrics-json", timeout=30).json()
    return {r["metric"][0]["__name__"]: float(r["value"]) for r in body["result"]
            if r["metric"][0]["__name__"].startswith("spec_decode_")}


async def closed_loop(server: Server, prompts: list[str], conc: int, max_tokens: int) -> dict[str, Any]:
    latencies: list[float] = []
    tokens = errors = 0
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=conc + 4)) as client:
        async def one(prompt: str) -> None:
            nonlocal tokens, errors
            async with sem:
                t0 = time.perf_counter()
                r = await client.post(server.url + "/v1/chat/completions", json={
                    "model": server.model, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens, "temperature": 0})
                if r.status_code != 200:
                    errors += 1
                    return
                tokens += int(r.json()["usage"]["completion_tokens"])
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    return {"n": len(prompts), "c": conc, "errors": errors, "wall_s": round(wall, 2), "completion_tokens": tokens,
            "out_tok_s": round(tokens / wall, 1), "latency_p50_s": round(statistics.median(latencies), 2)
            if latencies else None}


def measure(server: Server, load: str, conc: int, seed: int, n: int | None = None) -> dict[str, Any]:
    n = n or N_FOR_CONC.get(conc, 2 * conc)
    prompts = varied_prompts(n, seed) if load == "varied" else copy_prompts(n, seed)
    before = spec_counters(server)
    result = asyncio.run(closed_loop(server, prompts, conc, MAX_TOKENS[load]))
    after = spec_counters(server)
    drafted = after.get("spec_decode_draft_tokens", 0.0) - before.get("spec_decode_draft_tokens", 0.0)
    accepted = after.get("spec_decode_accepted_tokens", 0.0) - before.get("spec_decode_accepted_tokens", 0.0)
    if drafted:
        result["draft_tokens"] = int(drafted)
        result["acceptance_rate"] = round(accepted / drafted, 3)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="off,llma,fp32,self-spec,llama,llama-md,llama-lookup")
    ap.add_argument("--conc", default="1,16,64")
    ap.add_argument("--loads", default="varied,copy")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("-n", type=int, help="requests per run (default: 8 at c=1, 48 at c=16, 128 at c=64)")
    ap.add_argument("--logs", help="directory for mindie-host's logs")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "spec_bench.json"))
    ap.add_argument("--no-compile", action="store_true", help="eager decode steps (a quick sanity run)")
    ap.add_argument("--plugins", default="{}",
                    help='JSON: config.json "Plugins" sections for the plugins a system enables, e.g. '
                         '\'{"llma": {"numSpeculativeTokens": 8}}\'')
    args = ap.parse_args()
    global COMPILE
    COMPILE = not args.no_compile
    PLUGINS.update(json.loads(args.plugins))
    enabled = {name for system in args.systems.split(",") if not system.startswith("llama") for name in json.loads(
        mindie_config(system)["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["plugin_params"]
    )["plugin_type"].split(",")}
    if set(PLUGINS) - enabled:  # never ignored: a section for a plugin no system runs is a mistake
        ap.error(f"--plugins: {sorted(set(PLUGINS) - enabled)} enabled by none of --systems (they enable: "
                 f"{', '.join(sorted(enabled))})")
    systems = args.systems.split(",")
    concs = [int(c) for c in args.conc.split(",")]
    loads = args.loads.split(",")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for run in range(args.runs):
        for system in systems:
            for conc in concs if system.startswith("llama") else [None]:
                server = start_llama(system, conc) if conc is not None else start_mindie(system, args.logs)
                if server is None:
                    print(f"skipping {system}: not available", file=sys.stderr)
                    break
                try:
                    asyncio.run(closed_loop(server, varied_prompts(2, 99), 2, 8))  # warm-up, not counted
                    for c in [conc] if conc is not None else concs:
                        for load in loads:
                            r = measure(server, load, c, seed=run, n=args.n)
                            results.setdefault(system, {}).setdefault(f"{load}/c{c}", []).append(r)
                            print(system, load, c, r, file=sys.stderr, flush=True)
                finally:
                    server.stop()
                Path(args.out).write_text(json.dumps(results, indent=1))
    print(table(results, systems, loads, concs))
    return 0


def table(results: dict[str, dict[str, list[dict[str, Any]]]], systems: list[str], loads: list[str],
          concs: list[int]) -> str:
    """Median tokens/s (range) per system, load and concurrency, with the ratio to ``off`` and acceptance."""
    lines = ["| system | load | c | tokens/s median (range) | x off (self-spec: x fp32) | acceptance |", "| --- | --- | --- | --- | --- | --- |"]
    for load in loads:
        for c in concs:
            for system in systems:
                runs = results.get(system, {}).get(f"{load}/c{c}")
                if not runs:
                    continue
                # self-speculation is compared with its float32 target alone; the rest with "off"
                base = results.get("fp32" if system == "self-spec" else "off", {}).get(f"{load}/c{c}")
                base_med = statistics.median(r["out_tok_s"] for r in base) if base else None
                vals = [r["out_tok_s"] for r in runs]
                med = statistics.median(vals)
                acc = [r["acceptance_rate"] for r in runs if "acceptance_rate" in r]
                ratio = f"{med / base_med:.2f}" if base_med else "-"
                lines.append(f"| {LABELS.get(system, system)} | {load} | {c} | {med:.1f} ({min(vals):.1f}-"
                             f"{max(vals):.1f}) | {ratio} | {statistics.median(acc):.2f} |" if acc else
                             f"| {LABELS.get(system, system)} | {load} | {c} | {med:.1f} ({min(vals):.1f}-"
                             f"{max(vals):.1f}) | {ratio} | - |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
