"""The front end of engine processes: the tokenizer here, the model in one engine process per instance.

With ``ServerConfig.engineProcess`` (or ``modelInstanceNumber`` > 1) the server's process parses,
tokenizes and renders; :func:`launch_engines` starts the engine processes, each supervised by its
:class:`~.engine_client.EngineProcessClient`, waits until their models are loaded, makes the client
(or the balancer over several, :class:`~.instances.EngineInstances`) the host's engine, and keeps
the front end's own torch work on one thread.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from ..config import Config
from ..distributed.ranks import rank_threads
from ..engine.handle import EngineStartError
from ..host import Host
from .assemble import model_tokenizer
from .engine_client import EngineProcessClient
from .instances import EngineInstances

log = logging.getLogger("mindie_host.engine.process")


def launch_engines(host: Host, show_progress: bool = False) -> None:
    """Load the tokenizer here and the model in the engine process(es); tell the front end's plugins.

    ``show_progress``: the engine process draws the loading bar on the shared stderr (one instance only).
    """
    host.tokenizer = model_tokenizer(host.model_config)
    count = host.config.BackendConfig.modelInstanceNumber
    if count == 1:
        client: Any = EngineProcessClient(host, show_progress=show_progress)
        try:
            host.info = client.launch()
        except BaseException:
            client.stop()  # its sockets and socket directory
            raise
    else:  # one engine process per device group, balanced by requests in flight
        threads = rank_threads(count)
        clients = [EngineProcessClient(host, instance_config(host.config, i), threads) for i in range(count)]
        infos = []
        try:
            for i, c in enumerate(clients):
                infos.append(c.launch())
                log.info(
                    "model instance %d of %d ready on devices %s",
                    i + 1,
                    count,
                    host.config.BackendConfig.npuDeviceIds[i],
                )
        except BaseException:
            for c in clients:
                c.stop()
            raise
        host.info = infos[0]
        client = EngineInstances(host, clients)
    host.engine = client
    host.runtime.front_end_threads_before = limit_front_end_threads()
    try:
        host.plugins.hook.mindie_host_startup()
    except Exception as exc:
        client.stop()
        raise EngineStartError(
            f"a plugin failed to start in the front end ({type(exc).__name__}: {exc}); plugins that share "
            "objects between request parsing and the model backend need ServerConfig.engineProcess false"
        ) from exc
    client.start()


def instance_config(config: Config, index: int) -> Config:
    """The config of model instance ``index``: device group ``npuDeviceIds[index]``, one instance."""
    own = copy.deepcopy(config)
    own.BackendConfig.npuDeviceIds = [list(config.BackendConfig.npuDeviceIds[index])]
    own.BackendConfig.modelInstanceNumber = 1
    return own


def limit_front_end_threads() -> int:
    """Keep the front end's torch work on one thread, so it never competes with the engine's cores.

    Returns the previous thread count. The engine process is spawned with the environment
    unchanged, so it keeps every core.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    return previous
