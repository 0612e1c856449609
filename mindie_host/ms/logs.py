"""``log_info`` of the MS config files, and the environment variables that override it (spec §4.4).

Precedence: ``MINDIE_LOG_LEVEL`` (``"info"`` or per component ``"debug; ms:info"``) >
``MINDIEMS_LOG_LEVEL`` > ``log_info.log_level``; ``MINDIE_LOG_TO_FILE`` and
``MINDIE_LOG_TO_STDOUT`` (true/false/1/0, optionally ``"ms: false"``) override ``to_file`` and
``to_stdout``. The run log rotates at ``max_log_file_size`` MB over ``max_log_file_num`` files.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .schema import Section

LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
FORMAT = "[%(asctime)s] [%(process)d] [ms] [%(levelname)s] [%(name)s] %(message)s"


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


def _component_value(text: str, component: str = "ms") -> str | None:
    """``"debug; ms:info"`` -> ``info`` for ms; a bare value applies to every component."""
    default = None
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        if ":" in part:
            name, value = (p.strip() for p in part.split(":", 1))
            if name.lower() == component:
                return value
        else:
            default = part
    return default


def _flag(text: str | None, fallback: bool) -> bool:
    if text is None:
        return fallback
    value = _component_value(text)
    if value is None:
        return fallback
    return value.strip().lower() in ("1", "true")


def setup_ms_logging(info: LogInfo, name: str, env: Mapping[str, str] | None = None) -> logging.Logger:
    """Configure the ``mindie_host.ms`` loggers from ``log_info`` and the environment."""
    env = os.environ if env is None else env
    level_text = info.log_level
    for var in ("MINDIEMS_LOG_LEVEL", "MINDIE_LOG_LEVEL"):
        if env.get(var):
            level_text = _component_value(env[var]) or level_text
    level_name = level_text.strip().upper()
    logger = logging.getLogger("mindie_host.ms")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = False
    if level_name == "NULL":
        logger.disabled = True
        return logger.getChild(name)
    logger.setLevel(level_name if level_name in LEVELS else "INFO")
    formatter = logging.Formatter(FORMAT)
    if _flag(env.get("MINDIE_LOG_TO_STDOUT"), info.to_stdout):
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(formatter)
        logger.addHandler(stream)
    if _flag(env.get("MINDIE_LOG_TO_FILE"), info.to_file) and info.run_log_path:
        path = Path(info.run_log_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.RotatingFileHandler(
            path, maxBytes=info.max_log_file_size * 1024 * 1024, backupCount=info.max_log_file_num - 1)
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    return logger.getChild(name)
