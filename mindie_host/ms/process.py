"""What the coordinator and the controller share as processes: start-up logging and stop signals."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from .logs import setup_ms_logging


def stop_on_signals(stop: asyncio.Event) -> None:
    """Set ``stop`` on SIGTERM or SIGINT.

    Only the main thread may install signal handlers; a component served from another thread (the tests,
    ``mindie-host cluster`` in-process) is stopped through ``stop`` instead, so refusal is not an error.
    """
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread: ``stop`` is the way
            pass


def run_component(name: str, config: Any, serve: Callable[[Any], Coroutine[Any, Any, None]]) -> None:
    """``mindie-host <name>``: set up logging from ``config.log``, log the config's warnings, and serve."""
    setup_ms_logging(config.log, name)
    log = logging.getLogger(f"mindie_host.ms.{name}")
    for warning in config.warnings:
        log.warning("ms_%s.json: %s", name, warning)
    asyncio.run(serve(config))
