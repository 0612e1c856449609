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

Two workloads, each at every concurrency (``--workload``, default both): ``fixed``, the
12 short prompts of ``loadgen.py`` (64 max tokens by default), and ``varied``,
``bench/varied_load.py``: a distinct summarisation prompt per request, 40-900 words
with a long tail, 128 output tokens (``--varied-max-tokens``). Results of the varied
load are keyed ``<system>/varied``.

``--runs N`` measures each system, concurrency and load N times back to back (the varied load
draws new prompts each time, seeds 0 .. N-1, the same for every system); the table gives the
median run with the range over the runs, and each ratio with the range of the run-by-run ratios.
Each row also gives the server's peak RSS so far: the ``VmHWM`` of its process and its children
(mindie-host's engine process) summed.

llama-server is started once per concurrency with ``-np`` equal to it (and
``--llama-ctx-per-slot`` tokens of context per slot), so that every request in flight
has a slot, as mindie-host's continuous batching gives every request one.

``--profile avx2`` measures every system as it runs on an AVX2 CPU (x86-64-v3, no AVX-512), on this
machine: the script re-executes itself with torch's instruction-set switches
(``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``) and
``MINDIE_HOST_CPU_ISA=avx2`` (mindie-host's avx2 kernels and float32 dtypes), which the servers inherit,
and runs llama-server from ``$LLAMA_SERVER_AVX2``, a build with AVX-512 off
(``bench/build_llama_server.sh`` builds both it and the native one). Results go to
``bench/results/peers_avx2.json`` unless ``--out`` says otherwise.

mindie-host runs with ``bench/configs/peers.json``: the built-in defaults plus
``compile: true`` (compiled decode step) and the prefix_cache plugin with 16-token
blocks, the counterpart of llama-server's default per-slot prompt cache. The system
``mindie-defaults`` (not in the default list) runs the built-in defaults instead.

Peers: llama.cpp's ``llama-server`` (found through ``$LLAMA_SERVER`` or ``PATH``),
``transformers serve --continuous-batching`` (needs ``transformers[serving]`` and
an HF directory converted from the GGUF, ``$TRANSFORMERS_SERVE_DIR``), and
``hf-generate``: plain ``model.generate`` on static batches of ``conc`` prompts
(the same prompts and chat template; TTFT is a one-token ``generate`` of the batch).

On a GPU, ``--model`` names an HF directory that every system serves (for example
one written by ``bench/make_random_llama.py``) and ``--device cuda`` puts them all on
the GPU::

    python bench/peers.py --model DIR --device cuda --dtype bfloat16 \
        --systems mindie,hf-generate,transformers --config bench/configs/peers-cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from mindie_host.testing import free_port, private_copy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_profiles import PROFILES, run_as  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LOADGEN = Path(os.environ.get("LOADGEN", ROOT.parent / "shared" / "peers" / "loadgen.py"))
N_FOR_CONC = {1: 8, 16: 64, 64: 128}


START_TIMEOUT = float(os.environ.get("PEERS_START_TIMEOUT", 600))


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float | None = None) -> None:
    deadline = time.time() + (timeout or START_TIMEOUT)
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
        cmd += ["--config", private_copy(config)]  # a checkout leaves it 0644: the mode check wants 0640
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.device:
        cmd += ["--device", args.device]
    name = "SmolLM2-135M-Instruct"
    if args.model:
        name = Path(args.model).name
        cmd += ["--model", args.model, "--model-name", name]
    log = log_file(args, "mindie")
    compiled = compiles_on_cpu(config, args.device)
    if compiled and log == subprocess.DEVNULL:  # the compile's end is read from the server's log
        log = tempfile.NamedTemporaryFile(prefix="mindie-", suffix=".log", delete=False)  # noqa: SIM115
    # the configured path is measured: a compile past the server's budget for slow machines is waited for
    env = {**os.environ, "MINDIE_HOST_COMPILE_BUDGET_S": "0"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
    wait_ready(f"http://127.0.0.1:{mport}/v2/health/ready", proc)
    if compiled:  # ready means serving, eagerly until the decode step has compiled in the background
        wait_compiled(Path(log.name), proc)
    return proc, f"http://127.0.0.1:{port}", name


def compiles_on_cpu(config: str | None, device: str | None) -> bool:
    """Whether a mindie-host config compiles its decode step in the background (``compile: true`` on CPU)."""
    if not config or (device or "cpu") not in ("cpu", "auto"):
        return False
    model = json.loads(Path(config).read_text())["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    return bool(model.get("compile")) and model.get("device", "auto") in ("cpu", "auto") and not _cuda()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def wait_compiled(log: Path, proc: subprocess.Popen[bytes], timeout: float | None = None) -> None:
    """Wait for the server's log line saying decode steps now run compiled (or stay eager)."""
    deadline = time.time() + (timeout or START_TIMEOUT)
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early ({proc.returncode})")
        text = log.read_text(errors="replace")
        if "now run compiled" in text or "stay eager" in text:
            return
        time.sleep(0.5)
    raise TimeoutError(f"the decode step did not compile; see {log}")


def start_llama(args: argparse.Namespace, slots: int = 16) -> tuple[subprocess.Popen[bytes], str, str] | None:
    """llama-server with ``slots`` parallel slots (``-np``) of ``--llama-ctx-per-slot`` tokens each."""
    binary = llama_binary(args.profile)
    if not binary:
        return None
    from mindie_host.models.default import default_model_path

    port = free_port()
    ctx = slots * args.llama_ctx_per_slot
    gguf = args.model if args.model and args.model.endswith(".gguf") else str(default_model_path())
    proc = subprocess.Popen([binary, "-m", gguf, "--port", str(port), "-t", "2", "-np", str(slots),
                             "-c", str(ctx), "--jinja"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(f"http://127.0.0.1:{port}/health", proc)
    return proc, f"http://127.0.0.1:{port}", "default"


#: where bench/build_llama_server.sh puts its builds
LLAMA_BUILDS = Path(os.environ.get("LLAMA_BUILD_DIR", Path.home() / ".cache" / "mindie-bench" / "llama.cpp"))


def llama_binary(profile: str) -> str | None:
    """llama-server for the profile: ``$LLAMA_SERVER_AVX2`` or bench/build_llama_server.sh's avx2 build for avx2;
    ``$LLAMA_SERVER``, the one on PATH or the script's native build otherwise."""
    if profile == "avx2":
        binary = os.environ.get("LLAMA_SERVER_AVX2") or str(LLAMA_BUILDS / "avx2" / "bin" / "llama-server")
        return binary if Path(binary).exists() else None
    native = LLAMA_BUILDS / "native" / "bin" / "llama-server"
    return os.environ.get("LLAMA_SERVER") or shutil.which("llama-server") or (str(native) if native.exists() else None)


def hf_directory(args: argparse.Namespace) -> str | None:
    """The HF model directory the transformers-based peers load."""
    return args.model or os.environ.get("TRANSFORMERS_SERVE_DIR")


def log_file(args: argparse.Namespace, name: str) -> Any:
    """Where a server's stderr goes: ``--logs DIR/NAME.log``, or nowhere."""
    if not args.logs:
        return subprocess.DEVNULL
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    return open(Path(args.logs) / f"{name}.log", "wb")  # noqa: SIM115 (lives as long as the server)


def start_transformers(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str, str] | None:
    directory = hf_directory(args)
    exe = shutil.which("transformers")
    if not directory or not exe:
        return None
    port = free_port()
    device = args.device or "cpu"
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    proc = subprocess.Popen([exe, "serve", directory, "--continuous-batching", "--device", device, "--dtype", dtype,
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log_file(args, "transformers"))
    wait_ready(f"http://127.0.0.1:{port}/health", proc)  # /v1/models scans the hub cache
    return proc, f"http://127.0.0.1:{port}", directory


def loadgen_prompts() -> list[str]:
    """The load generator's prompts, read from its source (it runs on import)."""
    import ast

    tree = ast.parse(LOADGEN.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "PROMPTS" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise RuntimeError(f"no PROMPTS in {LOADGEN}")


def percentile(xs: list[float], p: float) -> float:
    """The loadgen's percentile (linear between closest ranks)."""
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def run_hf_generate(args: argparse.Namespace, concs: list[int]) -> dict[int, dict[str, float]] | None:
    """``model.generate`` on static batches of ``conc`` chat prompts: the no-server baseline.

    Output tok/s counts the new tokens up to each row's EOS over the time of the full
    ``generate`` calls; TTFT is a one-token ``generate`` of the same batch (its prefill);
    TPOT is the rest of the batch's time over its remaining tokens.
    """
    directory = hf_directory(args)
    if not directory:
        return None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = args.device or "cpu"
    dtype = getattr(torch, args.dtype or ("float32" if device == "cpu" else "bfloat16"))
    tok = AutoTokenizer.from_pretrained(directory)
    tok.padding_side = "left"
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in loadgen_prompts()]

    def generate(batch: list[str], new: int) -> tuple[torch.Tensor, float, int]:
        enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=new, min_new_tokens=0, do_sample=False, pad_token_id=pad_id)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return out[:, enc["input_ids"].shape[1]:], time.perf_counter() - t0, enc["input_ids"].shape[1]

    generate(texts[:2], 4)  # warm-up, not counted
    results: dict[int, dict[str, float]] = {}
    for c in concs:
        n = N_FOR_CONC.get(c, 4 * c)
        prompts = [texts[i % len(texts)] for i in range(n)]
        tokens, busy, ttfts, tpots = 0, 0.0, [], []
        for start in range(0, n, c):
            batch = prompts[start:start + c]
            _, ttft, _ = generate(batch, 1)
            out, took, _ = generate(batch, args.max_tokens)
            counts = []
            for row in out.tolist():
                ends = [i for i, t in enumerate(row) if t == tok.eos_token_id]
                counts.append(ends[0] + 1 if ends else len(row))
            tokens += sum(counts)
            busy += took
            ttfts += [ttft] * len(batch)
            if max(counts) > 1:
                tpots += [(took - ttft) / (max(counts) - 1)] * len(batch)
        results[c] = {"n": n, "c": c, "errors": 0, "out_tok_s": round(tokens / busy, 1),
                      "ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1),
                      "ttft_p99_ms": round(1000 * percentile(ttfts, 99), 1),
                      "tpot_p50_ms": round(1000 * percentile(tpots, 50), 1) if tpots else None,
                      "tpot_p99_ms": round(1000 * percentile(tpots, 99), 1) if tpots else None}
        print("hf-generate", c, results[c], file=sys.stderr, flush=True)
    return results


def start_mindie_defaults(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str, str]:
    return start_mindie(args, config="")


#: systems started once per concurrency, with that many parallel slots
PER_CONCURRENCY = {"llama"}
SYSTEMS = {"mindie": start_mindie, "mindie-defaults": start_mindie_defaults, "llama": start_llama,
           "transformers": start_transformers}
#: systems measured in this process rather than over HTTP
OFFLINE = {"hf-generate": run_hf_generate}
LABELS = {"mindie": "mindie-host", "mindie-defaults": "mindie-host (built-in defaults)",
          "llama": "llama.cpp llama-server (the same GGUF, -np = conc)", "transformers": "transformers serve --continuous-batching",
          "hf-generate": "HF transformers generate (static batches)"}
#: the first of these that ran is what the ratio column compares against
REFERENCES = ("llama", "transformers", "hf-generate")


def release_gpu_memory() -> None:
    """Hand back what an in-process system cached on the GPU, so the servers after it see the memory free."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")  # loaded only by a system that ran in this process
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_load(url: str, model: str, conc: int, n: int, max_tokens: int, workload: str = "fixed",
             seed: int = 0, ignore_eos: bool = False) -> dict[str, float]:
    """One closed-loop run: ``loadgen.py`` (``fixed``) or ``bench/varied_load.py`` (``varied``, its prompts drawn
    with ``seed``; ``ignore_eos``: every request runs to its max tokens)."""
    script = LOADGEN if workload == "fixed" else ROOT / "bench" / "varied_load.py"
    extra = ["--seed", str(seed), *(["--ignore-eos"] if ignore_eos else [])] if workload == "varied" else []
    out = subprocess.run([sys.executable, str(script), "--url", url, "--model", model, "-n", str(n), "-c", str(conc),
                          "--max-tokens", str(max_tokens), *extra], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="mindie,llama,transformers")
    ap.add_argument("--conc", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens of the fixed workload")
    ap.add_argument("--workload", default="fixed,varied", help="fixed (loadgen.py's 12 prompts), varied, or both")
    ap.add_argument("--varied-max-tokens", type=int, default=128, help="output tokens of the varied workload")
    ap.add_argument("--llama-ctx-per-slot", type=int, default=2048, help="llama-server context per parallel slot")
    ap.add_argument("--config", default=str(ROOT / "bench" / "configs" / "peers.json"),
                    help="mindie-host config.json (default: bench/configs/peers.json; '' = the built-in defaults)")
    ap.add_argument("--dtype", help="weight dtype of mindie-host and the transformers peers")
    ap.add_argument("--device", help="cpu or cuda, for mindie-host and the transformers peers (default: cpu)")
    ap.add_argument("--model", help="model every system serves (default: the default model): an HF directory, or a "
                    "GGUF file, which llama-server serves as well")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="varied load: every request generates its max tokens (for random-weight models)")
    ap.add_argument("--requests", type=int, help="requests per run at every concurrency (default: 8 at c=1, 64 at "
                    "c=16, 128 at c=64, 4 x conc otherwise)")
    ap.add_argument("--logs", help="directory for the servers' stderr logs")
    ap.add_argument("--start-timeout", type=float, help="seconds a server may take to get ready (default 600)")
    ap.add_argument("--runs", type=int, default=1,
                    help="measure each system, concurrency and load this many times back to back (the varied load "
                         "with new prompts each time: seeds 0, 1, ...); the table gives the median run and the range")
    ap.add_argument("--profile", choices=["native", "avx2"], default="native",
                    help="avx2: every system as on an AVX2 CPU (torch's and mindie-host's switches, llama-server "
                         "built with AVX-512 off)")
    ap.add_argument("--out", help="results file (default bench/results/peers.json, peers_avx2.json for --profile avx2)")
    args = ap.parse_args()
    run_as(PROFILES[args.profile])
    args.out = args.out or str(ROOT / "bench" / "results" / ("peers_avx2.json" if args.profile == "avx2" else "peers.json"))
    if not LOADGEN.exists():
        print(f"load generator not found at {LOADGEN} (set LOADGEN=...)", file=sys.stderr)
        return 2
    concs = [int(c) for c in args.conc.split(",")]
    workloads = [w for w in args.workload.split(",") if w]
    if not set(workloads) <= {"fixed", "varied"}:
        print(f"--workload: got {args.workload!r}; allowed: fixed, varied, or both", file=sys.stderr)
        return 2
    if args.start_timeout:
        global START_TIMEOUT
        START_TIMEOUT = args.start_timeout
    results: dict[str, dict[int, dict[str, float]]] = {}
    for name in args.systems.split(","):
        if name in OFFLINE:
            offline = OFFLINE[name](args, concs)
            if offline is None:
                print(f"skipping {name}: no HF model directory (--model)", file=sys.stderr)
            else:
                results[name] = offline
                save(args, results)
            release_gpu_memory()
            continue
        for group in ([[c] for c in concs] if name in PER_CONCURRENCY else [concs]):
            started = SYSTEMS[name](args, group[0]) if name in PER_CONCURRENCY else SYSTEMS[name](args)
            if started is None:
                print(f"skipping {name}: not installed", file=sys.stderr)
                break
            proc, url, model = started
            try:
                run_load(url, model, 2, 4, 8)  # warm-up, not counted
                for c in group:
                    for workload in workloads:
                        key = name if workload == "fixed" else f"{name}/{workload}"
                        tokens = args.max_tokens if workload == "fixed" else args.varied_max_tokens
                        n = args.requests or N_FOR_CONC.get(c, 4 * c)
                        runs = [run_load(url, model, c, n, tokens, workload, seed=i, ignore_eos=args.ignore_eos)
                                for i in range(args.runs)]
                        r = median_run(runs)
                        r["peak_rss_mb"] = peak_rss_mb(proc.pid)
                        results.setdefault(key, {})[c] = r
                        print(key, c, r, file=sys.stderr, flush=True)
                        save(args, results)
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    save(args, results)
    print(table(results, concs))
    return 0


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median output tok/s (the lower middle one of an even count), with every run's tok/s,
    TTFT p50 and TPOT p50 under ``runs`` when there were several (the varied load draws new prompts each run)."""
    ordered = sorted(runs, key=lambda r: r["out_tok_s"])
    r = dict(ordered[(len(ordered) - 1) // 2])
    if len(runs) > 1:
        r["runs"] = [{k: run.get(k) for k in ("out_tok_s", "ttft_p50_ms", "tpot_p50_ms", "tpot_p99_ms", "errors")}
                     for run in runs]
    return r


def peak_rss_mb(pid: int) -> float | None:
    """Peak resident memory of a server: the ``VmHWM`` of its process and every descendant still running
    (a mindie-host server and its engine process), summed, in MB; None where ``/proc`` does not tell."""
    total, stack, seen = 0, [pid], set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                stack += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return round(total / 1024, 1) if total else None


def save(args: argparse.Namespace, results: dict[str, dict[int, dict[str, float]]]) -> None:
    """Write the results so far to ``--out``."""
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"max_tokens": args.max_tokens, "varied_max_tokens": args.varied_max_tokens,
                                          "llama_ctx_per_slot": args.llama_ctx_per_slot,
                                          "model": args.model, "device": args.device, "profile": args.profile,
                                          "results": results}, indent=2))


def table(results: dict[str, dict[int, dict[str, float]]], concs: list[int]) -> str:
    """One Markdown table; each row's ratio is against the reference system on the same workload."""
    systems = {name.partition("/")[0] for name in results}  # "llama" or "llama/varied": the system either way
    ref_name = next((r for r in REFERENCES if r in systems), None)
    against = {"llama": "llama-server", "transformers": "transformers serve", "hf-generate": "HF generate"}.get(
        ref_name or "", "-")
    lines = [f"| system | conc | out tok/s | ratio vs {against} | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
             "| errors | peak RSS MB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, by_c in results.items():
        system, _, workload = name.partition("/")
        ref = results.get(f"{ref_name}/{workload}" if workload else ref_name or "")
        label = LABELS[system] + (f" ({workload} load)" if workload else "")
        for c in concs:
            r = by_c.get(c)
            if r is None:
                continue
            ratio = f"{r['out_tok_s'] / ref[c]['out_tok_s']:.2f}x" if ref and c in ref and ref[c]["out_tok_s"] else "-"
            rate = f"{r['out_tok_s']}"
            if r.get("runs"):  # the median run, and the range over all of them
                rates = [run["out_tok_s"] for run in r["runs"]]
                rate += f" ({min(rates)}-{max(rates)})"
                if ref and c in ref and ref[c].get("runs"):  # ratio of each run to the reference's run of that index
                    each = [a["out_tok_s"] / b["out_tok_s"] for a, b in zip(r["runs"], ref[c]["runs"]) if b["out_tok_s"]]
                    if each and ratio != "-":
                        ratio += f" ({min(each):.2f}-{max(each):.2f})"
            lines.append(f"| {label} | {c} | {rate} | {ratio} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | "
                         f"{r['tpot_p50_ms']} | {r['tpot_p99_ms']} | {r['errors']} | {r.get('peak_rss_mb', '-')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
