"""Shortest prompt first, with aging: a complete mindie-host scheduling plugin.

Waiting requests are admitted by the number of prompt tokens still to compute,
fewest first. A request's score drops by ``agingTokensPerSecond`` for every
second it has waited, so long prompts cannot starve. Enable it in config.json::

    "plugin_params": "{\\"plugin_type\\":\\"shortest_prompt_first\\"}"
    "Plugins": {"shortest_prompt_first": {"agingTokensPerSecond": 50}}
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from mindie_host.api import EngineContext, SequenceView, hookimpl


class Params(BaseModel):
    """``Plugins.shortest_prompt_first``: the host validates it at startup and in ``config validate``."""

    agingTokensPerSecond: float = Field(default=0.0, ge=0)


@hookimpl
def mindie_host_order_waiting(ctx: EngineContext, waiting: list[SequenceView], now: float) -> list[SequenceView]:
    """Fewest prompt tokens left first; every waited second counts as ``agingTokensPerSecond`` fewer."""
    rate = ctx.params.agingTokensPerSecond
    return sorted(waiting, key=lambda s: (s.num_uncomputed - rate * (now - s.arrival_time), s.arrival_time))
