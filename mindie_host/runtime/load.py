"""Load a host: check the config, enable the plugins, and bring the model up where the config says.

``ServerConfig.engineProcess`` (the default), or several model instances: the model loads in engine
processes supervised from here (:mod:`.front_end`). Otherwise it loads in this process
(:mod:`.assemble`) and the engine steps on a worker thread or the caller's thread, behind an
:class:`~mindie_host.engine.async_engine.AsyncEngine`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..engine.async_engine import AsyncEngine
from ..host import Host
from .assemble import assemble, check_and_enable
from .front_end import launch_engines

log = logging.getLogger("mindie_host")


def load_host(host: Host, progress: Callable[[int, int, str], None] | None = None) -> None:
    """Enable plugins, load tokenizer and weights, size the KV cache, build the engine: ``host`` is then
    ready to :meth:`~mindie_host.host.Host.start`. ``progress``: the loading bar of ``mindie-host serve``."""
    check_and_enable(host)
    instances = host.config.BackendConfig.modelInstanceNumber
    if instances > 1 and not host.config.server.engineProcess:
        log.info(
            "BackendConfig.modelInstanceNumber is %d: each instance runs in its own engine process "
            "(as with ServerConfig.engineProcess true)",
            instances,
        )
    if host.config.server.engineProcess or instances > 1:
        launch_engines(host, show_progress=progress is not None)
        return
    assemble(host, progress)
    assert host.llm is not None
    host.engine = AsyncEngine(host.llm, host.plugins)
    host.plugins.hook.mindie_host_startup()
