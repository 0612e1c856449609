"""Serving metrics: the Prometheus exporter on ``metricsPort`` and the numbers behind ``/metrics-json``.

Every series the spec lists (seed-api-triton-native-mgmt.md §4.4) is produced with
``prometheus-client`` objects: counters and gauges by a collector that reads the
engine statistics at scrape time, histograms by :class:`prometheus_client.Histogram`
fed from the engine's per-step outputs. Each series carries ``model_name`` (several
models joined with ``&``). The text is written in MindIE's layout: histogram lines in
the order ``_count``, ``_sum``, ``_bucket``, and numbers without a trailing ``.0``
(``le="1"``, ``le="2.5"``, ``le="+Inf"``).

After the spec's twenty metrics come this host's own, prefixed ``mindie_host_``
(KV blocks in use and in total, HTTP requests in progress / queued / rejected) and
every gauge a plugin returns from ``mindie_host_metrics``.

``MIES_SERVICE_MONITOR_MODE``: MindIE serves ``/metrics`` only when it is ``1``. This
host serves it unless the variable is set to ``0`` (then ``/metrics`` answers 500 with
the spec's message), because a fresh install should be observable.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .. import hookimpl
from ..engine.request import RequestOutput
from ..host_state import CacheSlot
from .admission import LINK_GATE
from .app import json_response

if TYPE_CHECKING:
    from ..context import HostContext
    from ..host_protocol import Host

ENV_MONITOR = "MIES_SERVICE_MONITOR_MODE"
ENV_WINDOW = "DYNAMIC_AVERAGE_WINDOW_SIZE"
MONITOR_OFF_MESSAGE = "Environment variable MIES_SERVICE_MONITOR_MODE is not set."
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5)
E2E_BUCKETS = (1, 2.5, 5, 10, 15, 20, 30, 40, 50, 60)
TOKEN_BUCKETS = (10, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

#: (name without ``_total`` for counters, type, HELP text) in the spec's order.
SPEC_SCALARS: tuple[tuple[str, str, str], ...] = (
    ("request_received", "counter", "Number of requests received so far."),
    ("request_success", "counter", "Number of requests proceed successfully so far."),
    ("request_failed", "counter", "Number of requests failed so far."),
    ("num_preemptions", "counter", "Cumulative number of preemption from the engine."),
    ("num_requests_running", "gauge", "Number of requests currently running on NPU."),
    ("num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    ("num_requests_swapped", "gauge", "Number of requests swapped to CPU."),
    ("prompt_tokens", "counter", "Number of prefill tokens processed."),
    ("generation_tokens", "counter", "Number of generation tokens processed."),
    ("avg_prompt_throughput_toks_per_s", "gauge", "Average prefill throughput in tokens/s."),
    ("avg_generation_throughput_toks_per_s", "gauge", "Average generation throughput in tokens/s."),
    ("failed_request_perc", "gauge", "Requests failure rate. 1 means 100 percent usage."),
    ("npu_cache_usage_perc", "gauge", "NPU KV-cache usage. 1 means 100 percent usage."),
    ("cpu_cache_usage_perc", "gauge", "CPU KV-cache usage. 1 means 100 percent usage."),
    ("npu_prefix_cache_hit_rate", "gauge", "NPU prefix cache block hit rate."),
)

#: (name, HELP text, buckets) of the spec's histograms, in order.
SPEC_HISTOGRAMS: tuple[tuple[str, str, tuple[float, ...]], ...] = (
    ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    ("time_per_output_token_seconds", "Histogram of time per output token in seconds.", TPOT_BUCKETS),
    ("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", E2E_BUCKETS),
    ("request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS),
    ("request_generation_tokens", "Number of generation tokens processed.", TOKEN_BUCKETS),
)

#: Engine statistics already shown under a spec name (not repeated as plugin gauges).
_ENGINE_KEYS = {
    "num_running", "num_waiting", "kv_blocks_total", "kv_blocks_used", "kv_blocks_free", "kv_usage",
    "num_active_requests", "npu_prefix_cache_hit_rate",
}
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def monitor_enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether ``/metrics`` is served (``MIES_SERVICE_MONITOR_MODE`` unset or not ``0``)."""
    env = os.environ if environ is None else environ
    return env.get(ENV_MONITOR, "1").strip() != "0"


def window_size(environ: dict[str, str] | None = None) -> int:
    """``DYNAMIC_AVERAGE_WINDOW_SIZE`` (default 1000): how many requests the /metrics-json averages span."""
    env = os.environ if environ is None else environ
    try:
        value = int(env.get(ENV_WINDOW, "1000"))
    except ValueError:
        return 1000
    return value if value > 0 else 1000


def format_value(value: float) -> str:
    """A number as MindIE prints it: ``1`` not ``1.0``, ``+Inf``, ``NaN``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def model_label(host: Host) -> str:
    """The ``model_name`` label: every configured model name joined with ``&``."""
    names = [m.modelName for m in host.config.deploy.ModelConfig] or [host.model_name]
    return "&".join(names)


class ServingMetrics:
    """Per-request measurements taken from the engine's outputs (worker thread) for both exporters."""

    def __init__(self, model_name: str, window: int = 1000) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.histograms: dict[str, Histogram] = {}
        self._lock = threading.Lock()
        self.ttft_window: deque[float] = deque(maxlen=window)
        self.tbt_window: deque[float] = deque(maxlen=window)
        self.prompt_throughput = 0.0
        self.generation_throughput = 0.0
        self.finished: dict[str, int] = {}

    def add_histograms(self) -> None:
        """Create the five spec histograms in this object's registry."""
        for name, doc, buckets in SPEC_HISTOGRAMS:
            self.histograms[name] = Histogram(
                name, doc, labelnames=("model_name",), buckets=buckets, registry=self.registry
            )
            self.histograms[name].labels(self.model_name)  # zero series exist before the first request

    def observe(self, outputs: Iterable[RequestOutput]) -> None:
        """Record every finished request among ``outputs`` (an engine step hook)."""
        for out in outputs:
            if out.finished:
                self._observe_finished(out)

    def _observe_finished(self, out: RequestOutput) -> None:
        label = self.model_name
        h = self.histograms
        reason = out.finish_reason or "unknown"
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
        if h:
            h["request_prompt_tokens"].labels(label).observe(out.num_prompt_tokens)
        if reason not in ("stop", "length"):
            return
        n_out = len(out.token_ids)
        if out.first_token_time is not None:
            ttft = max(0.0, out.first_token_time - out.arrival_time)
            self.ttft_window.append(ttft)
            if h:
                h["time_to_first_token_seconds"].labels(label).observe(ttft)
            if out.first_scheduled_time is not None and out.first_token_time > out.first_scheduled_time:
                self.prompt_throughput = out.num_prompt_tokens / (out.first_token_time - out.first_scheduled_time)
        times = out.token_times
        gaps = [b - a for a, b in zip(times, times[1:])]
        if gaps:
            self.tbt_window.append(sum(gaps) / len(gaps))
            if times[-1] > times[0]:
                self.generation_throughput = len(gaps) / (times[-1] - times[0])
        if h:
            tpot = h["time_per_output_token_seconds"].labels(label)
            for gap in gaps:
                tpot.observe(max(0.0, gap))
            if out.finished_time is not None:
                h["e2e_request_latency_seconds"].labels(label).observe(max(0.0, out.finished_time - out.arrival_time))
            h["request_generation_tokens"].labels(label).observe(n_out)

    @property
    def ttft_average(self) -> float:
        """Mean time to first token over the window, seconds (0 with no data)."""
        window = list(self.ttft_window)
        return sum(window) / len(window) if window else 0.0

    @property
    def tbt_average(self) -> float:
        """Mean time between tokens over the window, seconds (0 with no data)."""
        window = list(self.tbt_window)
        return sum(window) / len(window) if window else 0.0


#: the Prometheus histograms and the latency windows, per host
SERVING_METRICS: CacheSlot[ServingMetrics] = CacheSlot("serving metrics")


def serving_metrics(host: Host) -> ServingMetrics:
    """The host's :class:`ServingMetrics`, created on first use."""
    return host.caches.get_or_make(SERVING_METRICS, lambda: _new_metrics(host))


def _new_metrics(host: Host) -> ServingMetrics:
    metrics = ServingMetrics(model_label(host), window_size())
    metrics.registry.register(_ScalarCollector(host))
    metrics.add_histograms()
    metrics.registry.register(_ExtraCollector(host))
    return metrics


class _ScalarCollector(Collector):
    """Counters and gauges read from the engine statistics at scrape time."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def collect(self) -> Iterator[Metric]:
        values = spec_scalar_values(self.host)
        label = model_label(self.host)
        for name, kind, doc in SPEC_SCALARS:
            family_cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_cls(name, doc, labels=("model_name",))
            family.add_metric((label,), values.get(name, 0.0))
            yield family


class _ExtraCollector(Collector):
    """This host's own gauges and the plugins' gauges, after the spec's metrics."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def collect(self) -> Iterator[Metric]:
        yield from _extra_families(self.host, model_label(self.host))


def read_stats(host: Host) -> dict[str, float]:
    """``host.stats()``, retried if the engine thread adds a counter while it is being read."""
    for _ in range(5):
        try:
            return host.stats()
        except RuntimeError:  # dictionary changed size during iteration
            continue
    return host.stats()


def spec_scalar_values(host: Host) -> dict[str, float]:
    """Values of the spec's counters and gauges from ``host.stats()``."""
    stats = read_stats(host)
    metrics = host.caches.get(SERVING_METRICS)
    received = stats.get("requests_received", 0.0)
    failed = stats.get("finished_error", 0.0) + stats.get("finished_timeout", 0.0)
    return {
        "request_received": received,
        "request_success": stats.get("finished_stop", 0.0) + stats.get("finished_length", 0.0),
        "request_failed": failed,
        "num_preemptions": stats.get("preemptions", 0.0),
        "num_requests_running": stats.get("num_running", 0.0),
        "num_requests_waiting": stats.get("num_waiting", 0.0),
        "num_requests_swapped": stats.get("num_swapped", 0.0),
        "prompt_tokens": stats.get("prompt_tokens", 0.0),
        "generation_tokens": stats.get("generation_tokens", 0.0),
        "avg_prompt_throughput_toks_per_s": metrics.prompt_throughput if metrics else 0.0,
        "avg_generation_throughput_toks_per_s": metrics.generation_throughput if metrics else 0.0,
        "failed_request_perc": failed / received if received else 0.0,
        "npu_cache_usage_perc": stats.get("kv_usage", 0.0),
        "cpu_cache_usage_perc": stats.get("swap_usage", 0.0),
        "npu_prefix_cache_hit_rate": stats.get("npu_prefix_cache_hit_rate", 0.0),
    }


def _extra_families(host: Host, label: str) -> Iterator[Metric]:
    stats = read_stats(host)
    gauges = [
        ("mindie_host_kv_blocks_used", "KV-cache blocks referenced by live requests.", stats.get("kv_blocks_used", 0.0)),
        ("mindie_host_kv_blocks_total", "KV-cache blocks in the pool.", stats.get("kv_blocks_total", 0.0)),
        ("mindie_host_requests_active", "Requests submitted to the engine and not finished.",
         stats.get("num_active_requests", 0.0)),
    ]
    gate = host.caches.get(LINK_GATE)
    if gate is not None:
        gauges.append(("mindie_host_http_requests_processing", "Business requests being processed (maxLinkNum).",
                       float(gate.active)))
        gauges.append(("mindie_host_http_requests_queued", "Business requests queued for a processing slot.",
                       float(gate.waiting)))
    for name, doc, value in gauges:
        family = GaugeMetricFamily(name, doc, labels=("model_name",))
        family.add_metric((label,), value)
        yield family
    if gate is not None:
        counter = CounterMetricFamily("mindie_host_http_requests_rejected", "Business requests refused by maxLinkNum.",
                                      labels=("model_name",))
        counter.add_metric((label,), float(gate.rejected))
        yield counter
    restarts = getattr(host.engine, "restarts", None)
    if restarts is not None:  # engineProcess: restarts of the engine process (runtime/engine_client.py)
        counter = CounterMetricFamily("mindie_host_engine_restarts", "Restarts of the engine process after it died.",
                                      labels=("model_name",))
        counter.add_metric((label,), float(restarts))
        yield counter
    spec_names = {name for name, _, _ in SPEC_SCALARS}
    for key, value in plugin_metrics(host).items():
        if key in spec_names or key in _ENGINE_KEYS or not _METRIC_NAME.fullmatch(key):
            continue
        family = GaugeMetricFamily(key, f"Plugin metric {key}.", labels=("model_name",))
        family.add_metric((label,), float(value))
        yield family


def plugin_metrics(host: Host) -> dict[str, float]:
    """Gauges contributed by plugins through ``mindie_host_metrics`` (the engine process's included)."""
    out: dict[str, float] = {}
    for key, value in host.plugin_metrics().items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def render(registry: CollectorRegistry) -> str:
    """Prometheus text exposition in MindIE's layout (see the module docstring)."""
    lines: list[str] = []
    for family in registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        lines.append(f"# HELP {name} {family.documentation}")
        lines.append(f"# TYPE {name} {family.type}")
        samples = [s for s in family.samples if not s.name.endswith("_created")]
        if family.type == "histogram":
            order = {"_count": 0, "_sum": 1, "_bucket": 2}
            samples.sort(key=lambda s: order.get(s.name[len(family.name):], 3))
        for s in samples:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in s.labels.items())
            if "le" in s.labels:  # le last, as in the spec's sample
                others = ",".join(f'{k}="{_escape(v)}"' for k, v in s.labels.items() if k != "le")
                labels = f'{others},le="{format_value(float(s.labels["le"]))}"' if others else \
                    f'le="{format_value(float(s.labels["le"]))}"'
            lines.append(f"{s.name}{{{labels}}} {format_value(s.value)}" if labels else f"{s.name} {format_value(s.value)}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def metrics_json(host: Host, instance: str) -> dict[str, Any]:
    """The ``/metrics-json`` body (spec §4.1): TTFT, TBT, waiting, processing, remainBlocks, then plugin gauges."""
    stats = read_stats(host)
    metrics = host.caches.get(SERVING_METRICS)
    values: list[tuple[str, float]] = [
        ("TTFT", metrics.ttft_average if metrics else 0.0),
        ("TBT", metrics.tbt_average if metrics else 0.0),
        ("waitingInferRequestNum", stats.get("num_waiting", 0.0)),
        ("processingInferRequestNum", stats.get("num_running", 0.0)),
        ("remainBlocks", stats.get("kv_blocks_free", 0.0)),
    ]
    values.extend(plugin_metrics(host).items())
    return {
        "resultType": "vector",
        "result": [
            {"metric": [{"__name__": name, "job": "node", "instance": instance}], "value": format_value(float(v))}
            for name, v in values
        ],
    }


# -- hooks -------------------------------------------------------------------------------------
@hookimpl
def mindie_host_step_outputs(ctx: HostContext, outputs: list[RequestOutput]) -> None:
    """Feed the histograms from every engine step."""
    if ctx.host is not None:
        serving_metrics(ctx.host).observe(outputs)


@hookimpl
def mindie_host_add_routes(ctx: HostContext, app: FastAPI, plane: str) -> None:
    """``GET /metrics`` on the metrics plane."""
    host = ctx.host
    assert host is not None  # routes are added for a running host
    if plane != "metrics":
        return

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if not monitor_enabled():
            return json_response({"type": "Incomplete Generation", "error": MONITOR_OFF_MESSAGE}, status=500)
        text = render(serving_metrics(host).registry)
        return Response(text, media_type=CONTENT_TYPE)
