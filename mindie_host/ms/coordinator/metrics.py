"""``GET /metrics`` of the coordinator: every instance's Prometheus text, aggregated (spec §4.3).

Each instance in rotation is scraped at ``http://ip:metric_port/metrics`` at the same time, the
texts are parsed with ``prometheus_client``'s parser and combined series by series:

* counters and histograms (buckets, ``_sum``, ``_count``) are summed;
* gauges that count something (requests running or waiting, tokens per second, KV blocks)
  are summed; gauges that are shares (``*_perc``, ``*_rate``, ``*usage*``) are averaged;
* every series is labelled ``model_name`` with the instances' model names joined by ``&``.

The result is kept for ``reuse_time`` seconds: a request within that window gets the same
text, and does not move the window. With no instance answering, ``/metrics`` is 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from ...server.metrics import render
from .instances import Instance

log = logging.getLogger("mindie_host.ms.coordinator")
MEAN_MARKERS = ("_perc", "_rate", "usage")


def _is_share(name: str) -> bool:
    return any(marker in name for marker in MEAN_MARKERS)


def aggregate(texts: list[str]) -> list[Metric]:
    """Combine several Prometheus texts into one list of families (see the module docstring)."""
    families: dict[str, tuple[str, str]] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = {}
    models: list[str] = []
    for text in texts:
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, (family.documentation, family.type))
            series = values.setdefault(family.name, {})
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = dict(sample.labels)
                model = labels.pop("model_name", None)
                if model:
                    for name in model.split("&"):
                        if name not in models:
                            models.append(name)
                key = (sample.name, tuple(labels.items()))
                series.setdefault(key, []).append(float(sample.value))
    label = "&".join(models)
    out = []
    for name, (doc, kind) in families.items():
        metric = Metric(name, doc, kind)
        for (sample_name, labels), found in values[name].items():
            value = sum(found) / len(found) if kind == "gauge" and _is_share(name) else sum(found)
            full = {"model_name": label, **dict(labels)} if label else dict(labels)
            metric.add_sample(sample_name, full, value)
        out.append(metric)
    return out


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def render_families(families: list[Metric]) -> str:
    """Prometheus text in the servers' own layout."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))  # type: ignore[arg-type]
    return render(registry)


class MetricsAggregator:
    """Scrapes the instances and caches the combined text for ``reuse_time`` seconds."""

    def __init__(self, client: httpx.AsyncClient, reuse_time: float, scheme: str = "http",
                 timeout: float = 10.0) -> None:
        self.client = client
        self.reuse_time = reuse_time
        self.scheme = scheme
        self.timeout = timeout
        self._cached: tuple[float, str] | None = None
        self._lock = asyncio.Lock()

    async def _scrape(self, inst: Instance) -> str | None:
        try:
            resp = await self.client.get(f"{self.scheme}://{inst.ip}:{inst.metric_port}/metrics",
                                         timeout=self.timeout or None)
        except httpx.HTTPError as exc:
            log.warning("Get connection failed: metrics of instance %d (%s): %s", inst.id, inst.base_url,
                        type(exc).__name__)
            return None
        if resp.status_code != 200:
            log.warning("metrics of instance %d answered %d", inst.id, resp.status_code)
            return None
        return resp.text

    async def text(self, instances: list[Instance]) -> str | None:
        """The aggregated text, or None when no instance answered."""
        async with self._lock:
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < self.reuse_time:
                return self._cached[1]
            results: list[Any] = await asyncio.gather(*(self._scrape(i) for i in instances))
            texts = [t for t in results if t]
            if not texts:
                return None
            text = render_families(aggregate(texts))
            self._cached = (now, text)
            return text
