"""``log_info`` of the MS config files, and the environment variables that override it (spec §4.4).

Precedence: ``MINDIE_LOG_LEVEL`` (``"info"`` or per component ``"debug; ms:info"``) >
``MINDIEMS_LOG_LEVEL`` > ``log_info.log_level``; ``MINDIE_LOG_TO_FILE`` and
``MINDIE_LOG_TO_STDOUT`` (true/false/1/0, optionally ``"ms: false"``) override ``to_file`` and
``to_stdout`` (one parser with the server's: :mod:`mindie_host.log_env`; a bad value is refused).
Lines follow the spec's layout (:class:`~mindie_host.logs.SpecFormatter`, component ``ms``) with its
optional part unless ``MINDIE_LOG_VERBOSE`` is false for ms; ``MINDIE_HOST_LOG_FORMAT=json`` gives JSON.
The run log rotates at ``max_log_file_size`` MB over ``max_log_file_num`` files.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..log_env import (
    ENV_TO_FILE,
    ENV_TO_STDOUT,
    ENV_VERBOSE,
    check_log_env,
    env_level,
    env_switch,
    log_format,
    python_level,
)
from ..logs import JsonFormatter, SpecFormatter
from .schema import Section

LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


@dataclass(frozen=True)
class LogInfo:
    """The ``log_info`` object."""

    log_level: str = "INFO"
    to_file: bool = False
    to_stdout: bool = True
    run_log_path: str = ""
    operation_log_path: str = ""
    max_log_str_size: int = 4096
    max_log_file_size: int = 20
    max_log_file_num: int = 10


def read_log_info(section: Section, *, min_str_size: int) -> LogInfo:
    """Check ``log_info``; ``max_log_str_size`` starts at 128 for the coordinator and 1 for the controller."""
    info = LogInfo(
        log_level=section.string("log_level", choices=LEVELS),
        to_file=section.boolean("to_file"),
        to_stdout=section.boolean("to_stdout"),
        run_log_path=section.string("run_log_path"),
        operation_log_path=section.string("operation_log_path"),
        max_log_str_size=section.integer("max_log_str_size", min_str_size, 4096 if min_str_size > 1 else 65535),
        max_log_file_size=section.integer("max_log_file_size", 1, 100),
        max_log_file_num=section.integer("max_log_file_num", 2, 64),
    )
    section.finish()
    return info


def _formatter(env: Mapping[str, str]) -> logging.Formatter:
    verbose = env_switch(ENV_VERBOSE, "ms", env)
    if log_format(env, "ms") == "json":
        return JsonFormatter(verbose=bool(verbose), component="ms")
    return SpecFormatter(verbose=verbose is not False, component="ms")


def setup_ms_logging(info: LogInfo, name: str, env: Mapping[str, str] | None = None) -> logging.Logger:
    """Configure the ``mindie_host.ms`` loggers from ``log_info`` and the environment; a log variable with a
    value the spec does not allow raises :class:`~mindie_host.log_env.LogEnvError` naming it."""
    env = os.environ if env is None else env
    problems = check_log_env(env, "ms")
    if problems:
        raise problems[0]
    level_name = (env_level("ms", env) or info.log_level).strip().lower()
    logger = logging.getLogger("mindie_host.ms")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = False
    logger.disabled = level_name == "null"
    if logger.disabled:
        return logger.getChild(name)
    logger.setLevel(python_level(level_name))
    formatter = _formatter(env)
    to_stdout, to_file = env_switch(ENV_TO_STDOUT, "ms", env), env_switch(ENV_TO_FILE, "ms", env)
    if info.to_stdout if to_stdout is None else to_stdout:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(formatter)
        logger.addHandler(stream)
    if (info.to_file if to_file is None else to_file) and info.run_log_path:
        path = Path(info.run_log_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.RotatingFileHandler(
            path, maxBytes=info.max_log_file_size * 1024 * 1024, backupCount=info.max_log_file_num - 1)
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    return logger.getChild(name)

