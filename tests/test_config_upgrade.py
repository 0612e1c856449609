"""``mindie-host config upgrade`` (spec §8.4.4): forward only, pipelineNumber -> modelInstanceNumber, loader-checked."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest

from mindie_host.cli import main
from mindie_host.config import load_config

RC1 = {
    "Version": "1.0.0",
    "ServerConfig": {"port": 1025, "httpsEnabled": False},
    "BackendConfig": {
        "pipelineNumber": 2,
        "npuDeviceIds": [[0], [1]],
        "ModelDeployConfig": {"maxSeqLen": 2560, "ModelConfig": [{"modelName": "llama_65b", "worldSize": 1}]},
    },
}


def write(tmp_path: Path, data: Any, name: str = "old.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def run(*args: str) -> int:
    return main(["config", "upgrade", *args])


def test_rc1_pipeline_number_becomes_model_instance_number(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    old, new = write(tmp_path, RC1), tmp_path / "new.json"
    assert run("--old_config_path", str(old), "--new_config_path", str(new)) == 0
    assert "upgraded from 0.1.0 (1.0.RC1) to 1.1.0 (1.0.0)" in capsys.readouterr().out
    data = json.loads(new.read_text())
    assert "pipelineNumber" not in data["BackendConfig"]
    assert data["BackendConfig"]["modelInstanceNumber"] == 2
    assert data["ServerConfig"] == RC1["ServerConfig"]  # values carried over, nothing added
    assert stat.S_IMODE(new.stat().st_mode) == 0o640
    cfg = load_config(new)
    assert cfg.BackendConfig.modelInstanceNumber == 2 and cfg.deploy.maxSeqLen == 2560
    assert json.loads(old.read_text()) == RC1  # the old file is untouched
    # each intermediate target works too, and its result can be upgraded on
    mid = tmp_path / "rc2.json"
    assert run("--old_config_path", str(old), "--new_config_path", str(mid), "--target_version", "0.2.0") == 0
    assert json.loads(mid.read_text()) == data
    assert (
        run("--old_config_path", str(mid), "--old_version", "0.2.0", "--new_config_path", str(tmp_path / "final.json"))
        == 0
    )


@pytest.mark.parametrize(
    ("data", "extra", "message"),
    [
        ({"BackendConfig": {"modelInstanceNumber": 1}}, [], "is the same version"),
        ({}, ["--old_version", "1.1.0", "--target_version", "1.0.0"], "an earlier version (no rollback)"),
        ({"BackendConfig": {"pipelineNumber": 2, "modelInstanceNumber": 3}}, [], "remove one or make them agree"),
        ({"BackendConfig": {"pipelineNumber": 11}}, [], "allowed an integer in [1, 10]"),
        ({"BackendConfig": {"pipelineNumber": 1}, "ScheduleConfig": {"pipelineNumber": 2}}, [], "set more than once"),
        ({"BackendConfig": {"pipelineNumber": 1}}, ["--old_version", "0.2.0"], "only 1.0.RC1 (0.1.0) configs have"),
        ({"BackendConfig": {"pipelineNumber": 1}, "OtherParam": {"a": 1}}, [], "does not have: OtherParam"),
        ({"BackendConfig": {"pipelineNumber": 2}}, [], "BackendConfig.npuDeviceIds: got [[0]]; allowed 2 device"),
    ],
)
def test_refused(tmp_path: Path, capsys: pytest.CaptureFixture, data: dict, extra: list[str], message: str) -> None:
    old, new = write(tmp_path, data), tmp_path / "new.json"
    assert run("--old_config_path", str(old), "--new_config_path", str(new), *extra) == 1
    assert message in capsys.readouterr().err
    assert not new.exists()


def test_output_path(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    old = write(tmp_path, {"BackendConfig": {"pipelineNumber": 1}})
    monkeypatch.chdir(tmp_path)
    assert run("--old_config_path", str(old)) == 0
    written = [p for p in tmp_path.glob("*.json") if p.stem.isdigit() and len(p.stem) == 14]  # ./<timestamp>.json
    assert len(written) == 1 and load_config(written[0]).BackendConfig.modelInstanceNumber == 1
    assert run("--old_config_path", str(old), "--new_config_path", str(written[0])) == 1
    assert "exists (use --force" in capsys.readouterr().err
    assert run("--old_config_path", str(old), "--new_config_path", str(written[0]), "--force") == 0
    assert run("--old_config_path", str(old), "--new_config_path", str(old)) == 1
    assert "is the old file" in capsys.readouterr().err
