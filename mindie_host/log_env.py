"""MindIE's log environment variables (spec §8.3.5), read one way by the server and by MS.

``MINDIE_LOG_LEVEL``, ``MINDIE_LOG_TO_FILE``, ``MINDIE_LOG_TO_STDOUT`` and ``MINDIE_LOG_VERBOSE`` each hold
one value for every component (``"debug"``) or values per component (``"debug; ms:info"``, ``"llm: true"``);
a component's own entry wins over the bare value, and values and names are case-insensitive. The
components are the spec's names without the ``mindie`` prefix: cert, benchmark, client, ms, server, llm,
sd, rt, torch. Levels are critical, error, warning, info, debug and null (null: no log at all); the
switches are true/false or 1/0. An empty variable is unset. A value outside these is an error that
names the variable and what it allows (:func:`check_log_env`), never ignored.

``MINDIEMS_LOG_LEVEL`` (MS only, kept by the spec for older setups) is used when ``MINDIE_LOG_LEVEL``
gives MS no level; ``MINDIE_HOST_LOG_FORMAT`` (``text``, ``mindie``, ``json``) is this host's own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

COMPONENTS = ("cert", "benchmark", "client", "ms", "server", "llm", "sd", "rt", "torch")
LEVELS = ("critical", "error", "warning", "info", "debug", "null")
MS_LEVELS = ("critical", "error", "warning", "info", "debug")
SWITCHES = {"true": True, "1": True, "false": False, "0": False}
FORMATS = ("text", "mindie", "json")

ENV_LEVEL = "MINDIE_LOG_LEVEL"
ENV_TO_FILE = "MINDIE_LOG_TO_FILE"
ENV_TO_STDOUT = "MINDIE_LOG_TO_STDOUT"
ENV_VERBOSE = "MINDIE_LOG_VERBOSE"
ENV_MS_LEVEL = "MINDIEMS_LOG_LEVEL"
ENV_FORMAT = "MINDIE_HOST_LOG_FORMAT"
SWITCH_VARS = (ENV_TO_FILE, ENV_TO_STDOUT, ENV_VERBOSE)

#: ``null``: above every level, so nothing is logged
NULL_LEVEL = logging.CRITICAL + 10


class LogEnvError(ValueError):
    """A log environment variable holds a value outside what the spec allows."""

    def __init__(self, var: str, value: str, allowed: str) -> None:
        self.var, self.value, self.allowed = var, value, allowed
        super().__init__(f"{var}: got {value!r}; allowed {allowed}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.var, self.value, self.allowed))


@dataclass(frozen=True)
class ComponentValues:
    """A variable's bare value (every component) and its per-component values, lower case."""

    default: str | None = None
    per_component: dict[str, str] = field(default_factory=dict)

    def get(self, component: str) -> str | None:
        """The value for ``component``: its own entry, else the bare value, else None."""
        return self.per_component.get(component, self.default)


def _allowed(values: tuple[str, ...]) -> str:
    return (f"one of {', '.join(values)} for every component, or per component as 'debug; ms:info' "
            f"(components: {', '.join(COMPONENTS)}; case-insensitive)")


def parse_component_values(var: str, text: str, values: tuple[str, ...]) -> ComponentValues:
    """``text`` of variable ``var`` read as ``"v"`` or ``"v; comp:v; ..."``; :class:`LogEnvError` if a
    component or a value is not one the spec names (full-width ``：`` and ``；`` are read as ``:`` and ``;``)."""
    default: str | None = None
    per: dict[str, str] = {}
    normal = text.replace("：", ":").replace("；", ";").strip().strip("\"'“”")
    for part in normal.split(";"):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.rpartition(":")
        value = value.strip().lower()
        name = name.strip().lower()
        if value not in values or (sep and name not in COMPONENTS):
            raise LogEnvError(var, text, _allowed(values))
        if sep:
            per[name] = value
        else:
            default = value
    return ComponentValues(default, per)


def _values(env: Mapping[str, str], var: str, values: tuple[str, ...]) -> ComponentValues:
    text = env.get(var, "")
    return parse_component_values(var, text, values) if text.strip() else ComponentValues()


def env_level(component: str, env: Mapping[str, str] | None = None) -> str | None:
    """``MINDIE_LOG_LEVEL``'s level for ``component`` (lower case), or None when it gives none; for ``ms``,
    ``MINDIEMS_LOG_LEVEL`` when ``MINDIE_LOG_LEVEL`` gives none."""
    env = os.environ if env is None else env
    level = _values(env, ENV_LEVEL, LEVELS).get(component)
    if level is None and component == "ms" and env.get(ENV_MS_LEVEL, "").strip():
        level = env[ENV_MS_LEVEL].strip().lower()
        if level not in MS_LEVELS:
            raise LogEnvError(ENV_MS_LEVEL, env[ENV_MS_LEVEL], f"one of {', '.join(v.upper() for v in MS_LEVELS)}")
    return level


def env_switch(var: str, component: str, env: Mapping[str, str] | None = None) -> bool | None:
    """The true/false value of switch ``var`` (``MINDIE_LOG_TO_FILE``, ...) for ``component``, None when unset."""
    env = os.environ if env is None else env
    value = _values(env, var, tuple(SWITCHES)).get(component)
    return None if value is None else SWITCHES[value]


def python_level(level: str) -> int:
    """A spec level name (any case; also LogConfig's verbose and warn) as a :mod:`logging` level."""
    name = level.strip().lower()
    if name == "null":
        return NULL_LEVEL
    return {"verbose": logging.DEBUG, "warn": logging.WARNING}.get(name) or logging.getLevelName(name.upper())


def log_format(env: Mapping[str, str] | None = None, component: str = "server") -> str:
    """The line layout: ``MINDIE_HOST_LOG_FORMAT`` when set; else the spec's layout (``mindie``) when
    ``MINDIE_LOG_VERBOSE`` speaks to ``component`` (the variable is about that layout), else ``text``."""
    env = os.environ if env is None else env
    fmt = env.get(ENV_FORMAT, "").strip().lower()
    if fmt:
        if fmt not in FORMATS:
            raise LogEnvError(ENV_FORMAT, env[ENV_FORMAT], f"one of {', '.join(FORMATS)}")
        return fmt
    return "mindie" if env_switch(ENV_VERBOSE, component, env) is not None else "text"


def check_log_env(env: Mapping[str, str] | None = None, component: str = "server") -> list[LogEnvError]:
    """Every log variable's problem for ``component`` (empty when all are valid or unset): what startup refuses."""
    env = os.environ if env is None else env
    problems: list[LogEnvError] = []
    checks = [lambda: env_level(component, env), lambda: log_format(env, component)]
    checks += [lambda var=var: env_switch(var, component, env) for var in SWITCH_VARS]  # type: ignore[misc]
    for check in checks:
        try:
            check()
        except LogEnvError as err:
            if all(p.var != err.var for p in problems):
                problems.append(err)
    return problems
