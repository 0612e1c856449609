"""``mindie-host bench --DatasetType textvqa``: a TextVQA-style local JSONL of images and questions, on every
HTTP protocol of a server with the multimodal plugin."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from mm_helpers import image_png, make_tiny_llava, mm_config

from mindie_host.testing import BenchDatasetError, RunningServer, load_bench_items, run_bench

ROWS = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("tiny-llava-bench"))


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[RunningServer]:
    with RunningServer(mm_config(model)) as s:
        yield s


@pytest.fixture(scope="module")
def textvqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("textvqa")
    (d / "images").mkdir()
    rows = []
    for i in range(ROWS):
        (d / "images" / f"{i}.png").write_bytes(image_png(56, 56, 100 + i))
        rows.append({"image": f"images/{i}.png", "question": f"What does sign {i} say?", "answers": [f"word{i}"]})
    path = d / "textvqa.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_textvqa_items_are_typed_lists(textvqa: Path, tmp_path: Path) -> None:
    items = load_bench_items("textvqa", str(textvqa), max_tokens=8, count=None, tokenizer_mode=True,
                       synthetic_config=None, seed=0, encode=None)
    assert len(items) == ROWS
    assert items[0].content is not None and items[0].content[0]["type"] == "image_url"
    assert items[0].content[0]["image_url"].startswith("data:image/png;base64,")
    assert items[0].content[1] == {"type": "text", "text": "What does sign 0 say?"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "no image"}) + "\n")
    with pytest.raises(BenchDatasetError, match="image"):
        load_bench_items("textvqa", str(bad), max_tokens=8, count=None, tokenizer_mode=True, synthetic_config=None,
                   seed=0, encode=None)


@pytest.mark.parametrize("test_type", ["openai", "tgi_client", "vllm_client", "triton_client", "native_client"])
def test_bench_textvqa_every_protocol(test_type: str, server: RunningServer, model: Path, textvqa: Path,
                                      tmp_path: Path) -> None:
    argv = ["--Http", server.url, "--ModelName", "tiny", "--ModelPath", str(model), "--SavePath", str(tmp_path),
            "--Concurrency", "2", "--WarmupSize", "0", "--MaxOutputLen", "6", "--Plot", "False",
            "--TestType", test_type, "--DatasetType", "textvqa", "--DatasetPath", str(textvqa)]
    assert run_bench(argv) == 0
    summary = json.loads(next(tmp_path.glob("summary_*.json")).read_text())
    assert summary["common"]["Total"] == ROWS and summary["common"]["Failed"] == 0, summary["common"]
    assert summary["perf"]["GeneratedTokens"]["max"] >= 1


def test_bench_textvqa_refuses_engine_mode(model: Path, textvqa: Path, tmp_path: Path) -> None:
    argv = ["--ModelPath", str(model), "--SavePath", str(tmp_path), "--TestType", "engine",
            "--DatasetType", "textvqa", "--DatasetPath", str(textvqa)]
    assert run_bench(argv) == 2
