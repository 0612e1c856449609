"""``compile: true``: decode steps of up to 16 sequences run through torch.compile, with the same tokens as eager.

A first compile that runs past the budget for slow machines (3 minutes; 400 s on two Zen 3 cores) is stopped:
decode steps stay eager, the log says so, and later starts of that model do not try again. The tests that compile
lift the budget (``MINDIE_HOST_COMPILE_BUDGET_S=0``), so a busy machine does not stop them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mindie_host.api import EngineRequest, SamplingParams
from mindie_host.backends.torch.backend import TorchBackend
from mindie_host.testing import loaded_host, run_engine, server_config

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def no_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINDIE_HOST_COMPILE_BUDGET_S", "0")


def _requests() -> list[EngineRequest]:
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [42] * 11, [100, 200, 300, 400], [5, 6], [77, 78, 79, 80, 81, 82]]
    return [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=12, ignore_eos=True)) for i, p in enumerate(prompts)]


def test_the_step_compiles_in_the_background_and_gives_the_eager_tokens(tiny_model: Path, tmp_path: Path,
                                                                       monkeypatch) -> None:
    """One compile, from a cold cache: the engine serves at once (eagerly), then compiled, with the eager tokens."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a cold cache
    eager = loaded_host(server_config(tiny_model, model={"compile": False}))
    compiled = loaded_host(server_config(tiny_model, model={"compile": True}))
    backend = compiled.backend
    assert not backend.compile_finished.is_set()  # warm-up returned before the compile ended
    assert backend.model.compiled_decode is None
    want = run_engine(eager, _requests())
    got = run_engine(compiled, _requests())  # served now, eagerly or (if the compile ends meanwhile) compiled
    assert {rid: out.token_ids for rid, out in got.items()} == {rid: out.token_ids for rid, out in want.items()}
    assert backend.wait_compiled(600)
    model = backend.model
    assert model.compiled_decode is not None
    before = model.compiled_steps
    again = run_engine(compiled, _requests())
    assert model.compiled_steps - before >= 11  # every decode step of these 6 sequences ran compiled
    assert {rid: out.token_ids for rid, out in again.items()} == {rid: out.token_ids for rid, out in want.items()}
    assert eager.backend.model.compiled_steps == 0
    # a lone request (batch of one is its own compiled graph) also matches
    one = [EngineRequest("solo", [3, 1, 4, 1, 5], SamplingParams(max_tokens=8, ignore_eos=True))]
    assert run_engine(compiled, one)["solo"].token_ids == run_engine(eager, one)["solo"].token_ids


def test_a_compile_past_its_budget_is_stopped_and_not_tried_again(tiny_model: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a cold cache: far more than 1 s
    monkeypatch.setenv("MINDIE_HOST_COMPILE_BUDGET_S", "1")
    marker = tmp_path / "too-slow.json"
    monkeypatch.setattr(TorchBackend, "_slow_compile_marker", lambda self: marker)
    with caplog.at_level(logging.WARNING, "mindie_host.backends.torch"):
        host = loaded_host(server_config(tiny_model, model={"compile": True}))
        assert host.backend.wait_compiled(120)
    assert host.backend.model.compiled_decode is None and marker.exists()
    assert any("takes more than 1 s on this machine" in r.getMessage() and "stay eager" in r.getMessage()
               for r in caplog.records)
    assert run_engine(host, _requests())  # served eagerly
    caplog.clear()
    with caplog.at_level(logging.WARNING, "mindie_host.backends.torch"):
        again = loaded_host(server_config(tiny_model, model={"compile": True}))
        assert again.backend.wait_compiled(5)  # not tried
    assert any("is not tried" in r.getMessage() for r in caplog.records)
