"""Benchmark output: terminal tables, per-request JSON, summary CSVs, PNG plots, and ``--compare``.

Files written to ``--SavePath`` for a run stamped ``{ts}`` (``YYYYmmdd_HHMMSS``, plus ``_rate{r}``
when several ``--RequestRate`` values run):

* ``results_per_request_{ts}.json`` - one object per measured request (warm-up excluded);
* ``result_perf_{ts}.csv`` - the per-request statistics table (rows = metrics, columns = average..N);
* ``result_common_{ts}.csv`` - the end-to-end table (Name,Value);
* ``summary_{ts}.json`` - both tables and the options, read by ``--compare``;
* ``ttft_{ts}.png``, ``tpot_{ts}.png``, ``throughput_{ts}.png`` - the plots.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from .metrics import COLUMNS, METRICS, RequestRecord


def fmt(value: Any, digits: int = 4) -> str:
    """A table cell: "-" for missing values, integers plain, floats to ``digits`` significant places."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.3e}"
        return f"{value:.{digits}f}".rstrip("0").rstrip(".") if abs(value) < 1e6 else f"{value:.4g}"
    return str(value)


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain ASCII table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    sep = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [sep, "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |", sep]
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    out.append(sep)
    return "\n".join(out)


def perf_table(stats: dict[str, dict[str, Any]], hide_empty: bool = True) -> str:
    """The per-request statistics as text."""
    rows = []
    for name, unit in METRICS:
        row = stats[name]
        if hide_empty and not row.get("N"):
            continue
        label = f"{name} ({unit})" if unit else name
        rows.append([label] + [fmt(row.get(c)) for c in COLUMNS])
    return table(["Metric"] + COLUMNS, rows)


def common_table(common: dict[str, Any]) -> str:
    """The end-to-end results as text."""
    return table(["Name", "Value"], [[k, fmt(v)] for k, v in common.items()])


def write_outputs(save: Path, ts: str, records: list[RequestRecord], stats: dict[str, dict[str, Any]],
                  common: dict[str, Any], options: dict[str, Any], plots: bool = True,
                  keep_ids: bool = False) -> dict[str, Path]:
    """Write the run's files; returns name -> path."""
    save.mkdir(parents=True, exist_ok=True)
    paths = {"per_request": save / f"results_per_request_{ts}.json", "perf_csv": save / f"result_perf_{ts}.csv",
             "common_csv": save / f"result_common_{ts}.csv", "summary": save / f"summary_{ts}.json"}
    paths["per_request"].write_text(json.dumps([r.to_json(keep_ids) for r in records], indent=1,
                                               ensure_ascii=False))
    with open(paths["perf_csv"], "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["Metric", "Unit"] + COLUMNS)
        for name, unit in METRICS:
            w.writerow([name, unit] + ["" if stats[name].get(c) is None else stats[name][c] for c in COLUMNS])
    with open(paths["common_csv"], "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["Name", "Value"])
        for key, value in common.items():
            w.writerow([key, "" if value is None else value])
    paths["summary"].write_text(json.dumps({"common": common, "perf": stats, "options": options}, indent=1,
                                           default=str))
    if plots:
        paths.update(make_plots(save, ts, records, common))
    return paths


def make_plots(save: Path, ts: str, records: list[RequestRecord], common: dict[str, Any]) -> dict[str, Path]:
    """TTFT and TPOT histograms and output tokens/s over time (1 s bins), with matplotlib (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.success]
    out: dict[str, Path] = {}
    title = f"{common.get('ModelName', '')} {common.get('TestType', '')} c={common.get('Concurrency')}"
    for key, values, label in (("ttft", [r.ttft_ms for r in ok if r.ttft_ms is not None], "TTFT (ms)"),
                               ("tpot", [r.tpot_ms for r in ok if r.tpot_ms is not None],
                                "TPOT (ms, first token excluded)")):
        fig, ax = plt.subplots(figsize=(6.4, 4))
        if values:
            ax.hist(values, bins=min(40, max(5, len(values) // 2)), color="#4472c4", edgecolor="white")
            for p, style in ((50, "--"), (99, ":")):
                v = float(np.percentile(values, p))
                ax.axvline(v, color="black", linestyle=style, label=f"P{p} ≈ {v:.1f} ms")
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no data (non-streaming run)", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(label)
        ax.set_ylabel("requests")
        ax.set_title(f"{label.split(' ')[0]} distribution - {title}")
        fig.tight_layout()
        path = save / f"{key}_{ts}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out[f"{key}_png"] = path
    times = [t for r in ok for t in (r.token_times or [r.end] * r.output_tokens)]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    width = 1.0
    if times:
        horizon = max(times)
        width = 1.0 if horizon >= 40 else max(horizon / 40, 0.05)
        bins = max(1, math.ceil(horizon / width))
        counts = [0] * bins
        for t in times:
            counts[min(bins - 1, int(t / width))] += 1
        ax.plot([(i + 0.5) * width for i in range(bins)], [c / width for c in counts], marker=".", color="#ed7d31")
        ax.set_xlim(0, bins * width)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel(f"output tokens/s ({width:.2g} s bins)")
    ax.set_title(f"Output tokens/s over time - {title}")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    path = save / f"throughput_{ts}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    out["throughput_png"] = path
    return out


def load_summary(path: str) -> tuple[Path, dict[str, Any]]:
    """A summary JSON: the file itself, or the newest ``summary_*.json`` in a folder."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("summary_*.json"), key=lambda f: f.stat().st_mtime)
        if not found:
            raise FileNotFoundError(f"{path}: no summary_*.json (run `mindie-host bench --SavePath {path}` first)")
        p = found[-1]
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no such file or folder")
    return p, json.loads(p.read_text())


COMPARE_COMMON = ["TestType", "ModelName", "Concurrency", "RequestRate", "Total", "Failed", "TimeElapsed",
                  "Throughput", "GenerateSpeed", "GenerateSpeedPerClient", "Goodput", "GoodputRatio", "accuracy"]
COMPARE_PERF = [("FirstTokenTime", "average"), ("FirstTokenTime", "P50"), ("FirstTokenTime", "P99"),
                ("TPOT", "average"), ("TPOT", "P50"), ("TPOT", "P99"), ("DecodeTime", "average"),
                ("DecodeTime", "P99"), ("GenerateTime", "average"), ("GenerateTime", "P99"),
                ("GeneratedTokens", "average"), ("InputTokens", "average"), ("QueueWaitTime", "average")]


def compare(path_a: str, path_b: str) -> str:
    """Two runs side by side, with B/A ratios for numbers."""
    fa, a = load_summary(path_a)
    fb, b = load_summary(path_b)
    rows = []

    def add(label: str, va: Any, vb: Any) -> None:
        if va is None and vb is None:
            return
        ratio = "-"
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and not isinstance(va, bool) and va:
            ratio = f"{vb / va:.3f}"
        rows.append([label, fmt(va), fmt(vb), ratio])

    for key in COMPARE_COMMON:
        add(key, a["common"].get(key), b["common"].get(key))
    for metric, col in COMPARE_PERF:
        add(f"{metric} {col}", a["perf"].get(metric, {}).get(col), b["perf"].get(metric, {}).get(col))
    return f"A: {fa}\nB: {fb}\n" + table(["Metric", "A", "B", "B/A"], rows)
