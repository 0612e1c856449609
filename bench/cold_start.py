"""Cold start of a compiled config: time to readiness, service while the decode step compiles, time to compiled.

Starts ``mindie-host serve`` with ``--config`` (default bench/configs/peers.json, ``compile: true``)
and a fresh, empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` in a temporary directory, unless
``--cache-dir`` names one, to time a warm start), then:

1. times readiness (``/v2/health/ready`` on the management port);
2. runs the varied workload (bench/varied_load.py) at c=1 at once, while the decode step compiles;
3. waits for the server's log line that decode steps now run compiled (or that the compile ran past the
   server's budget for slow machines, ``MINDIE_HOST_COMPILE_BUDGET_S``, and decode steps stay eager), and times it;
4. runs the same c=1 load again, compiled (or eager).

``--profile avx2`` runs the server as on an AVX2 CPU (torch's instruction-set switches and
``MINDIE_HOST_CPU_ISA=avx2``, as ``bench/peers.py --profile avx2``). With ``TORCH_EXTENSIONS_DIR`` set to an
empty directory the server also builds its CPU kernels, as on a machine that never ran it.

``--config default`` starts the README's serve command as it is (no config file: the default config, eager
decode steps), so only readiness and one c=1 load are timed. ``--drop-page-cache`` (root) drops the OS page
cache first, so the model file and the Python packages are read from disk as on a first start.

Prints one JSON line::

    python bench/cold_start.py                      # cold: a fresh inductor cache
    TORCH_EXTENSIONS_DIR=$(mktemp -d) python bench/cold_start.py --config default --drop-page-cache
    python bench/cold_start.py --cache-dir /tmp/ind # warm, once that directory has been filled
    TORCH_EXTENSIONS_DIR=$(mktemp -d) python bench/cold_start.py --profile avx2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from mindie_host.testing import free_port, private_copy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_profiles import PROFILES  # noqa: E402
from varied_load import make_prompts, run  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMPILED = "now run compiled"
EAGER = "stay eager"


def wait_for(check: Any, timeout: float) -> float | None:
    """Seconds until ``check()`` is true (polling), or None at ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(0.25)
    return None


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "bench" / "configs" / "peers.json"))
    ap.add_argument("--cache-dir", default=None, help="inductor cache directory (default: a fresh one)")
    ap.add_argument("-n", type=int, default=4, help="requests in each c=1 load")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--profile", choices=["native", "avx2"], default="native")
    ap.add_argument("--drop-page-cache", action="store_true", help="drop the OS page cache first (needs root)")
    a = ap.parse_args()
    default_config = a.config == "default"
    if a.drop_page_cache:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    cache = a.cache_dir or tempfile.mkdtemp(prefix="inductor-cold-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, **PROFILES[a.profile]}
    port, mport, xport = free_port(), free_port(), free_port()
    log_path = Path(tempfile.mkdtemp(prefix="cold-start-")) / "server.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "mindie_host.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--management-port", str(mport), "--metrics-port", str(xport),
             *([] if default_config else ["--config", private_copy(a.config)])],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir(),
        )
    result: dict[str, Any] = {"config": a.config, "cache": "given" if a.cache_dir else "fresh", "profile": a.profile,
                              "kernel_cache": os.environ.get("TORCH_EXTENSIONS_DIR", "default"),
                              "page_cache": "dropped" if a.drop_page_cache else "as it was"}
    try:
        if wait_for(lambda: ready(f"http://127.0.0.1:{mport}"), a.timeout) is None:
            raise SystemExit(f"not ready after {a.timeout} s; see {log_path}")
        result["ready_s"] = round(time.monotonic() - start, 1)
        url = f"http://127.0.0.1:{port}"
        prompts = make_prompts(a.n, seed=5)
        model = "SmolLM2-135M-Instruct"
        result["while_compiling"] = asyncio.run(run(url, model, a.n, 1, 128, prompts))
        result["kernels_built"] = [line.split("] ", 1)[-1] for line in log_path.read_text().splitlines()
                                   if "CPU kernels in" in line]
        if default_config:  # eager decode steps: nothing compiles
            result["eager"] = result.pop("while_compiling")
        elif wait_for(lambda: COMPILED in log_path.read_text() or EAGER in log_path.read_text(), a.timeout) is None:
            raise SystemExit(f"the decode step did not compile within {a.timeout} s; see {log_path}")
        if not default_config:
            _compiled(result, start, log_path, url, model, a.n)
    finally:
        server.terminate()
        server.wait(60)
    for key in ("while_compiling", "compiled", "eager"):
        if key in result:
            r = result[key]
            result[key] = {k: r[k] for k in ("out_tok_s", "ttft_p50_ms", "tpot_p50_ms", "tpot_p99_ms", "errors")}
    print(json.dumps(result))


def _compiled(result: dict[str, Any], start: float, log_path: Path, url: str, model: str, n: int) -> None:
    """Time to compiled decode steps (or to the log's word that they stay eager), and a c=1 load after it."""
    result["compiled_s"] = round(time.monotonic() - start, 1)
    result["decode"] = "compiled" if COMPILED in log_path.read_text() else "eager (compile stopped or failed)"
    # other prompts than the first load's, so the prefix cache does not serve them
    result["compiled"] = asyncio.run(run(url, model, n, 1, 128, make_prompts(n, seed=6)))


if __name__ == "__main__":
    main()
