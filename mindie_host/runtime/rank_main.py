"""The process of a tensor-parallel rank other than 0: the same backend with this rank's slices, replaying rank 0.

Rank 0 (:class:`~mindie_host.distributed.ranks.ParallelBackend`, where the engine lives) broadcasts
each call that touches the model; :func:`rank_main` builds the same backend through the same
``mindie_host_model_backend`` hook, with only the plugins it needs (no host, no tokenizer, no
engine), and replays the calls in the same order.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from typing import Any

from ..config import Config
from ..distributed.ranks import init_groups
from ..distributed.tensor_parallel import TensorParallel
from ..plugins import PluginHost
from .backend import create_backend
from .exits import RANK_ORPHANED
from .plugin_transport import PluginSpecs, register_specs

log = logging.getLogger("mindie_host.distributed")


def spawn_rank(
    config: Config,
    specs: PluginSpecs,
    rank: int,
    world: int,
    device: int,
    address: str,
    threads: int,
    joined: Any = None,
) -> Any:
    """The (unstarted) process of rank ``rank`` of ``world`` on ``device``, with ``threads`` compute threads;
    ``joined`` (a multiprocessing Event) is set once it has loaded its slices and met the other ranks."""
    ctx = multiprocessing.get_context("spawn")
    return ctx.Process(
        target=rank_main,
        name=f"mindie-rank-{rank}",
        daemon=True,
        args=(config, specs, rank, world, device, address, os.getpid(), threads, joined),
    )


def rank_main(
    config: Config,
    specs: PluginSpecs,
    rank: int,
    world: int,
    device: int,
    address: str,
    parent_pid: int,
    threads: int,
    joined: Any = None,
) -> None:
    """A rank other than 0: build the same backend with this rank's slices, then replay rank 0's calls."""
    import torch
    import torch.distributed as dist

    from ..config.hot_update import watch_config
    from ..logs import setup_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: rank 0 stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so does a SIGTERM to the group: rank 0 stops us after the drain
    setup_logging(config.LogConfig, to_stderr=True)
    watch_config(config)  # LogConfig.logLevel's hot update, in this process too
    torch.set_num_threads(threads)
    plugins = PluginHost()
    plugins.bind(config)
    register_specs(plugins, specs)
    plugins.enable_from_config(config)
    backend = create_backend(plugins, config)
    control = init_groups(backend.dist_backend, address, rank, world)
    backend.bind_parallel(TensorParallel(rank, world, None, device))
    backend.load()
    dist.barrier(group=control)
    if joined is not None:
        joined.set()
    log.info("rank %d of %d loaded (pid %d)", rank, world, os.getpid())
    while True:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=control)
        except Exception as exc:  # rank 0 is gone
            if os.getppid() != parent_pid or not _parent_alive(parent_pid):
                log.info("rank %d: rank 0 is gone; exiting", rank)
            else:
                log.error("rank %d: lost the control channel (%s); exiting", rank, exc)
            os._exit(RANK_ORPHANED)
        name, args = box[0]
        if name == "stop":
            break
        if name != "ping":  # rank 0's heartbeat while idle
            getattr(backend, name)(*args)
    backend.shutdown()
    dist.destroy_process_group()
    time.sleep(0)
    os._exit(0)


def _parent_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
