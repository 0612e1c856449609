"""Logging set up from ``LogConfig``: level, file path, size-based rotation."""

from __future__ import annotations

import logging
import logging.handlers
import sys
from pathlib import Path
from typing import Any

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(log_config: Any, to_stderr: bool = True) -> None:
    """Configure the ``mindie_host`` logger tree from a ``LogConfig``."""
    root = logging.getLogger("mindie_host")
    root.setLevel(log_config.python_level)
    root.handlers.clear()
    root.propagate = False
    fmt = logging.Formatter(FORMAT)
    if to_stderr:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(fmt)
        root.addHandler(h)
    if log_config.logFileSize > 0 and log_config.logFileNum > 0 and log_config.logPath:
        path = Path(log_config.logPath)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = logging.handlers.RotatingFileHandler(
                path, maxBytes=log_config.logFileSize * 1024 * 1024, backupCount=log_config.logFileNum
            )
            fh.setFormatter(fmt)
            root.addHandler(fh)
        except OSError as exc:
            root.warning("cannot write log file %s: %s", path, exc)
