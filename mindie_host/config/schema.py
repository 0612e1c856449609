"""The ``config.json`` schema: its sections as dataclasses, each key with its default and its :class:`~.rules.Rule`.

The layout follows MindIE Service's ``config.json`` (``Version``, ``LogConfig``,
``ServerConfig``, ``BackendConfig`` with ``ModelDeployConfig``/``ModelConfig[]`` and
``ScheduleConfig``).  Attribute names are the JSON keys, camelCase included, so a key
in the file and the attribute in code read the same.

Extensions of this host (not in MindIE) are marked "extension" below; defaults that
deliberately differ from MindIE are listed in :data:`DEVIATIONS`.  Rules between two keys
live in :mod:`.checks`, reading a file in :mod:`.loader`.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from dataclasses import dataclass, field, fields
from typing import Any

from ..models.default import DEFAULT_MODEL_NAME
from .environment import Environment
from .rules import (
    BOOL,
    INT32_MAX,
    IPV4,
    PATH_MAX,
    PORT,
    UINT32_MAX,
    ConfigError,
    Rule,
    files_key,
    int_one_of,
    int_range,
    json_key,
    num_range,
    one_of,
    path_rule,
)

CONFIG_VERSION = "1.0.0"
DEFAULT_BACKEND_NAME = "mindieservice_llm_engine"

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


@dataclass
class LogConfig:
    """``LogConfig``: log level, rotation size/count and file path."""

    logLevel: str = json_key("Info", one_of("Verbose", "Info", "Warning", "Warn", "Error", "Debug", nocase=True))
    logFileSize: int = json_key(20, int_range(0, 500))  # MB per file; 0 = no log file
    logFileNum: int = json_key(20, int_range(0, 64))  # rotated files kept; 0 = no log file
    logPath: str = json_key("logs/mindservice.log", Rule("str", min_len=1, max_len=PATH_MAX))

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


_API_KEY_RULE = Rule(
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

    ipAddress: str = json_key("127.0.0.1", IPV4)
    managementIpAddress: str = json_key("127.0.0.2", IPV4)
    port: int = json_key(1025, PORT)
    managementPort: int = json_key(1026, PORT)
    metricsPort: int = json_key(1027, PORT)
    allowAllZeroIpListening: bool = json_key(False, BOOL)
    maxLinkNum: int = json_key(1000, int_range(1, 1000))
    httpsEnabled: bool = json_key(False, BOOL)  # deviation: MindIE default is true
    fullTextEnabled: bool = json_key(False, BOOL)
    tlsCaPath: str = json_key("security/ca/", path_rule("https"))
    tlsCaFile: list[str] = files_key("ca.pem", required_when="https")
    tlsCert: str = json_key("security/certs/server.pem", path_rule("https"))
    tlsPk: str = json_key("security/keys/server.key.pem", path_rule("https"))
    tlsPkPwd: str = json_key("security/pass/key_pwd.txt", path_rule())
    tlsCrlPath: str = json_key("security/certs/", path_rule())
    tlsCrlFiles: list[str] = files_key("server_crl.pem", required_when="https")
    managementTlsCaFile: list[str] = files_key("management_ca.pem", required_when="mgmt_tls")
    managementTlsCert: str = json_key("security/certs/management/server.pem", path_rule("mgmt_tls"))
    managementTlsPk: str = json_key("security/keys/management/server.key.pem", path_rule("mgmt_tls"))
    managementTlsPkPwd: str = json_key("security/pass/management/key_pwd.txt", path_rule())
    managementTlsCrlPath: str = json_key("security/management/certs/", path_rule("mgmt_tls"))
    managementTlsCrlFiles: list[str] = files_key("server_crl.pem", required_when="https")
    kmcKsfMaster: str = json_key("tools/pmt/master/ksfa", path_rule("https"))
    kmcKsfStandby: str = json_key("tools/pmt/standby/ksfb", path_rule("https"))
    inferMode: str = json_key("standard", one_of("standard", "dmi"))
    interCommTLSEnabled: bool = json_key(True, BOOL)
    interCommPort: int = json_key(1121, PORT)
    interCommTlsCaPath: str = json_key("security/grpc/ca/", path_rule("intercomm_tls"))
    interCommTlsCaFiles: list[str] = files_key("ca.pem", required_when="intercomm_tls", max_items=None)
    interCommTlsCert: str = json_key("security/grpc/certs/server.pem", path_rule("intercomm_tls"))
    interCommPk: str = json_key("security/grpc/keys/server.key.pem", path_rule("intercomm_tls"))
    interCommPkPwd: str = json_key("security/grpc/pass/key_pwd.txt", path_rule())
    interCommTlsCrlPath: str = json_key("security/grpc/certs/", path_rule())
    interCommTlsCrlFiles: list[str] = files_key("server_crl.pem", max_items=None)
    openAiSupport: str = json_key("vllm", Rule("str"))
    # extensions
    apiKey: str = json_key("", _API_KEY_RULE)
    maxRequestBodyBytes: int = json_key(16 * 1024 * 1024, int_range(1024, 1 << 30))
    requestTimeoutSeconds: float = json_key(600.0, num_range(0, 86400, lo_open=True))
    shutdownDrainSeconds: float = json_key(30.0, num_range(0, 3600))
    headerReadTimeoutSeconds: float = json_key(10.0, num_range(0, 3600, lo_open=True))
    bodyReadTimeoutSeconds: float = json_key(30.0, num_range(0, 3600, lo_open=True))
    engineProcess: bool = json_key(True, BOOL)
    engineRestartMaxRetries: int = json_key(3, int_range(0, 100))
    engineRestartBackoffSeconds: float = json_key(1.0, num_range(0, 600))


_MODEL_NAME_RULE = Rule(
    "str",
    max_len=256,
    pattern=re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._\-]*[A-Za-z0-9])?"),
    validator=bool,
    text="1 to 256 characters from A-Z a-z 0-9 - . _, not starting or ending with - . or _",
)
_BACKEND_TYPE_RULE = Rule(
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
    decode steps from CUDA graphs on CUDA (captured at start-up); ``expertParallel`` gives each tensor-parallel rank
    ``1/worldSize`` of a mixture-of-experts model's routed experts whole instead of every expert's share of channels
    (torch backend; docs/scale-out.md); ``maxKvBlocks`` caps the KV-cache pool
    below what the memory budget allows (0 = no cap); the sampling keys (``temperature`` ...
    ``do_sample``) are per-model defaults for requests that leave them out (``None`` = not
    set, fall back to the model's generation config).

    Derived, not written back by :meth:`Config.to_dict`: ``plugins`` (names from
    ``plugin_params``' ``plugin_type``, comma-separated allowed) and ``plugin_options``
    (the other keys of that JSON object).  ``extra`` keeps unknown keys so plugins can read
    them; they are written back.
    """

    modelInstanceType: str = json_key("Standard", one_of("Standard", "StandardMock"))
    modelName: str = json_key(DEFAULT_MODEL_NAME, _MODEL_NAME_RULE)
    modelWeightPath: str = json_key("", path_rule())  # deviation: "" = the default model
    worldSize: int = json_key(1, int_range(1, UINT32_MAX))
    cpuMemSize: int = json_key(5, int_range(0, UINT32_MAX))
    npuMemSize: int = json_key(-1, int_range(0, INT32_MAX, lo_open=True, special=(-1,)))
    backendType: str = json_key("torch", _BACKEND_TYPE_RULE)
    trustRemoteCode: bool = json_key(False, BOOL)
    plugin_params: str = json_key("", Rule("str", validator=_plugin_params_ok, text=_PLUGIN_PARAMS_TEXT))
    # extensions
    dtype: str = json_key("auto", one_of("auto", "float32", "bfloat16", "float16"))
    # auto = the weights' dtype
    kvCacheDtype: str = json_key("auto", one_of("auto", "float32", "bfloat16", "float16", "int8"))
    device: str = json_key("auto", one_of("auto", "cpu", "cuda", "npu"))
    quantization: str = json_key("auto", one_of("auto", "none", "w8a16", "w8a8"))
    compile: bool = json_key(False, BOOL)
    expertParallel: bool = json_key(False, BOOL)
    maxKvBlocks: int = json_key(0, int_range(0, INT32_MAX))  # 0 = as many as the memory budget allows
    temperature: float | None = json_key(None, num_range(0, 2, nullable=True))
    top_k: int | None = json_key(None, int_range(0, INT32_MAX, nullable=True))
    top_p: float | None = json_key(None, num_range(0, 1, lo_open=True, nullable=True))
    typical_p: float | None = json_key(None, num_range(0, 1, lo_open=True, nullable=True))
    min_p: float | None = json_key(None, num_range(0, 1, nullable=True))
    repetition_penalty: float | None = json_key(None, num_range(0, 2, lo_open=True, nullable=True))
    presence_penalty: float | None = json_key(None, num_range(-2, 2, nullable=True))
    frequency_penalty: float | None = json_key(None, num_range(-2, 2, nullable=True))
    do_sample: bool | None = json_key(None, Rule("bool", nullable=True))
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

    maxSeqLen: int = json_key(2560, int_range(1, UINT32_MAX))
    maxInputTokenLen: int = json_key(2048, int_range(1, 4194304))
    truncation: bool = json_key(False, BOOL)
    ModelConfig: list[ModelConfig] = field(default_factory=_default_models, metadata={"section_list": ModelConfig})

    @property
    def max_input_len(self) -> int:
        """The input-token limit actually applied: ``min(maxInputTokenLen, maxSeqLen - 1)``."""
        return min(self.maxInputTokenLen, self.maxSeqLen - 1)


@dataclass
class ScheduleConfig:
    """``ScheduleConfig``: batching limits, scheduling policies, SplitFuse and Prefix Cache switches."""

    templateType: str = json_key("Standard", one_of("Standard", "Mix"))
    templateName: str = json_key("Standard_LLM", one_of("Standard_LLM"))
    cacheBlockSize: int = json_key(128, int_range(1, 128))
    maxPrefillBatchSize: int = json_key(50, int_range(0, 5000))  # 0 = use maxBatchSize
    maxPrefillTokens: int = json_key(8192, int_range(1, 4194304))
    prefillTimeMsPerReq: int = json_key(150, int_range(0, 1000))
    prefillPolicyType: int = json_key(0, int_one_of(0, 1, 2, 3))
    decodeTimeMsPerReq: int = json_key(50, int_range(0, 1000))
    decodePolicyType: int = json_key(0, int_one_of(0, 1, 2, 3))
    maxBatchSize: int = json_key(200, int_range(1, 5000))
    maxIterTimes: int = json_key(512, int_range(1, UINT32_MAX))
    maxPreemptCount: int = json_key(0, int_range(0, 5000))
    supportSelectBatch: bool = json_key(False, BOOL)
    maxQueueDelayMicroseconds: int = json_key(5000, int_range(500, 1000000))
    enablePrefixCache: bool = json_key(False, BOOL)
    enableSplit: bool = json_key(False, BOOL)
    policyType: int = json_key(0, int_one_of(0, 4, 5, 6, 7))
    splitType: bool = json_key(False, BOOL)
    splitStartType: bool = json_key(False, BOOL)
    splitChunkTokens: int = json_key(512, int_range(1, 8192))
    splitStartBatchSize: int = json_key(16, int_range(0, 5000))

    @property
    def prefill_batch_limit(self) -> int:
        """``maxPrefillBatchSize``, with 0 meaning ``maxBatchSize``."""
        return self.maxPrefillBatchSize or self.maxBatchSize


_BACKEND_NAME_RULE = Rule(
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

    backendName: str = json_key(DEFAULT_BACKEND_NAME, _BACKEND_NAME_RULE)
    modelInstanceNumber: int = json_key(1, int_range(1, 10))
    npuDeviceIds: list[list[int]] = field(default_factory=lambda: [[0]], metadata=Rule("ids").meta)
    tokenizerProcessNumber: int = json_key(8, int_range(1, 32))
    multiNodesInferEnabled: bool = json_key(False, BOOL)
    multiNodesInferPort: int = json_key(1120, PORT)
    interNodeTLSEnabled: bool = json_key(True, BOOL)
    interNodeTlsCaPath: str = json_key("security/grpc/ca/", path_rule("internode_tls"))
    interNodeTlsCaFiles: list[str] = files_key("ca.pem", required_when="internode_tls", max_items=None)
    interNodeTlsCert: str = json_key("security/grpc/certs/server.pem", path_rule("internode_tls"))
    interNodeTlsPk: str = json_key("security/grpc/keys/server.key.pem", path_rule("internode_tls"))
    interNodeTlsPkPwd: str = json_key("security/grpc/pass/mindie_server_key_pwd.txt", path_rule())
    interNodeTlsCrlPath: str = json_key("security/grpc/certs/", path_rule())
    interNodeTlsCrlFiles: list[str] = files_key("server_crl.pem", max_items=None)
    interNodeKmcKsfMaster: str = json_key("tools/pmt/master/ksfa", path_rule("internode_tls"))
    interNodeKmcKsfStandby: str = json_key("tools/pmt/standby/ksfb", path_rule("internode_tls"))
    ModelDeployConfig: ModelDeployConfig = field(
        default_factory=ModelDeployConfig, metadata={"section": ModelDeployConfig}
    )
    ScheduleConfig: ScheduleConfig = field(default_factory=ScheduleConfig, metadata={"section": ScheduleConfig})


@dataclass
class Config:
    """The whole ``config.json``.

    ``Plugins`` is an extension of this host: one JSON object per plugin name
    (``{"prefix_cache": {...}}``) that the plugin validates itself.  ``warnings`` (unknown
    keys ...), ``source_path`` (the file it came from) and ``environment`` (the environment variables read
    beside it) are not written back.
    """

    Version: str = json_key(CONFIG_VERSION, Rule("str", choices=(CONFIG_VERSION,), text=f"exactly {CONFIG_VERSION!r}"))
    LogConfig: LogConfig = field(default_factory=LogConfig, metadata={"section": LogConfig})
    ServerConfig: ServerConfig = field(default_factory=ServerConfig, metadata={"section": ServerConfig})
    BackendConfig: BackendConfig = field(default_factory=BackendConfig, metadata={"section": BackendConfig})
    Plugins: dict[str, dict[str, Any]] = field(default_factory=dict, metadata=Rule("plugins").meta)
    warnings: list[str] = field(default_factory=list, compare=False)
    source_path: str | None = field(default=None, compare=False)
    #: the environment variables read beside the file (:mod:`.environment`), not written back
    environment: Environment = field(default_factory=Environment, compare=False, metadata={"not_a_key": True})

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
