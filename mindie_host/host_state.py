"""What a running host keeps besides its model: the server's machinery, and values its modules make once.

:class:`ServerRuntime` is the server's own machinery (set by ``server/runner.py`` and the engine
launcher). :class:`HostCaches` holds what a module computes or builds once per host, on first use:
each module declares its own typed :class:`CacheSlot` beside the code that fills it, so this module
names none of its users. Plugins keep their own state in ``ctx.state`` (:mod:`mindie_host.context`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")


@dataclass
class ServerRuntime:
    """The running server's event loop, stop signals and pools."""

    #: the event loop serving HTTP (server/runner.py)
    loop: asyncio.AbstractEventLoop | None = None
    #: set to stop gracefully (SIGTERM, /stopService), and to stop at once (a second signal)
    stop_event: asyncio.Event | None = None
    force_stop_event: asyncio.Event | None = None
    #: why the model failed to load while the listeners were already up
    load_error: BaseException | None = None
    #: ``tokenizerProcessNumber`` threads for tokenising and decoding tensors (server/app.py)
    request_pool: ThreadPoolExecutor | None = None
    #: the torch thread count before the engine process took the cores (the engine launcher)
    front_end_threads_before: int | None = None
    #: tasks the server started that no request awaits (D's replays); kept referenced until they end
    background: set[Any] = field(default_factory=set)


@dataclass(frozen=True, eq=False)
class CacheSlot(Generic[T]):
    """One value of type ``T`` a host holds for the module that declares the slot.

    ``VOCAB: CacheSlot[Vocab] = CacheSlot("the builtin grammar engine's vocabulary")`` in the
    module that builds it; ``host.caches.get(VOCAB)`` then reads it, typed. Slots compare by
    identity: two modules never share one by accident.
    """

    #: what the value is, for reprs and errors
    what: str


class HostCaches:
    """Values computed or built once per host on first use, each in its declaring module's slot."""

    def __init__(self) -> None:
        self._values: dict[CacheSlot[Any], Any] = {}
        self._making: dict[CacheSlot[Any], threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, slot: CacheSlot[T]) -> T | None:
        """The value in ``slot``, or ``None`` while nothing has filled it."""
        return cast("T | None", self._values.get(slot))

    def put(self, slot: CacheSlot[T], value: T | None) -> None:
        """Fill ``slot`` with ``value`` (``None`` empties it)."""
        if value is None:
            self._values.pop(slot, None)
        else:
            self._values[slot] = value

    def get_or_make(self, slot: CacheSlot[T], make: Callable[[], T]) -> T:
        """The value in ``slot``; the first caller makes it with ``make()``, once (other slots never wait on it)."""
        value = self._values.get(slot)
        if value is None:
            with self._lock:
                making = self._making.setdefault(slot, threading.Lock())
            with making:
                value = self._values.get(slot)
                if value is None:
                    value = self._values[slot] = make()
        return cast("T", value)

    def __repr__(self) -> str:
        return f"HostCaches({', '.join(slot.what for slot in self._values)})"
