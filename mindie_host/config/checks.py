"""The rules of ``config.json`` that relate two keys (``maxPrefillTokens >= maxInputTokenLen`` ...).

Each is one :meth:`~.rules.Findings.need` call, skipped when a key it reads already failed its
own :class:`~.rules.Rule`, so a file gets one error per mistake. Keys that must be non-empty
only while a feature is on (HTTPS, multi-node TLS ...) name their gate in their rule's
``required_when``; :data:`_GATES` says when each gate holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

from .rules import UINT32_MAX, Findings
from .schema import DEFAULT_BACKEND_NAME, Config

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


def cross_checks(c: Config, b: Findings) -> None:
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
    # only meaningful with SplitFuse on, so a small maxBatchSize alone does not trip it; the one copy of this
    # rule, so that it holds whether or not the plugin that splits is installed
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
        "BackendConfig.npuDeviceIds",
        be.npuDeviceIds,
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
                    len(ids) == m.worldSize,
                    f"BackendConfig.npuDeviceIds[{j}]",
                    ids,
                    f"a list of {m.worldSize} device id(s), one per rank ({p}.worldSize is {m.worldSize})",
                    f"{p}.worldSize",
                    "BackendConfig.npuDeviceIds",
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
