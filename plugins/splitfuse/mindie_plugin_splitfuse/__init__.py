"""mindie-host plugin ``splitfuse``: MindIE's ``Mix`` template with prompt splitting (MindIE §7.6).

Enabled per model, as in MindIE::

    "ModelConfig": [{"plugin_params": "{\\"plugin_type\\":\\"splitfuse\\"}", ...}]
    "ScheduleConfig": {"templateType": "Mix", "enableSplit": true, "splitChunkTokens": 256,
                       "splitStartBatchSize": 16, "splitType": false, "splitStartType": false, ...}

``templateType`` must be ``"Mix"`` when the plugin is enabled (startup is refused
otherwise, naming the key). ``enableSplit: false`` gives ``Mix`` without
splitting: prefills and decodes still share steps, but prompts are never cut.
"""

from __future__ import annotations

from typing import Any

from mindie_host import hookimpl
from mindie_host.api import EngineContext, HostContext, SchedulerState, StepPlan

from .planner import may_split, plan_mix, split_active

__all__ = ["PLUGIN_NAME", "is_enabled", "may_split", "plan_mix", "split_active"]

PLUGIN_NAME = "splitfuse"


def is_enabled(config: Any) -> bool:
    """True when the first model lists ``splitfuse`` in ``plugin_params`` and ``templateType`` is ``Mix``."""
    return PLUGIN_NAME in config.model.plugins and config.schedule.templateType == "Mix"


@hookimpl
def mindie_host_validate_config(ctx: HostContext) -> list[str]:
    """``templateType`` must be ``Mix``.

    The split keys' own rules (``splitChunkTokens`` in [1, 8192], ``splitStartBatchSize`` at most
    ``maxBatchSize`` when ``enableSplit`` is true) are the config's, checked whether or not this
    plugin is installed.
    """
    template = ctx.config.schedule.templateType
    if PLUGIN_NAME not in ctx.model.plugins or template == "Mix":
        return []
    return [
        f"BackendConfig.ScheduleConfig.templateType is {template!r} but ModelConfig.plugin_params enables "
        f"'splitfuse'; allowed: \"Mix\" (SplitFuse batches prefill and decode together) or remove splitfuse from "
        f"plugin_type"
    ]


@hookimpl
def mindie_host_plan_step(ctx: EngineContext, state: SchedulerState) -> StepPlan | None:
    """Every step: decodes first, then prefill chunks, within ``splitChunkTokens``."""
    if not is_enabled(state.config):
        return None
    return plan_mix(state)
