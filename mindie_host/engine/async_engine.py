"""asyncio facade over :class:`LLMEngine`: submit, stream, cancel.

The engine steps on a dedicated worker thread, so HTTP handling on the event loop
never stalls decoding (torch releases the GIL inside its kernels). Requests and
aborts cross into the worker through a lock-protected inbox; outputs come back
with one ``call_soon_threadsafe`` per step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from .commands import CommandRefused, answer, run_command, settle
from .core import LLMEngine
from .request import EngineRequest, RequestError, RequestOutput, failed_output

if TYPE_CHECKING:
    from .hook_relay import HookRelay

log = logging.getLogger("mindie_host.engine")


class AsyncEngine:
    """Runs an :class:`LLMEngine` on a worker thread and streams outputs to coroutines."""

    def __init__(self, engine: LLMEngine, plugins: HookRelay | None = None) -> None:
        self.engine = engine
        #: the plugins (``mindie_host_step_outputs`` sees every step's outputs); None runs no hook
        self.plugins = plugins
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[tuple[str, Any]] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stopped = threading.Event()
        self._loop_started = False  # set once _run begins, on whichever thread runs it
        self.dead: str | None = None
        self.step_failures = 0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mindie-engine", daemon=True)
            self._thread.start()

    def run_here(self) -> None:
        """Step the engine on the calling thread until :meth:`stop` (instead of :meth:`start`).

        ``mindie-host serve`` runs the engine on the process's main thread: that is
        OpenMP's initial thread, where MKL's kernels run measurably faster than on a
        second thread (bench/PERF.md); HTTP then runs on a helper thread.
        """
        self._run()

    def stop(self) -> None:
        """Abort everything and stop the worker."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        elif self._loop_started:
            self._stopped.wait(timeout=30)  # run_here() on another thread: wait for its loop to end

    @property
    def num_active(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._queues)

    # -- requests -------------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit ``request`` and yield its outputs until it finishes.

        Leaving the iterator early (a client disconnect cancels the task) aborts
        the request and frees its KV blocks.
        """
        if self.dead:
            raise RequestError(f"engine is not running: {self.dead}", status=503)
        if self._stopping:
            raise RequestError("The service has been stopped.", status=503)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid = request.request_id
        if rid in self._queues:
            raise RequestError(f"request id {rid!r} is already in use", status=422, field="id")
        self._queues[rid] = (loop, queue)
        self._post(("add", request))
        finished = False
        try:
            while True:
                out = await queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self._post(("abort", rid))

    def abort(self, request_id: str) -> bool:
        """Cancel a running request; returns False if it is unknown."""
        if request_id not in self._queues:
            return False
        self._post(("abort", request_id))
        return True

    def release(self, request_id: str) -> None:
        """Abort ``request_id`` in the engine even when no stream waits on it here (PD: free the blocks a
        P instance holds for a D instance that will not take them)."""
        self._post(("abort", request_id))

    def abort_all(self) -> int:
        """Cancel every request in flight; each ends with finish reason ``abort`` (a clean final event)."""
        ids = list(self._queues)
        for rid in ids:
            self._post(("abort", rid))
        return len(ids)

    def call(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run ``fn(engine)`` on the worker thread between steps (for plugins and management)."""
        self._post(("call", fn))

    async def command(self, target: str, command: str, payload: Any = None) -> list[Any]:
        """Run plugin ``target``'s ``command`` on the engine thread between steps (``mindie_host_engine_command``).

        Returns one answer per engine (here: one); a refusal raises its :class:`RequestError`.
        """
        if self.dead:
            raise RequestError(f"engine is not running: {self.dead}", status=503)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        self._post(("command", (target, command, payload, loop, done)))
        return [answer(await done)]

    def _post(self, item: tuple[str, Any]) -> None:
        with self._lock:
            self._inbox.append(item)
        self._wake.set()

    # -- worker ----------------------------------------------------------------------------------
    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            items, self._inbox = self._inbox, []
        outputs: list[RequestOutput] = []
        for kind, payload in items:
            if kind == "add":
                try:
                    self.engine.add_request(payload)
                except Exception as exc:
                    outputs.append(failed_output(payload, exc))
            elif kind == "abort":
                out = self.engine.abort(payload)
                if out is not None:
                    outputs.append(out)
            elif kind == "call":
                try:
                    payload(self.engine)
                except Exception:
                    log.exception("engine call failed")
            elif kind == "command":
                target, command, args, loop, done = payload
                settle(loop, done, run_command(self.plugins, target, command, args))
        return outputs

    def _run(self) -> None:
        engine = self.engine
        self._loop_started = True
        try:
            while not self._stopping:
                outputs = self._drain_inbox()
                if engine.has_work():
                    outputs.extend(self._step())
                elif not outputs:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                if outputs:
                    self._dispatch(outputs)
        except Exception:  # pragma: no cover - a bug in the engine itself
            log.exception("engine loop died")
            self.dead = "the engine loop stopped after an internal error; see the server log"
            self._fail_all(self.dead)
        finally:
            if self._stopping:
                self._fail_all("The service has been stopped.")
            self._refuse_commands(self.dead or "The service has been stopped.")
            self._stopped.set()

    def _refuse_commands(self, message: str) -> None:
        """Answer the commands still queued once the worker has stopped, so no caller waits for ever."""
        with self._lock:
            commands = [payload for kind, payload in self._inbox if kind == "command"]
            self._inbox = [item for item in self._inbox if item[0] != "command"]
        for _target, _command, _args, loop, done in commands:
            settle(loop, done, CommandRefused(message, 503))

    def _step(self) -> list[RequestOutput]:
        """One engine step; if it raises, only the sequences it was serving fail and the loop goes on."""
        try:
            return self.engine.step()
        except Exception:
            log.exception("engine step failed; ending the requests it was serving")
            self.step_failures += 1
            return self.engine.fail_active(
                "generation failed in an engine step; the server log has the details"
            )

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        if self.plugins is not None:
            self.plugins.call_observers("mindie_host_step_outputs", outputs=outputs)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]] = {}
        for out in outputs:
            target = self._queues.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # loop closed
                pass

    def _fail_all(self, message: str) -> None:
        for rid in list(self._queues):
            try:
                self.engine.abort(rid)
            except Exception:
                pass
        outs = [
            RequestOutput(rid, [], "", "", [], 0, finished=True, finish_reason="error", error=message)
            for rid in list(self._queues)
        ]
        self._dispatch(outs)


def _deliver(items: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)

