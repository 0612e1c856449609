"""MindIE Service ``config.json``: the schema, its defaults and ranges, and loading it with clear errors.

* :mod:`.rules`: the rule language (one :class:`~.rules.Rule` per key; :class:`ConfigError`).
* :mod:`.schema`: the sections as dataclasses, each key with its default and rule; :data:`DEVIATIONS`.
* :mod:`.checks`: the rules between two keys (``maxPrefillTokens >= maxInputTokenLen`` ...).
* :mod:`.loader`: reading a file or a dict, the environment variables that win over it.
* :mod:`.support`: which keys this host refuses, and which have no effect here.

Everything the rest of the code imports by name is re-exported here.
"""

from __future__ import annotations

from .loader import (
    ENV_CONFIG_PATH,
    ENV_CONTAINER_IP,
    ENV_CONTAINER_MANAGEMENT_IP,
    MAX_CONFIG_FILE_BYTES,
    check_file_mode,
    config_from_dict,
    default_config_dict,
    load_config,
    read_json,
    validate_config_file,
)
from .rules import ConfigError
from .schema import (
    CONFIG_VERSION,
    DEVIATIONS,
    BackendConfig,
    Config,
    LogConfig,
    ModelConfig,
    ModelDeployConfig,
    ScheduleConfig,
    ServerConfig,
)

__all__ = [
    "CONFIG_VERSION",
    "DEVIATIONS",
    "ENV_CONFIG_PATH",
    "ENV_CONTAINER_IP",
    "ENV_CONTAINER_MANAGEMENT_IP",
    "MAX_CONFIG_FILE_BYTES",
    "BackendConfig",
    "Config",
    "ConfigError",
    "LogConfig",
    "ModelConfig",
    "ModelDeployConfig",
    "ScheduleConfig",
    "ServerConfig",
    "check_file_mode",
    "config_from_dict",
    "default_config_dict",
    "load_config",
    "read_json",
    "validate_config_file",
]
