"""Which config keys this host honours: the keys it refuses and the keys that have no effect here.

Every key of the spec is parsed and range-checked by :mod:`mindie_host.config` (:mod:`.schema`, :mod:`.checks`). Most
drive the server; the few below do not, and none of them is dropped in silence:

* :func:`unsupported` lists settings whose non-default value this version cannot honour,
  where serving anyway would give silently wrong behaviour. Startup refuses them, and
  ``mindie-host config validate`` reports them as errors.
* :func:`no_effect` lists keys set to a non-default value that change nothing here, with the
  reason. Startup logs each as a warning, and ``config validate`` prints them.

:data:`NO_EFFECT_KEYS` names every key that the server reads nowhere, with the reason; a
test checks that every other config key is read somewhere in the package.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from .schema import Config

SCALE_OUT = "run one instance per model or per device group behind the MS coordinator (docs/scale-out.md)"

#: Keys the server reads nowhere, and why (dotted paths; ``ModelConfig`` keys without an index).
NO_EFFECT_KEYS: dict[str, str] = {
    "Version": "the config format version; checked, then informational",
    "BackendConfig.backendName": "the spec allows one value, mindieservice_llm_engine; checked, then informational",
    "BackendConfig.ScheduleConfig.templateName": "the spec allows one value, Standard_LLM; checked, then informational",
}
_INTER_NODE_TLS = (
    "inter-node TLS: torch.distributed's transports carry no TLS (interNodeTLSEnabled must be false with multi-node "
    "inference; docs/scale-out.md)"
)
_INTER_COMM_TLS = "inter-instance TLS (inferMode 'dmi'): interCommTLSEnabled must be false in this version"
# The TLS files of the two features above, named one by one: a prefix would also catch the keys that are read
# (interCommPort carries PD's P-to-D requests; the two TLSEnabled switches are refused when true where they apply).
NO_EFFECT_KEYS.update(
    {f"BackendConfig.{k}": _INTER_NODE_TLS for k in (
        "interNodeTlsCaPath", "interNodeTlsCaFiles", "interNodeTlsCert", "interNodeTlsPk", "interNodeTlsPkPwd",
        "interNodeTlsCrlPath", "interNodeTlsCrlFiles", "interNodeKmcKsfMaster", "interNodeKmcKsfStandby")}
    | {f"ServerConfig.{k}": _INTER_COMM_TLS for k in (
        "interCommTlsCaPath", "interCommTlsCaFiles", "interCommTlsCert", "interCommPk", "interCommPkPwd",
        "interCommTlsCrlPath", "interCommTlsCrlFiles")}
)


def unsupported(config: Config) -> list[str]:
    """Settings this version cannot honour; each message names the key, the value and what is allowed."""
    errors: list[str] = []
    models = config.BackendConfig.ModelDeployConfig.ModelConfig
    for i, extra in enumerate(models[1:], 1):
        errors.append(
            f"BackendConfig.ModelDeployConfig.ModelConfig[{i}] (modelName {extra.modelName!r}): this server serves "
            f"one model, ModelConfig[0] ({models[0].modelName!r}); allowed: one ModelConfig entry. To serve several "
            f"models, {SCALE_OUT}"
        )
    errors.extend(plugin_needs(config))
    srv, be = config.ServerConfig, config.BackendConfig
    if srv.inferMode == "dmi":
        errors.extend(_dmi_errors(config))
    errors.extend(_mock_errors(config))
    if config.model.expertParallel and config.model.backendType != "torch":
        errors.append(
            f"BackendConfig.ModelDeployConfig.ModelConfig[0].expertParallel: got true with backendType "
            f"{config.model.backendType!r}; expert parallelism is served by backendType 'torch' only: set backendType "
            "'torch' or expertParallel false"
        )
    if be.ScheduleConfig.policyType == 7:
        errors.append(
            "BackendConfig.ScheduleConfig.policyType: got 7 (SJF-MLFQ); allowed 0 (FCFS), 4 (SJF), 5 (LJF) or 6 "
            "(Skip-Join MLFQ): the spec only names SJF-MLFQ and no published form of it was found to implement "
            "(docs/compatibility.md)"
        )
    if be.multiNodesInferEnabled and be.interNodeTLSEnabled:
        errors.append(
            "BackendConfig.interNodeTLSEnabled: got true with multiNodesInferEnabled; allowed false: the ranks talk "
            "over torch.distributed (gloo, NCCL, HCCL), whose transports in the standard PyTorch builds carry no "
            "TLS; run the nodes on a private network or under IPsec/WireGuard and set interNodeTLSEnabled to false "
            "(docs/scale-out.md)"
        )
    return errors


#: Schedule keys that only the splitfuse plugin's Mix template reads (non-default values need it).
SPLIT_KEYS = ("enableSplit", "splitType", "splitStartType", "splitChunkTokens", "splitStartBatchSize")


def plugin_needs(config: Config) -> list[str]:
    """Schedule values that only a plugin serves, set while that plugin is not enabled: each message names the key,
    the plugin to enable in ``ModelConfig[0].plugin_params`` and the package that provides it."""
    sch, plugins = config.BackendConfig.ScheduleConfig, config.model.plugins
    S = "BackendConfig.ScheduleConfig"
    enable = "add {name!r} to ModelConfig[0].plugin_params' plugin_type (installed by: pip install {package})"
    errors = []
    if sch.templateType == "Mix" and "splitfuse" not in plugins:
        errors.append(
            f"{S}.templateType: got 'Mix' without the splitfuse plugin, which serves the Mix template; "
            + enable.format(name="splitfuse", package="mindie-plugin-splitfuse")
            + ", or set templateType to 'Standard'"
        )
    elif "splitfuse" not in plugins:  # (splitfuse enabled beside Standard: the plugin refuses that)
        default = type(sch)()
        for key in SPLIT_KEYS:
            value = getattr(sch, key)
            if value != getattr(default, key):
                errors.append(
                    f"{S}.{key}: got {json.dumps(value)} with templateType {sch.templateType!r}; SplitFuse's keys act "
                    "only in the Mix template: set templateType to 'Mix' and "
                    + enable.format(name="splitfuse", package="mindie-plugin-splitfuse")
                    + f", or leave {key} at its default {json.dumps(getattr(default, key))}"
                )
    if sch.enablePrefixCache and "prefix_cache" not in plugins:
        errors.append(
            f"{S}.enablePrefixCache: got true without the prefix_cache plugin, which serves Prefix Cache; "
            + enable.format(name="prefix_cache", package="mindie-plugin-prefix-cache")
            + ", or set enablePrefixCache to false"
        )
    return errors


#: ModelConfig keys that choose how a model is loaded and run: with StandardMock (no model) they have no effect
MOCK_NO_EFFECT = ("backendType", "dtype", "kvCacheDtype", "device", "quantization", "compile", "expertParallel")


def _mock_errors(config: Config) -> list[str]:
    """What ``modelInstanceType: "StandardMock"`` (no model loaded) cannot be combined with."""
    be, mc = config.BackendConfig, config.model
    if mc.modelInstanceType != "StandardMock":
        return []
    why = "with modelInstanceType 'StandardMock', which loads no model"
    errors = []
    if mc.worldSize > 1 or be.multiNodesInferEnabled:
        errors.append(f"BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize: got {mc.worldSize} {why}; allowed 1 "
                      "(there are no weights to split over ranks); multiNodesInferEnabled must be false")
    return errors


def _dmi_errors(config: Config) -> list[str]:
    """What PD disaggregation (``inferMode: "dmi"``, docs/scale-out.md) cannot be combined with in this version."""
    srv, be = config.ServerConfig, config.BackendConfig
    mc = be.ModelDeployConfig.ModelConfig[0]
    why = "with ServerConfig.inferMode 'dmi'"
    errors = []
    if srv.interCommTLSEnabled:
        errors.append(
            f"ServerConfig.interCommTLSEnabled: got true {why}; allowed false: the built-in KV transport "
            "and the P-to-D requests run over plain TCP in this version (use a private network)"
        )
    if mc.worldSize > 1 or be.multiNodesInferEnabled:
        errors.append(
            f"BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize: got {mc.worldSize} {why}; allowed 1 "
            "(a P or D instance runs on one device in this version; run more instances instead)"
        )
    if be.modelInstanceNumber > 1:
        errors.append(
            f"BackendConfig.modelInstanceNumber: got {be.modelInstanceNumber} {why}; allowed 1 "
            "(one engine per P or D instance)"
        )
    if mc.kvCacheDtype == "int8":
        errors.append(
            f"BackendConfig.ModelDeployConfig.ModelConfig[0].kvCacheDtype: got 'int8' {why}; allowed auto, "
            "float32, bfloat16, float16 (the int8 cache keeps per-slot scales the transfer does not carry)"
        )
    return errors


def no_effect(config: Config) -> list[str]:
    """A warning for each key set to a non-default value that has no effect here."""
    notes: list[str] = []
    default = Config()
    mc, base = config.model, default.model
    if mc.modelInstanceType == "StandardMock":
        notes += [f"BackendConfig.ModelDeployConfig.ModelConfig[0].{key} is {getattr(mc, key)!r}: no effect here "
                  "(modelInstanceType 'StandardMock' loads no model)"
                  for key in MOCK_NO_EFFECT if getattr(mc, key) != getattr(base, key)]
    srv, be = config.ServerConfig, config.BackendConfig
    scoped = []  # keys the spec gives a meaning only in a mode that is off
    if srv.inferMode != "dmi":
        scoped += [(f"ServerConfig.{k}", getattr(srv, k), getattr(default.ServerConfig, k),
                    "PD's inter-instance link: the spec uses it with inferMode 'dmi' only")
                   for k in ("interCommTLSEnabled", "interCommPort")]
    if not be.multiNodesInferEnabled:
        scoped += [(f"BackendConfig.{k}", getattr(be, k), getattr(default.BackendConfig, k),
                    "multi-node inference: the spec uses it with multiNodesInferEnabled true only")
                   for k in ("interNodeTLSEnabled", "multiNodesInferPort")]
    if config.model.worldSize == 1 and not be.multiNodesInferEnabled:
        scoped.append(("BackendConfig.ModelDeployConfig.ModelConfig[0].expertParallel", config.model.expertParallel,
                       False, "worldSize 1: the one rank holds every expert"))
    notes += [f"{path} is {value!r}: no effect here ({why})" for path, value, base_value, why in scoped
              if value != base_value]
    for path, value, default_value in config_leaves(config, default, ""):
        reason = NO_EFFECT_KEYS.get(path)
        if reason is not None and value != default_value and value not in ("", [], None, False):
            notes.append(f"{path} is {value!r}: no effect here ({reason})")
    return notes


def config_leaves(obj: Any, default: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    out: list[tuple[str, Any, Any]] = []
    for f in fields(obj):
        if f.metadata.get("not_a_key"):  # read from elsewhere (the environment), not from config.json
            continue
        value, base = getattr(obj, f.name), getattr(default, f.name, None)
        path = f"{prefix}{f.name}"
        if hasattr(value, "__dataclass_fields__"):
            out.extend(config_leaves(value, base, path + "."))
        else:
            out.append((path, value, base))
    return out
