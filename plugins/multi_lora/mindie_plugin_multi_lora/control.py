"""Where the adapter routes act: on the registry beside the model, or through the engine process.

With the engine in the server's process the registry (:mod:`.registry`) is right here:
:class:`LocalAdapters` acts on it directly. With ``ServerConfig.engineProcess`` the slot pools
and the registry live in the engine process, and the front end keeps an
:class:`AdapterCatalogue`: the adapter names that requests may select, each with the salt of
its load, and the requests refined for each that the engine may not have seen yet.
:class:`EngineAdapters` then loads, unloads and lists adapters with engine commands
(``host.engine_command("multi_lora", ...)``, answered by :func:`engine_command`), in every
engine instance.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mindie_host.api import RequestError

from .adapters import AdapterError, ModelDims, load_adapter
from .registry import STALE_UNSEEN_S, AdapterRegistry, UnloadableTable

NAME = "multi_lora"


@dataclass
class CatalogueEntry:
    """An adapter the front end lets requests select (the engine process holds its weights)."""

    name: str
    generation: int
    unloading: bool = False
    #: request id -> when it was refined; dropped at its first output (the engine has it then)
    unseen: dict[str, float] = field(default_factory=dict)
    slot: int = -1  # the engine binds the slot; the front end never knows it

    @property
    def salt(self) -> str:
        """Folded into the request's ``cache_salt``: a reloaded adapter of the same name gets a new one."""
        return f"{self.name}#{self.generation}"


class AdapterCatalogue(UnloadableTable):
    """The front end's adapter names, salts and not-yet-seen requests (``engineProcess``). Thread-safe."""

    def __init__(self, startup: list[str]) -> None:
        self.lock = threading.Lock()
        self.startup = list(startup)  # the names of lora_adapter.json and Plugins.multi_lora.adapters
        self.entries: dict[str, CatalogueEntry] = {}
        self._owner: dict[str, CatalogueEntry] = {}
        self._generation = 0
        self.reset()

    def reset(self) -> None:
        """Back to the startup adapters: a restarted engine process knows only those."""
        with self.lock:
            self.entries.clear()
            self._owner.clear()
            for name in self.startup:
                self._add(name)

    def _add(self, name: str) -> CatalogueEntry:
        self._generation += 1
        entry = self.entries[name] = CatalogueEntry(name, self._generation)
        return entry

    def add(self, name: str) -> CatalogueEntry:
        """Make a runtime-loaded adapter selectable; raises ``KeyError`` if the name is taken."""
        with self.lock:
            if name in self.entries:
                raise KeyError(name)
            return self._add(name)

    def track(self, request: Any, entry: CatalogueEntry) -> None:
        """A request refined for ``entry``: it counts as in flight here until the engine has it."""
        with self.lock:
            entry.unseen[request.request_id] = time.monotonic()
            self._owner[request.request_id] = entry

    def seen(self, request_ids: list[str]) -> None:
        """Outputs came back for these requests: the engine counts them from now on."""
        if not self._owner:
            return
        with self.lock:
            for rid in request_ids:
                entry = self._owner.pop(rid, None)
                if entry is not None:
                    entry.unseen.pop(rid, None)

    def finished(self, request_id: str) -> None:
        """Forget a request (as :meth:`AdapterRegistry.finished` does): the engine will never see it."""
        self.seen([request_id])

    def unseen(self, name: str) -> int:
        """Requests refined for ``name`` that may not have reached the engine yet."""
        with self.lock:
            entry = self.entries.get(name)
            if entry is None:
                return 0
            now = time.monotonic()
            for rid, refined in list(entry.unseen.items()):
                if now - refined > STALE_UNSEEN_S:  # never submitted, or long in the engine's queue
                    entry.unseen.pop(rid, None)
                    self._owner.pop(rid, None)
            return len(entry.unseen)

    def remove(self, name: str) -> None:
        with self.lock:
            entry = self.entries.pop(name, None)
            if entry is not None:
                for rid in entry.unseen:
                    self._owner.pop(rid, None)


class AdapterControl(Protocol):
    """What the management routes do, wherever the registry is."""

    async def describe(self) -> dict[str, Any]: ...

    async def load(self, name: str, path: Path) -> dict[str, Any]: ...

    async def unload(self, name: str, timeout: float) -> None: ...


def _busy(name: str, count: int, timeout: float) -> RequestError:
    return RequestError(f"LoRA adapter {name!r} still has {count} requests in flight after {timeout} s; "
                        "it stays loaded", status=409, field="lora_name")


def _taken(name: str) -> RequestError:
    return RequestError(f"LoRA adapter {name!r} is already loaded", status=409, field="lora_name")


class LocalAdapters:
    """The routes' actions on the registry in this process (the engine runs in the server's process)."""

    def __init__(self, registry: AdapterRegistry, dims: ModelDims) -> None:
        self.registry = registry
        self.dims = dims

    async def describe(self) -> dict[str, Any]:
        r = self.registry
        return {"adapters": r.describe(), "slots": r.runtime.slots, "max_rank": r.runtime.rank}

    async def load(self, name: str, path: Path) -> dict[str, Any]:
        if name in self.registry.entries:
            raise _taken(name)
        adapter = await asyncio.to_thread(_read, name, path, self.dims, self.registry.runtime.rank)
        try:
            self.registry.add(adapter)
        except KeyError:
            raise _taken(name) from None
        return {"rank": adapter.rank, "modules": adapter.modules}

    async def unload(self, name: str, timeout: float) -> None:
        registry = self.registry
        if registry.begin_unload(name) is None:
            raise RequestError(f"LoRA adapter {name!r} not found", status=404, field="lora_name")
        deadline = time.monotonic() + timeout
        while not registry.remove(name):
            if time.monotonic() > deadline:
                busy = registry.inflight(name)
                registry.cancel_unload(name)
                raise _busy(name, busy, timeout)
            await asyncio.sleep(0.02)


class EngineAdapters:
    """The routes' actions through engine commands (``engineProcess``), in every engine instance."""

    def __init__(self, host: Any, catalogue: AdapterCatalogue) -> None:
        self.host = host
        self.catalogue = catalogue

    async def describe(self) -> dict[str, Any]:
        answers = await self.host.engine_command(NAME, "describe")
        first = answers[0]  # every instance holds the same adapters; slot residency is per instance
        if len(answers) > 1:
            first = {**first, "instances": answers}
        return first

    async def load(self, name: str, path: Path) -> dict[str, Any]:
        if name in self.catalogue.entries:
            raise _taken(name)
        answers = await self.host.engine_command(NAME, "load", {"name": name, "path": str(path)})
        try:
            self.catalogue.add(name)
        except KeyError:
            raise _taken(name) from None
        return answers[0]

    async def unload(self, name: str, timeout: float) -> None:
        catalogue = self.catalogue
        if catalogue.begin_unload(name) is None:
            raise RequestError(f"LoRA adapter {name!r} not found", status=404, field="lora_name")
        deadline = time.monotonic() + timeout
        try:
            while True:
                busy = catalogue.unseen(name)
                if not busy:
                    answers = await self.host.engine_command(NAME, "remove", {"name": name})
                    if all(a["removed"] for a in answers):
                        catalogue.remove(name)
                        return
                    busy = max(a["inflight"] for a in answers)
                if time.monotonic() > deadline:
                    raise _busy(name, busy, timeout)
                await asyncio.sleep(0.02)
        except BaseException:
            if name in catalogue.entries:
                catalogue.cancel_unload(name)
                try:
                    await self.host.engine_command(NAME, "cancel_unload", {"name": name})
                except RequestError:
                    pass
            raise


def _read(name: str, path: Path | str, dims: ModelDims, max_rank: int) -> Any:
    try:
        return load_adapter(name, path, dims, max_rank)
    except AdapterError as exc:
        raise RequestError(str(exc), status=422, field="lora_path") from exc


def engine_command(registry: AdapterRegistry | None, dims: ModelDims, command: str, payload: Any) -> dict[str, Any]:
    """The engine's side of :class:`EngineAdapters` (the ``mindie_host_engine_command`` hook)."""
    if registry is None:
        raise RequestError("multi_lora is not running (model still loading or plugin not enabled)", status=503)
    name = payload.get("name") if isinstance(payload, dict) else None
    if command == "describe":
        return {"adapters": registry.describe(), "slots": registry.runtime.slots, "max_rank": registry.runtime.rank}
    if command == "load":
        path = str(payload["path"])
        known = registry.entries.get(name)
        if known is not None:  # idempotent for the same directory (an instance that kept it across a restart)
            if known.adapter.path != path or known.unloading:
                raise _taken(name)
            return {"rank": known.adapter.rank, "modules": known.adapter.modules}
        adapter = _read(name, path, dims, registry.runtime.rank)
        registry.add(adapter)
        return {"rank": adapter.rank, "modules": adapter.modules}
    if command == "remove":
        if name not in registry.entries:
            return {"removed": True, "inflight": 0}
        registry.begin_unload(name)
        removed = registry.remove(name)
        return {"removed": removed, "inflight": 0 if removed else registry.inflight(name)}
    if command == "cancel_unload":
        registry.cancel_unload(name)
        return {}
    raise RequestError(f"multi_lora has no engine command {command!r}", status=404)
