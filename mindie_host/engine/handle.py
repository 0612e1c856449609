"""The engine handle the protocol modules hold as ``host.engine``, whichever way the engine runs.

In one process it is an :class:`~mindie_host.engine.async_engine.AsyncEngine` (the engine steps on a
worker thread or the main thread); with ``ServerConfig.engineProcess`` it is the front end's client of
the engine process, and with ``modelInstanceNumber`` > 1 a balancer over several of those. All three
have this shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from .request import EngineRequest, RequestOutput


class EngineStartError(RuntimeError):
    """The engine could not start: its process could not load the model, died while loading, or a plugin
    it needs could not be sent to it."""


class EngineHandle(Protocol):
    """Submit, stream, cancel; run plugin commands beside the model; start and stop."""

    #: why the engine can no longer serve (liveness fails), or None
    dead: str | None

    @property
    def num_active(self) -> int:
        """Requests submitted and not yet finished."""
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit ``request`` and yield its outputs until it finishes (leaving early aborts it)."""
        ...

    def abort(self, request_id: str) -> bool:
        """Cancel a request in flight; False if it is unknown."""
        ...

    def abort_all(self) -> int:
        """Cancel every request in flight (each ends with finish reason ``abort``); how many there were."""
        ...

    def release(self, request_id: str) -> None:
        """Abort ``request_id`` in the engine even when no stream waits on it (PD: blocks held for a D instance)."""
        ...

    async def command(self, target: str, command: str, payload: Any = None) -> list[Any]:
        """Run plugin ``target``'s ``mindie_host_engine_command`` beside the model: one answer per engine."""
        ...

    def call(self, fn: Callable[[Any], Any]) -> None:
        """Run ``fn(engine)`` between steps where the engine object lives (refused across processes)."""
        ...

    def start(self) -> None:
        """Start stepping (a worker thread, or the engine process's monitor)."""
        ...

    def run_here(self) -> None:
        """Step on the calling thread until :meth:`stop` (``mindie-host serve``'s main thread)."""
        ...

    def stop(self) -> None:
        """End every request in flight and stop."""
        ...
