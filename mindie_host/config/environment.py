"""The environment variables a server reads beside ``config.json`` (spec §10.1 and §5.1's table 5-1), checked
when the config is built: a value outside the allowed ones is a :class:`~.rules.ConfigError` naming the
variable and what it allows, so startup and ``mindie-host config validate`` refuse it.

The MINDIE_LOG_* variables are read where logging is set up (:mod:`mindie_host.log_env`); they are only
checked here. The others are read once into :class:`Environment`, which travels with the config to the
engine process and the ranks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..log_env import check_log_env
from .rules import ConfigError

ENV_CONFIG_POLL = "MINDIE_HOST_CONFIG_POLL_S"


@dataclass(frozen=True)
class Environment:
    """What the environment asks of this server (each field names its variable).

    :ivar config_poll_s: ``MINDIE_HOST_CONFIG_POLL_S``: how often the config file is read again for the keys
        the spec lets change without a restart (``LogConfig.logLevel``), in seconds; 0 turns it off.
    :ivar recompute_threshold: ``MIES_RECOMPUTE_THRESHOLD`` in [0, 1), default 0.5: a running sequence the
        KV pool cannot grow is preempted only when the step's dispatchable sequences hold less than this share
        of the blocks (engine/scheduler.py); otherwise it waits a step.
    :ivar use_mb_swapper: ``MIES_USE_MB_SWAPPER`` 1: swap preemption to the CPU (``maxPreemptCount``,
        ``cpuMemSize``) is on; unset or 0, preempted sequences are recomputed (spec §5.1: maxPreemptCount
        takes effect when the variable is 1).
    :ivar tokenizer_encode_timeout: ``TOKENIZER_ENCODE_TIMEOUT`` in [5, 300] s, default 60: a prompt whose
        tokenization takes longer fails with a 422.
    :ivar profiler: ``MIES_PROFILER_MODE`` 1: a torch profiler trace (Chrome trace format) of the engine's first
        ``profiler_steps`` steps (``MINDIE_HOST_PROFILER_STEPS``, 10) in ``profiler_dir``.
    :ivar memory_detector: ``MIES_MEMORY_DETECTOR_MODE`` 1: a memory report (JSON lines) when the engine is built and
        every ``memory_report_steps`` steps (``MINDIE_HOST_MEMORY_REPORT_STEPS``, 100) in ``profiler_dir``.
    :ivar profiler_dir: ``MINDIE_HOST_PROFILER_DIR`` (``profiler``): the folder of both, relative to the log file's.
    """

    config_poll_s: float = 2.0
    recompute_threshold: float = 0.5
    use_mb_swapper: bool = False
    tokenizer_encode_timeout: float = 60.0
    profiler: bool = False
    profiler_steps: int = 10
    memory_detector: bool = False
    memory_report_steps: int = 100
    profiler_dir: str = "profiler"


def _number(env: Mapping[str, str], var: str, default: float, low: float, high: float, allowed: str,
            errors: list[ConfigError], *, integer: bool = False, high_open: bool = False) -> Any:
    text = env.get(var, "").strip()
    if not text:
        return default
    pattern = r"[0-9]+" if integer else r"[0-9]+(\.[0-9]*)?|\.[0-9]+"
    value = float(text) if re.fullmatch(pattern, text) else math.nan
    if not (low <= value <= high) or (high_open and value >= high):
        errors.append(ConfigError(var, env[var], allowed))
        return default
    return int(value) if integer else value


def _switch(env: Mapping[str, str], var: str, errors: list[ConfigError]) -> bool:
    text = env.get(var, "").strip()
    if text not in ("", "0", "1"):
        errors.append(ConfigError(var, env[var], "0 (off) or 1 (on)"))
        return False
    return text == "1"


def read_environment(env: Mapping[str, str]) -> tuple[Environment, list[ConfigError]]:
    """The :class:`Environment` ``env`` describes, and every problem with it (the log variables' too)."""
    errors = [ConfigError(p.var, p.value, p.allowed) for p in check_log_env(env)]
    poll = _number(env, ENV_CONFIG_POLL, 2.0, 0.0, 3600.0, "a number of seconds in [0, 3600] (0: off)", errors)
    threshold = _number(env, "MIES_RECOMPUTE_THRESHOLD", 0.5, 0.0, 1.0, "a number in [0, 1)", errors, high_open=True)
    swapper = _switch(env, "MIES_USE_MB_SWAPPER", errors)
    timeout = _number(env, "TOKENIZER_ENCODE_TIMEOUT", 60, 5, 300, "an integer number of seconds in [5, 300]",
                      errors, integer=True)
    steps = _number(env, "MINDIE_HOST_PROFILER_STEPS", 10, 1, 100_000, "an integer in [1, 100000]", errors,
                    integer=True)
    every = _number(env, "MINDIE_HOST_MEMORY_REPORT_STEPS", 100, 1, 10**9, "an integer in [1, 1000000000]", errors,
                    integer=True)
    folder = env.get("MINDIE_HOST_PROFILER_DIR", "").strip() or "profiler"
    if len(folder) > 4096 or "\0" in folder:
        errors.append(ConfigError("MINDIE_HOST_PROFILER_DIR", folder[:80], "a folder path of at most 4096 characters"))
    return Environment(
        config_poll_s=poll, recompute_threshold=threshold, use_mb_swapper=swapper,
        tokenizer_encode_timeout=float(timeout), profiler=_switch(env, "MIES_PROFILER_MODE", errors),
        profiler_steps=steps, memory_detector=_switch(env, "MIES_MEMORY_DETECTOR_MODE", errors),
        memory_report_steps=every, profiler_dir=folder,
    ), errors


__all__ = ["Environment", "read_environment"]
