"""Per-request records and the statistics the benchmark reports.

Definitions (identical to ``shared/peers/loadgen.py`` for TTFT and TPOT):

* a request starts when the benchmark sends it; every streamed event that carries generated text
  (or token ids) is a token arrival;
* **FirstTokenTime / TTFT** = first arrival - start;
* **TPOT** = (last arrival - first arrival) / (arrivals - 1): the first token is excluded; only
  requests with at least two arrivals have one;
* **DecodeTime** = every gap between consecutive arrivals (token granularity);
* percentiles interpolate linearly between order statistics (numpy's default, loadgen's ``pct``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

#: Columns of the per-request statistics table (MindIE's plus P50 for comparison with loadgen).
COLUMNS = ["average", "max", "min", "P50", "P75", "P90", "SLO_P90", "P99", "N"]

#: Rows of the statistics table, with units, in MindIE's order (TTFT and TPOT are extra rows).
METRICS: list[tuple[str, str]] = [
    ("FirstTokenTime", "ms"),
    ("DecodeTime", "ms"),
    ("LastDecodeTime", "ms"),
    ("MaxDecodeTime", "ms"),
    ("GenerateTime", "ms"),
    ("TPOT", "ms"),
    ("InputTokens", "tokens"),
    ("GeneratedTokens", "tokens"),
    ("GeneratedTokenSpeed", "token/s"),
    ("GeneratedCharacters", "chars"),
    ("Tokenizer", "ms"),
    ("Detokenizer", "ms"),
    ("CharactersPerToken", ""),
    ("PostProcessingTime", "ms"),
    ("ForwardTime", "ms"),
    ("PrefillBatchsize", ""),
    ("DecoderBatchsize", ""),
    ("QueueWaitTime", "us"),
]


@dataclass
class RequestRecord:
    """What one benchmark request measured (times are seconds from the run's start)."""

    index: int
    prompt: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    output_text: str = ""
    start: float = 0.0
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)
    success: bool = False
    error: str | None = None
    finish_reason: str | None = None
    tokenizer_ms: float | None = None
    detokenizer_ms: float | None = None
    prefill_batch_sizes: list[int] = field(default_factory=list)
    decode_batch_sizes: list[int] = field(default_factory=list)
    queue_wait_us: list[float] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    input_token_ids: list[int] = field(default_factory=list)
    reference: Any = None

    # -- derived -------------------------------------------------------------------------------
    @property
    def ttft_ms(self) -> float | None:
        return (self.token_times[0] - self.start) * 1000 if self.token_times else None

    @property
    def gaps_ms(self) -> list[float]:
        t = self.token_times
        return [(t[i] - t[i - 1]) * 1000 for i in range(1, len(t))]

    @property
    def tpot_ms(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) * 1000 / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e_ms(self) -> float:
        return (self.end - self.start) * 1000

    def to_json(self, keep_ids: bool = False) -> dict[str, Any]:
        """The per-request JSON entry (derived metrics included)."""
        data = asdict(self)
        if not keep_ids:
            data.pop("output_token_ids")
            data.pop("input_token_ids")
        data["FirstTokenTime"] = self.ttft_ms
        data["TPOT"] = self.tpot_ms
        data["GenerateTime"] = self.e2e_ms
        data["DecodeTimes"] = self.gaps_ms
        return data


def percentile(values: list[float], p: float) -> float | None:
    """Linear-interpolated percentile (same as loadgen's ``pct``); None for no values."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), p))


def _row(token_values: list[float], per_request: list[float] | None, avg_only: bool = False,
         no_slo: bool = False) -> dict[str, Any]:
    """Statistics of one metric: token-granular values plus per-request means for SLO_P90."""
    if not token_values:
        return {c: None for c in COLUMNS} | {"N": 0}
    arr = np.asarray(token_values, dtype=float)
    row: dict[str, Any] = {"average": float(arr.mean()), "N": len(token_values)}
    if avg_only:
        return {c: None for c in COLUMNS} | row
    row.update({"max": float(arr.max()), "min": float(arr.min()), "P50": percentile(token_values, 50),
                "P75": percentile(token_values, 75), "P90": percentile(token_values, 90),
                "P99": percentile(token_values, 99)})
    row["SLO_P90"] = None if no_slo else percentile(per_request if per_request is not None else token_values, 90)
    return row


def per_request_stats(records: list[RequestRecord]) -> dict[str, dict[str, Any]]:
    """The statistics table: metric -> column -> value, over successful requests."""
    ok = [r for r in records if r.success]
    gaps = [r.gaps_ms for r in ok]
    stats: dict[str, dict[str, Any]] = {}
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    stats["FirstTokenTime"] = _row(ttft, None)
    stats["DecodeTime"] = _row([g for gs in gaps for g in gs], [sum(gs) / len(gs) for gs in gaps if gs])
    stats["LastDecodeTime"] = _row([gs[-1] for gs in gaps if gs], None)
    stats["MaxDecodeTime"] = _row([max(gs) for gs in gaps if gs], None)
    stats["GenerateTime"] = _row([r.e2e_ms for r in ok], None)
    stats["TPOT"] = _row([r.tpot_ms for r in ok if r.tpot_ms is not None], None)
    stats["InputTokens"] = _row([float(r.input_tokens) for r in ok], None)
    stats["GeneratedTokens"] = _row([float(r.output_tokens) for r in ok], None)
    speeds = [r.output_tokens / (r.e2e_ms / 1000) for r in ok if r.e2e_ms > 0]
    stats["GeneratedTokenSpeed"] = _row(speeds, None)
    stats["GeneratedCharacters"] = _row([float(len(r.output_text)) for r in ok], None)
    stats["Tokenizer"] = _row([r.tokenizer_ms for r in ok if r.tokenizer_ms is not None], None)
    stats["Detokenizer"] = _row([r.detokenizer_ms for r in ok if r.detokenizer_ms is not None], None)
    chars = sum(len(r.output_text) for r in ok)
    tokens = sum(r.output_tokens for r in ok)
    stats["CharactersPerToken"] = _row([chars / tokens] if tokens else [], None, avg_only=True)
    stats["PostProcessingTime"] = _row([], None)
    stats["ForwardTime"] = _row([], None)
    pb = [[float(b) for b in r.prefill_batch_sizes] for r in ok]
    stats["PrefillBatchsize"] = _row([b for bs in pb for b in bs], [sum(bs) / len(bs) for bs in pb if bs])
    stats["DecoderBatchsize"] = _row([float(b) for r in ok for b in r.decode_batch_sizes], None, no_slo=True)
    stats["QueueWaitTime"] = _row([float(q) for r in ok for q in r.queue_wait_us], None, no_slo=True)
    return stats


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft:500,tpot:50,e2e:10000"`` (milliseconds) -> thresholds; raises ValueError naming the problem."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for part in text.split(","):
        key, _, value = part.partition(":")
        key = key.strip().lower()
        if key not in ("ttft", "tpot", "e2e"):
            raise ValueError(f"--SLO key {key!r} is not one of ttft, tpot, e2e")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"--SLO value for {key} must be milliseconds, got {value!r}") from None
        if not out[key] > 0:
            raise ValueError(f"--SLO {key} must be > 0 ms")
    return out


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a successful request met every threshold (a missing TPOT counts as met)."""
    if not record.success:
        return False
    checks = {"ttft": record.ttft_ms, "tpot": record.tpot_ms, "e2e": record.e2e_ms}
    for key, limit in slo.items():
        value = checks[key]
        if key == "ttft" and value is None:
            value = record.e2e_ms  # non-streaming: the first token arrives with the whole answer
        if value is not None and value > limit:
            return False
    return True


def run_totals(records: list[RequestRecord], elapsed_s: float, concurrency: int, slo: dict[str, float],
               stats: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The end-to-end table (MindIE Table 8-6 plus goodput)."""
    ok = [r for r in records if r.success]
    tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.input_tokens for r in ok)
    ttft_total = sum(r.ttft_ms or 0.0 for r in ok)
    speed = tokens / elapsed_s if elapsed_s > 0 else 0.0
    totals: dict[str, Any] = {
        "TimeElapsed": round(elapsed_s, 4),
        "Failed": sum(1 for r in records if not r.success),
        "Returned": sum(1 for r in records if r.success or r.output_text),
        "Total": len(records),
        "Concurrency": concurrency,
        "lpct": (ttft_total / input_tokens) if input_tokens else None,
        "Throughput": len(ok) / elapsed_s if elapsed_s > 0 else 0.0,
        "GenerateSpeed": speed,
        "GenerateSpeedPerClient": speed / concurrency if concurrency else None,
        "InputTokensTotal": input_tokens,
        "GeneratedTokensTotal": tokens,
    }
    if slo:
        good = sum(1 for r in records if meets_slo(r, slo))
        totals["SLO"] = ",".join(f"{k}:{v:g}" for k, v in slo.items())
        totals["Goodput"] = good / elapsed_s if elapsed_s > 0 else 0.0
        totals["GoodputRatio"] = good / len(records) if records else 0.0
    for key in ("FirstTokenTime", "TPOT"):
        for col in ("P50", "P99"):
            value = stats[key][col]
            totals[f"{key}_{col}"] = None if value is None or math.isnan(value) else value
    return totals
