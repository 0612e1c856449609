"""Reading ``config.json``: the file, the environment variables that win over it, and the public entry points.

One generic walker (:class:`_Builder`) reads a JSON dict against the schema's rules
(:mod:`.schema`), then the rules between keys run (:mod:`.checks`).  Every problem raises
:class:`~.rules.ConfigError` naming the dotted key, the value given and the allowed range.
Unknown keys are never fatal: they are recorded in ``Config.warnings`` and logged.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ..file_modes import CONFIG_MODE, FileModeError, check_mode
from .checks import cross_checks
from .environment import read_environment
from .rules import IPV4, ConfigError, Findings, logger
from .schema import Config

MAX_CONFIG_FILE_BYTES = 10 * 1024 * 1024
ENV_CONFIG_PATH = "MIES_CONFIG_JSON_PATH"
ENV_CONTAINER_IP = "MIES_CONTAINER_IP"
ENV_CONTAINER_MANAGEMENT_IP = "MIES_CONTAINER_MANAGEMENT_IP"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class _Builder(Findings):
    """Walks a JSON dict against the schema's rules, collecting errors and warnings."""

    def section(self, cls: type, data: Any, path: str) -> Any:
        if not isinstance(data, dict):
            self.error(ConfigError(path or "config", data, "a JSON object"))
            data = {}
        kwargs: dict[str, Any] = {}
        known: set[str] = set()
        keeps_extra = False
        for f in fields(cls):
            meta, key = f.metadata, _join(path, f.name)
            if meta.get("extra"):
                keeps_extra = True
                continue
            if not f.init or not ({"rule", "section", "section_list"} & meta.keys()):
                continue
            known.add(f.name)
            if "section" in meta:
                kwargs[f.name] = self.section(meta["section"], data.get(f.name, {}), key)
            elif "section_list" in meta:
                if f.name in data:
                    kwargs[f.name] = self.section_list(meta["section_list"], data[f.name], key)
            elif f.name in data:
                try:
                    kwargs[f.name] = meta["rule"].check(data[f.name], key)
                except ConfigError as err:
                    self.error(err)
        unknown = [k for k in data if k not in known]
        for k in unknown:
            self.warn(f"unknown key {_join(path, k)} ignored")
        if keeps_extra:
            kwargs["extra"] = {k: copy.deepcopy(data[k]) for k in unknown}
        return cls(**kwargs)

    def section_list(self, cls: type, data: Any, path: str) -> list[Any]:
        if not isinstance(data, list) or not data:
            self.error(ConfigError(path, data, "a non-empty list of JSON objects (at least one model)"))
            return [cls()]
        return [self.section(cls, item, f"{path}[{i}]") for i, item in enumerate(data)]


def _apply_env(cfg: Config, env: Mapping[str, str], b: _Builder) -> None:
    """MIES_CONTAINER_IP / MIES_CONTAINER_MANAGEMENT_IP win over the file."""
    for var, attr in ((ENV_CONTAINER_IP, "ipAddress"), (ENV_CONTAINER_MANAGEMENT_IP, "managementIpAddress")):
        value = env.get(var)
        if not value:
            continue
        try:
            setattr(cfg.ServerConfig, attr, IPV4.check(value, var))
            logger.info("ServerConfig.%s = %s (from environment variable %s)", attr, value, var)
        except ConfigError as err:
            b.error(err)


#: The PD-disaggregation environment variables (spec §1.8): variable -> (dotted key, kind). They win over
#: the file and are checked by the same rules as the key they set (an error names the key and the variable).
ENV_KEYS: dict[str, tuple[str, str]] = {
    "MINDIE_INFER_MODE": ("ServerConfig.inferMode", "str"),
    "MINDIE_DECODE_BATCH_SIZE": ("BackendConfig.ScheduleConfig.maxBatchSize", "int"),
    "MINDIE_PREFILL_BATCH_SIZE": ("BackendConfig.ScheduleConfig.maxPrefillBatchSize", "int"),
    "MINDIE_MAX_SEQ_LEN": ("BackendConfig.ModelDeployConfig.maxSeqLen", "int"),
    "MINDIE_MAX_ITER_TIMES": ("BackendConfig.ScheduleConfig.maxIterTimes", "int"),
    "MINDIE_MODEL_NAME": ("BackendConfig.ModelDeployConfig.ModelConfig.0.modelName", "str"),
    "MINDIE_MODEL_WEIGHT_PATH": ("BackendConfig.ModelDeployConfig.ModelConfig.0.modelWeightPath", "str"),
    "MINDIE_ENDPOINT_HTTPS_ENABLED": ("ServerConfig.httpsEnabled", "bool"),
    "MINDIE_INTER_COMM_TLS_ENABLED": ("ServerConfig.interCommTLSEnabled", "bool"),
}


def _env_overlay(data: Any, env: Mapping[str, str]) -> Any:
    """``data`` with the :data:`ENV_KEYS` variables that are set written over it (a copy; ``data`` is kept)."""
    wanted = {var: spec for var, spec in ENV_KEYS.items() if env.get(var, "") != ""}
    if not wanted or not isinstance(data, dict):
        return data
    data = copy.deepcopy(data)
    for var, (path, kind) in wanted.items():
        text = env[var].strip()
        value: Any = text
        if kind == "int":
            value = int(text) if re.fullmatch(r"-?[0-9]+", text) else text
        elif kind == "bool":
            value = {"1": True, "true": True, "0": False, "false": False}.get(text.lower(), text)
        node: Any = data
        parts = path.split(".")
        for part in parts[:-1]:
            if isinstance(node, list):
                if not node:
                    node.append({})
                node = node[int(part)]
            else:
                node = node.setdefault(part, [] if part == "ModelConfig" else {})
        if isinstance(node, dict):
            node[parts[-1]] = value
            logger.info("%s = %r (from environment variable %s)", path.replace(".0.", "[0]."), value, var)
    return data


def _build(data: Any, *, source_path: str | None, environ: Mapping[str, str] | None) -> tuple[Config, _Builder]:
    env = os.environ if environ is None else environ
    b = _Builder()
    data = _env_overlay(data, env)
    if isinstance(data, dict):
        server = data.get("ServerConfig")
        # MindIE: a missing managementIpAddress falls back to ipAddress (not to 127.0.0.2)
        if isinstance(server, dict) and "managementIpAddress" not in server and "ipAddress" in server:
            data = {**data, "ServerConfig": {**server, "managementIpAddress": server["ipAddress"]}}
    cfg: Config = b.section(Config, data, "")
    _apply_env(cfg, env, b)
    cfg.environment, env_errors = read_environment(env)
    for err in env_errors:
        b.error(err)
    cross_checks(cfg, b)
    cfg.warnings = b.warnings
    cfg.source_path = source_path
    return cfg, b


def default_config_dict() -> dict[str, Any]:
    """The complete default config as a JSON-ready dict (what ``mindie-host`` writes out)."""
    return Config().to_dict()


def config_from_dict(
    data: dict[str, Any],
    *,
    source_path: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build a :class:`Config` from parsed JSON: fill defaults, check every key.

    ``environ`` (default ``os.environ``) supplies ``MIES_CONTAINER_IP`` and
    ``MIES_CONTAINER_MANAGEMENT_IP``, which override the two bind addresses.  Raises the
    first :class:`ConfigError` found; unknown keys only add to ``Config.warnings``.
    """
    cfg, b = _build(data, source_path=source_path, environ=environ)
    if b.errors:
        raise b.errors[0]
    return cfg


def _resolve_path(path: str | os.PathLike[str] | None, env: Mapping[str, str]) -> str:
    if path is None:
        path = env.get(ENV_CONFIG_PATH) or None
        if path is None:
            raise ConfigError(ENV_CONFIG_PATH, None, f"a config.json path: pass one or set {ENV_CONFIG_PATH}")
    return os.fspath(path)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def read_json(path: str) -> Any:
    """A JSON file of 1 byte to 10 MB (UTF-8, no NaN or Infinity); every problem a :class:`ConfigError` naming the file."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_FILE_BYTES + 1)
    except OSError as err:
        raise ConfigError(path, err.strerror or str(err), "a readable config file") from err
    if not 0 < len(raw) <= MAX_CONFIG_FILE_BYTES:
        size = len(raw) if len(raw) <= MAX_CONFIG_FILE_BYTES else f"more than {MAX_CONFIG_FILE_BYTES} bytes"
        raise ConfigError(path, size, f"a file size in (0, {MAX_CONFIG_FILE_BYTES}] bytes (10 MB)")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(path, f"invalid UTF-8 at byte {err.start}", "a UTF-8 JSON file") from err
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} line {err.lineno} column {err.colno}", err.msg, "valid JSON") from err
    except ValueError as err:
        raise ConfigError(path, str(err), "valid JSON (no NaN or Infinity)") from err
    except RecursionError as err:
        raise ConfigError(path, "nesting too deep", "valid JSON of reasonable depth") from err


def load_config(path: str | os.PathLike[str] | None = None, *, environ: Mapping[str, str] | None = None) -> Config:
    """Read and check a ``config.json``.

    With ``path`` None the file named by ``MIES_CONFIG_JSON_PATH`` is read; if that is
    unset too, :class:`ConfigError` is raised.  The file must be 1 byte to 10 MB of JSON,
    with mode 0640 at most unless ``MINDIE_CHECK_INPUTFILES_PERMISSION=0``.
    """
    env = os.environ if environ is None else environ
    resolved = _resolve_path(path, env)
    check_file_mode(resolved, env)
    return config_from_dict(read_json(resolved), source_path=resolved, environ=env)


def check_file_mode(path: str, env: Mapping[str, str]) -> None:
    """``MINDIE_CHECK_INPUTFILES_PERMISSION``: a config file has mode 0640 at most (:mod:`mindie_host.file_modes`)."""
    try:
        check_mode(path, CONFIG_MODE, "a config file", env=env)
    except FileModeError as err:
        raise ConfigError(err.path, err.got, err.allowed) from None


def validate_config_file(path: str | os.PathLike[str] | None, *, environ: Mapping[str, str] | None = None) -> list[str]:
    """Check a config file and return ``[]`` when it is valid.

    Otherwise every error is returned as ``"error: ..."`` followed by the warnings as
    ``"warning: ..."``.  (A valid file's warnings are in ``load_config(path).warnings``.)
    """
    env = os.environ if environ is None else environ
    try:
        resolved = _resolve_path(path, env)
        check_file_mode(resolved, env)
        data = read_json(resolved)
    except ConfigError as err:
        return [f"error: {err}"]
    _, b = _build(data, source_path=resolved, environ=env)
    if not b.errors:
        return []
    return [f"error: {e}" for e in b.errors] + [f"warning: {w}" for w in b.warnings]
