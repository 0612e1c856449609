"""MindIE's log environment variables (MINDIE_LOG_LEVEL per component, MINDIE_LOG_VERBOSE's line layout, the
switches) for the server and MS through one parser, and the hot update of LogConfig.logLevel on a running server."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from mindie_host.config import ConfigError, config_from_dict, default_config_dict, validate_config_file
from mindie_host.config.hot_update import ConfigWatch
from mindie_host.log_env import LogEnvError, env_level, env_switch
from mindie_host.logs import make_formatter, setup_logging
from mindie_host.ms.logs import LogInfo, setup_ms_logging
from mindie_host.testing import RunningServer, server_config, wait_for

LOG_VARS = ("MINDIE_LOG_LEVEL", "MINDIE_LOG_TO_FILE", "MINDIE_LOG_TO_STDOUT", "MINDIE_LOG_VERBOSE",
            "MINDIEMS_LOG_LEVEL", "MINDIE_HOST_LOG_FORMAT")
WATCHED = ("mindie_host", "mindie_host.engine", "mindie_host.backends", "mindie_host.ms", "mindie_host.bench")


@pytest.fixture(autouse=True)
def saved_loggers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts without the log variables and leaves the loggers as it found them."""
    for var in LOG_VARS:
        monkeypatch.delenv(var, raising=False)
    saved = {n: (lg.level, lg.handlers[:], lg.propagate, lg.disabled)
             for n in WATCHED for lg in [logging.getLogger(n)]}
    yield
    for name, (level, handlers, propagate, disabled) in saved.items():
        lg = logging.getLogger(name)
        for h in lg.handlers[:]:
            if h not in handlers:
                lg.removeHandler(h)
                h.close()
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled


def test_spec_examples_parse_per_component() -> None:
    env = {"MINDIE_LOG_LEVEL": "debug; ms:INfo", "MINDIE_LOG_VERBOSE": "llm: true", "MINDIE_LOG_TO_STDOUT": "1"}
    assert env_level("server", env) == "debug" and env_level("ms", env) == "info"
    assert env_level("llm", {"MINDIE_LOG_LEVEL": "llm：error"}) == "error"  # the spec's full-width colon
    assert env_level("server", {"MINDIE_LOG_LEVEL": "llm：error"}) is None
    assert env_switch("MINDIE_LOG_VERBOSE", "llm", env) is True and env_switch("MINDIE_LOG_VERBOSE", "server", env) is None
    assert env_switch("MINDIE_LOG_TO_STDOUT", "ms", env) is True
    # MINDIEMS_LOG_LEVEL serves MS only, and only when MINDIE_LOG_LEVEL gives MS nothing
    assert env_level("ms", {"MINDIEMS_LOG_LEVEL": "ERROR", "MINDIE_LOG_LEVEL": "server:debug"}) == "error"
    assert env_level("ms", {"MINDIEMS_LOG_LEVEL": "ERROR", "MINDIE_LOG_LEVEL": "warning"}) == "warning"


@pytest.mark.parametrize(("var", "value"), [
    ("MINDIE_LOG_LEVEL", "loud"), ("MINDIE_LOG_LEVEL", "debug; gpu:info"), ("MINDIE_LOG_LEVEL", "verbose"),
    ("MINDIE_LOG_TO_FILE", "yes"), ("MINDIE_LOG_TO_STDOUT", "server: maybe"), ("MINDIE_LOG_VERBOSE", "2"),
    ("MINDIE_HOST_LOG_FORMAT", "xml"),
])
def test_a_bad_value_stops_startup_naming_the_variable(var: str, value: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(default_config_dict(), environ={var: value})
    assert err.value.key == var and value in str(err.value) and "allowed" in str(err.value)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(default_config_dict()))
    assert any(var in line for line in validate_config_file(path, environ={var: value}))
    with pytest.raises(LogEnvError, match=var):  # MS refuses it too
        setup_ms_logging(LogInfo(to_stdout=False), "coordinator", env={var: value, "MINDIE_HOST_LOG_FORMAT": "text"}
                         if var != "MINDIE_HOST_LOG_FORMAT" else {var: value})


def test_component_levels_win_over_log_config(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config_from_dict(default_config_dict())  # logLevel Info
    monkeypatch.setenv("MINDIE_LOG_TO_FILE", "false")
    monkeypatch.setenv("MINDIE_LOG_LEVEL", "error; llm:debug; torch:warning; sd:info")
    setup_logging(cfg.LogConfig, to_stderr=False)
    assert logging.getLogger("mindie_host.server").getEffectiveLevel() == logging.ERROR
    assert logging.getLogger("mindie_host.engine.process").getEffectiveLevel() == logging.DEBUG
    assert logging.getLogger("mindie_host.backends.torch").getEffectiveLevel() == logging.DEBUG
    monkeypatch.setenv("MINDIE_LOG_LEVEL", "null")
    setup_logging(cfg.LogConfig, to_stderr=False)
    assert not logging.getLogger("mindie_host.server").isEnabledFor(logging.CRITICAL)
    assert logging.getLogger("mindie_host.engine").getEffectiveLevel() == logging.getLogger("mindie_host").level
    monkeypatch.delenv("MINDIE_LOG_LEVEL")
    setup_logging(cfg.LogConfig, to_stderr=False)  # the config's level again, for every component
    assert logging.getLogger("mindie_host.engine").getEffectiveLevel() == logging.INFO


def _line(formatter: logging.Formatter, name: str = "mindie_host.engine") -> str:
    record = logging.LogRecord(name, logging.WARNING, "/x/scheduler.py", 42, "preempted %s", ("r1",), None)
    record.request_id = "-"
    return formatter.format(record)


def test_the_spec_layout_with_and_without_its_optional_part(monkeypatch: pytest.MonkeyPatch) -> None:
    stamp = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\]"
    monkeypatch.setenv("MINDIE_LOG_VERBOSE", "true")
    full = _line(make_formatter())
    assert re.fullmatch(stamp + rf" \[{os.getpid()}\] \[\d+\] \[llm\] \[WARNING\] \[scheduler.py:42\] : "
                        r"\[mindie_host.engine\] preempted r1", full), full
    monkeypatch.setenv("MINDIE_LOG_VERBOSE", "server:false")
    assert re.fullmatch(stamp + r" : \[mindie_host.engine\] preempted r1", _line(make_formatter()))
    monkeypatch.setenv("MINDIE_HOST_LOG_FORMAT", "json")  # JSON stays an option; verbose adds the optional fields
    monkeypatch.setenv("MINDIE_LOG_VERBOSE", "1")
    data = json.loads(_line(make_formatter()))
    assert data["component"] == "llm" and data["pid"] == os.getpid() and data["line"] == 42
    monkeypatch.delenv("MINDIE_HOST_LOG_FORMAT")
    monkeypatch.delenv("MINDIE_LOG_VERBOSE")
    assert _line(make_formatter()).split()[2:4] == ["WARNING", "mindie_host.engine"]  # the host's own text layout


def test_ms_reads_the_same_variables(tmp_path: Path) -> None:
    log_file = tmp_path / "ms.log"
    info = LogInfo(log_level="ERROR", to_file=False, to_stdout=False, run_log_path=str(log_file))
    env = {"MINDIE_LOG_LEVEL": "error; ms:debug", "MINDIE_LOG_TO_FILE": "ms: true", "MINDIE_LOG_VERBOSE": "false"}
    log = setup_ms_logging(info, "coordinator", env)
    assert log.getEffectiveLevel() == logging.DEBUG
    log.debug("hello")
    assert re.fullmatch(r"\[[^]]+\] : \[mindie_host.ms.coordinator\] hello\n", log_file.read_text())
    setup_ms_logging(info, "coordinator", {"MINDIE_LOG_TO_FILE": "1"})
    log.info("kept out")
    log.error("verbose by default")
    lines = log_file.read_text().splitlines()
    assert len(lines) == 2 and f"[{os.getpid()}]" in lines[1] and "[ms] [ERROR]" in lines[1]


def test_hot_update_respects_the_environment_and_refuses_a_bad_file(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "config.json"
    data = default_config_dict()
    path.write_text(json.dumps(data))
    cfg = config_from_dict(data, source_path=str(path))
    setup_logging(cfg.LogConfig, to_stderr=False)
    watch = ConfigWatch(cfg, 60)
    assert not watch.check()
    data["LogConfig"]["logLevel"] = "Loud"
    path.write_text(json.dumps(data))
    assert watch.check() and logging.getLogger("mindie_host").level == logging.INFO  # invalid: the level stays
    monkeypatch.setenv("MINDIE_LOG_LEVEL", "warning")
    data["LogConfig"]["logLevel"] = "debug"
    path.write_text(json.dumps(data))
    assert watch.check() and cfg.LogConfig.logLevel == "debug"
    assert logging.getLogger("mindie_host").level == logging.WARNING  # the variable wins, as at startup
    assert logging.getLogger("mindie_host.engine").getEffectiveLevel() == logging.WARNING


def test_log_level_hot_update_on_a_running_server(tiny_model: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The file the server started from changes: the front end and the engine process follow, no restart."""
    monkeypatch.setenv("MINDIE_HOST_CONFIG_POLL_S", "0.1")
    monkeypatch.setenv("MINDIE_LOG_VERBOSE", "1")  # lines carry their pid
    monkeypatch.setenv("MINDIE_LOG_TO_STDOUT", "0")
    log_file = tmp_path / "logs" / "server.log"
    cfg = server_config(tiny_model, server={"engineProcess": True})
    cfg["LogConfig"].update({"logLevel": "Error", "logPath": str(log_file), "logFileSize": 1, "logFileNum": 2})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with RunningServer(cfg, source_path=str(path)) as server:
        engine_pid = server.host.engine.process.pid
        cfg["LogConfig"]["logLevel"] = "Info"
        path.write_text(json.dumps(cfg))
        wait_for(lambda: log_file.exists() and f"[{engine_pid}]" in log_file.read_text()
                 and "LogConfig.logLevel is now Info" in log_file.read_text(), 30, "the engine process's hot update")
        wait_for(lambda: logging.getLogger("mindie_host").level == logging.INFO, 30, "the front end's hot update")
        assert server.host.config.LogConfig.logLevel == "Info"
