"""``mindie_host.api`` is the one import path: what plugins and embedding applications need, nothing more."""

from __future__ import annotations

import json
import subprocess
import sys

import mindie_host.api as api

NEEDED = {"Config", "ModelConfig", "Host", "hookimpl", "PluginContext", "HostContext", "EngineContext",
          "BackendContext", "CONTRACT_VERSION", "BlockPool", "KVCacheManager", "EngineRequest",
          "SequenceView", "StepPlan", "ModelBackend", "LinearDeltas", "RequestError"}


def test_the_api_exports_the_contract() -> None:
    assert NEEDED <= set(api.__all__)
    assert all(hasattr(api, name) for name in api.__all__)


def test_the_api_exports_nothing_backend_specific_and_imports_no_server_module() -> None:
    code = ("import json, sys, mindie_host.api as a; print(json.dumps({'modules': sorted(sys.modules), "
            "'origins': {n: getattr(getattr(a, n), '__module__', '') for n in a.__all__}}))")
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                    timeout=120).stdout)
    loaded = [m for m in out["modules"] if m.startswith(("mindie_host.server", "mindie_host.backends.torch"))]
    assert not loaded, loaded
    specific = {n: o for n, o in out["origins"].items()
                if o and o.startswith(("mindie_host.backends.torch", "mindie_host.backends.platform"))}
    assert not specific, specific
