"""The front end's client of an engine-core process, and its supervisor.

``host.engine`` in the front end (``ServerConfig.engineProcess: true``) is an
:class:`EngineProcessClient`: the same asyncio interface as
:class:`~mindie_host.engine.async_engine.AsyncEngine` (``generate``, ``abort``, ``abort_all``,
``num_active``, ``dead``; each step's outputs go to ``mindie_host_step_outputs``), whose inbox is a
ZeroMQ socket. It starts the engine process (:func:`~.engine_main.engine_core_main`, with
multiprocessing's ``spawn``) and talks to it over two PUSH/PULL pipes on ``ipc://`` sockets with
msgpack frames (:mod:`mindie_host.engine.ipc`; bench/ipc_bench.py measured the choice). Outputs come
back once per step, with the engine statistics.

Supervision: a monitor thread polls the output socket and the child's process sentinel. When the
child dies, readiness turns 503 at once, every request in flight ends with an error output, and
the engine is restarted with the same config after ``engineRestartBackoffSeconds * 2**n`` seconds,
at most ``engineRestartMaxRetries`` times in a row (a child that has served for
:data:`HEALTHY_SECONDS` resets the count). When the budget is spent, :attr:`dead` is set and
liveness fails.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from ..engine import ipc
from ..engine.async_engine import AsyncEngine
from ..engine.commands import CommandRefused, answer, settle
from ..engine.handle import EngineStartError
from ..engine.request import RequestError, RequestOutput, failed_output
from ..host import Host
from .engine_main import engine_core_main
from .exits import exit_reason
from .plugin_transport import plugin_specs

if TYPE_CHECKING:
    from ..backends.base import ModelInfo
    from ..config import Config

log = logging.getLogger("mindie_host.engine.process")

#: A restarted engine that has run this long without dying resets the retry count.
HEALTHY_SECONDS = 60.0
_OUTPUTS = ipc.OUTPUTS.encode()
_RESULT = ipc.RESULT.encode()
#: How long a stopping engine process gets to exit before it is killed.
STOP_SECONDS = 10.0


class EngineProcessClient(AsyncEngine):
    """The front end's handle on the engine-core process: same asyncio interface as :class:`AsyncEngine`."""

    def __init__(
        self, host: Host, config: Config | None = None, threads: int | None = None, show_progress: bool = False
    ) -> None:
        super().__init__(None, plugins=host.plugins)  # type: ignore[arg-type]
        self.host = host
        #: the config the engine process loads (an instance's own device group with modelInstanceNumber > 1)
        self.config = config or host.config
        #: compute threads of the engine process (None: every core)
        self.threads = threads
        #: the engine process draws a loading bar on stderr (``mindie-host serve``)
        self.show_progress = show_progress
        #: told when this engine goes down (False) or is back (True); sets the host's readiness by default
        self.report_ready: Callable[[bool], None] = self._set_host_ready
        self.specs = plugin_specs(host.plugins)
        self.restarts = 0
        self.engine_stats: dict[str, float] = {}
        #: the metrics of the plugins that live in the engine process (a prefix cache's hit rate), from its last step
        self.engine_plugin_metrics: dict[str, float] = {}
        self.process: Any = None
        self._spawn = multiprocessing.get_context("spawn")
        self._zmq = zmq.Context()
        self._dir = tempfile.mkdtemp(prefix="mindie-engine-")
        self._push: zmq.Socket[bytes] | None = None
        self._pull: zmq.Socket[bytes] | None = None
        self._generation = 0
        self._up = False
        self._up_since = 0.0
        self._attempts = 0  # restarts in a row since the engine last ran healthy
        #: Why the engine is being restarted (shown by readiness), or None.
        self.restarting: str | None = None
        self._commands: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._command_ids = itertools.count(1)
        self._monitor: threading.Thread | None = None
        # runs before multiprocessing's own exit handler terminates the child: no restart at exit
        atexit.register(self._exiting)

    def _exiting(self) -> None:
        self._stopping = True

    # -- lifecycle ---------------------------------------------------------------------------
    def launch(self) -> ModelInfo:
        """Start an engine process and wait until its model is loaded; returns its :class:`ModelInfo`."""
        self._generation += 1
        base = os.path.join(self._dir, str(self._generation))
        push = self._zmq.socket(zmq.PUSH)
        pull = self._zmq.socket(zmq.PULL)
        push.bind(f"ipc://{base}-in")
        pull.bind(f"ipc://{base}-out")
        proc = self._spawn.Process(
            target=engine_core_main,
            name="mindie-engine-core",
            daemon=True,
            args=(
                self.config,
                self.specs,
                f"ipc://{base}-in",
                f"ipc://{base}-out",
                os.getpid(),
                self.threads,
                self.show_progress,
            ),
        )
        proc.start()
        try:
            info = self._wait_ready(proc, pull)
        except BaseException:
            push.close(linger=0)
            pull.close(linger=0)
            _reap(proc)
            raise
        with self._lock:
            old = (self._push, self._pull)
            self._push, self._pull, self.process = push, pull, proc
            self._up, self._up_since = True, time.monotonic()
        for sock in old:
            if sock is not None:
                sock.close(linger=0)
        log.info("engine process %d ready", proc.pid)
        return info

    def _wait_ready(self, proc: Any, pull: zmq.Socket[bytes]) -> ModelInfo:
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        poller.register(proc.sentinel, zmq.POLLIN)
        while True:
            events = dict(poller.poll(1000))
            if pull in events:
                frames = pull.recv_multipart()
                kind = frames[0].decode()
                if kind == ipc.READY:
                    info: ModelInfo
                    info, self.engine_stats = pickle.loads(frames[1])  # stats: /v1/config's block count at once
                    return info
                if kind == ipc.FAILED:
                    raise _start_failure(frames)
            elif proc.exitcode is not None:
                raise EngineStartError(f"the engine process died while loading ({exit_reason(proc.exitcode)})")
            if self._stopping:
                raise EngineStartError("stopped while the engine process was loading")

    def start(self) -> None:
        """Start the monitor thread (outputs and supervision)."""
        if self._monitor is None:
            self._monitor = threading.Thread(target=self._watch, name="mindie-engine-monitor", daemon=True)
            self._monitor.start()

    def run_here(self) -> None:
        """``mindie-host serve`` hands its main thread to the engine; here the engine has its own process.

        The main thread waits in short steps: Python runs a signal's handler on the main thread only, and a wait
        without end is cut short only by a signal the kernel hands to this thread. One that arrives while the
        process is frozen (SIGSTOP, a paused container) goes to whichever thread runs first when it thaws, and
        SIGTERM would then wait for nothing (the deployer's SIGKILL at the end of the grace period)."""
        self.start()
        while not self._stopped.wait(timeout=1.0):
            pass

    def stop(self) -> None:
        """Stop the engine process, end every request in flight, and release the sockets."""
        if self._stopping and self._stopped.is_set():
            return
        self._stopping = True
        with self._lock:
            self._up = False
            if self._push is not None:
                try:
                    self._push.send_multipart(ipc.encode(ipc.SHUTDOWN), flags=zmq.NOBLOCK)
                except zmq.ZMQError:  # no engine on the other end (it died): nothing to tell
                    pass
        if self.process is not None:
            _reap(self.process, STOP_SECONDS)
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=STOP_SECONDS)
        self._fail_all("The service has been stopped.")
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        previous, self.host.runtime.front_end_threads_before = self.host.runtime.front_end_threads_before, None
        if previous:
            import torch

            torch.set_num_threads(previous)
        atexit.unregister(self._exiting)
        self._stopped.set()

    def call(self, fn: Callable[[Any], Any]) -> None:
        """Not available: the engine object lives in another process."""
        raise RequestError(
            "this operation needs the engine in the server's process; set ServerConfig.engineProcess to false",
            status=501,
        )

    async def command(self, target: str, command: str, payload: Any = None) -> list[Any]:
        """Run plugin ``target``'s ``command`` in the engine process between steps; one answer (a list of one)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        ident = next(self._command_ids)
        with self._lock:
            if not (self._up and self._push is not None):
                raise RequestError("The engine is restarting; retry the request shortly.", status=503)
            self._commands[ident] = (loop, done)
            self._push.send_multipart(ipc.encode_blob(ipc.COMMAND, ident, (target, command, payload)))
        try:
            return [answer(await done)]
        finally:
            self._commands.pop(ident, None)

    # -- requests ----------------------------------------------------------------------------------
    def _post(self, item: tuple[str, Any]) -> None:
        kind, payload = item
        with self._lock:
            if self._up and self._push is not None:
                frames = ipc.encode_request(payload) if kind == "add" else ipc.encode(ipc.ABORT, payload)
                self._push.send_multipart(frames, copy=False)
                return
        if kind == "add":  # the engine is down or restarting: this request ends now, with an error
            restarting = RequestError("The engine is restarting; retry the request shortly.", status=503)
            self._dispatch([failed_output(payload, restarting)])

    # -- monitor thread ----------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stopping:
            proc, pull = self.process, self._pull
            assert pull is not None
            self._pump(proc, pull)
            if self._stopping:
                break
            self._recover(proc)
            if self.dead:
                break

    def _pump(self, proc: Any, pull: zmq.Socket[bytes]) -> None:
        """Dispatch outputs until the engine process exits (or the client stops)."""
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        poller.register(proc.sentinel, zmq.POLLIN)
        while not self._stopping:
            events = dict(poller.poll(200))
            if pull in events:
                self._receive(pull)
            if proc.exitcode is not None:
                self._receive(pull)  # what it sent before it died
                return

    def _receive(self, pull: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed by stop()
                return
            if frames[0] == _OUTPUTS:
                outputs = ipc.decode_outputs(frames[1])
                self.engine_stats = ipc.decode(frames[2])
                self.engine_plugin_metrics = ipc.decode(frames[3])
                if outputs:
                    self._dispatch(outputs)
            elif frames[0] == _RESULT:
                ident, result = ipc.decode_blob(frames)
                self._settle(ident, result)

    def _recover(self, proc: Any) -> None:
        """The engine process died: fail what it held, then restart it within the retry budget."""
        why = exit_reason(proc.exitcode)
        with self._lock:
            healthy = time.monotonic() - self._up_since >= HEALTHY_SECONDS
            self._up = False
        self.restarting = f"the engine process died: {why}"
        self.report_ready(False)  # readiness answers 503 from now on
        message = f"the engine process died ({why}); the request was not completed"
        log.error("engine process %d died (%s); ending %d requests in flight", proc.pid, why, self.num_active)
        self._fail_all(message)
        if self.host.draining:  # stopping anyway: no restart
            self.dead = f"the engine process died ({why}) while the service was stopping"
            return
        if healthy:
            self._attempts = 0
        cfg = self.config.server
        while not self._stopping:
            attempts = self._attempts
            if attempts >= cfg.engineRestartMaxRetries:
                self.dead = (
                    f"the engine process died ({why}) after {attempts} restarts in a row; "
                    f"engineRestartMaxRetries is {cfg.engineRestartMaxRetries}"
                )
                log.error("%s; liveness now fails", self.dead)
                self.restarting = None
                return
            self._attempts = attempts + 1
            delay = cfg.engineRestartBackoffSeconds * (2**attempts)
            log.warning(
                "restarting the engine process in %g s (restart %d of at most %d in a row; reason: %s)",
                delay,
                attempts + 1,
                cfg.engineRestartMaxRetries,
                why,
            )
            time.sleep(delay)
            if self._stopping:
                return
            self.restarts += 1
            try:
                self.launch()
            except Exception as exc:
                why = str(exc)
                log.error("engine restart failed: %s", exc)
                continue
            # plugins drop what they changed in the old engine at run time (its state is gone)
            self.host.plugins.call_observers("mindie_host_engine_restarted")
            self.restarting = None
            if not self.host.draining:
                self.report_ready(True)
            return

    def _set_host_ready(self, up: bool) -> None:
        self.host.ready = up

    @property
    def up(self) -> bool:
        """Whether the engine process is loaded and serving."""
        return self._up

    def _fail_all(self, message: str) -> None:
        outs = [
            RequestOutput(rid, [], "", "", [], 0, finished=True, finish_reason="error", error=message)
            for rid in list(self._queues)
        ]
        self._dispatch(outs)
        for ident in list(self._commands):  # commands in flight end too: none waits for ever
            self._settle(ident, CommandRefused(message, 503))

    def _settle(self, ident: int, result: Any) -> None:
        waiter = self._commands.pop(ident, None)
        if waiter is None:
            return
        settle(*waiter, result)


def _start_failure(frames: list[bytes]) -> BaseException:
    """The error a ``FAILED`` message reports: the engine's own exception when it crossed intact."""
    reason = EngineStartError(f"the engine process could not start: {ipc.decode(frames[1])}")
    if len(frames) > 2 and frames[2]:
        try:
            error = pickle.loads(frames[2])
        except Exception:
            return reason
        if isinstance(error, Exception):
            error.__cause__ = reason
            return error
    return reason


def _reap(proc: Any, timeout: float = 0.0) -> None:
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join(5)
