"""MindIE's two instrumentation switches (spec §10.1), on the engine's steps in the process that runs them.

* ``MIES_PROFILER_MODE=1`` ("performance instrumentation"): the first ``MINDIE_HOST_PROFILER_STEPS`` engine steps
  (10) run under torch's profiler, each step marked ``engine step <n>``; once they have run, the trace is written
  in Chrome trace format (open it in chrome://tracing or Perfetto) as ``trace_<pid>_<time>.json``.
* ``MIES_MEMORY_DETECTOR_MODE=1`` ("memory instrumentation"): one JSON object per line in ``memory_<pid>.jsonl``
  when the engine is built and every ``MINDIE_HOST_MEMORY_REPORT_STEPS`` steps (100): the process's resident and
  peak memory, the KV pool's and the swap space's blocks in use and their bytes, the device's allocator figures
  (CUDA), the queues.

Both write to ``MINDIE_HOST_PROFILER_DIR`` (``profiler``), a folder relative to the log file's (``logPath``,
resolved as logging resolves it) unless absolute. With tensor parallelism, rank 0's process records (the
others replay its calls).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config import Config
from ..engine.core import LLMEngine
from ..logs import resolve_log_path

log = logging.getLogger("mindie_host.runtime")
MIB = 1 << 20


def diagnostics_dir(config: Config) -> Path:
    """``MINDIE_HOST_PROFILER_DIR``: as is when absolute, else under the log file's folder."""
    folder = Path(config.environment.profiler_dir).expanduser()
    return folder if folder.is_absolute() else resolve_log_path(config.LogConfig.logPath).parent / folder


class StepProfiler:
    """Runs the first ``steps`` engine steps under ``torch.profiler`` and writes their Chrome trace."""

    def __init__(self, steps: int, folder: Path) -> None:
        self.left = steps
        self.folder = folder
        self.done = 0
        self.path: Path | None = None
        self._prof: torch.profiler.profile | None = None

    def around(self, step: Callable[[], Any]) -> Any:
        """Run ``step`` (one engine step), profiled while steps are left."""
        if self.left <= 0:
            return step()
        if self._prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.start()
        try:
            with torch.profiler.record_function(f"engine step {self.done + 1}"):
                return step()
        finally:
            self.done += 1
            self.left -= 1
            if self.left == 0:
                self._finish()

    def _finish(self) -> None:
        assert self._prof is not None
        self._prof.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"trace_{os.getpid()}_{time.strftime('%Y%m%d-%H%M%S')}.json"
        self._prof.export_chrome_trace(str(path))
        self._prof = None
        self.path = path
        log.info("MIES_PROFILER_MODE: trace of %d engine steps written to %s", self.done, path)


def _process_memory() -> dict[str, int]:
    """Resident and peak resident bytes of this process (``/proc/self/status``; getrusage's peak elsewhere)."""
    out = {"rss_bytes": 0, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                out["rss_bytes" if name == "VmRSS" else "peak_rss_bytes"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


class MemoryReport:
    """Appends one JSON line of ``llm``'s memory figures to ``memory_<pid>.jsonl``, now and every ``every`` steps."""

    def __init__(self, llm: LLMEngine, every: int, folder: Path) -> None:
        self.llm = llm
        self.every = every
        self.steps = 0
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"memory_{os.getpid()}.jsonl"
        self.write("engine built")

    def figures(self) -> dict[str, Any]:
        """This moment's memory figures (see the module docstring)."""
        llm = self.llm
        kv, swap, stats = llm.kv, llm.scheduler.swap, llm.scheduler.stats()
        report: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "pid": os.getpid(),
            "steps": int(llm.counters["steps"]),
            **_process_memory(),
            "kv_cache": {
                "device": llm.info.device,
                "blocks_total": kv.num_blocks,
                "blocks_used": kv.num_used_blocks(),
                "block_tokens": kv.block_size,
                "bytes_per_block": llm.backend.kv_cache_bytes_per_block(kv.block_size),
            },
            "swap_space": None if swap is None else {
                "blocks_total": swap.pool.num_blocks,
                "blocks_used": swap.pool.num_blocks - swap.pool.num_free(),
                "bytes_per_block": llm.backend.swap_block_bytes(),
            },
            "requests": {k: int(stats[k]) for k in ("num_running", "num_waiting", "num_swapped")},
        }
        if torch.cuda.is_available():
            report["cuda"] = {"allocated_bytes": torch.cuda.memory_allocated(),
                              "reserved_bytes": torch.cuda.memory_reserved(),
                              "peak_allocated_bytes": torch.cuda.max_memory_allocated()}
        return report

    def write(self, why: str) -> dict[str, Any]:
        """Append the figures as one line, log a summary, and return them."""
        report = {"event": why, **self.figures()}
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(report) + "\n")
        kv = report["kv_cache"]
        log.info("MIES_MEMORY_DETECTOR_MODE: rss %.0f MiB (peak %.0f MiB), KV %d/%d blocks (%s) -> %s",
                 report["rss_bytes"] / MIB, report["peak_rss_bytes"] / MIB, kv["blocks_used"], kv["blocks_total"],
                 why, self.path)
        return report

    def around(self, step: Callable[[], Any]) -> Any:
        """Run ``step``; every ``every`` steps, write a report after it."""
        try:
            return step()
        finally:
            self.steps += 1
            if self.steps % self.every == 0:
                self.write(f"after step {self.steps}")


def install_diagnostics(llm: LLMEngine, config: Config) -> list[Any]:
    """Wrap ``llm.step`` with what ``MIES_PROFILER_MODE`` and ``MIES_MEMORY_DETECTOR_MODE`` switch on; returns the
    installed recorders (none when both are off)."""
    env = config.environment
    folder = diagnostics_dir(config)
    recorders: list[Any] = []
    if env.profiler:  # innermost: the trace holds the step itself, not the memory report's writing
        recorders.append(StepProfiler(env.profiler_steps, folder))
        log.info("MIES_PROFILER_MODE: profiling the first %d engine steps into %s", env.profiler_steps, folder)
    if env.memory_detector:
        recorders.append(MemoryReport(llm, env.memory_report_steps, folder))
    step = llm.step
    for recorder in recorders:
        step = _wrapped(recorder, step)
    if recorders:
        llm.step = step  # type: ignore[method-assign]
    return recorders


def _wrapped(recorder: Any, step: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: recorder.around(step)
