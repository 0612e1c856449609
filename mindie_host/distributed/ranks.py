"""The ranks of one tensor-parallel model instance, on ``torch.distributed``.

Rank 0 lives where the engine lives (the engine-core process, or the server's process with
``engineProcess: false``): there the scheduler runs once, and the backend the host sees is a
:class:`ParallelBackend`. It wraps rank 0's own backend and, before each call that touches
the model (``allocate_kv_cache``, ``warmup``, ``execute``, swaps, ``shutdown``), broadcasts
the call, with its arguments (a step's whole :class:`~mindie_host.backends.base.ModelInput`),
to the other ranks. Each of them (one process per rank) builds the same backend through the
same ``mindie_host_model_backend`` hook and replays the calls in the same order; the
decoder's collectives then line up rank by rank.

Two process groups: the **step group** (``Platform.dist_backend``: gloo on CPU, NCCL on CUDA,
HCCL on Ascend) carries the decoder's all-reduces with a timeout
(:data:`COLLECTIVE_TIMEOUT_S`, environment ``MINDIE_HOST_COLLECTIVE_TIMEOUT_S``), so a lost
rank never hangs a step; the **control group** (gloo, on the CPU) carries the calls, and
waits as long as the engine is idle.

The other ranks' processes are started by the runtime (:mod:`mindie_host.runtime.rank_main`), through
the ``make_worker`` callable rank 0 is given.

Faults: a watcher thread waits on the rank processes. When one dies, rank 0 logs which and why
and the instance fails fast: it calls the ``on_lost`` it was given (the engine-core process exits
at once, taking the other ranks with it, and the front end's supervisor restarts every rank
together); without one (the engine in the server's process), every later step fails and liveness
reports the engine dead. A rank whose rank 0 is gone sees its control broadcast fail (or its
parent change) and exits.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..backends.base import LinearDeltas, ModelBackend, ModelInfo, ModelInput
from ..logs import describe_exit
from .cores import core_share
from .tensor_parallel import TensorParallel

if TYPE_CHECKING:
    import torch

log = logging.getLogger("mindie_host.distributed")

#: Seconds a step's collective may wait for the other ranks before it fails.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("MINDIE_HOST_COLLECTIVE_TIMEOUT_S", "300"))
#: The control group waits for the next call while the engine is idle: effectively forever.
_IDLE_TIMEOUT = datetime.timedelta(days=3650)
#: Seconds of idleness after which rank 0 checks that every rank still answers (finds lost ranks of other nodes).
HEARTBEAT_S = 1.0


class RankFailedError(RuntimeError):
    """A rank of this tensor-parallel instance died; the instance cannot step until it is restarted."""


def rank_threads(world_size: int) -> int:
    """Compute threads per rank: the cores this process may use, shared evenly among the ranks."""
    return core_share(world_size)


def local_address() -> str:
    """``127.0.0.1:<free port>``: the rendezvous of ranks that all run on this machine."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def init_groups(backend: str, address: str, rank: int, world_size: int) -> Any:
    """Join the world (TCP rendezvous at ``address``); returns the control group."""
    import torch.distributed as dist

    dist.init_process_group(
        backend, init_method=f"tcp://{address}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    return dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)


class ParallelBackend(ModelBackend):
    """Rank 0's view of a tensor-parallel instance: its own backend, with every call replayed on the other ranks.

    ``local`` maps the ranks of this node (rank 0 among them) to their devices
    (``BackendConfig.npuDeviceIds[0]``, or the rank table's); ranks of other nodes are started
    there (:mod:`mindie_host.runtime.rank_node`). ``make_worker(rank, device, address, threads)``
    makes the process of a local rank ``>= 1``. The local ranks share this process's compute
    threads evenly. ``on_lost()`` is called once the instance is lost (a rank died, or a collective
    failed), after the local ranks are stopped; without it later calls raise :class:`RankFailedError`.
    """

    def __init__(self, inner: ModelBackend, *, world_size: int, local: dict[int, int],
                 make_worker: Callable[[int, int, str, int], Any], address: str, dist_backend: str,
                 on_lost: Callable[[], None] | None = None) -> None:
        import torch

        self.inner = inner
        self.threads = max(1, torch.get_num_threads() // len(local))
        self.backend_type = inner.backend_type
        self.world_size = world_size
        self.local = local
        self.make_worker = make_worker
        self.address = address
        self._dist_backend = dist_backend
        self.on_lost = on_lost
        self.workers: list[Any] = []
        self.control: Any = None
        self.failed: str | None = None
        self._closing = False
        self._lock = threading.Lock()
        self._last_call = time.monotonic()
        self.deltas = None
        self._deltas_sent = -1

    def __getattr__(self, name: str) -> Any:  # read-only facts of the inner backend (platform, dtype ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- start ------------------------------------------------------------------------------------------
    @property
    def dist_backend(self) -> str:
        """The backend the ranks joined with (rank 0's platform's)."""
        return self._dist_backend

    def load(self) -> ModelInfo:
        import torch

        torch.set_num_threads(self.threads)
        self.ranks = sorted(r for r in self.local if r != 0)
        self.workers = [self.make_worker(r, self.local[r], self.address, self.threads) for r in self.ranks]
        for proc in self.workers:
            proc.start()
        try:
            self.control = self._while_ranks_live(
                lambda: init_groups(self.dist_backend, self.address, 0, self.world_size), "joining the world")
            self.inner.bind_parallel(TensorParallel(0, self.world_size, None, self.local[0]))
            info = self.inner.load()
            self._while_ranks_live(lambda: self._barrier(), "loading their slices")
        except BaseException:
            self._stop_workers()
            self._leave_world()  # a process that failed to load may load again (a test, a restart in process)
            raise
        threading.Thread(target=self._watch, name="mindie-rank-watcher", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="mindie-rank-heartbeat", daemon=True).start()
        log.info("tensor parallel: %d ranks (%s), rank 0 here, local ranks %s in processes %s", self.world_size,
                 self.dist_backend, self.ranks, [p.pid for p in self.workers])
        return info

    def _barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.control)

    def _while_ranks_live(self, fn: Callable[[], Any], doing: str) -> Any:
        """Run ``fn`` (a rendezvous with the other ranks) and fail as soon as one of them exits instead."""
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["value"] = fn()
            except BaseException as exc:
                result["error"] = exc

        def dead_rank() -> RankFailedError | None:
            dead = [(r, p) for r, p in zip(self.ranks, self.workers) if p.exitcode is not None]
            if not dead:
                return None
            r, p = dead[0]
            return RankFailedError(f"rank {r} exited ({describe_exit(p.exitcode)}) while the ranks were {doing}")

        thread = threading.Thread(target=run, name="mindie-rank-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            lost = dead_rank()
            if lost is not None and thread.is_alive():
                raise lost
        if "error" in result:
            # a collective fails as soon as a peer's connection closes, before that peer's exit is seen: say which
            for _ in range(20):
                lost = dead_rank()
                if lost is not None:
                    raise lost from result["error"]
                time.sleep(0.05)
            raise result["error"]
        return result.get("value")

    # -- faults --------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        from multiprocessing.connection import wait

        pending = {p.sentinel: (r, p) for r, p in zip(self.ranks, self.workers)}
        if not pending:  # every other rank is on another node: a lost one shows as a failed step
            return
        ready = wait(list(pending))
        if self._closing:
            return
        rank, proc = pending[ready[0]]  # type: ignore[index]
        proc.join(1)
        self.failed = f"rank {rank} of {self.world_size} died ({describe_exit(proc.exitcode)})"
        log.error("tensor parallel: %s; the instance stops", self.failed)
        if self.on_lost is not None:  # the engine-core process exits: the supervisor restarts every rank together
            self._stop_workers()
            self.on_lost()

    def _heartbeat(self) -> None:
        """While idle, broadcast a no-op every :data:`HEARTBEAT_S`: a rank lost on another node fails it."""
        while not self._closing and self.failed is None:
            time.sleep(HEARTBEAT_S)
            if time.monotonic() - self._last_call >= HEARTBEAT_S and not self._closing:
                try:
                    self._call("ping")
                except RankFailedError:
                    return

    def _call(self, name: str, *args: Any) -> None:
        """Broadcast call ``name(*args)`` to the other ranks (they run it in the same order as rank 0)."""
        import torch.distributed as dist

        if self.failed is not None:
            raise RankFailedError(f"tensor parallel instance is down: {self.failed}")
        try:
            with self._lock:
                self._last_call = time.monotonic()
                dist.broadcast_object_list([(name, args)], src=0, group=self.control)
        except Exception as exc:
            self._lost(f"the control broadcast of {name!r} failed ({exc})")

    def _lost(self, why: str) -> None:
        """A collective failed: a rank (perhaps on another node) is gone; the instance stops."""
        if self._closing:  # stopping anyway: the ranks are going
            raise RankFailedError(f"tensor parallel instance is stopping: {why}")
        self.failed = self.failed or why
        log.error("tensor parallel: %s; the instance stops", self.failed)
        if self.on_lost is not None:
            self._stop_workers()
            self.on_lost()
        raise RankFailedError(f"tensor parallel instance is down: {self.failed}")

    # -- the backend contract, replayed -----------------------------------------------------------------------
    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return self.inner.kv_cache_bytes_per_block(block_size)

    def available_kv_memory(self, requested_gb: int) -> int:
        return self.inner.available_kv_memory(requested_gb)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._call("allocate_kv_cache", num_blocks, block_size)
        self.inner.allocate_kv_cache(num_blocks, block_size)

    def set_max_positions(self, max_positions: int) -> None:
        self._call("set_max_positions", max_positions)
        self.inner.set_max_positions(max_positions)

    def execute(self, batch: ModelInput) -> torch.Tensor:
        deltas = self.deltas
        if deltas is not None and deltas.version != self._deltas_sent and any(v >= 0 for v in batch.row_variants):
            self._deltas_sent = deltas.version
            self._call("set_linear_deltas", deltas)  # the provider's weights changed: every rank gets them
        self._call("execute", batch)
        try:
            return self.inner.execute(batch)
        except Exception as exc:  # the ranks may now be out of step: only a restart of all of them is safe
            self._lost(f"a step failed on rank 0 ({type(exc).__name__}: {exc})")
            raise

    def warmup(self) -> None:
        self._call("warmup")
        self.inner.warmup()

    def set_linear_deltas(self, provider: LinearDeltas | None) -> bool:
        """Rank 0 applies ``provider`` here; the other ranks get it pickled before the first step that needs it,
        and again whenever its ``version`` changes. A provider without ``version`` cannot be kept in step."""
        if provider is not None and not isinstance(getattr(provider, "version", None), int):
            log.error("tensor parallel: the linear-delta provider %s has no integer 'version' attribute, so its "
                      "changes cannot be sent to the other ranks", type(provider).__name__)
            return False
        if not self.inner.set_linear_deltas(provider):
            return False
        self.deltas: Any = provider
        self._deltas_sent = -1
        return True

    def swap_block_bytes(self) -> int:
        return self.inner.swap_block_bytes()

    def allocate_swap_space(self, num_blocks: int) -> bool:
        self._call("allocate_swap_space", num_blocks)
        return self.inner.allocate_swap_space(num_blocks)

    def swap_out(self, blocks: list[int], swap_blocks: list[int]) -> None:
        self._call("swap_out", blocks, swap_blocks)
        self.inner.swap_out(blocks, swap_blocks)

    def swap_in(self, swap_blocks: list[int], blocks: list[int]) -> None:
        self._call("swap_in", swap_blocks, blocks)
        self.inner.swap_in(swap_blocks, blocks)

    def shutdown(self) -> None:
        self._closing = True
        if self.failed is None and self.control is not None:
            try:
                self._call("stop")
            except Exception as exc:  # a rank is already gone: nothing to tell it
                log.info("tensor parallel: could not tell the ranks to stop (%s)", exc)
        self._stop_workers()
        self.inner.shutdown()
        self._leave_world()

    @staticmethod
    def _leave_world() -> None:
        """Destroy this process's default group (and with it the control group), if it joined one."""
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a half-formed world: nothing more to release
                log.info("tensor parallel: could not destroy the process group (%s)", exc)

    def _stop_workers(self) -> None:
        self._closing = True
        for proc in self.workers:
            proc.join(5)
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)
