"""MINDIE_CHECK_INPUTFILES_PERMISSION: config files at most 0640, TLS files at most 0600, owned by us or root."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from test_tls import issue, make_ca, write_pem

from mindie_host.cli import main
from mindie_host.config import ConfigError, default_config_dict, load_config
from mindie_host.file_modes import ENV_CHECK, write_file
from mindie_host.ms.controller.config import default_controller_dict, load_controller_config
from mindie_host.ms.coordinator.config import default_coordinator_dict, load_coordinator_config
from mindie_host.server.tls import TLSConfigError, build_ssl_context


@pytest.fixture(autouse=True)
def checks_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_CHECK, raising=False)  # the default: unset means checked


def config_file(tmp_path: Path, mode: int, name: str = "config.json", data: dict | None = None) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data if data is not None else default_config_dict()))
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o640, 0o600, 0o440, 0o400])
def test_config_modes_accepted(tmp_path: Path, mode: int) -> None:
    assert load_config(config_file(tmp_path, mode)).ServerConfig.port == 1025


@pytest.mark.parametrize("mode", [0o644, 0o660, 0o740, 0o604, 0o666])
def test_config_modes_refused(tmp_path: Path, mode: int) -> None:
    path = config_file(tmp_path, mode)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert text.startswith(f"{path}: got 'mode {mode:04o}'") and "at most 0640" in text
    assert f"chmod 640 {path}" in text and f"{ENV_CHECK}=0" in text


def test_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = config_file(tmp_path, 0o644)
    for value in ("", "1", "true", " 2 "):
        monkeypatch.setenv(ENV_CHECK, value)
        with pytest.raises(ConfigError):
            load_config(path)
    monkeypatch.setenv(ENV_CHECK, "0")
    assert load_config(path).ServerConfig.port == 1025


def test_owner_and_kind(tmp_path: Path) -> None:
    path = config_file(tmp_path, 0o640)
    if os.geteuid() == 0:  # root can hand the file to a stranger
        os.chown(path, 54321, -1)
        with pytest.raises(ConfigError, match="owner uid 54321.*owned by the user running this process"):
            load_config(path)
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(tmp_path / "dir.json")


def test_links_are_judged_by_their_target(tmp_path: Path) -> None:
    """A Kubernetes ConfigMap mount: config.json -> ..data/config.json."""
    data = tmp_path / "..data"
    data.mkdir()
    target = config_file(data, 0o440)
    link = tmp_path / "config.json"
    link.symlink_to(target)
    assert load_config(link).ServerConfig.port == 1025
    target.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 0644"):
        load_config(link)


def test_serve_and_validate_say_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = config_file(tmp_path, 0o664)
    assert main(["serve", "--config", str(path)]) == 2
    assert f"{path}: got 'mode 0664'" in capsys.readouterr().err
    assert main(["config", "validate", str(path)]) == 1
    assert "mode 0664" in capsys.readouterr().out
    init = tmp_path / "init.json"
    assert main(["config", "init", str(init)]) == 0  # written 0640, whatever the umask
    assert init.stat().st_mode & 0o777 == 0o640 and load_config(init).ServerConfig.port == 1025


def test_ms_config_files(tmp_path: Path) -> None:
    coordinator = config_file(tmp_path, 0o644, "ms_coordinator.json", default_coordinator_dict())
    with pytest.raises(ConfigError, match="ms_coordinator.json: got 'mode 0644'"):
        load_coordinator_config(str(coordinator))
    coordinator.chmod(0o640)
    assert load_coordinator_config(str(coordinator)).predict_port == 1025
    controller = config_file(tmp_path, 0o660, "ms_controller.json", default_controller_dict())
    with pytest.raises(ConfigError, match="ms_controller.json: got 'mode 0660'"):
        load_controller_config(str(controller))


def test_tls_files(tmp_path: Path) -> None:
    ca = make_ca("root")
    cert, key = write_pem(tmp_path, "server", issue(ca, "server", server_ips=("127.0.0.1",)))
    ca_file = write_file(tmp_path / "ca.pem", ca.cert.public_bytes(serialization.Encoding.PEM), 0o600)
    for path, mode in ((cert, 0o600), (key, 0o400)):
        path.chmod(mode)
    assert build_ssl_context(cert, key, None, [ca_file], [], "business plane") is not None
    for path, mode in ((key, 0o640), (cert, 0o644), (ca_file, 0o604)):
        path.chmod(mode)
        with pytest.raises(TLSConfigError) as err:
            build_ssl_context(cert, key, None, [ca_file], [], "business plane")
        assert f"business plane: {path}: got 'mode {mode:04o}'" in str(err.value) and "at most 0600" in str(err.value)
        path.chmod(0o600)
