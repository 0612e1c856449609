"""A node other than the master in multi-node inference: its ranks, kept joined, and health probes.

``mindie-host serve`` on such a node (the rank table puts rank 0 elsewhere) loads no tokenizer
and serves no API: it starts one process per local rank (:func:`~mindie_host.runtime.rank_main.rank_main`),
which joins the world through the rendezvous on the master and replays rank 0's calls, and
answers the health probes on the management address (``/health``, ``/v1/health``,
``/v2/health/live``, ``/v2/health/ready``). When its ranks exit (the master's engine died or
restarted, or a rank of this node died), it ends the others and starts them again, so they
join the master's next world; readiness is 503 until they have loaded their slices.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from typing import TYPE_CHECKING, Any

from ..distributed.ranks import rank_threads
from .rank_main import spawn_rank

if TYPE_CHECKING:
    from ..config import Config
    from ..distributed.rank_table import NodePlan

log = logging.getLogger("mindie_host.distributed.node")

#: Seconds between a lost world and the next start of this node's ranks: longer than rank 0's heartbeat
#: (distributed/ranks.py), so the master's old world is gone before they look for the next one.
RESTART_DELAY_S = 3.0


class RankNode:
    """This node's ranks, restarted together whenever one of them exits."""

    def __init__(self, config: Config, plan: NodePlan) -> None:
        self.config = config
        self.plan = plan
        self.threads = rank_threads(len(plan.local))
        self.procs: list[Any] = []
        self.joined: list[Any] = []
        self.restarts = 0
        self.stopping = threading.Event()

    @property
    def ready(self) -> bool:
        """Every local rank is up and has loaded its slices."""
        return bool(self.procs) and all(p.exitcode is None for p in self.procs) and all(e.is_set() for e in self.joined)

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.joined = [ctx.Event() for _ in self.plan.local]
        self.procs = [
            spawn_rank(self.config, [], rank, self.plan.world_size, device, self.plan.address, self.threads, joined)
            for (rank, device), joined in zip(sorted(self.plan.local.items()), self.joined)
        ]
        for p in self.procs:
            p.start()
        log.info(
            "node %s: ranks %s started; joining the world of %d at %s",
            self.plan.node_ip,
            sorted(self.plan.local),
            self.plan.world_size,
            self.plan.address,
        )

    def supervise(self) -> None:
        """Restart this node's ranks whenever one exits, until :meth:`stop`."""
        from multiprocessing.connection import wait

        while not self.stopping.is_set():
            wait([p.sentinel for p in self.procs], timeout=1.0)
            dead = [p for p in self.procs if p.exitcode is not None]
            if not dead or self.stopping.is_set():
                continue
            log.warning(
                "node %s: rank process %d exited (exit code %s); restarting this node's ranks",
                self.plan.node_ip,
                dead[0].pid,
                dead[0].exitcode,
            )
            self._end()
            time.sleep(RESTART_DELAY_S)
            if not self.stopping.is_set():
                self.restarts += 1
                self.start()

    def _end(self) -> None:
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
            p.join(5)

    def stop(self) -> None:
        self.stopping.set()
        self._end()


def health_app(node: RankNode) -> Any:
    """The probes a non-master node answers."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    async def live(_: Any) -> Any:
        return PlainTextResponse("", status_code=200)

    async def ready(_: Any) -> Any:
        if node.ready:
            return PlainTextResponse("", status_code=200)
        return JSONResponse({"error": "this node's ranks are joining the world"}, status_code=503)

    async def info(_: Any) -> Any:
        return JSONResponse(
            {
                "role": "rank node",
                "node": node.plan.node_ip,
                "master": node.plan.master_ip,
                "ranks": sorted(node.plan.local),
                "world_size": node.plan.world_size,
                "ready": node.ready,
                "restarts": node.restarts,
            }
        )

    return Starlette(
        routes=[
            Route("/v2/health/live", live),
            Route("/v2/health/ready", ready),
            Route("/health", ready),
            Route("/v1/health", ready),
            Route("/v1/node", info),
        ]
    )


def serve_rank_node(config: Config, plan: NodePlan) -> int:
    """Run this node's ranks and its health probes until SIGTERM or Ctrl-C."""
    import uvicorn

    node = RankNode(config, plan)
    node.start()
    supervisor = threading.Thread(target=node.supervise, name="mindie-rank-node", daemon=True)
    supervisor.start()
    srv = config.server
    server = uvicorn.Server(
        uvicorn.Config(health_app(node), host=srv.managementIpAddress, port=srv.managementPort, log_level="warning")
    )
    try:
        server.run()  # until SIGTERM or Ctrl-C (uvicorn's handlers)
    finally:
        node.stop()
    return 0
