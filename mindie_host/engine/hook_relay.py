"""What the engine sees of the plugin manager: a way to call a hook, and a way to notify observers.

The engine never holds the plugin manager itself (:class:`~mindie_host.plugins.PluginHost`, which sits
above it); it is given an object with this shape, and calls hooks by name through ``hook``.
"""

from __future__ import annotations

from typing import Any, Protocol


class HookCaller(Protocol):
    """``relay.hook.mindie_host_xxx(**kwargs)``: each hook by name; each implementation gets its own ``ctx``."""

    def __getattr__(self, name: str) -> Any: ...


class HookRelay(Protocol):
    """The two ways the engine reaches plugins."""

    @property
    def hook(self) -> HookCaller:
        """Call a hook by name with keyword arguments (firstresult hooks return one value, others a list)."""
        ...

    def call_observers(self, name: str, **kwargs: Any) -> None:
        """Call every implementation of hook ``name``; one that raises is logged and skipped."""
        ...
