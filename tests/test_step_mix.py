"""bench/step_mix.py: a varied load driven through the engine in process, every forward pass timed and classed."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

from mindie_host.testing import make_tiny_llama, server_config

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "step_mix.py"


def _module() -> ModuleType:
    sys.path.insert(0, str(SCRIPT.parent))  # as the script itself does: it imports bench/varied_load.py
    return importlib.import_module(SCRIPT.stem)


def test_step_classes() -> None:
    sm = _module()
    assert sm.step_class(16, 0) == "decode only, 16 or more decode rows"
    assert sm.step_class(3, 0) == "decode only, fewer than 16 decode rows"
    assert sm.step_class(0, 512) == "prompt + decode, fewer than 16 decode rows"
    assert sm.step_class(20, 300) == "prompt + decode, 16 or more decode rows"


def test_a_load_accounts_for_every_row(tmp_path: Path) -> None:
    sm = _module()
    model = make_tiny_llama(tmp_path / "tiny")
    config = server_config(model, deploy={"maxSeqLen": 2048, "maxInputTokenLen": 1536})
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "mix.json"
    assert sm.main(["--conc", "2", "--max-tokens", "3", "--config", str(tmp_path / "config.json"),
                    "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    steps, classes = result["steps"], result["classes"]
    assert result["conc"] == 2 and 0 < result["generated"] <= 8 * 3  # 4 x conc requests, 3 tokens at most each
    assert sum(c["steps"] for c in classes.values()) == len(steps)
    assert sum(c["prompt_rows"] for c in classes.values()) == sum(p for _, p, _ in steps) > 8 * 40  # 40+ words each
    # every generated token but each request's first (which its last prompt row gives) came from a decode row
    assert sum(c["decode_rows"] for c in classes.values()) == result["generated"] - 8
    assert all(d <= 2 for d, _, _ in steps)  # never more than conc sequences decoding
