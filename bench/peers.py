#!/usr/bin/env python3
"""Side-by-side serving benchmark: mindie-host against the peers that are installed, one run, same load generator.

Starts each system on the default model (SmolLM2-135M-Instruct), drives it with
the peers' closed-loop OpenAI load generator (``../shared/peers/loadgen.py``:
streaming chat, greedy, fixed max tokens) at each concurrency, and prints one
table with output tokens/s, TTFT and TPOT percentiles and the ratio to the
strongest peer. Systems are measured one after another in the same run, so
ratios are comparable on a noisy shared machine.

    python bench/peers.py                              # mindie-host + every peer found
    python bench/peers.py --systems mindie --conc 1,16 # just us
    LLAMA_SERVER=/path/to/llama-server python bench/peers.py

mindie-host runs with ``bench/configs/peers.json``: the built-in defaults plus
``compile: true`` (compiled decode step) and the prefix_cache plugin with 16-token
blocks, the counterpart of llama-server's default per-slot prompt cache. The system
``mindie-defaults`` (not in the default list) runs the built-in defaults instead.

Peers: llama.cpp's ``llama-server`` (found through ``$LLAMA_SERVER`` or ``PATH``),
``transformers serve --continuous-batching`` (needs ``transformers[serving]`` and
an HF directory converted from the GGUF, ``$TRANSFORMERS_SERVE_DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
LOADGEN = Path(os.environ.get("LOADGEN", ROOT.parent / "shared" / "peers" / "loadgen.py"))
N_FOR_CONC = {1: 8, 16: 64, 64: 128}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early ({proc.returncode})")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def start_mindie(args: argparse.Namespace, config: str | None = None) -> tuple[subprocess.Popen[bytes], str, str]:
    port, mport, xport = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "mindie_host.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--management-port", str(mport), "--metrics-port", str(xport)]
    config = args.config if config is None else config
    if config:
        cmd += ["--config", config]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(f"http://127.0.0.1:{mport}/v2/health/ready", proc)
    return proc, f"http://127.0.0.1:{port}", "SmolLM2-135M-Instruct"


def start_llama(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str, str] | None:
    binary = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not binary:
        return None
    from mindie_host.models.default import default_model_path

    port = free_port()
    proc = subprocess.Popen([binary, "-m", str(default_model_path()), "--port", str(port), "-t", "2", "-np", "16",
                             "-c", "32768", "--jinja"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(f"http://127.0.0.1:{port}/health", proc)
    return proc, f"http://127.0.0.1:{port}", "default"


def start_transformers(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str, str] | None:
    directory = os.environ.get("TRANSFORMERS_SERVE_DIR")
    exe = shutil.which("transformers")
    if not directory or not exe:
        return None
    port = free_port()
    proc = subprocess.Popen([exe, "serve", directory, "--continuous-batching", "--device", "cpu", "--dtype", "float32",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(f"http://127.0.0.1:{port}/v1/models", proc)
    return proc, f"http://127.0.0.1:{port}", directory


def start_mindie_defaults(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str, str]:
    return start_mindie(args, config="")


SYSTEMS = {"mindie": start_mindie, "mindie-defaults": start_mindie_defaults, "llama": start_llama,
           "transformers": start_transformers}
LABELS = {"mindie": "mindie-host", "mindie-defaults": "mindie-host (built-in defaults)",
          "llama": "llama.cpp llama-server (Q4_1, -np 16)", "transformers": "transformers serve --continuous-batching"}


def run_load(url: str, model: str, conc: int, n: int, max_tokens: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, str(LOADGEN), "--url", url, "--model", model, "-n", str(n), "-c", str(conc),
                          "--max-tokens", str(max_tokens)], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="mindie,llama,transformers")
    ap.add_argument("--conc", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--config", default=str(ROOT / "bench" / "configs" / "peers.json"),
                    help="mindie-host config.json (default: bench/configs/peers.json; '' = the built-in defaults)")
    ap.add_argument("--dtype", help="mindie-host weight dtype")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "peers.json"))
    args = ap.parse_args()
    if not LOADGEN.exists():
        print(f"load generator not found at {LOADGEN} (set LOADGEN=...)", file=sys.stderr)
        return 2
    concs = [int(c) for c in args.conc.split(",")]
    results: dict[str, dict[int, dict[str, float]]] = {}
    for name in args.systems.split(","):
        started = SYSTEMS[name](args)
        if started is None:
            print(f"skipping {name}: not installed", file=sys.stderr)
            continue
        proc, url, model = started
        try:
            run_load(url, model, 2, 4, 8)  # warm-up, not counted
            for c in concs:
                results.setdefault(name, {})[c] = run_load(url, model, c, N_FOR_CONC.get(c, 4 * c), args.max_tokens)
                print(name, c, results[name][c], file=sys.stderr, flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"max_tokens": args.max_tokens, "results": results}, indent=2))
    print(table(results, concs))
    return 0


def table(results: dict[str, dict[int, dict[str, float]]], concs: list[int]) -> str:
    ref = results.get("llama")
    lines = ["| system | conc | out tok/s | ratio vs llama-server | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | errors |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, by_c in results.items():
        for c in concs:
            r = by_c.get(c)
            if r is None:
                continue
            ratio = f"{r['out_tok_s'] / ref[c]['out_tok_s']:.2f}x" if ref and c in ref and ref[c]["out_tok_s"] else "-"
            lines.append(f"| {LABELS[name]} | {c} | {r['out_tok_s']} | {ratio} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | "
                         f"{r['tpot_p50_ms']} | {r['tpot_p99_ms']} | {r['errors']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
