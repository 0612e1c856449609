"""lm-evaluation-harness against the real server (issue 18, defect 1).

A small multiple-choice task over a JSONL file written here is scored twice: by lm-eval's
``local-completions`` model talking to the server's ``/v1/completions`` (``echo`` with prompt
logprobs), and by lm-eval's ``hf`` model on the same weights in transformers. Accuracy and every
per-choice loglikelihood must agree (quantization ``none``).

lm-eval runs in a child process (:func:`~mindie_host.testing.child_process`): what it imports and builds (datasets,
its task index, transformers' model) leaves with that process instead of staying in the test process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from mindie_host.testing import RunningServer, child_process, server_config

lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [
    ("The capital of France is", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("Two plus two equals", ["three", "four", "five"], 1),
    ("The sky on a clear day is", ["green", "blue", "red"], 1),
    ("Water freezes at zero degrees", ["Celsius", "Kelvin", "Fahrenheit"], 0),
    ("The largest planet in the solar system is", ["Mars", "Venus", "Jupiter", "Mercury"], 2),
    ("A week has seven", ["days", "hours", "months"], 0),
    ("The opposite of hot is", ["warm", "cold", "loud"], 1),
    ("Bees make", ["milk", "honey", "silk", "wool"], 1),
    ("The first month of the year is", ["March", "January", "July"], 1),
    ("Cats like to chase", ["mice", "clouds", "trains"], 0),
    ("The sun rises in the", ["west", "north", "east", "south"], 2),
    ("Ice is frozen", ["air", "water", "sand"], 1),
]

TASK_YAML = """\
task: mindie_host_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _evaluate(model: str, model_args: dict[str, Any], task_dir: Path) -> tuple[float, list[list[float]]]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=model, model_args=model_args, tasks=["mindie_host_mc"],
                              task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                              batch_size=1, bootstrap_iters=0)
    acc = results["results"]["mindie_host_mc"]["acc,none"]
    samples = sorted(results["samples"]["mindie_host_mc"], key=lambda s: s["doc_id"])
    lls = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    return acc, lls


def test_lm_eval_local_completions_matches_hf(tiny_model: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "label": a}) + "\n" for q, c, a in QUESTIONS))
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    (task_dir / "mindie_host_mc.yaml").write_text(TASK_YAML.format(data=data))

    with child_process() as child:  # started now, with the environment set above
        hf_acc, hf_lls = child.submit(_evaluate, "hf", {"pretrained": str(tiny_model), "dtype": "float32",
                                                        "device": "cpu"}, task_dir).result()
        cfg = server_config(tiny_model, model={"quantization": "none"})
        with RunningServer(cfg) as server:
            api_acc, api_lls = child.submit(_evaluate, "local-completions", {
                "base_url": server.url + "/v1/completions", "model": "tiny", "tokenizer": str(tiny_model),
                "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1,
            }, task_dir).result()
    assert len(api_lls) == len(hf_lls) == len(QUESTIONS)
    for got, want in zip(api_lls, hf_lls):
        assert got == pytest.approx(want, abs=1e-3)
    assert api_acc == hf_acc
    # the scores are real: a choice's loglikelihood is a sum over its tokens, never zero or all equal
    assert all(x < 0 for row in api_lls for x in row)
    assert len({round(x, 4) for row in api_lls for x in row}) > len(QUESTIONS)
    assert os.environ.get("HF_DATASETS_OFFLINE") == "1"
