"""bench/varied_load.py: distinct, long-tailed summarisation prompts from CPython's shipped docs, driven at a real server."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from types import ModuleType

from mindie_host.testing import RunningServer, make_tiny_llama, server_config

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "varied_load.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("varied_load", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prompts_are_distinct_long_tailed_and_reproducible() -> None:
    vl = _module()
    prompts = vl.make_prompts(128, seed=3)
    assert prompts == vl.make_prompts(128, seed=3) and prompts != vl.make_prompts(128, seed=4)
    assert len(set(prompts)) == 128
    words = sorted(len(p.split()) - len(vl.INSTRUCTION.split()) for p in prompts)
    assert words[0] >= 40 and words[-1] <= 900
    median = words[len(words) // 2]
    assert 150 <= median <= 330 and words[int(0.9 * len(words))] >= 2 * median  # a long tail
    # beyond the instruction line, no two passages start alike (a prefix cache gains nothing more)
    heads = {p[len(vl.INSTRUCTION):][:80] for p in prompts}
    assert len(heads) == 128


def test_runs_against_a_real_server(tmp_path: Path) -> None:
    vl = _module()
    model = make_tiny_llama(tmp_path / "tiny")
    with RunningServer(server_config(model, deploy={"maxSeqLen": 2048, "maxInputTokenLen": 1536})) as srv:
        prompts = vl.make_prompts(4, seed=1)
        result = asyncio.run(vl.run(srv.url, "tiny", 4, 2, 8, prompts))
    assert result["errors"] == 0 and result["n"] == 4 and result["out_tok_s"] > 0
    assert result["ttft_p50_ms"] is not None and result["prompt_words"]["max"] <= 900
