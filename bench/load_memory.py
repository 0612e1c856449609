#!/usr/bin/env python3
"""Peak RSS of serving a model: at load and after a warm-up, against the model file plus the KV pool.

Loads ``MODEL`` (a GGUF file or an HF directory; default: the default model) in a fresh process with the torch
backend's defaults (dtype and quantization ``auto``), allocates a KV pool of ``--kv-mib`` MiB, runs the backend's
warm-up, one prompt of ``--prompt`` tokens and ``--decode`` decode steps, and prints the process's peak RSS
(``VmHWM``) after the load and after the steps, the file's size, the pool's bytes and the ratio of the final peak
to (file + pool). Issue 35 item 10's target: at most 1.3. The KV pool is committed as it is used (the ratio's
allowance counts all of it). Run it under ``nice -n 19`` on a shared machine; ``MINDIE_HOST_CPU_ISA=avx2``
measures the avx2 profile.

    python bench/load_memory.py /work/models/llama-1b.Q4_0.gguf --kv-mib 512
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _status(key: str) -> int:
    """A ``/proc/self/status`` figure in bytes (VmHWM, VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(model: str, kv_mib: int, prompt: int, decode: int, block: int, keep_pages: bool) -> dict[str, object]:
    """Load, warm up and step in this process; the figures as a dict."""
    if keep_pages:  # the GGUF file's pages stay resident after each tensor is converted (for comparison)
        from mindie_host.models import weights

        weights.release_pages = lambda tensor: None
    from mindie_host.backends.base import ModelInput
    from mindie_host.backends.torch.backend import TorchBackend
    from mindie_host.models.weights import resolve_model

    source = resolve_model(model)
    t0 = time.perf_counter()
    backend = TorchBackend(source, name="bench")
    backend.load()
    load_s = time.perf_counter() - t0
    load_hwm, load_rss = _status("VmHWM"), _status("VmRSS")
    per_block = backend.kv_cache_bytes_per_block(block)
    blocks = max(1, (kv_mib << 20) // per_block)
    backend.allocate_kv_cache(blocks, block)
    backend.warmup()
    table = list(range(1, -(-(prompt + decode) // block) + 1))
    ids = [(7 * t + 11) % 1000 + 10 for t in range(prompt)]
    backend.execute(ModelInput(input_ids=ids, positions=list(range(prompt)), query_lens=[prompt],
                               context_lens=[prompt], block_tables=[table], logits_indices=[prompt - 1],
                               row_variants=[-1], prompt_lens=[prompt]))
    for i in range(decode):
        backend.execute(ModelInput(input_ids=[42], positions=[prompt + i], query_lens=[1],
                                   context_lens=[prompt + i + 1], block_tables=[table], logits_indices=[0],
                                   row_variants=[-1], prompt_lens=[prompt]))
    size = source.path.stat().st_size if source.kind == "gguf" else sum(
        f.stat().st_size for f in source.path.glob("*.safetensors"))
    kv = blocks * per_block
    hwm = _status("VmHWM")
    return {
        "model": str(source.path), "file_bytes": size, "kv_pool_bytes": kv, "load_s": round(load_s, 1),
        "load_hwm": load_hwm, "load_rss": load_rss, "warm_hwm": hwm, "warm_rss": _status("VmRSS"),
        "ratio_load": round(load_hwm / (size + kv), 3), "ratio": round(hwm / (size + kv), 3),
        "isa": os.environ.get("MINDIE_HOST_CPU_ISA", "auto"), "keep_pages": keep_pages,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="a GGUF file or HF directory (default: the default model)")
    ap.add_argument("--kv-mib", type=int, default=512, help="KV pool size in MiB (default 512)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens of the measured request (default 256)")
    ap.add_argument("--decode", type=int, default=8, help="decode steps after it (default 8)")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--keep-pages", action="store_true",
                    help="do not give the GGUF file's pages back after each tensor is read (for comparison)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from mindie_host.models.default import default_model_path

        model = str(default_model_path())
    if args.child:
        print(json.dumps(child(model, args.kv_mib, args.prompt, args.decode, args.block_size, args.keep_pages)))
        return 0
    cmd = [sys.executable, __file__, model, "--child", "--kv-mib", str(args.kv_mib), "--prompt", str(args.prompt),
           "--decode", str(args.decode), "--block-size", str(args.block_size)] + ["--keep-pages"] * args.keep_pages
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    r = json.loads(out)
    mib = 1 << 20
    print(json.dumps(r))
    print(f"{Path(r['model']).name} ({r['isa']}): file {r['file_bytes'] / mib:.0f} MiB + KV pool "
          f"{r['kv_pool_bytes'] / mib:.0f} MiB; peak RSS at load {r['load_hwm'] / mib:.0f} MiB "
          f"({r['ratio_load']}x), after warm-up and a {args.prompt}-token prompt {r['warm_hwm'] / mib:.0f} MiB "
          f"({r['ratio']}x); load {r['load_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
