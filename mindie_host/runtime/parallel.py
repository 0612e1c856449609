"""Rank 0 of a tensor-parallel model instance: the world it belongs to, and the backend that drives its ranks."""

from __future__ import annotations

from collections.abc import Callable

from ..backends.base import ModelBackend
from ..config import Config
from ..distributed.ranks import ParallelBackend, local_address
from ..plugins import PluginError, PluginHost
from .plugin_transport import plugin_specs
from .rank_main import spawn_rank


def world(config: Config) -> tuple[int, dict[int, int], str]:
    """``(world size, {local rank: device}, rendezvous address)`` of this model instance.

    One node: ``worldSize`` ranks on ``npuDeviceIds[0]``, rendezvous on a free local port.
    ``multiNodesInferEnabled``: the rank table's world (``RANKTABLEFILE``; mindie_host/distributed/rank_table.py).
    """
    be = config.BackendConfig
    if be.multiNodesInferEnabled:
        from ..distributed.rank_table import load_plan

        plan = load_plan(be.multiNodesInferPort)
        return plan.world_size, plan.local, plan.address
    return config.model.worldSize, dict(enumerate(be.npuDeviceIds[0])), local_address()


def parallel_backend(
    backend: ModelBackend, config: Config, plugins: PluginHost, on_rank_lost: Callable[[], None] | None = None
) -> ParallelBackend:
    """Rank 0 of the instance's tensor-parallel ranks around ``backend``; the local ranks ``>= 1`` run
    :func:`~mindie_host.runtime.rank_main.rank_main` with the same config and plugins."""
    size, local, address = world(config)
    key = (
        "the rank table's device count (RANKTABLEFILE)"
        if config.BackendConfig.multiNodesInferEnabled
        else "BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize"
    )
    errors = backend.parallel_errors(size, key)
    if errors:
        raise PluginError("config.json asks for what this server cannot do:\n  " + "\n  ".join(errors))
    specs = plugin_specs(plugins)
    return ParallelBackend(
        backend,
        world_size=size,
        local=local,
        address=address,
        make_worker=lambda rank, device, addr, threads: spawn_rank(config, specs, rank, size, device, addr, threads),
        dist_backend=backend.dist_backend,
        on_lost=on_rank_lost,
    )
