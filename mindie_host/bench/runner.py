"""Load generation: warm-up, closed loop (``--Concurrency``) and open loop (``--RequestRate``)."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

import numpy as np

from .datasets import BenchItem
from .drivers import Driver
from .metrics import RequestRecord


@dataclass
class LoadPlan:
    """How requests are released: ``rate`` None means closed loop with ``concurrency`` in flight."""

    concurrency: int
    rate: float | None = None
    distribution: str = "uniform"  # uniform | poisson | gamma (arrival process of the open loop)
    burstiness: float = 1.0
    seed: int = 0
    warmup: int = 0
    progress: bool | None = None  # None: only on a terminal


def arrival_offsets(n: int, rate: float, distribution: str, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests at ``rate`` req/s.

    ``uniform``: evenly spaced. ``poisson``: exponential gaps (burstiness 1). ``gamma``: gamma gaps of
    shape ``burstiness`` and mean ``1/rate`` (vLLM's burstiness: < 1 burstier, > 1 more regular).
    """
    if n <= 0:
        return []
    if distribution == "uniform":
        gaps = np.full(n, 1.0 / rate)
    else:
        shape = 1.0 if distribution == "poisson" else burstiness
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]


def _progress(total: int, enabled: bool | None, desc: str):  # noqa: ANN202 - tqdm or a no-op
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency of transformers
        return None
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=(None if enabled is None else not enabled),
                dynamic_ncols=True)


async def _one(driver: Driver, item: BenchItem, index: int) -> RequestRecord:
    record = RequestRecord(index=index, prompt=item.prompt, reference=item.reference)
    try:
        await driver.send(item, record)
        record.success = bool(record.output_tokens or record.output_text) or record.finish_reason is not None
        if not record.success:
            record.error = "empty response"
    except Exception as exc:  # every failure is counted, never fatal to the run
        record.error = f"{type(exc).__name__}: {exc}"
        record.success = False
        if not record.end:
            record.end = driver.now()
    return record


async def run_load(driver: Driver, items: list[BenchItem], plan: LoadPlan, desc: str = "bench"
                   ) -> tuple[list[RequestRecord], float, float]:
    """Warm up, then send every item; returns (records, elapsed seconds, wall-clock start)."""
    if plan.warmup > 0 and items:
        warm = [items[i % len(items)] for i in range(plan.warmup)]
        sem = asyncio.Semaphore(max(1, min(plan.concurrency, plan.warmup)))

        async def warm_one(i: int, item: BenchItem) -> None:
            async with sem:
                await _one(driver, BenchItem(item.prompt, item.max_tokens, item.token_ids, item.ignore_eos), -1 - i)

        await asyncio.gather(*(warm_one(i, it) for i, it in enumerate(warm)))
    bar = _progress(len(items), plan.progress, desc)
    sem = asyncio.Semaphore(plan.concurrency)
    records: list[RequestRecord | None] = [None] * len(items)
    driver.origin = time.perf_counter()
    wall_start = time.time()

    async def task(i: int, item: BenchItem, at: float | None) -> None:
        if at is not None:
            delay = at - driver.now()
            if delay > 0:
                await asyncio.sleep(delay)
        async with sem:
            records[i] = await _one(driver, item, i)
        if bar is not None:
            bar.update(1)

    offsets: list[float | None]
    if plan.rate is not None:
        offsets = list(arrival_offsets(len(items), plan.rate, plan.distribution, plan.burstiness, plan.seed))
    else:
        offsets = [None] * len(items)
    await asyncio.gather(*(task(i, it, offsets[i]) for i, it in enumerate(items)))
    elapsed = driver.now()
    if bar is not None:
        bar.close()
    return [r for r in records if r is not None], elapsed, wall_start
