"""Logging set up from ``LogConfig``: level, file path, size-based rotation, request ids.

Every record carries ``request_id``: the id of the HTTP request being handled on
the current task (``-`` outside one), set by the server's request middleware via
:func:`bind_request_id` and read back by :class:`RequestIdFilter`. Lines are plain
text by default::

    2026-11-22 17:40:01,123 INFO mindie_host.server [req=9f2c...] POST /v1/completions -> 200 (0.412 s)

or one JSON object per line when ``MINDIE_HOST_LOG_FORMAT=json``, or the spec's layout (§8.3.5) when
``MINDIE_HOST_LOG_FORMAT=mindie`` or ``MINDIE_LOG_VERBOSE`` is set::

    [2026-11-22 17:40:01.123] [4242] [4250] [server] [INFO] [http.py:88] : [mindie_host.server] [req=9f2c...] POST ...

(the parenthesised part of the spec's ``[date time] ([pid] [tid] [component] [LEVEL] [file:line]) :
[error code] [sub-component] message`` is left out when ``MINDIE_LOG_VERBOSE`` is false; this host has no
error codes).  ``MINDIE_LOG_LEVEL`` (``"debug; llm:info"``, :mod:`mindie_host.log_env`) wins over
``LogConfig.logLevel`` for the components it names: :data:`COMPONENT_LOGGERS` maps the spec's component
names to the loggers here.

Prompt and generated text are never logged at INFO or above: request lines carry
the method, path, status, sizes and timings only. Bodies may appear at DEBUG.

``logPath``: an absolute path is used as is; a relative one is joined to
``MIES_INSTALL_PATH`` when that is set (MindIE's rule), else to the working
directory. ``logFileSize`` (MB) and ``logFileNum`` drive rotation; either at 0
means no log file. ``MINDIE_LOG_TO_STDOUT`` / ``MINDIE_LOG_TO_FILE`` false (or 0, for the server)
switch the console or file output off.

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
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .log_env import ENV_TO_FILE, ENV_TO_STDOUT, ENV_VERBOSE, env_level, env_switch, log_format, python_level

FORMAT = "%(asctime)s %(levelname)s %(name)s [req=%(request_id)s] %(message)s"

#: The spec's components (``MINDIE_LOG_LEVEL="llm:debug"``) and their loggers here. ``server`` is the
#: whole ``mindie_host`` tree with the plugins' loggers, but for what another component names; MindIE SD
#: (``sd``) and RT (``rt``) have no counterpart here, and ``ms`` is set up by :mod:`mindie_host.ms.logs`.
COMPONENT_LOGGERS: dict[str, tuple[str, ...]] = {
    "server": ("mindie_host",),
    "llm": ("mindie_host.engine", "mindie_host.backends", "mindie_host.models", "mindie_host.quant",
            "mindie_host.distributed", "mindie_host.kv_sizing"),
    "ms": ("mindie_host.ms",),
    "benchmark": ("mindie_host.bench",),
    "client": ("mindie_host.client",),
    "cert": ("mindie_host.tools.certs", "mindie_host.keystore"),
    "torch": ("torch",),
}

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


def component_of(logger: str) -> str:
    """The spec's component a logger belongs to (:data:`COMPONENT_LOGGERS`; ``server`` by default)."""
    best, found = "server", 0
    for component, names in COMPONENT_LOGGERS.items():
        for name in names:
            if (logger == name or logger.startswith(name + ".")) and len(name) > found:
                best, found = component, len(name)
    return best


def _verbose_fields(record: logging.LogRecord, component: str | None) -> dict[str, Any]:
    return {"pid": record.process, "tid": threading.get_native_id(),
            "component": component or component_of(record.name), "level": record.levelname,
            "file": record.filename, "line": record.lineno}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, request_id, message (and the traceback); with
    ``verbose`` also pid, tid, component, file and line."""

    def __init__(self, verbose: bool = False, component: str | None = None) -> None:
        super().__init__()
        self.verbose, self.component = verbose, component

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if self.verbose:
            data.update(_verbose_fields(record, self.component))
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, ensure_ascii=False)


class SpecFormatter(logging.Formatter):
    """MindIE's line layout (spec §8.3.5): ``[date time] ([pid] [tid] [component] [LEVEL] [file:line]) :
    [sub-component] message``, the parenthesised part only when ``verbose``; the sub-component is the
    logger's name, followed by ``[req=<id>]`` inside a request. ``component`` fixes the component (``ms``);
    otherwise it comes from the logger's name."""

    def __init__(self, verbose: bool = True, component: str | None = None) -> None:
        super().__init__()
        self.verbose, self.component = verbose, component

    def format(self, record: logging.LogRecord) -> str:
        stamp = self.formatTime(record, "%Y-%m-%d %H:%M:%S") + f".{int(record.msecs):03d}"
        head = f"[{stamp}]"
        if self.verbose:
            f = _verbose_fields(record, self.component)
            head += f" [{f['pid']}] [{f['tid']}] [{f['component']}] [{f['level']}] [{f['file']}:{f['line']}]"
        rid = getattr(record, "request_id", "-")
        line = f"{head} : [{record.name}]{f' [req={rid}]' if rid and rid != '-' else ''} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def make_formatter(component: str = "server", env: Mapping[str, str] | None = None) -> logging.Formatter:
    """The formatter ``MINDIE_HOST_LOG_FORMAT`` and ``MINDIE_LOG_VERBOSE`` ask for, for ``component``'s lines.
    The spec's layout is verbose unless ``MINDIE_LOG_VERBOSE`` is false; JSON only when it is true."""
    fmt = log_format(env, component)
    verbose = env_switch(ENV_VERBOSE, component, env)
    if fmt == "json":
        return JsonFormatter(verbose=bool(verbose))
    if fmt == "mindie":
        return SpecFormatter(verbose=verbose is not False, component=None if component == "server" else component)
    return logging.Formatter(FORMAT)


def resolve_log_path(log_path: str) -> Path:
    """``logPath`` made absolute: relative paths are under ``MIES_INSTALL_PATH`` if set, else the cwd."""
    path = Path(log_path).expanduser()
    if path.is_absolute():
        return path
    base = os.environ.get("MIES_INSTALL_PATH")
    return (Path(base) / path) if base else path


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


#: ``LogConfig.logLevel`` as last set (at setup, then by a hot update), for :func:`apply_levels`
_config_level = logging.INFO


def apply_levels(config_level: int | None = None, env: Mapping[str, str] | None = None) -> int:
    """Set every component's logger level: ``MINDIE_LOG_LEVEL``'s level for the component where it gives one,
    else ``config_level`` (``LogConfig.logLevel``; None keeps the last one). Returns the server's level."""
    global _config_level
    if config_level is not None:
        _config_level = config_level
    server = env_level("server", env)
    root = logging.getLogger("mindie_host")
    root.setLevel(python_level(server) if server else _config_level)
    for component, names in COMPONENT_LOGGERS.items():
        if component in ("server", "ms"):
            continue
        level = env_level(component, env)
        for name in names:
            if level:
                logging.getLogger(name).setLevel(python_level(level))
            elif name.startswith("mindie_host."):  # back to the server's level (torch's own is left alone)
                logging.getLogger(name).setLevel(logging.NOTSET)
    for name in _adopted:
        logging.getLogger(name).setLevel(root.level)
    return root.level


def setup_logging(log_config: Any, to_stderr: bool = True) -> None:
    """Configure the ``mindie_host`` logger tree (and adopted plugin loggers) from a ``LogConfig`` and the
    ``MINDIE_LOG_*`` variables (checked by the config's loader: a bad value stops startup before this)."""
    root = logging.getLogger("mindie_host")
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.propagate = False
    fmt = make_formatter()
    rid = RequestIdFilter()
    if to_stderr and env_switch(ENV_TO_STDOUT, "server") is not False:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(fmt)
        h.addFilter(rid)
        root.addHandler(h)
    if log_config.logFileSize > 0 and log_config.logFileNum > 0 and log_config.logPath and env_switch(
            ENV_TO_FILE, "server") is not False:
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
    apply_levels(log_config.python_level)


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
