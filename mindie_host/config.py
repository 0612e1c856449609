"""MindIE Service ``config.json``: schema, defaults, range checks, loading.

The layout follows MindIE Service's ``config.json`` (``Version``, ``LogConfig``,
``ServerConfig``, ``BackendConfig`` with ``ModelDeployConfig``/``ModelConfig[]`` and
``ScheduleConfig``).  Attribute names are the JSON keys, camelCase included, so a key
in the file and the attribute in code read the same.

Each dataclass field that maps to a JSON key carries a :class:`_Rule` in its
metadata: its type, its range or choices, and the text that an error message shows
as "allowed".  One generic walker (:class:`_Builder`) reads a JSON dict against those
rules; rules that involve two keys (``maxPrefillTokens >= maxInputTokenLen`` ...) live
in :func:`_cross_checks`.  Every problem raises :class:`ConfigError` naming the dotted
key, the value given and the allowed range.  Unknown keys are never fatal: they are
recorded in ``Config.warnings`` and logged.

Extensions of this host (not in MindIE) are marked "extension" below; defaults that
deliberately differ from MindIE are listed in :data:`DEVIATIONS`.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .file_modes import CONFIG_MODE, FileModeError, check_mode

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
    "config_from_dict",
    "default_config_dict",
    "load_config",
    "validate_config_file",
]

logger = logging.getLogger("mindie_host.config")

CONFIG_VERSION = "1.0.0"
MAX_CONFIG_FILE_BYTES = 10 * 1024 * 1024
ENV_CONFIG_PATH = "MIES_CONFIG_JSON_PATH"
ENV_CONTAINER_IP = "MIES_CONTAINER_IP"
ENV_CONTAINER_MANAGEMENT_IP = "MIES_CONTAINER_MANAGEMENT_IP"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_BACKEND_NAME = "mindieservice_llm_engine"

PATH_MAX = 4096
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1

# Defaults that deliberately differ from the MindIE Service manual.  This host runs
# on CPU/GPU out of the box, without certificates or NPUs.
DEVIATIONS: list[str] = [
    (
        "ServerConfig.httpsEnabled defaults to false (MindIE: true): a fresh install has no "
        "certificates, so HTTPS cannot start; set it to true once tls* files exist."
    ),
    (
        "ModelConfig.backendType defaults to 'torch' (MindIE: 'atb') and accepts any backend name "
        "matching ^[a-z][a-z0-9_]*$ (MindIE: only 'atb' or 'ms'); whether a backend of that name is "
        "installed is checked by the plugin host, not here."
    ),
    ("ModelConfig.worldSize defaults to 1 (MindIE: 4) and BackendConfig.npuDeviceIds to [[0]] (MindIE: [[0,1,2,3]])."),
    "ModelConfig.modelName defaults to 'SmolLM2-135M-Instruct' (MindIE: 'llama_65b').",
    (
        "ModelConfig.modelWeightPath defaults to '' (MindIE: a llama-65b path, minimum length 1); "
        "'' means the bundled default model."
    ),
    (
        "ModelConfig.cpuMemSize caps the KV pool in GB when the model runs on CPU (the pool holds at most "
        "maxBatchSize x maxSeqLen tokens and 80% of available memory, committed as used; MindIE: the CPU swap "
        "space for preempted requests, its meaning here too when a device runs the model); the MindIE rule is "
        "kept: 0 only when ScheduleConfig.maxPreemptCount is 0."
    ),
]


class ConfigError(ValueError):
    """A config value has the wrong type, is out of range, or breaks a rule between keys.

    ``key`` is the dotted path of the offending key (for example
    ``BackendConfig.ScheduleConfig.maxBatchSize``, or ``...ModelConfig[0].modelName``),
    ``value`` the value given and ``allowed`` a human description of what is accepted.
    File-level problems use the file name (and line) as ``key``.
    """

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        super().__init__(f"{key}: got {value!r}; allowed {allowed}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.value, self.allowed))


# --------------------------------------------------------------------------- rules


def _fmt(x: float | None) -> str:
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return str(x)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class _Rule:
    """Type and range of one JSON key.

    kinds: ``bool``, ``int``, ``num`` (int or float, stored as float), ``str``,
    ``ipv4``, ``names`` (list of strings), ``ids`` (list of lists of device ids),
    ``plugins`` (object of objects).
    """

    kind: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    special: tuple[Any, ...] = ()  # values accepted outside [lo, hi] (npuMemSize -1)
    choices: tuple[str, ...] = ()
    nocase: bool = False
    pattern: re.Pattern[str] | None = None
    min_len: int = 0
    max_len: int | None = None
    max_items: int | None = None
    nullable: bool = False
    secret: bool = False  # never echo the value in messages
    text: str | None = None  # overrides the generated "allowed" text
    required_when: str | None = None  # gate name: value must be non-empty when the gate holds
    validator: Callable[[Any], bool] | None = None

    @property
    def meta(self) -> dict[str, _Rule]:
        """Dataclass field metadata carrying this rule."""
        return {"rule": self}

    def interval(self) -> str:
        left = "(" if self.lo_open else "["
        right = ")" if self.hi_open else "]"
        return f"{left}{_fmt(self.lo)}, {_fmt(self.hi)}{right}"

    def describe(self) -> str:
        if self.text is not None:
            desc = self.text
        elif self.kind == "bool":
            desc = "true or false"
        elif self.kind in ("int", "num"):
            noun = "an integer" if self.kind == "int" else "a number"
            desc = f"{noun} in {self.interval()}"
            if self.special:
                desc = " or ".join(repr(s) for s in self.special) + f" or {desc}"
        elif self.kind == "str" and self.choices:
            desc = "one of " + ", ".join(repr(c) for c in self.choices)
            if self.nocase:
                desc += " (case-insensitive)"
        elif self.kind == "str":
            desc = f"a string of length [{self.min_len}, {self.max_len}]" if self.max_len else "a string"
        elif self.kind == "ipv4":
            desc = "an IPv4 address such as '127.0.0.1'"
        elif self.kind == "names":
            most = f"at most {self.max_items}" if self.max_items else "any number of"
            desc = f"a list of {most} file names, each a string of length [1, {self.max_len}]"
        elif self.kind == "ids":
            desc = "a non-empty list of non-empty lists of device ids (integers >= 0)"
        else:  # plugins
            desc = "a JSON object mapping plugin names to JSON objects"
        return f"null or {desc}" if self.nullable else desc

    def describe_required(self) -> str:
        """What a ``required_when`` key accepts while its gate holds."""
        if self.kind == "names":
            most = f"1 to {self.max_items}" if self.max_items else "at least 1"
            return f"a list of {most} file names, each a string of length [1, {self.max_len}]"
        return f"a non-empty string of length [1, {self.max_len}]"

    def fail(self, key: str, value: Any, allowed: str | None = None) -> ConfigError:
        shown = "<hidden>" if self.secret else value
        return ConfigError(key, shown, allowed or self.describe())

    def check(self, value: Any, key: str) -> Any:
        """Return the value to store, or raise :class:`ConfigError`."""
        if value is None and self.nullable:
            return None
        if not self._type_ok(value):
            raise self.fail(key, value)
        if self.kind in ("int", "num"):
            if value not in self.special and (self.lo is None or not self._in_range(value)):
                raise self.fail(key, value)
            if self.kind == "num":
                value = float(value)
        elif self.kind == "str":
            if self.choices:
                ok = value.lower() in (c.lower() for c in self.choices) if self.nocase else value in self.choices
                if not ok:
                    raise self.fail(key, value)
            if len(value) < self.min_len or (self.max_len is not None and len(value) > self.max_len):
                raise self.fail(key, value)
            if value and self.pattern is not None and not self.pattern.fullmatch(value):
                raise self.fail(key, value)
        elif self.kind == "ipv4":
            try:
                ipaddress.IPv4Address(value)
            except ValueError:
                raise self.fail(key, value) from None
        elif self.kind == "names":
            if self.max_items is not None and len(value) > self.max_items:
                raise self.fail(key, value)
            if any(not n or (self.max_len is not None and len(n) > self.max_len) for n in value):
                raise self.fail(key, value)
        elif self.kind == "ids":
            if not value or any(not ids or any(not _is_int(i) or i < 0 for i in ids) for ids in value):
                raise self.fail(key, value)
        elif self.kind == "plugins":
            for name, section in value.items():
                if not isinstance(section, dict):
                    raise ConfigError(f"{key}.{name}", section, "a JSON object (this plugin's settings)")
        if self.validator is not None and not self.validator(value):
            raise self.fail(key, value)
        return copy.deepcopy(value)

    def _type_ok(self, v: Any) -> bool:
        if self.kind == "bool":
            return isinstance(v, bool)
        if self.kind == "int":
            return _is_int(v)
        if self.kind == "num":
            return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)
        if self.kind in ("str", "ipv4"):
            return isinstance(v, str)
        if self.kind == "names":
            return isinstance(v, list) and all(isinstance(n, str) for n in v)
        if self.kind == "ids":
            return isinstance(v, list) and all(isinstance(ids, list) for ids in v)
        return isinstance(v, dict) and all(isinstance(k, str) for k in v)  # plugins

    def _in_range(self, v: float) -> bool:
        lo, hi = self.lo, self.hi
        if lo is not None and (v <= lo if self.lo_open else v < lo):
            return False
        return not (hi is not None and (v >= hi if self.hi_open else v > hi))


def _int(lo: int, hi: int, **kw: Any) -> _Rule:
    return _Rule("int", lo=lo, hi=hi, **kw)


def _num(lo: float, hi: float, **kw: Any) -> _Rule:
    return _Rule("num", lo=lo, hi=hi, **kw)


_BOOL = _Rule("bool")
_PORT = _int(1024, 65535)
_IPV4 = _Rule("ipv4")


def _choice(*choices: str, nocase: bool = False) -> _Rule:
    return _Rule("str", choices=choices, nocase=nocase)


def _int_choice(*choices: int) -> _Rule:
    return _Rule("int", special=choices, text="one of " + ", ".join(map(str, choices)))


def _path(required_when: str | None = None) -> _Rule:
    """A file or directory path: at most PATH_MAX characters, non-empty when its gate holds."""
    return _Rule("str", max_len=PATH_MAX, required_when=required_when)


def _files(required_when: str | None = None, max_items: int | None = 3) -> _Rule:
    """A list of certificate / CRL file names."""
    return _Rule("names", max_len=PATH_MAX, max_items=max_items, required_when=required_when)


def _key(default: Any, rule: _Rule) -> Any:
    """A dataclass field for one JSON key with an immutable default (lists use ``field``)."""
    return field(default=default, metadata=rule.meta)


def _names(*names: str) -> Callable[[], list[str]]:
    """default_factory for a list-of-file-names key."""
    return lambda: list(names)


def _split_plugin_type(plugin_type: str) -> list[str]:
    names: list[str] = []
    for part in plugin_type.split(","):
        name = part.strip()
        if name and name not in names:
            names.append(name)
    return names


_PLUGIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def _parse_plugin_params(text: str) -> tuple[list[str], dict[str, Any]] | None:
    """``plugin_params`` -> (plugin names, other options), or None when malformed."""
    if not text.strip():
        return [], {}
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("plugin_type"), str):
        return None
    names = _split_plugin_type(obj["plugin_type"])
    if not all(_PLUGIN_NAME.fullmatch(n) for n in names):
        return None
    return names, {k: v for k, v in obj.items() if k != "plugin_type"}


_PLUGIN_PARAMS_TEXT = (
    "'' or a JSON object string with a string \"plugin_type\" of comma-separated plugin names, "
    'e.g. \'{"plugin_type": "splitfuse"}\''
)

# --------------------------------------------------------------------------- sections


@dataclass
class LogConfig:
    """``LogConfig``: log level, rotation size/count and file path."""

    logLevel: str = _key("Info", _choice("Verbose", "Info", "Warning", "Warn", "Error", "Debug", nocase=True))
    logFileSize: int = _key(20, _int(0, 500))  # MB per file; 0 = no log file
    logFileNum: int = _key(20, _int(0, 64))  # rotated files kept; 0 = no log file
    logPath: str = _key("logs/mindservice.log", _Rule("str", min_len=1, max_len=PATH_MAX))

    @property
    def python_level(self) -> int:
        """``logLevel`` as a :mod:`logging` level (Verbose/Debug -> DEBUG ...)."""
        return {
            "verbose": logging.DEBUG,
            "debug": logging.DEBUG,
            "info": logging.INFO,
            "warning": logging.WARNING,
            "warn": logging.WARNING,
            "error": logging.ERROR,
        }[self.logLevel.lower()]


_API_KEY_RULE = _Rule(
    "str",
    max_len=PATH_MAX,
    pattern=re.compile(r"[\x21-\x7e]+"),
    secret=True,
    text="a string of printable ASCII without spaces, length [0, 4096] ('' turns the check off)",
)


@dataclass
class ServerConfig:
    """``ServerConfig``: business/management endpoints, TLS files, PD inter-instance settings.

    Bind addresses: the environment variables ``MIES_CONTAINER_IP`` and
    ``MIES_CONTAINER_MANAGEMENT_IP`` override ``ipAddress`` / ``managementIpAddress``; a file
    that sets ``ipAddress`` but not ``managementIpAddress`` gets the management plane on
    ``ipAddress`` too (MindIE's rule); with neither set the defaults apply.

    TLS keys must be non-empty only when ``httpsEnabled`` is true (``management*`` ones when
    the management IP also differs from the business IP); ``interComm*`` only in ``dmi`` mode.

    Extensions of this host, not in MindIE:

    * ``apiKey``: bearer token required on the business port; ``""`` turns it off.
    * ``maxRequestBodyBytes``: largest accepted HTTP request body.
    * ``requestTimeoutSeconds``: longest a single request may run.
    * ``shutdownDrainSeconds``: how long a graceful stop waits for in-flight requests.
    * ``headerReadTimeoutSeconds``: a connection whose request line and headers have not
      all arrived this long after its first byte (or after it opened) is closed (slowloris).
    * ``bodyReadTimeoutSeconds``: a business request whose body has not all arrived this
      long after its headers gets 408; the body is read before a ``maxLinkNum`` slot is taken.
    * ``engineProcess``: run the engine core (scheduler, KV manager, model) in its own
      process, supervised by the HTTP front end (docs/architecture.md). Default true;
      false steps the engine on a thread of the server's process (no supervision: an
      engine that dies stays dead), for debugging and white-box tests.
    * ``engineRestartMaxRetries``: with ``engineProcess``, how many times in a row a dead
      engine process is restarted before liveness fails (0: never restart).
    * ``engineRestartBackoffSeconds``: the wait before the first restart; it doubles with
      each further restart in a row.
    """

    ipAddress: str = _key("127.0.0.1", _IPV4)
    managementIpAddress: str = _key("127.0.0.2", _IPV4)
    port: int = _key(1025, _PORT)
    managementPort: int = _key(1026, _PORT)
    metricsPort: int = _key(1027, _PORT)
    allowAllZeroIpListening: bool = _key(False, _BOOL)
    maxLinkNum: int = _key(1000, _int(1, 1000))
    httpsEnabled: bool = _key(False, _BOOL)  # deviation: MindIE default is true
    fullTextEnabled: bool = _key(False, _BOOL)
    tlsCaPath: str = _key("security/ca/", _path("https"))
    tlsCaFile: list[str] = field(default_factory=_names("ca.pem"), metadata=_files("https").meta)
    tlsCert: str = _key("security/certs/server.pem", _path("https"))
    tlsPk: str = _key("security/keys/server.key.pem", _path("https"))
    tlsPkPwd: str = _key("security/pass/key_pwd.txt", _path())
    tlsCrlPath: str = _key("security/certs/", _path())
    tlsCrlFiles: list[str] = field(default_factory=_names("server_crl.pem"), metadata=_files("https").meta)
    managementTlsCaFile: list[str] = field(
        default_factory=_names("management_ca.pem"), metadata=_files("mgmt_tls").meta
    )
    managementTlsCert: str = _key("security/certs/management/server.pem", _path("mgmt_tls"))
    managementTlsPk: str = _key("security/keys/management/server.key.pem", _path("mgmt_tls"))
    managementTlsPkPwd: str = _key("security/pass/management/key_pwd.txt", _path())
    managementTlsCrlPath: str = _key("security/management/certs/", _path("mgmt_tls"))
    managementTlsCrlFiles: list[str] = field(default_factory=_names("server_crl.pem"), metadata=_files("https").meta)
    kmcKsfMaster: str = _key("tools/pmt/master/ksfa", _path("https"))
    kmcKsfStandby: str = _key("tools/pmt/standby/ksfb", _path("https"))
    inferMode: str = _key("standard", _choice("standard", "dmi"))
    interCommTLSEnabled: bool = _key(True, _BOOL)
    interCommPort: int = _key(1121, _PORT)
    interCommTlsCaPath: str = _key("security/grpc/ca/", _path("intercomm_tls"))
    interCommTlsCaFiles: list[str] = field(
        default_factory=_names("ca.pem"), metadata=_files("intercomm_tls", None).meta
    )
    interCommTlsCert: str = _key("security/grpc/certs/server.pem", _path("intercomm_tls"))
    interCommPk: str = _key("security/grpc/keys/server.key.pem", _path("intercomm_tls"))
    interCommPkPwd: str = _key("security/grpc/pass/key_pwd.txt", _path())
    interCommTlsCrlPath: str = _key("security/grpc/certs/", _path())
    interCommTlsCrlFiles: list[str] = field(default_factory=_names("server_crl.pem"), metadata=_files(None, None).meta)
    openAiSupport: str = _key("vllm", _Rule("str"))
    # extensions
    apiKey: str = _key("", _API_KEY_RULE)
    maxRequestBodyBytes: int = _key(16 * 1024 * 1024, _int(1024, 1 << 30))
    requestTimeoutSeconds: float = _key(600.0, _num(0, 86400, lo_open=True))
    shutdownDrainSeconds: float = _key(30.0, _num(0, 3600))
    headerReadTimeoutSeconds: float = _key(10.0, _num(0, 3600, lo_open=True))
    bodyReadTimeoutSeconds: float = _key(30.0, _num(0, 3600, lo_open=True))
    engineProcess: bool = _key(True, _BOOL)
    engineRestartMaxRetries: int = _key(3, _int(0, 100))
    engineRestartBackoffSeconds: float = _key(1.0, _num(0, 600))


_MODEL_NAME_RULE = _Rule(
    "str",
    max_len=256,
    pattern=re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._\-]*[A-Za-z0-9])?"),
    validator=bool,
    text="1 to 256 characters from A-Z a-z 0-9 - . _, not starting or ending with - . or _",
)
_BACKEND_TYPE_RULE = _Rule(
    "str",
    max_len=64,
    pattern=re.compile(r"[a-z][a-z0-9_]*"),
    validator=bool,
    text="a backend name matching ^[a-z][a-z0-9_]*$ (at most 64 characters), e.g. 'torch', 'atb', 'ms'",
)


def _plugin_params_ok(text: str) -> bool:
    return _parse_plugin_params(text) is not None


@dataclass
class ModelConfig:
    """One ``ModelDeployConfig.ModelConfig[]`` entry: which model, where, on what backend.

    Extensions of this host, not in MindIE: ``dtype`` and ``device`` pick the weights'
    precision and where the torch backend runs; ``kvCacheDtype`` the KV cache's (``auto``:
    the weights'; ``int8``: int8 codes with a scale per token and KV head); ``quantization`` says whether CPU decode
    reads a GGUF file's 4- and 8-bit matrices in that form for products of few rows
    (``auto``, which also serves an int8 checkpoint's layers as stored) or only their dequantized
    values (``none``), or serves the decoder's linear layers in int8 (``w8a16``: int8 weights;
    ``w8a8``: int8 weights and per-token int8 activations; docs/quantization.md); ``compile`` runs decode steps
    of up to 16 sequences through ``torch.compile`` on CPU (compiled at start-up) and replays
    decode steps from CUDA graphs on CUDA (captured at start-up); ``maxKvBlocks`` caps the KV-cache pool
    below what the memory budget allows (0 = no cap); the sampling keys (``temperature`` ...
    ``do_sample``) are per-model defaults for requests that leave them out (``None`` = not
    set, fall back to the model's generation config).

    Derived, not written back by :meth:`Config.to_dict`: ``plugins`` (names from
    ``plugin_params``' ``plugin_type``, comma-separated allowed) and ``plugin_options``
    (the other keys of that JSON object).  ``extra`` keeps unknown keys so plugins can read
    them; they are written back.
    """

    modelInstanceType: str = _key("Standard", _choice("Standard", "StandardMock"))
    modelName: str = _key(DEFAULT_MODEL_NAME, _MODEL_NAME_RULE)
    modelWeightPath: str = _key("", _path())  # deviation: "" = the default model
    worldSize: int = _key(1, _int(1, UINT32_MAX))
    cpuMemSize: int = _key(5, _int(0, UINT32_MAX))
    npuMemSize: int = _key(-1, _int(0, INT32_MAX, lo_open=True, special=(-1,)))
    backendType: str = _key("torch", _BACKEND_TYPE_RULE)
    trustRemoteCode: bool = _key(False, _BOOL)
    plugin_params: str = _key("", _Rule("str", validator=_plugin_params_ok, text=_PLUGIN_PARAMS_TEXT))
    # extensions
    dtype: str = _key("auto", _choice("auto", "float32", "bfloat16", "float16"))
    kvCacheDtype: str = _key("auto", _choice("auto", "float32", "bfloat16", "float16", "int8"))  # auto = the weights' dtype
    device: str = _key("auto", _choice("auto", "cpu", "cuda", "npu"))
    quantization: str = _key("auto", _choice("auto", "none", "w8a16", "w8a8"))
    compile: bool = _key(False, _BOOL)
    maxKvBlocks: int = _key(0, _int(0, INT32_MAX))  # 0 = as many as the memory budget allows
    temperature: float | None = _key(None, _num(0, 2, nullable=True))
    top_k: int | None = _key(None, _int(0, INT32_MAX, nullable=True))
    top_p: float | None = _key(None, _num(0, 1, lo_open=True, nullable=True))
    typical_p: float | None = _key(None, _num(0, 1, lo_open=True, nullable=True))
    min_p: float | None = _key(None, _num(0, 1, nullable=True))
    repetition_penalty: float | None = _key(None, _num(0, 2, lo_open=True, nullable=True))
    presence_penalty: float | None = _key(None, _num(-2, 2, nullable=True))
    frequency_penalty: float | None = _key(None, _num(-2, 2, nullable=True))
    do_sample: bool | None = _key(None, _Rule("bool", nullable=True))
    # derived / kept aside
    extra: dict[str, Any] = field(default_factory=dict, metadata={"extra": True})
    plugins: list[str] = field(default_factory=list, init=False)
    plugin_options: dict[str, Any] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        parsed = _parse_plugin_params(self.plugin_params) if isinstance(self.plugin_params, str) else None
        if parsed is None:
            raise ConfigError("ModelConfig.plugin_params", self.plugin_params, _PLUGIN_PARAMS_TEXT)
        self.plugins, self.plugin_options = parsed


def _default_models() -> list[ModelConfig]:
    return [ModelConfig()]


@dataclass
class ModelDeployConfig:
    """``ModelDeployConfig``: sequence-length limits and the list of models."""

    maxSeqLen: int = _key(2560, _int(1, UINT32_MAX))
    maxInputTokenLen: int = _key(2048, _int(1, 4194304))
    truncation: bool = _key(False, _BOOL)
    ModelConfig: list[ModelConfig] = field(default_factory=_default_models, metadata={"section_list": ModelConfig})

    @property
    def max_input_len(self) -> int:
        """The input-token limit actually applied: ``min(maxInputTokenLen, maxSeqLen - 1)``."""
        return min(self.maxInputTokenLen, self.maxSeqLen - 1)


@dataclass
class ScheduleConfig:
    """``ScheduleConfig``: batching limits, scheduling policies, SplitFuse and Prefix Cache switches."""

    templateType: str = _key("Standard", _choice("Standard", "Mix"))
    templateName: str = _key("Standard_LLM", _choice("Standard_LLM"))
    cacheBlockSize: int = _key(128, _int(1, 128))
    maxPrefillBatchSize: int = _key(50, _int(0, 5000))  # 0 = use maxBatchSize
    maxPrefillTokens: int = _key(8192, _int(1, 4194304))
    prefillTimeMsPerReq: int = _key(150, _int(0, 1000))
    prefillPolicyType: int = _key(0, _int_choice(0, 1, 2, 3))
    decodeTimeMsPerReq: int = _key(50, _int(0, 1000))
    decodePolicyType: int = _key(0, _int_choice(0, 1, 2, 3))
    maxBatchSize: int = _key(200, _int(1, 5000))
    maxIterTimes: int = _key(512, _int(1, UINT32_MAX))
    maxPreemptCount: int = _key(0, _int(0, 5000))
    supportSelectBatch: bool = _key(False, _BOOL)
    maxQueueDelayMicroseconds: int = _key(5000, _int(500, 1000000))
    enablePrefixCache: bool = _key(False, _BOOL)
    enableSplit: bool = _key(False, _BOOL)
    policyType: int = _key(0, _int_choice(0, 4, 5, 6, 7))
    splitType: bool = _key(False, _BOOL)
    splitStartType: bool = _key(False, _BOOL)
    splitChunkTokens: int = _key(512, _int(1, 8192))
    splitStartBatchSize: int = _key(16, _int(0, 5000))

    @property
    def prefill_batch_limit(self) -> int:
        """``maxPrefillBatchSize``, with 0 meaning ``maxBatchSize``."""
        return self.maxPrefillBatchSize or self.maxBatchSize


_BACKEND_NAME_RULE = _Rule(
    "str",
    max_len=50,
    pattern=re.compile(r"[a-z](?:[a-z_]*[a-z])?"),
    validator=bool,
    text="1 to 50 lowercase letters and '_', not starting or ending with '_'",
)


@dataclass
class BackendConfig:
    """``BackendConfig``: engine name, instances, devices, multi-node settings, and the
    ``ModelDeployConfig`` / ``ScheduleConfig`` sub-sections."""

    backendName: str = _key(DEFAULT_BACKEND_NAME, _BACKEND_NAME_RULE)
    modelInstanceNumber: int = _key(1, _int(1, 10))
    npuDeviceIds: list[list[int]] = field(default_factory=lambda: [[0]], metadata=_Rule("ids").meta)
    tokenizerProcessNumber: int = _key(8, _int(1, 32))
    multiNodesInferEnabled: bool = _key(False, _BOOL)
    multiNodesInferPort: int = _key(1120, _PORT)
    interNodeTLSEnabled: bool = _key(True, _BOOL)
    interNodeTlsCaPath: str = _key("security/grpc/ca/", _path("internode_tls"))
    interNodeTlsCaFiles: list[str] = field(
        default_factory=_names("ca.pem"), metadata=_files("internode_tls", None).meta
    )
    interNodeTlsCert: str = _key("security/grpc/certs/server.pem", _path("internode_tls"))
    interNodeTlsPk: str = _key("security/grpc/keys/server.key.pem", _path("internode_tls"))
    interNodeTlsPkPwd: str = _key("security/grpc/pass/mindie_server_key_pwd.txt", _path())
    interNodeTlsCrlPath: str = _key("security/grpc/certs/", _path())
    interNodeTlsCrlFiles: list[str] = field(default_factory=_names("server_crl.pem"), metadata=_files(None, None).meta)
    interNodeKmcKsfMaster: str = _key("tools/pmt/master/ksfa", _path("internode_tls"))
    interNodeKmcKsfStandby: str = _key("tools/pmt/standby/ksfb", _path("internode_tls"))
    ModelDeployConfig: ModelDeployConfig = field(
        default_factory=ModelDeployConfig, metadata={"section": ModelDeployConfig}
    )
    ScheduleConfig: ScheduleConfig = field(default_factory=ScheduleConfig, metadata={"section": ScheduleConfig})


@dataclass
class Config:
    """The whole ``config.json``.

    ``Plugins`` is an extension of this host: one JSON object per plugin name
    (``{"prefix_cache": {...}}``) that the plugin validates itself.  ``warnings`` (unknown
    keys ...) and ``source_path`` (the file it came from) are not written back.
    """

    Version: str = _key(CONFIG_VERSION, _Rule("str", choices=(CONFIG_VERSION,), text=f"exactly {CONFIG_VERSION!r}"))
    LogConfig: LogConfig = field(default_factory=LogConfig, metadata={"section": LogConfig})
    ServerConfig: ServerConfig = field(default_factory=ServerConfig, metadata={"section": ServerConfig})
    BackendConfig: BackendConfig = field(default_factory=BackendConfig, metadata={"section": BackendConfig})
    Plugins: dict[str, dict[str, Any]] = field(default_factory=dict, metadata=_Rule("plugins").meta)
    warnings: list[str] = field(default_factory=list, compare=False)
    source_path: str | None = field(default=None, compare=False)

    @property
    def model(self) -> ModelConfig:
        """The first ``ModelConfig`` entry."""
        return self.BackendConfig.ModelDeployConfig.ModelConfig[0]

    @property
    def deploy(self) -> ModelDeployConfig:
        return self.BackendConfig.ModelDeployConfig

    @property
    def schedule(self) -> ScheduleConfig:
        return self.BackendConfig.ScheduleConfig

    @property
    def server(self) -> ServerConfig:
        return self.ServerConfig

    @property
    def backend(self) -> BackendConfig:
        return self.BackendConfig

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict in MindIE's layout; derived fields and unset extensions left out."""
        return _section_to_dict(self)


def _section_to_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        meta = f.metadata
        if "rule" in meta:
            if value is None and meta["rule"].nullable:
                continue
            out[f.name] = copy.deepcopy(value)
        elif "section" in meta:
            out[f.name] = _section_to_dict(value)
        elif "section_list" in meta:
            out[f.name] = [_section_to_dict(item) for item in value]
        elif meta.get("extra"):
            out.update({k: copy.deepcopy(v) for k, v in value.items() if k not in out})
    return out


# --------------------------------------------------------------------------- building

# Conditions under which "required when ..." keys must be non-empty: (description, test).
_GATES: dict[str, tuple[str, Callable[[Config], bool]]] = {
    "https": ("ServerConfig.httpsEnabled is true", lambda c: c.ServerConfig.httpsEnabled),
    "mgmt_tls": (
        "ServerConfig.httpsEnabled is true and managementIpAddress differs from ipAddress",
        lambda c: c.ServerConfig.httpsEnabled and c.ServerConfig.managementIpAddress != c.ServerConfig.ipAddress,
    ),
    "intercomm_tls": (
        "ServerConfig.inferMode is 'dmi' and interCommTLSEnabled is true",
        lambda c: c.ServerConfig.inferMode == "dmi" and c.ServerConfig.interCommTLSEnabled,
    ),
    "internode_tls": (
        "BackendConfig.multiNodesInferEnabled and interNodeTLSEnabled are true",
        lambda c: c.BackendConfig.multiNodesInferEnabled and c.BackendConfig.interNodeTLSEnabled,
    ),
}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class _Builder:
    """Walks a JSON dict against the dataclass rules, collecting errors and warnings."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []
        self.warnings: list[str] = []
        self.bad: set[str] = set()

    def error(self, err: ConfigError) -> None:
        self.errors.append(err)
        self.bad.add(err.key)

    def need(self, ok: bool, key: str, value: Any, allowed: str, *reads: str) -> None:
        """Record an error for ``key`` unless ``ok``, or unless it or a key in ``reads`` already failed."""
        if not ok and key not in self.bad and not any(r in self.bad for r in reads):
            self.error(ConfigError(key, value, allowed))

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        logger.warning("%s", message)

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
            setattr(cfg.ServerConfig, attr, _IPV4.check(value, var))
            logger.info("ServerConfig.%s = %s (from environment variable %s)", attr, value, var)
        except ConfigError as err:
            b.error(err)


def _cross_checks(c: Config, b: _Builder) -> None:
    """Rules that relate two keys; each is skipped when a key it reads already failed."""
    srv, be = c.ServerConfig, c.BackendConfig
    dep, sch = be.ModelDeployConfig, be.ScheduleConfig
    S, D = "BackendConfig.ScheduleConfig", "BackendConfig.ModelDeployConfig"
    mbs = sch.maxBatchSize

    zero_ip = "an IPv4 address other than 0.0.0.0 unless ServerConfig.allowAllZeroIpListening is true"
    for attr in ("ipAddress", "managementIpAddress"):
        ip = getattr(srv, attr)
        b.need(srv.allowAllZeroIpListening or ip != "0.0.0.0", f"ServerConfig.{attr}", ip, zero_ip)

    b.need(
        sch.maxPrefillBatchSize <= mbs,
        f"{S}.maxPrefillBatchSize",
        sch.maxPrefillBatchSize,
        f"an integer in [0, {mbs}] (at most {S}.maxBatchSize; 0 means maxBatchSize)",
        f"{S}.maxBatchSize",
    )
    b.need(
        sch.maxPrefillTokens >= dep.maxInputTokenLen,
        f"{S}.maxPrefillTokens",
        sch.maxPrefillTokens,
        f"an integer in [{dep.maxInputTokenLen}, 4194304] (at least {D}.maxInputTokenLen)",
        f"{D}.maxInputTokenLen",
    )
    b.need(
        sch.maxIterTimes <= dep.maxSeqLen,
        f"{S}.maxIterTimes",
        sch.maxIterTimes,
        f"an integer in [1, {dep.maxSeqLen}] (at most {D}.maxSeqLen)",
        f"{D}.maxSeqLen",
    )
    b.need(
        sch.maxPreemptCount <= mbs,
        f"{S}.maxPreemptCount",
        sch.maxPreemptCount,
        f"an integer in [0, {mbs}] (at most {S}.maxBatchSize)",
        f"{S}.maxBatchSize",
    )
    # only meaningful with SplitFuse on, so a small maxBatchSize alone does not trip it
    b.need(
        not sch.enableSplit or sch.splitStartBatchSize <= mbs,
        f"{S}.splitStartBatchSize",
        sch.splitStartBatchSize,
        f"an integer in [0, {mbs}] (at most {S}.maxBatchSize when enableSplit is true)",
        f"{S}.maxBatchSize",
        f"{S}.enableSplit",
    )
    b.need(
        not be.multiNodesInferEnabled or be.modelInstanceNumber == 1,
        "BackendConfig.modelInstanceNumber",
        be.modelInstanceNumber,
        "1 when BackendConfig.multiNodesInferEnabled is true",
        "BackendConfig.multiNodesInferEnabled",
    )

    b.need(
        be.multiNodesInferEnabled or len(be.npuDeviceIds) == be.modelInstanceNumber,
        "BackendConfig.npuDeviceIds", be.npuDeviceIds,
        f"{be.modelInstanceNumber} device list(s), one per model instance (BackendConfig.modelInstanceNumber is "
        f"{be.modelInstanceNumber})",
        "BackendConfig.modelInstanceNumber",
    )
    first_use: dict[str, int] = {}
    for i, m in enumerate(dep.ModelConfig):
        p = f"{D}.ModelConfig[{i}]"
        b.need(
            sch.maxPreemptCount == 0 or m.cpuMemSize > 0,
            f"{p}.cpuMemSize",
            m.cpuMemSize,
            f"an integer in [1, {UINT32_MAX}] when {S}.maxPreemptCount > 0 (0 only when it is 0)",
            f"{S}.maxPreemptCount",
        )
        first = first_use.setdefault(m.modelName, i)
        b.need(
            first == i, f"{p}.modelName", m.modelName, f"a name no other entry uses ({D}.ModelConfig[{first}] has it)"
        )
        if not be.multiNodesInferEnabled:  # one device per rank (multi-node: the rank table lists them)
            for j, ids in enumerate(be.npuDeviceIds):
                b.need(
                    len(ids) == m.worldSize, f"BackendConfig.npuDeviceIds[{j}]", ids,
                    f"a list of {m.worldSize} device id(s), one per rank ({p}.worldSize is {m.worldSize})",
                    f"{p}.worldSize", "BackendConfig.npuDeviceIds",
                )

    # keys that must be non-empty when their feature (HTTPS, multi-node TLS ...) is on
    for obj, path in ((srv, "ServerConfig"), (be, "BackendConfig")):
        for f in fields(obj):
            rule = f.metadata.get("rule")
            if rule is None or rule.required_when is None:
                continue
            key, value = f"{path}.{f.name}", getattr(obj, f.name)
            gate_text, gate = _GATES[rule.required_when]
            if not value and key not in b.bad and gate(c):
                b.error(rule.fail(key, value, f"{rule.describe_required()} when {gate_text}"))

    if be.backendName != DEFAULT_BACKEND_NAME and "BackendConfig.backendName" not in b.bad:
        b.warn(f"BackendConfig.backendName {be.backendName!r} is not {DEFAULT_BACKEND_NAME!r}; this host ignores it")


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
    _cross_checks(cfg, b)
    cfg.warnings = b.warnings
    cfg.source_path = source_path
    return cfg, b


# --------------------------------------------------------------------------- public functions


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


def _read_json(path: str) -> Any:
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
    _check_file_mode(resolved, env)
    return config_from_dict(_read_json(resolved), source_path=resolved, environ=env)


def _check_file_mode(path: str, env: Mapping[str, str]) -> None:
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
        _check_file_mode(resolved, env)
        data = _read_json(resolved)
    except ConfigError as err:
        return [f"error: {err}"]
    _, b = _build(data, source_path=resolved, environ=env)
    if not b.errors:
        return []
    return [f"error: {e}" for e in b.errors] + [f"warning: {w}" for w in b.warnings]
