"""Hot update of ``config.json``: ``LogConfig.logLevel`` changes without a restart (the spec marks it
"supports hot update"; it does not say how one is triggered, so here each process of a server polls the
file it started from).

Every ``MINDIE_HOST_CONFIG_POLL_S`` seconds (2 by default; 0 turns this off) a :class:`ConfigWatch` thread
looks at the file's modification time and size. When they change it reads and checks the whole file as
startup does: a valid file's ``logLevel`` is applied (``MINDIE_LOG_LEVEL`` still wins for the components it
names, as at startup) and logged; an invalid one is logged as a warning and the level stays. Changes to
other keys are logged as needing a restart. The front end, the engine process and each tensor-parallel rank
run their own watch, so each process's loggers follow the file.
"""

from __future__ import annotations

import logging
import os
import threading

from ..logs import apply_levels
from .loader import load_config
from .rules import ConfigError
from .schema import Config

log = logging.getLogger("mindie_host.config")


class ConfigWatch:
    """Polls ``config.source_path`` and applies a new ``LogConfig.logLevel`` (see the module docstring)."""

    def __init__(self, config: Config, interval: float) -> None:
        assert config.source_path, "a config read from a file"
        self.path = config.source_path
        self.interval = interval
        self.config = config
        self._stamp = self._stat()
        try:  # what "changed" means for the other keys: the file as it was (the command line may override it)
            self._baseline: dict | None = load_config(self.path).to_dict()
        except (ConfigError, OSError):
            self._baseline = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def check(self) -> bool:
        """One look at the file; True when it changed (whatever came of it)."""
        stamp = self._stat()
        if stamp == self._stamp or stamp is None:
            return False
        self._stamp = stamp
        try:
            new = load_config(self.path)
        except ConfigError as err:
            log.warning("%s changed but is not valid (%s): LogConfig.logLevel stays %s", self.path, err,
                        self.config.LogConfig.logLevel)
            return True
        old_level, level = self.config.LogConfig.logLevel, new.LogConfig.logLevel
        if level.lower() != old_level.lower():
            self.config.LogConfig.logLevel = level
            applied = apply_levels(new.LogConfig.python_level)
            # at WARNING so the line is written whichever way the level went
            log.warning("LogConfig.logLevel is now %s (hot update from %s; was %s)%s", level, self.path, old_level,
                        "" if applied == new.LogConfig.python_level else
                        f"; MINDIE_LOG_LEVEL sets the server's level to {logging.getLevelName(applied)}")
        old, now = self._baseline, new.to_dict()
        self._baseline = now
        if old is None:
            return True
        changed = sorted(k for k in now if k != "LogConfig" and now.get(k) != old.get(k))
        changed += [f"LogConfig.{k}" for k in now["LogConfig"] if k != "logLevel"
                    and now["LogConfig"][k] != old["LogConfig"].get(k)]
        if changed:
            log.warning("%s: changes to %s take effect at the next start (only LogConfig.logLevel is hot-updated)",
                        self.path, ", ".join(changed))
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # the watch must never take a server down
                log.exception("reading %s for a hot update failed", self.path)

    def start(self) -> ConfigWatch:
        """Poll on a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="mindie-config-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the polling thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def watch_config(config: Config) -> ConfigWatch | None:
    """Start a :class:`ConfigWatch` for a config read from a file (None when there is no file or polling is off)."""
    interval = config.environment.config_poll_s
    if not config.source_path or interval <= 0:
        return None
    return ConfigWatch(config, interval).start()
