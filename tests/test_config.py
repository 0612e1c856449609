"""Tests for mindie_host.config: defaults, every range check, cross-key rules, loading."""

from __future__ import annotations

import json
import logging
import pickle
import re
from typing import Any

import pytest

from mindie_host.config import (
    DEVIATIONS,
    MAX_CONFIG_FILE_BYTES,
    Config,
    ConfigError,
    ModelConfig,
    config_from_dict,
    default_config_dict,
    load_config,
    validate_config_file,
)

S = "BackendConfig.ScheduleConfig"
D = "BackendConfig.ModelDeployConfig"
M = f"{D}.ModelConfig[0]"
ENV_VARS = ("MIES_CONFIG_JSON_PATH", "MIES_CONTAINER_IP", "MIES_CONTAINER_MANAGEMENT_IP")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def _set(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """Set ``a.b[0].c`` in a nested dict (in place) and return it."""
    parts = [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", path)]
    node: Any = data
    for part in parts[:-1]:
        node = node[part]
    node[parts[-1]] = value
    return data


def _with(**changes: Any) -> dict[str, Any]:
    """The default config with dotted-path changes (``__`` stands for ``.``)."""
    data = default_config_dict()
    for path, value in changes.items():
        _set(data, path.replace("__", "."), value)
    return data


def _cfg(changes: dict[str, Any]) -> Config:
    data = default_config_dict()
    for path, value in changes.items():
        _set(data, path, value)
    return config_from_dict(data)


def _error(changes: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        _cfg(changes)
    return info.value


# --------------------------------------------------------------------------- defaults


def test_defaults_round_trip() -> None:
    default = default_config_dict()
    assert config_from_dict(default_config_dict()).to_dict() == default
    assert json.loads(json.dumps(default)) == default


def test_default_dict_matches_dataclass_defaults() -> None:
    cfg = config_from_dict(default_config_dict())
    assert cfg == Config()
    assert cfg.warnings == []
    assert config_from_dict({}).to_dict() == default_config_dict()


def test_default_values() -> None:
    cfg = Config()
    assert cfg.Version == "1.0.0"
    assert cfg.LogConfig.logLevel == "Info" and cfg.LogConfig.logPath == "logs/mindservice.log"
    assert cfg.server is cfg.ServerConfig
    assert (cfg.server.ipAddress, cfg.server.managementIpAddress) == ("127.0.0.1", "127.0.0.2")
    assert (cfg.server.port, cfg.server.managementPort, cfg.server.metricsPort) == (1025, 1026, 1027)
    assert cfg.server.httpsEnabled is False
    assert cfg.server.apiKey == "" and cfg.server.maxRequestBodyBytes == 16 * 1024 * 1024
    assert cfg.BackendConfig.npuDeviceIds == [[0]]
    assert cfg.BackendConfig.backendName == "mindieservice_llm_engine"
    assert cfg.deploy is cfg.BackendConfig.ModelDeployConfig
    assert (cfg.deploy.maxSeqLen, cfg.deploy.maxInputTokenLen, cfg.deploy.max_input_len) == (2560, 2048, 2048)
    assert cfg.model is cfg.deploy.ModelConfig[0]
    assert cfg.model.modelName == "SmolLM2-135M-Instruct"
    assert (cfg.model.backendType, cfg.model.worldSize, cfg.model.modelWeightPath) == ("torch", 1, "")
    assert cfg.model.plugins == [] and cfg.model.plugin_options == {}
    assert cfg.schedule is cfg.BackendConfig.ScheduleConfig
    assert (cfg.schedule.maxBatchSize, cfg.schedule.maxPrefillBatchSize, cfg.schedule.cacheBlockSize) == (200, 50, 128)
    assert (cfg.schedule.splitChunkTokens, cfg.schedule.splitStartBatchSize, cfg.schedule.policyType) == (512, 16, 0)
    assert cfg.schedule.enablePrefixCache is False and cfg.schedule.enableSplit is False
    assert cfg.Plugins == {}


def test_to_dict_leaves_out_derived_and_unset_fields() -> None:
    model = default_config_dict()["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    for derived in ("plugins", "plugin_options", "extra", "temperature", "do_sample"):
        assert derived not in model
    top = default_config_dict()
    assert list(top) == ["Version", "LogConfig", "ServerConfig", "BackendConfig", "Plugins"]
    assert "warnings" not in top and "source_path" not in top


def test_to_dict_is_a_copy() -> None:
    cfg = Config()
    cfg.to_dict()["BackendConfig"]["npuDeviceIds"][0].append(7)
    assert cfg.BackendConfig.npuDeviceIds == [[0]]
    assert Config().ServerConfig.tlsCaFile is not Config().ServerConfig.tlsCaFile


def test_deviations_documented() -> None:
    text = "\n".join(DEVIATIONS)
    for key in ("httpsEnabled", "backendType", "worldSize", "npuDeviceIds", "modelName", "modelWeightPath"):
        assert key in text
    assert "managementIpAddress" not in text


def test_config_error_format_and_pickle() -> None:
    err = ConfigError("ServerConfig.port", 80, "an integer in [1024, 65535]")
    assert isinstance(err, ValueError)
    assert str(err) == "ServerConfig.port: got 80; allowed an integer in [1024, 65535]"
    again = pickle.loads(pickle.dumps(err))
    assert (again.key, again.value, again.allowed) == (err.key, err.value, err.allowed)


# --------------------------------------------------------------------------- single-key checks

BAD_VALUES: list[tuple[str, Any, str]] = [
    ("Version", "1.1.0", "'1.0.0'"),
    ("LogConfig.logLevel", "Loud", "'Verbose'"),
    ("LogConfig.logLevel", 1, "case-insensitive"),
    ("LogConfig.logFileSize", 501, "[0, 500]"),
    ("LogConfig.logFileSize", -1, "[0, 500]"),
    ("LogConfig.logFileNum", 65, "[0, 64]"),
    ("LogConfig.logPath", "", "[1, 4096]"),
    ("LogConfig.logPath", "x" * 4097, "[1, 4096]"),
    ("ServerConfig.ipAddress", "256.0.0.1", "IPv4"),
    ("ServerConfig.ipAddress", "localhost", "IPv4"),
    ("ServerConfig.ipAddress", "::1", "IPv4"),
    ("ServerConfig.managementIpAddress", 127, "IPv4"),
    ("ServerConfig.port", 1023, "[1024, 65535]"),
    ("ServerConfig.port", 65536, "[1024, 65535]"),
    ("ServerConfig.port", "1025", "[1024, 65535]"),
    ("ServerConfig.port", 1025.0, "[1024, 65535]"),
    ("ServerConfig.port", True, "[1024, 65535]"),
    ("ServerConfig.managementPort", 80, "[1024, 65535]"),
    ("ServerConfig.metricsPort", 70000, "[1024, 65535]"),
    ("ServerConfig.allowAllZeroIpListening", "false", "true or false"),
    ("ServerConfig.maxLinkNum", 0, "[1, 1000]"),
    ("ServerConfig.maxLinkNum", 1001, "[1, 1000]"),
    ("ServerConfig.httpsEnabled", 1, "true or false"),
    ("ServerConfig.fullTextEnabled", None, "true or false"),
    ("ServerConfig.tlsCaPath", 5, "[0, 4096]"),
    ("ServerConfig.tlsCaFile", ["a", "b", "c", "d"], "at most 3"),
    ("ServerConfig.tlsCaFile", "ca.pem", "at most 3"),
    ("ServerConfig.tlsCaFile", [""], "at most 3"),
    ("ServerConfig.tlsCrlFiles", ["a", "b", "c", "d"], "at most 3"),
    ("ServerConfig.managementTlsCaFile", [1], "at most 3"),
    ("ServerConfig.tlsCert", "p" * 4097, "[0, 4096]"),
    ("ServerConfig.inferMode", "pd", "'standard', 'dmi'"),
    ("ServerConfig.inferMode", "Standard", "'standard', 'dmi'"),
    ("ServerConfig.interCommTLSEnabled", "yes", "true or false"),
    ("ServerConfig.interCommPort", 1000, "[1024, 65535]"),
    ("ServerConfig.openAiSupport", 1, "a string"),
    ("ServerConfig.maxRequestBodyBytes", 1023, "[1024, 1073741824]"),
    ("ServerConfig.maxRequestBodyBytes", 2**30 + 1, "[1024, 1073741824]"),
    ("ServerConfig.requestTimeoutSeconds", 0, "(0, 86400]"),
    ("ServerConfig.requestTimeoutSeconds", 86401, "(0, 86400]"),
    ("ServerConfig.requestTimeoutSeconds", float("nan"), "(0, 86400]"),
    ("ServerConfig.requestTimeoutSeconds", "60", "(0, 86400]"),
    ("ServerConfig.shutdownDrainSeconds", -1, "[0, 3600]"),
    ("ServerConfig.shutdownDrainSeconds", 3600.5, "[0, 3600]"),
    ("ServerConfig.apiKey", "has space", "printable ASCII"),
    ("BackendConfig.backendName", "Mindie", "lowercase letters"),
    ("BackendConfig.backendName", "_engine", "lowercase letters"),
    ("BackendConfig.backendName", "x" * 51, "1 to 50"),
    ("BackendConfig.modelInstanceNumber", 0, "[1, 10]"),
    ("BackendConfig.modelInstanceNumber", 11, "[1, 10]"),
    ("BackendConfig.npuDeviceIds", [], "device ids"),
    ("BackendConfig.npuDeviceIds", [[]], "device ids"),
    ("BackendConfig.npuDeviceIds", [[-1]], "device ids"),
    ("BackendConfig.npuDeviceIds", [[0.5]], "device ids"),
    ("BackendConfig.npuDeviceIds", [0], "device ids"),
    ("BackendConfig.tokenizerProcessNumber", 33, "[1, 32]"),
    ("BackendConfig.tokenizerProcessNumber", 0, "[1, 32]"),
    ("BackendConfig.multiNodesInferEnabled", "false", "true or false"),
    ("BackendConfig.multiNodesInferPort", 1000, "[1024, 65535]"),
    ("BackendConfig.interNodeTLSEnabled", 0, "true or false"),
    ("BackendConfig.interNodeTlsCaFiles", "ca.pem", "file names"),
    (f"{D}.maxSeqLen", 0, "[1, 4294967295]"),
    (f"{D}.maxInputTokenLen", 0, "[1, 4194304]"),
    (f"{D}.maxInputTokenLen", 4194305, "[1, 4194304]"),
    (f"{D}.truncation", "no", "true or false"),
    (f"{D}.ModelConfig", [], "at least one model"),
    (f"{D}.ModelConfig", {"modelName": "x"}, "at least one model"),
    (f"{M}.modelInstanceType", "Mock", "'Standard', 'StandardMock'"),
    (f"{M}.modelName", "", "1 to 256 characters"),
    (f"{M}.modelName", "-llama", "1 to 256 characters"),
    (f"{M}.modelName", "llama_", "1 to 256 characters"),
    (f"{M}.modelName", "org/llama", "1 to 256 characters"),
    (f"{M}.modelName", "a" * 257, "1 to 256 characters"),
    (f"{M}.modelWeightPath", "/" * 4097, "[0, 4096]"),
    (f"{M}.worldSize", 0, "[1, 4294967295]"),
    (f"{M}.cpuMemSize", -1, "[0, 4294967295]"),
    (f"{M}.npuMemSize", 0, "-1 or an integer in (0, 2147483647]"),
    (f"{M}.npuMemSize", -2, "-1 or an integer in (0, 2147483647]"),
    (f"{M}.npuMemSize", 2**31, "-1 or an integer in (0, 2147483647]"),
    (f"{M}.backendType", "Atb", "^[a-z][a-z0-9_]*$"),
    (f"{M}.backendType", "", "^[a-z][a-z0-9_]*$"),
    (f"{M}.backendType", "1torch", "^[a-z][a-z0-9_]*$"),
    (f"{M}.trustRemoteCode", "false", "true or false"),
    (f"{M}.plugin_params", 5, "plugin_type"),
    (f"{M}.plugin_params", {"plugin_type": "splitfuse"}, "plugin_type"),
    (f"{M}.dtype", "fp8", "'auto', 'float32', 'bfloat16', 'float16'"),
    (f"{M}.device", "tpu", "'auto', 'cpu', 'cuda', 'npu'"),
    (f"{M}.temperature", 2.5, "[0, 2]"),
    (f"{M}.temperature", -0.1, "[0, 2]"),
    (f"{M}.top_k", -1, "[0, 2147483647]"),
    (f"{M}.top_k", 1.5, "[0, 2147483647]"),
    (f"{M}.top_p", 0, "(0, 1]"),
    (f"{M}.top_p", 1.01, "(0, 1]"),
    (f"{M}.typical_p", 0.0, "(0, 1]"),
    (f"{M}.min_p", -0.5, "[0, 1]"),
    (f"{M}.repetition_penalty", 0, "(0, 2]"),
    (f"{M}.repetition_penalty", 2.1, "(0, 2]"),
    (f"{M}.presence_penalty", 2.5, "[-2, 2]"),
    (f"{M}.frequency_penalty", -3, "[-2, 2]"),
    (f"{M}.do_sample", "yes", "true or false"),
    (f"{S}.templateType", "Split", "'Standard', 'Mix'"),
    (f"{S}.templateName", "Mix_LLM", "'Standard_LLM'"),
    (f"{S}.cacheBlockSize", 0, "[1, 128]"),
    (f"{S}.cacheBlockSize", 129, "[1, 128]"),
    (f"{S}.maxPrefillBatchSize", -1, "[0, 5000]"),
    (f"{S}.maxPrefillTokens", 0, "[1, 4194304]"),
    (f"{S}.maxPrefillTokens", 4194305, "[1, 4194304]"),
    (f"{S}.prefillTimeMsPerReq", 1001, "[0, 1000]"),
    (f"{S}.decodeTimeMsPerReq", -1, "[0, 1000]"),
    (f"{S}.prefillPolicyType", 4, "one of 0, 1, 2, 3"),
    (f"{S}.decodePolicyType", "0", "one of 0, 1, 2, 3"),
    (f"{S}.maxBatchSize", 0, "[1, 5000]"),
    (f"{S}.maxBatchSize", 5001, "[1, 5000]"),
    (f"{S}.maxBatchSize", 200.0, "[1, 5000]"),
    (f"{S}.maxIterTimes", 0, "[1, 4294967295]"),
    (f"{S}.maxPreemptCount", -1, "[0, 5000]"),
    (f"{S}.supportSelectBatch", 0, "true or false"),
    (f"{S}.maxQueueDelayMicroseconds", 499, "[500, 1000000]"),
    (f"{S}.maxQueueDelayMicroseconds", 1000001, "[500, 1000000]"),
    (f"{S}.enablePrefixCache", "true", "true or false"),
    (f"{S}.enableSplit", 1, "true or false"),
    (f"{S}.policyType", 1, "one of 0, 4, 5, 6, 7"),
    (f"{S}.policyType", 8, "one of 0, 4, 5, 6, 7"),
    (f"{S}.splitType", "false", "true or false"),
    (f"{S}.splitStartType", None, "true or false"),
    (f"{S}.splitChunkTokens", 0, "[1, 8192]"),
    (f"{S}.splitChunkTokens", 8193, "[1, 8192]"),
    (f"{S}.splitStartBatchSize", -1, "[0, 5000]"),
    ("Plugins", [], "JSON object"),
    ("LogConfig", [], "a JSON object"),
    ("BackendConfig.ScheduleConfig", "x", "a JSON object"),
]


@pytest.mark.parametrize(("key", "value", "allowed"), BAD_VALUES, ids=[f"{k}={v!r}"[:60] for k, v, _ in BAD_VALUES])
def test_bad_value_names_key_value_and_range(key: str, value: Any, allowed: str) -> None:
    err = _error({key: value})
    assert err.key == key
    assert allowed in err.allowed
    message = str(err)
    assert message.startswith(f"{key}: got ")
    assert allowed in message
    if key != "ServerConfig.apiKey":
        assert repr(value)[:40] in message


def test_api_key_is_not_echoed() -> None:
    err = _error({"ServerConfig.apiKey": "secret token"})
    assert "secret" not in str(err)
    cfg = _cfg({"ServerConfig.apiKey": "s3cr3t-Token"})
    assert cfg.server.apiKey == "s3cr3t-Token"


def test_plugin_section_must_be_object() -> None:
    err = _error({"Plugins": {"prefix_cache": 3}})
    assert err.key == "Plugins.prefix_cache"
    cfg = _cfg({"Plugins": {"prefix_cache": {"max_blocks": 10}}})
    assert cfg.Plugins == {"prefix_cache": {"max_blocks": 10}}
    assert cfg.to_dict()["Plugins"] == {"prefix_cache": {"max_blocks": 10}}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("LogConfig.logLevel", "ERROR"),
        ("LogConfig.logLevel", "warn"),
        ("LogConfig.logFileSize", 0),
        ("LogConfig.logFileNum", 64),
        ("ServerConfig.port", 65535),
        ("ServerConfig.maxLinkNum", 1),
        ("ServerConfig.requestTimeoutSeconds", 86400),
        ("ServerConfig.shutdownDrainSeconds", 0),
        ("ServerConfig.tlsCaFile", ["a.pem", "b.pem", "c.pem"]),
        ("ServerConfig.inferMode", "dmi"),
        ("ServerConfig.openAiSupport", "openai"),
        ("BackendConfig.npuDeviceIds", [[7]]),
        (f"{M}.modelName", "Qwen2.5-0.5B_Instruct"),
        (f"{M}.modelName", "a" * 256),
        (f"{M}.npuMemSize", -1),
        (f"{M}.npuMemSize", 2**31 - 1),
        (f"{M}.backendType", "atb"),
        (f"{M}.backendType", "my_backend2"),
        (f"{M}.modelInstanceType", "StandardMock"),
        (f"{M}.top_k", 0),
        (f"{M}.presence_penalty", -2),
        (f"{S}.cacheBlockSize", 1),
        (f"{S}.maxPrefillBatchSize", 0),
        (f"{S}.policyType", 7),
        (f"{S}.maxQueueDelayMicroseconds", 500),
    ],
)
def test_edge_values_accepted(key: str, value: Any) -> None:
    cfg = _cfg({key: value})
    stored = cfg.to_dict()
    _set(expected := default_config_dict(), key, value)
    assert stored == expected


def test_number_keys_store_floats() -> None:
    cfg = _cfg({f"{M}.temperature": 1, "ServerConfig.requestTimeoutSeconds": 30})
    assert cfg.model.temperature == 1.0 and isinstance(cfg.model.temperature, float)
    assert isinstance(cfg.server.requestTimeoutSeconds, float)
    assert cfg.to_dict()["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["temperature"] == 1.0


def test_sampling_defaults_round_trip() -> None:
    data = default_config_dict()
    _set(data, f"{M}.temperature", 0.7)
    _set(data, f"{M}.do_sample", True)
    _set(data, f"{M}.top_k", None)
    cfg = config_from_dict(data)
    assert (cfg.model.temperature, cfg.model.do_sample, cfg.model.top_k) == (0.7, True, None)
    out = cfg.to_dict()["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    assert out["temperature"] == 0.7 and out["do_sample"] is True and "top_k" not in out


def test_log_level_case_insensitive() -> None:
    cfg = _cfg({"LogConfig.logLevel": "ERROR"})
    assert cfg.LogConfig.logLevel == "ERROR"
    assert cfg.LogConfig.python_level == logging.ERROR
    assert _cfg({"LogConfig.logLevel": "verbose"}).LogConfig.python_level == logging.DEBUG


# --------------------------------------------------------------------------- cross-key rules


@pytest.mark.parametrize(
    ("changes", "key", "allowed"),
    [
        ({f"{S}.maxPrefillBatchSize": 201}, f"{S}.maxPrefillBatchSize", "[0, 200]"),
        ({f"{S}.maxBatchSize": 10, f"{S}.maxPrefillBatchSize": 11}, f"{S}.maxPrefillBatchSize", "[0, 10]"),
        ({f"{S}.maxPrefillTokens": 2047}, f"{S}.maxPrefillTokens", "[2048, 4194304]"),
        ({f"{D}.maxInputTokenLen": 9000}, f"{S}.maxPrefillTokens", "[9000, 4194304]"),
        ({f"{S}.maxIterTimes": 2561}, f"{S}.maxIterTimes", "[1, 2560]"),
        ({f"{D}.maxSeqLen": 100}, f"{S}.maxIterTimes", "[1, 100]"),
        ({f"{S}.maxPreemptCount": 201}, f"{S}.maxPreemptCount", "[0, 200]"),
        ({f"{S}.maxPreemptCount": 1, f"{M}.cpuMemSize": 0}, f"{M}.cpuMemSize", "maxPreemptCount > 0"),
        (
            {f"{S}.enableSplit": True, f"{S}.maxBatchSize": 8, f"{S}.maxPrefillBatchSize": 0},
            f"{S}.splitStartBatchSize",
            "[0, 8]",
        ),
        (
            {"BackendConfig.multiNodesInferEnabled": True, "BackendConfig.modelInstanceNumber": 2},
            "BackendConfig.modelInstanceNumber",
            "multiNodesInferEnabled",
        ),
        ({"ServerConfig.ipAddress": "0.0.0.0"}, "ServerConfig.ipAddress", "allowAllZeroIpListening"),
        ({"ServerConfig.managementIpAddress": "0.0.0.0"}, "ServerConfig.managementIpAddress", "0.0.0.0"),
    ],
)
def test_cross_key_rules(changes: dict[str, Any], key: str, allowed: str) -> None:
    err = _error(changes)
    assert err.key == key
    assert allowed in str(err)


def test_cross_key_rules_accept_valid_combinations() -> None:
    cfg = _cfg({f"{S}.maxPrefillBatchSize": 0, f"{S}.maxBatchSize": 8})
    assert cfg.schedule.prefill_batch_limit == 8
    assert _cfg({f"{S}.maxPrefillBatchSize": 200}).schedule.prefill_batch_limit == 200
    assert _cfg({f"{S}.maxPrefillTokens": 2048}).schedule.maxPrefillTokens == 2048
    assert _cfg({f"{S}.maxIterTimes": 2560}).schedule.maxIterTimes == 2560
    assert _cfg({f"{S}.maxPreemptCount": 200}).schedule.maxPreemptCount == 200
    assert _cfg({f"{M}.cpuMemSize": 0}).model.cpuMemSize == 0  # fine while maxPreemptCount is 0
    # splitStartBatchSize is only bounded by maxBatchSize when SplitFuse is on
    assert _cfg({f"{S}.maxBatchSize": 8, f"{S}.maxPrefillBatchSize": 8}).schedule.splitStartBatchSize == 16
    zero = _cfg({"ServerConfig.ipAddress": "0.0.0.0", "ServerConfig.allowAllZeroIpListening": True})
    assert zero.server.ipAddress == "0.0.0.0"
    assert _cfg({"BackendConfig.multiNodesInferEnabled": True}).backend.modelInstanceNumber == 1


def test_effective_max_input_len() -> None:
    cfg = _cfg({f"{D}.maxSeqLen": 1024, f"{S}.maxIterTimes": 512})
    assert cfg.deploy.max_input_len == 1023


def test_failed_key_does_not_cascade(tmp_path: Any) -> None:
    data = default_config_dict()
    _set(data, f"{S}.maxBatchSize", "big")
    _set(data, f"{S}.maxPrefillBatchSize", 300)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    messages = validate_config_file(path)
    assert len([m for m in messages if m.startswith("error:")]) == 1
    assert f"{S}.maxBatchSize" in messages[0]


@pytest.mark.parametrize(
    ("key", "gate_changes", "ok_changes"),
    [
        ("ServerConfig.tlsCert", {"ServerConfig.httpsEnabled": True}, {}),
        ("ServerConfig.kmcKsfMaster", {"ServerConfig.httpsEnabled": True}, {}),
        (
            "ServerConfig.managementTlsCert",
            {"ServerConfig.httpsEnabled": True},
            {"ServerConfig.httpsEnabled": True, "ServerConfig.managementIpAddress": "127.0.0.1"},
        ),
        (
            "ServerConfig.interCommPk",
            {"ServerConfig.inferMode": "dmi"},
            {"ServerConfig.inferMode": "dmi", "ServerConfig.interCommTLSEnabled": False},
        ),
        ("BackendConfig.interNodeTlsCert", {"BackendConfig.multiNodesInferEnabled": True}, {}),
    ],
)
def test_tls_paths_required_only_when_enabled(
    key: str, gate_changes: dict[str, Any], ok_changes: dict[str, Any]
) -> None:
    assert _cfg({key: "", **ok_changes}) is not None
    err = _error({key: "", **gate_changes})
    assert err.key == key
    assert err.allowed.startswith("a non-empty string of length [1, 4096] when ")


def test_ca_file_list_needs_an_entry_with_https() -> None:
    assert _cfg({"ServerConfig.tlsCaFile": []}).server.tlsCaFile == []
    err = _error({"ServerConfig.tlsCaFile": [], "ServerConfig.httpsEnabled": True})
    assert err.key == "ServerConfig.tlsCaFile"
    assert "1 to 3 file names" in str(err) and "when ServerConfig.httpsEnabled is true" in str(err)


def test_duplicate_model_names_rejected() -> None:
    data = default_config_dict()
    models = data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"]
    models.append(dict(models[0]))
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert info.value.key == f"{D}.ModelConfig[1].modelName"
    models[1]["modelName"] = "second-model"
    cfg = config_from_dict(data)
    assert [m.modelName for m in cfg.deploy.ModelConfig] == ["SmolLM2-135M-Instruct", "second-model"]
    assert cfg.model.modelName == "SmolLM2-135M-Instruct"


def test_second_model_errors_use_its_index() -> None:
    data = default_config_dict()
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"].append({"modelName": "b", "worldSize": 0})
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert info.value.key == f"{D}.ModelConfig[1].worldSize"


def test_device_lists_must_match_world_size_and_instances() -> None:
    with pytest.raises(ConfigError) as info:
        _cfg({"BackendConfig.npuDeviceIds": [[0, 1]]})
    assert info.value.key == "BackendConfig.npuDeviceIds[0]" and "1 device id(s), one per rank" in str(info.value)
    assert not _cfg({"BackendConfig.npuDeviceIds": [[0, 1]], f"{M}.worldSize": 2}).warnings
    with pytest.raises(ConfigError) as info:
        _cfg({"BackendConfig.npuDeviceIds": [[0], [1]]})
    assert info.value.key == "BackendConfig.npuDeviceIds" and "one per model instance" in str(info.value)
    assert not _cfg({"BackendConfig.npuDeviceIds": [[0], [1]], "BackendConfig.modelInstanceNumber": 2}).warnings


def test_other_backend_name_is_a_warning() -> None:
    cfg = _cfg({"BackendConfig.backendName": "my_engine"})
    assert any("backendName" in w for w in cfg.warnings)


# --------------------------------------------------------------------------- plugin_params


@pytest.mark.parametrize(
    ("params", "plugins", "options"),
    [
        ("", [], {}),
        ("   ", [], {}),
        ('{"plugin_type": ""}', [], {}),
        ('{"plugin_type":"splitfuse"}', ["splitfuse"], {}),
        ('{"plugin_type":"prefix_cache"}', ["prefix_cache"], {}),
        ('{"plugin_type": " splitfuse , prefix_cache ,"}', ["splitfuse", "prefix_cache"], {}),
        ('{"plugin_type": "a,a,b"}', ["a", "b"], {}),
        ('{"plugin_type": "mtp", "num_speculative_tokens": 1}', ["mtp"], {"num_speculative_tokens": 1}),
    ],
)
def test_plugin_params_parsing(params: str, plugins: list[str], options: dict[str, Any]) -> None:
    cfg = _cfg({f"{M}.plugin_params": params})
    assert cfg.model.plugins == plugins
    assert cfg.model.plugin_options == options
    assert cfg.to_dict()["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["plugin_params"] == params


@pytest.mark.parametrize(
    "params",
    [
        "{",
        "splitfuse",
        "[]",
        '"splitfuse"',
        "{}",
        '{"plugin_type": 1}',
        '{"plugin_type": ["a"]}',
        '{"plugin_type": "a b"}',
    ],
)
def test_plugin_params_invalid(params: str) -> None:
    err = _error({f"{M}.plugin_params": params})
    assert err.key == f"{M}.plugin_params"
    assert err.value == params
    assert '"plugin_type"' in str(err)


def test_model_config_parses_plugin_params_directly() -> None:
    model = ModelConfig(plugin_params='{"plugin_type": "prefix_cache"}')
    assert model.plugins == ["prefix_cache"]
    with pytest.raises(ConfigError):
        ModelConfig(plugin_params="{bad")


# --------------------------------------------------------------------------- unknown keys


def test_unknown_keys_warn_and_are_never_fatal(caplog: pytest.LogCaptureFixture) -> None:
    data = default_config_dict()
    data["Foo"] = 1
    data["ServerConfig"]["bar"] = True
    data["BackendConfig"]["ScheduleConfig"]["baz"] = {}
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["LoraModules"] = [{"name": "a"}]
    with caplog.at_level(logging.WARNING, logger="mindie_host.config"):
        cfg = config_from_dict(data)
    expected = [
        "unknown key Foo ignored",
        "unknown key ServerConfig.bar ignored",
        f"unknown key {M}.LoraModules ignored",
        f"unknown key {S}.baz ignored",
    ]
    assert sorted(cfg.warnings) == sorted(expected)
    logged = [r.getMessage() for r in caplog.records if r.name == "mindie_host.config"]
    assert sorted(logged) == sorted(expected)
    # unknown ModelConfig keys stay readable for plugins and are written back
    assert cfg.model.extra == {"LoraModules": [{"name": "a"}]}
    out = cfg.to_dict()
    assert out["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["LoraModules"] == [{"name": "a"}]
    assert "Foo" not in out and "bar" not in out["ServerConfig"]


# --------------------------------------------------------------------------- environment


def test_env_overrides_bind_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIES_CONTAINER_IP", "10.1.2.3")
    monkeypatch.setenv("MIES_CONTAINER_MANAGEMENT_IP", "10.1.2.4")
    cfg = config_from_dict(default_config_dict())
    assert (cfg.server.ipAddress, cfg.server.managementIpAddress) == ("10.1.2.3", "10.1.2.4")


def test_env_override_via_environ_argument() -> None:
    cfg = config_from_dict(default_config_dict(), environ={"MIES_CONTAINER_IP": "192.168.0.9"})
    assert cfg.server.ipAddress == "192.168.0.9"
    assert cfg.server.managementIpAddress == "127.0.0.2"
    assert config_from_dict({}, environ={"MIES_CONTAINER_IP": ""}).server.ipAddress == "127.0.0.1"


def test_env_override_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIES_CONTAINER_IP", "not-an-ip")
    with pytest.raises(ConfigError) as info:
        config_from_dict({})
    assert info.value.key == "MIES_CONTAINER_IP" and "IPv4" in str(info.value)
    monkeypatch.setenv("MIES_CONTAINER_IP", "0.0.0.0")
    with pytest.raises(ConfigError) as info:
        config_from_dict({})
    assert info.value.key == "ServerConfig.ipAddress"


def test_management_ip_falls_back_to_ip_address() -> None:
    cfg = config_from_dict({"ServerConfig": {"ipAddress": "10.0.0.7"}})
    assert cfg.server.managementIpAddress == "10.0.0.7"
    cfg = config_from_dict({"ServerConfig": {"port": 2000}})
    assert cfg.server.managementIpAddress == "127.0.0.2"


# --------------------------------------------------------------------------- files


def test_load_from_file(tmp_path: Any) -> None:
    path = tmp_path / "config.json"
    data = _with(ServerConfig__port=8080)
    path.write_text(json.dumps(data), encoding="utf-8")
    cfg = load_config(path)
    assert cfg.server.port == 8080
    assert cfg.source_path == str(path)
    assert cfg.to_dict() == data


def test_load_from_env_path(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"LogConfig": {"logLevel": "Debug"}}), encoding="utf-8")
    monkeypatch.setenv("MIES_CONFIG_JSON_PATH", str(path))
    cfg = load_config()
    assert cfg.LogConfig.logLevel == "Debug"
    assert cfg.source_path == str(path)


def test_load_without_path_or_env() -> None:
    with pytest.raises(ConfigError) as info:
        load_config()
    assert info.value.key == "MIES_CONFIG_JSON_PATH"


def test_missing_file(tmp_path: Any) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.json")
    assert "nope.json" in info.value.key
    with pytest.raises(ConfigError):
        load_config(tmp_path)  # a directory


def test_file_size_limit(tmp_path: Any) -> None:
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        load_config(empty)
    assert "(0, 10485760]" in str(info.value) and "empty.json" in str(info.value)

    body = json.dumps(default_config_dict())
    exact = tmp_path / "exact.json"
    exact.write_text(body + " " * (MAX_CONFIG_FILE_BYTES - len(body)), encoding="utf-8")
    assert exact.stat().st_size == MAX_CONFIG_FILE_BYTES
    assert load_config(exact).to_dict() == default_config_dict()

    big = tmp_path / "big.json"
    big.write_text(body + " " * (MAX_CONFIG_FILE_BYTES - len(body) + 1), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(big)
    assert "(0, 10485760]" in str(info.value)


def test_bad_json_names_file_and_line(tmp_path: Any) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "Version": "1.0.0",\n  "LogConfig": {,}\n}\n', encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in info.value.key and "line 3" in info.value.key


def test_non_standard_json_rejected(tmp_path: Any) -> None:
    path = tmp_path / "nan.json"
    path.write_text('{"ServerConfig": {"requestTimeoutSeconds": NaN}}', encoding="utf-8")
    with pytest.raises(ConfigError, match="NaN"):
        load_config(path)
    bad_utf8 = tmp_path / "latin1.json"
    bad_utf8.write_bytes(b'{"LogConfig": {"logPath": "\xe9"}}')
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config(bad_utf8)


def test_top_level_must_be_object(tmp_path: Any) -> None:
    path = tmp_path / "list.json"
    path.write_text("[]", encoding="utf-8")
    with pytest.raises(ConfigError, match="a JSON object"):
        load_config(path)


def test_utf8_bom_accepted(tmp_path: Any) -> None:
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"Version": "1.0.0"}).encode())
    assert load_config(path).Version == "1.0.0"


def test_validate_config_file(tmp_path: Any) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_with(Unknown=1)), encoding="utf-8")
    assert validate_config_file(good) == []
    assert load_config(good).warnings == ["unknown key Unknown ignored"]

    bad_data = _with(Unknown=1)
    _set(bad_data, "ServerConfig.port", 80)
    _set(bad_data, f"{S}.cacheBlockSize", 256)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(bad_data), encoding="utf-8")
    messages = validate_config_file(bad)
    assert messages == [
        "error: ServerConfig.port: got 80; allowed an integer in [1024, 65535]",
        f"error: {S}.cacheBlockSize: got 256; allowed an integer in [1, 128]",
        "warning: unknown key Unknown ignored",
    ]

    broken = tmp_path / "broken.json"
    broken.write_text("{", encoding="utf-8")
    (only,) = validate_config_file(broken)
    assert only.startswith("error: ") and "broken.json line 1" in only
