"""Plugin commands that run where the engine lives (the ``mindie_host_engine_command`` hook).

A management route in the front end may need to change state that exists only beside the
model (a model variant's device slot, a pool). It calls ``await host.engine_command(target,
command, payload)``; the engine runs the hook between two steps (on its worker thread, or in
the engine process with ``engineProcess``) and the answer comes back. :func:`run_command` is
the engine's side in both modes; its result crosses the process boundary pickled, so a
refusal travels as a :class:`CommandRefused` value, never as an exception object.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .request import RequestError

if TYPE_CHECKING:
    from .hook_relay import HookRelay

log = logging.getLogger("mindie_host.engine")


@dataclass(frozen=True)
class CommandRefused:
    """A command that did not run or raised: what the caller's :class:`RequestError` will say."""

    message: str
    status: int
    field: str | None = None

    def error(self) -> RequestError:
        """The :class:`RequestError` the front end raises for it."""
        return RequestError(self.message, status=self.status, field=self.field)


def run_command(plugins: HookRelay | None, target: str, command: str, payload: Any) -> Any:
    """Run ``target``'s ``command`` on the engine's side: its answer, or a :class:`CommandRefused`."""
    if plugins is None:
        return CommandRefused("this engine runs no plugins", 404)
    try:
        result = plugins.hook.mindie_host_engine_command(target=target, command=command, payload=payload)
    except RequestError as exc:
        return CommandRefused(exc.message, exc.status, exc.field)
    except Exception:
        log.exception("plugin %s failed in its engine command %r", target, command)
        return CommandRefused(f"plugin {target}'s engine command {command!r} failed; the server log has the details",
                              500)
    if result is None:
        return CommandRefused(f"no enabled plugin {target!r} answers the engine command {command!r}", 404)
    return result


def answer(result: Any) -> Any:
    """The caller's side: ``result`` itself, or the :class:`RequestError` of a refusal raised."""
    if isinstance(result, CommandRefused):
        raise result.error()
    return result


def settle(loop: asyncio.AbstractEventLoop, done: asyncio.Future[Any], result: Any) -> None:
    """Hand ``result`` to the caller waiting on ``done``, from any thread (nothing if its loop has closed)."""
    try:
        loop.call_soon_threadsafe(_set_result, done, result)
    except RuntimeError:  # the caller's loop is closed
        pass


def _set_result(done: asyncio.Future[Any], result: Any) -> None:
    if not done.done():
        done.set_result(result)
