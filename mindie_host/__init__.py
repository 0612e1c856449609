"""mindie-host: a plugin-based LLM inference server that speaks MindIE Service's protocols.

Plugin authors import from :mod:`mindie_host.api`; the whole hook contract is
:mod:`mindie_host.hookspecs`.
"""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

#: Marker for hook implementations: ``@hookimpl def mindie_host_...``.
hookimpl = pluggy.HookimplMarker("mindie_host")

__all__ = ["__version__", "hookimpl"]
