"""Logging set up from ``LogConfig``: level, file path, size-based rotation, request ids.

Every record carries ``request_id``: the id of the HTTP request being handled on
the current task (``-`` outside one), set by the server's request middleware via
:func:`bind_request_id` and read back by :class:`RequestIdFilter`. Lines are plain
text by default::

    2026-11-22 17:40:01,123 INFO mindie_host.server [req=9f2c...] POST /v1/completions -> 200 (0.412 s)

or one JSON object per line when ``MINDIE_HOST_LOG_FORMAT=json``.

Prompt and generated text are never logged at INFO or above: request lines carry
the method, path, status, sizes and timings only. Bodies may appear at DEBUG.

``logPath``: an absolute path is used as is; a relative one is joined to
``MIES_INSTALL_PATH`` when that is set (MindIE's rule), else to the working
directory. ``logFileSize`` (MB) and ``logFileNum`` drive rotation; either at 0
means no log file. ``MINDIE_LOG_TO_STDOUT=0``/``MINDIE_LOG_TO_FILE=0`` switch the
console or file output off when set.

Plugins log under their own package's name (``logging.getLogger(__name__)``):
:func:`adopt_logger` gives such a logger the host's handlers and level, so its
lines reach the same console and file as the host's own.
"""

from __future__ import annotations

import contextvars
import json
import logging
import logging.handlers
import os
import sys
from pathlib import Path
from typing import Any

FORMAT = "%(asctime)s %(levelname)s %(name)s [req=%(request_id)s] %(message)s"
ENV_FORMAT = "MINDIE_HOST_LOG_FORMAT"

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("mindie_request_id", default="-")


def bind_request_id(request_id: str) -> contextvars.Token[str]:
    """Mark the current task as handling ``request_id``; returns a token for :func:`reset_request_id`."""
    return _request_id.set(request_id)


def reset_request_id(token: contextvars.Token[str]) -> None:
    """Undo :func:`bind_request_id`."""
    _request_id.reset(token)


def current_request_id() -> str:
    """The request id bound to the current task, or ``-``."""
    return _request_id.get()


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (the bound id, unless the record already names one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", None):
            record.request_id = _request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, request_id, message (and the traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, ensure_ascii=False)


def make_formatter() -> logging.Formatter:
    """The formatter ``MINDIE_HOST_LOG_FORMAT`` asks for (``text`` or ``json``)."""
    if os.environ.get(ENV_FORMAT, "text").lower() == "json":
        return JsonFormatter()
    return logging.Formatter(FORMAT)


def resolve_log_path(log_path: str) -> Path:
    """``logPath`` made absolute: relative paths are under ``MIES_INSTALL_PATH`` if set, else the cwd."""
    path = Path(log_path).expanduser()
    if path.is_absolute():
        return path
    base = os.environ.get("MIES_INSTALL_PATH")
    return (Path(base) / path) if base else path


def _env_off(name: str) -> bool:
    return os.environ.get(name, "").strip() == "0"


#: Loggers outside ``mindie_host.`` that share its handlers (plugins' packages), kept for a later setup_logging.
_adopted: set[str] = set()


def adopt_logger(name: str) -> None:
    """Route the logger tree ``name`` (a plugin's top-level package) to the host's log output.

    Before :func:`setup_logging` has run (tests, embedding), nothing changes: the
    logger propagates to the root logger as usual. After it, the logger gets the
    host's handlers and level and stops propagating, so no line is lost or doubled.
    """
    if not name or name == "mindie_host" or name.startswith("mindie_host."):
        return
    _adopted.add(name)
    host = logging.getLogger("mindie_host")
    if host.handlers:
        _share(host, logging.getLogger(name))


def _share(host: logging.Logger, logger: logging.Logger) -> None:
    for handler in list(logger.handlers):
        if getattr(handler, "_mindie_host_shared", False):
            logger.removeHandler(handler)
    for handler in host.handlers:
        logger.addHandler(handler)
    logger.setLevel(host.level)
    logger.propagate = False


def setup_logging(log_config: Any, to_stderr: bool = True) -> None:
    """Configure the ``mindie_host`` logger tree (and adopted plugin loggers) from a ``LogConfig``."""
    root = logging.getLogger("mindie_host")
    root.setLevel(log_config.python_level)
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.propagate = False
    fmt = make_formatter()
    rid = RequestIdFilter()
    if to_stderr and not _env_off("MINDIE_LOG_TO_STDOUT"):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(fmt)
        h.addFilter(rid)
        root.addHandler(h)
    if log_config.logFileSize > 0 and log_config.logFileNum > 0 and log_config.logPath and not _env_off(
            "MINDIE_LOG_TO_FILE"):
        path = resolve_log_path(log_config.logPath)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = logging.handlers.RotatingFileHandler(
                path, maxBytes=log_config.logFileSize * 1024 * 1024, backupCount=log_config.logFileNum,
                encoding="utf-8",
            )
            fh.setFormatter(fmt)
            fh.addFilter(rid)
            root.addHandler(fh)
        except OSError as exc:
            root.warning("cannot write log file %s: %s", path, exc)
    for handler in root.handlers:
        handler._mindie_host_shared = True  # type: ignore[attr-defined]
    for name in _adopted:
        _share(root, logging.getLogger(name))


class LoadProgress:
    """A one-line progress bar for model loading, on stderr (``mindie-host serve``; the engine process too)."""

    def __init__(self) -> None:
        self.last = -1

    def __call__(self, done: int, total: int, name: str) -> None:
        pct = int(100 * done / max(total, 1))
        if pct != self.last and sys.stderr.isatty() or done == total:
            bar = "#" * (pct // 4)
            sys.stderr.write(f"\rloading weights [{bar:<25}] {pct:3d}% ({done}/{total})")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()
            self.last = pct


def describe_exit(exitcode: int | None) -> str:
    """``exit code 3``, ``killed by SIGKILL`` or ``still running``: a child process's end, for a log line."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
