"""Shortest prompt first, with aging: a complete mindie-host scheduling plugin.

Waiting requests are admitted by the number of prompt tokens still to compute,
fewest first. A request's score drops by ``agingTokensPerSecond`` for every
second it has waited, so long prompts cannot starve. Enable it in config.json::

    "plugin_params": "{\\"plugin_type\\":\\"shortest_prompt_first\\"}"
    "Plugins": {"shortest_prompt_first": {"agingTokensPerSecond": 50}}
"""

from __future__ import annotations

from typing import Any

from mindie_host.api import hookimpl

NAME = "shortest_prompt_first"


def aging(config: Any) -> Any:
    """``Plugins.shortest_prompt_first.agingTokensPerSecond`` (default 0: pure shortest-first)."""
    return config.Plugins.get(NAME, {}).get("agingTokensPerSecond", 0)


@hookimpl
def mindie_host_validate_config(config: Any, model_config: Any) -> list[str]:
    """Refuse a negative or non-numeric aging rate, naming the key and the allowed range."""
    rate = aging(config)
    if NAME in model_config.plugins and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate < 0):
        return [f"Plugins.{NAME}.agingTokensPerSecond is {rate!r}; allowed: a number >= 0"]
    return []


@hookimpl
def mindie_host_order_waiting(waiting: list[Any], config: Any, now: float) -> list[Any] | None:
    """Fewest prompt tokens left first; every waited second counts as ``agingTokensPerSecond`` fewer."""
    if NAME not in config.model.plugins:
        return None  # installed but not enabled for this model: let the builtin order decide
    rate = aging(config)
    return sorted(waiting, key=lambda s: (s.num_uncomputed - rate * (now - s.arrival_time), s.arrival_time))
