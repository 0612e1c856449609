"""The typed hook context (plugin contract 3): every hook gets its own plugin's ``ctx``.

A plugin declares ``Params`` (validated from ``Plugins.<name>``) and ``State`` (one per engine); the
host hands each hook a frozen context of the hook's shape (HostContext, EngineContext, BackendContext)
with the config, the model entry, the params, a ``mindie_host.plugins.<name>`` logger and the state.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest

from mindie_host.api import (
    BackendContext,
    EngineContext,
    HostContext,
    PluginContext,
    hookimpl,
)
from mindie_host.plugins import PluginError
from mindie_host.testing import RunningServer, loaded_host, make_tiny_llama, server_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("ctx_model"))


class Recorder:
    """A plugin with pydantic ``Params`` and a ``State``, recording the contexts it is handed."""

    class Params(pydantic.BaseModel):
        greeting: str = "hi"
        limit: int = pydantic.Field(default=4, ge=1, le=64)

    class State:
        def __init__(self) -> None:
            self.seen: list[PluginContext] = []
            self.steps = 0
            self.refined: list[str] = []

    @hookimpl
    def mindie_host_startup(self, ctx: HostContext) -> None:
        ctx.state.seen.append(ctx)

    @hookimpl
    def mindie_host_refine_request(self, ctx: HostContext, request: Any) -> None:
        ctx.state.seen.append(ctx)
        ctx.state.refined.append(request.request_id)

    @hookimpl
    def mindie_host_filter_waiting(self, ctx: EngineContext, waiting: list[Any]) -> None:
        if not any(isinstance(c, EngineContext) for c in ctx.state.seen):
            ctx.state.seen.append(ctx)

    @hookimpl
    def mindie_host_kv_cache_manager(self, ctx: EngineContext) -> None:
        ctx.state.seen.append(ctx)

    @hookimpl
    def mindie_host_model_architectures(self, ctx: BackendContext) -> None:
        ctx.state.seen.append(ctx)

    @hookimpl
    def mindie_host_step_outputs(self, ctx: HostContext, outputs: list[Any]) -> None:
        ctx.state.steps += 1

    @hookimpl
    def mindie_host_metrics(self, ctx: HostContext) -> dict[str, float]:
        return {"recorder_steps": float(ctx.state.steps), "recorder_limit": float(ctx.params.limit)}


def test_each_hook_gets_a_typed_context_with_params_state_and_logger(tiny_model: Path) -> None:
    plugin = Recorder()
    # engineProcess false: the test reads the State that engine-side hooks filled, so it must be in this process
    config = server_config(tiny_model, plugins={"recorder": {"greeting": "hello", "limit": 8}},
                           server={"engineProcess": False})
    with RunningServer(config, plugins=[(plugin, "recorder")]) as server:
        r = httpx.post(server.url + "/v1/completions",
                       json={"model": "tiny", "prompt": "a b c", "max_tokens": 3, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        state = server.host.plugins.state("recorder", plugin)
        metrics = server.host.stats()
    kinds = {type(c) for c in state.seen}
    assert {HostContext, EngineContext, BackendContext} <= kinds  # one class per shape
    for ctx in state.seen:
        assert dataclasses.is_dataclass(ctx)
        with pytest.raises(dataclasses.FrozenInstanceError):
            ctx.plugin = "other"  # type: ignore[misc]
        assert ctx.plugin == "recorder"
        assert ctx.params == Recorder.Params(greeting="hello", limit=8)
        assert ctx.state is state  # one State per plugin and engine, shared by every hook
        assert ctx.log.name == "mindie_host.plugins.recorder"
        assert ctx.model is server.host.model_config
        assert ctx.config is server.host.config
    startup = next(c for c in state.seen if isinstance(c, HostContext))
    assert startup.host is server.host
    assert len(state.refined) == 1
    assert state.steps >= 3  # mindie_host_step_outputs saw every step of the request
    assert 3 <= metrics["recorder_steps"] <= state.steps and metrics["recorder_limit"] == 8.0


@dataclasses.dataclass
class DataclassParams:
    """``Params`` may be a stdlib dataclass too: its types are checked all the same."""

    blocks: int = 2
    mode: str = "lru"


class DataclassPlugin:
    Params = DataclassParams

    @hookimpl
    def mindie_host_startup(self, ctx: HostContext) -> None:
        self.params = ctx.params


@pytest.mark.parametrize(
    ("plugin", "section", "expected"),
    [
        (Recorder(), {"limit": 0}, "Plugins.recorder.limit: got 0"),
        (Recorder(), {"limit": "many"}, "Plugins.recorder.limit: got 'many'"),
        (Recorder(), {"colour": "red"}, "Plugins.recorder.colour: not a parameter of plugin 'recorder'"),
        (DataclassPlugin(), {"blocks": "two"}, "Plugins.recorder.blocks: got 'two'"),
        (DataclassPlugin(), {"extra": 1}, "Plugins.recorder.extra: not a parameter"),
    ],
)
def test_bad_plugin_params_stop_startup_naming_the_key(tiny_model: Path, plugin: object, section: dict[str, Any],
                                                       expected: str) -> None:
    with pytest.raises(PluginError, match=expected.replace(".", r"\.").replace("(", r"\(")):
        loaded_host(server_config(tiny_model, plugins={"recorder": section}), plugins=[(plugin, "recorder")])


def test_dataclass_params_are_validated_into_the_dataclass(tiny_model: Path) -> None:
    plugin = DataclassPlugin()
    host = loaded_host(server_config(tiny_model, plugins={"dc": {"blocks": 5}}), plugins=[(plugin, "dc")])
    try:
        assert plugin.params == DataclassParams(blocks=5, mode="lru")
    finally:
        host.shutdown()


class NoParams:
    @hookimpl
    def mindie_host_startup(self, ctx: HostContext) -> None:
        assert ctx.params is None and ctx.state is None


def test_a_section_for_a_plugin_without_params_is_refused_not_ignored(tiny_model: Path) -> None:
    with pytest.raises(PluginError, match=r"Plugins\.plain: plugin 'plain' declares no parameters"):
        loaded_host(server_config(tiny_model, plugins={"plain": {"x": 1}}), plugins=[(NoParams(), "plain")])
    host = loaded_host(server_config(tiny_model), plugins=[(NoParams(), "plain")])
    host.shutdown()


def test_a_section_for_a_plugin_that_is_not_enabled_is_refused(tiny_model: Path) -> None:
    with pytest.raises(PluginError, match=r"Plugins\.nowhere: no enabled plugin is named 'nowhere'"):
        loaded_host(server_config(tiny_model, plugins={"nowhere": {}}))


class Exploding:
    @hookimpl
    def mindie_host_step_outputs(self, ctx: HostContext, outputs: list[Any]) -> None:
        raise RuntimeError("observer bug")


def test_a_failing_step_observer_does_not_hurt_requests(tiny_model: Path) -> None:
    with RunningServer(server_config(tiny_model), plugins=[(Exploding(), "exploding")]) as server:
        r = httpx.post(server.url + "/v1/completions",
                       json={"model": "tiny", "prompt": "a b", "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4


class WrapperWithContext:
    """A ``wrapper=True`` implementation that takes ``ctx`` keeps pluggy's wrapper semantics."""

    class State:
        def __init__(self) -> None:
            self.plans = 0

    @hookimpl(wrapper=True)
    def mindie_host_plan_step(self, ctx: EngineContext, state: Any) -> Any:
        plan = yield
        if plan and plan.scheduled:
            ctx.state.plans += 1
        return plan


def test_wrapper_implementations_get_their_context(tiny_model: Path) -> None:
    plugin = WrapperWithContext()
    cfg = server_config(tiny_model, server={"engineProcess": False})  # reads the engine-side State here
    with RunningServer(cfg, plugins=[(plugin, "wrapper")]) as server:
        r = httpx.post(server.url + "/v1/completions",
                       json={"model": "tiny", "prompt": "a b", "max_tokens": 3, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert server.host.plugins.state("wrapper", plugin).plans >= 3
