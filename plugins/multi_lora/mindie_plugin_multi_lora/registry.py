"""Which adapters are known, which sit in a slot, and which requests use them.

All adapters named in ``lora_adapter.json`` (or loaded at runtime) are *known*
and kept in host memory; at most ``maxLoras`` are *resident* in the device
pools. A request is bound to its adapter's slot when the engine considers it for
admission (``mindie_host_filter_waiting``); a non-resident adapter is copied into
a free slot then, or into the least recently used slot that no live request is
bound to. A request waits (held back from the planner) while every slot is
pinned by live requests of other adapters. The binding is released when the
request leaves the engine (``mindie_host_request_finished``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .adapters import LoraAdapter
from .runtime import LoraRuntime

#: A refined request the engine has not seen after this long never reached it
#: (its protocol module failed it before submitting); it no longer counts as in flight.
STALE_UNSEEN_S = 10.0


@dataclass
class AdapterEntry:
    """A known adapter and its live state."""

    adapter: LoraAdapter
    generation: int
    slot: int = -1
    pins: int = 0
    last_used: float = 0.0
    unloading: bool = False
    inflight: dict[str, float] = field(default_factory=dict)  # request id -> time refined

    @property
    def salt(self) -> str:
        """Folded into the request's ``cache_salt``: a reloaded adapter of the same name gets a new one."""
        return f"{self.adapter.name}#{self.generation}"


@dataclass
class _Tracked:
    name: str
    request: Any  # EngineRequest
    refined_at: float
    seen: bool = False
    bound: bool = False


class UnloadableTable:
    """Named entries with an ``unloading`` flag, behind ``self.lock``: what the registry and the catalogue share."""

    lock: Any
    entries: dict[str, Any]

    def get(self, name: str) -> Any:
        """The entry of a known adapter that accepts new requests, else None."""
        with self.lock:
            entry = self.entries.get(name)
            return None if entry is None or entry.unloading else entry

    def begin_unload(self, name: str) -> Any:
        """Stop accepting requests for ``name``; returns its entry (None if unknown or already unloading)."""
        with self.lock:
            entry = self.entries.get(name)
            if entry is None or entry.unloading:
                return None
            entry.unloading = True
            return entry

    def cancel_unload(self, name: str) -> None:
        """Accept requests for ``name`` again (an unload that timed out)."""
        with self.lock:
            entry = self.entries.get(name)
            if entry is not None:
                entry.unloading = False


class AdapterRegistry(UnloadableTable):
    """Known adapters, slot residency (LRU over unpinned slots) and per-request bindings. Thread-safe."""

    def __init__(self, runtime: LoraRuntime) -> None:
        self.runtime = runtime
        self.served: dict[str, int] = {}  # name -> slot (-1 = not resident)
        self.lock = threading.RLock()
        self.entries: dict[str, AdapterEntry] = {}
        self.slot_owner: list[str | None] = [None] * runtime.slots
        self.tracked: dict[str, _Tracked] = {}
        self._generation = 0
        self.counters = {"slot_loads": 0, "slot_evictions": 0, "adapter_loads": 0, "adapter_unloads": 0}

    # -- catalogue -----------------------------------------------------------------------
    def add(self, adapter: LoraAdapter) -> AdapterEntry:
        """Make ``adapter`` known; raises ``KeyError`` if the name is taken."""
        with self.lock:
            if adapter.name in self.entries:
                raise KeyError(adapter.name)
            self._generation += 1
            entry = AdapterEntry(adapter, self._generation)
            self.entries[adapter.name] = entry
            self.served[adapter.name] = -1
            self.counters["adapter_loads"] += 1
            return entry

    def preload(self) -> None:
        """Fill empty slots with known adapters (startup, before the engine runs)."""
        with self.lock:
            for entry in self.entries.values():
                if entry.slot < 0:
                    slot = self._free_slot(evict=False)
                    if slot is None:
                        return
                    self._place(entry, slot)

    def inflight(self, name: str) -> int:
        """Requests on ``name`` that have not finished (stale never-submitted ones are dropped)."""
        with self.lock:
            entry = self.entries.get(name)
            if entry is None:
                return 0
            now = time.monotonic()
            for rid in list(entry.inflight):
                t = self.tracked.get(rid)
                if t is None or (not t.seen and now - t.refined_at > STALE_UNSEEN_S):
                    entry.inflight.pop(rid, None)
                    self.tracked.pop(rid, None)
            return len(entry.inflight)

    def remove(self, name: str) -> bool:
        """Forget ``name`` if nothing is in flight on it; frees its slot."""
        with self.lock:
            entry = self.entries.get(name)
            if entry is None or self.inflight(name) or entry.pins:
                return False
            if entry.slot >= 0:
                self.slot_owner[entry.slot] = None
            del self.entries[name]
            self.served.pop(name, None)
            self.counters["adapter_unloads"] += 1
            return True

    # -- requests ----------------------------------------------------------------------------
    def track(self, request: Any, entry: AdapterEntry) -> None:
        """Remember a refined request on ``entry`` (counts as in flight from now)."""
        now = time.monotonic()
        with self.lock:
            self.tracked[request.request_id] = _Tracked(entry.adapter.name, request, now)
            entry.inflight[request.request_id] = now
            if len(self.tracked) > 4096:
                self._prune(now)

    def owns(self, request_id: str) -> bool:
        return request_id in self.tracked

    def bind(self, request_id: str) -> bool:
        """Engine thread: make sure the request's adapter is resident and pinned; False = hold it back."""
        with self.lock:
            t = self.tracked.get(request_id)
            if t is None:
                return True
            t.seen = True
            entry = self.entries.get(t.name)
            if entry is None:  # cannot happen: unload waits for in-flight requests
                return False
            entry.last_used = time.monotonic()
            if t.bound:
                return True
            if entry.slot < 0:
                slot = self._free_slot(evict=True)
                if slot is None:
                    return False
                self._place(entry, slot)
            entry.pins += 1
            t.bound = True
            t.request.variant = entry.slot
            return True

    def finished(self, request_id: str) -> None:
        """Engine thread: release the request's binding."""
        with self.lock:
            t = self.tracked.pop(request_id, None)
            if t is None:
                return
            entry = self.entries.get(t.name)
            if entry is None:
                return
            entry.inflight.pop(request_id, None)
            if t.bound:
                entry.pins -= 1
                entry.last_used = time.monotonic()

    # -- slots ----------------------------------------------------------------------------------
    def _free_slot(self, *, evict: bool) -> int | None:
        for slot, owner in enumerate(self.slot_owner):
            if owner is None:
                return slot
        if not evict:
            return None
        idle = [self.entries[o] for o in self.slot_owner if o is not None and self.entries[o].pins == 0]
        if not idle:
            return None
        victim = min(idle, key=lambda e: e.last_used)
        slot = victim.slot
        victim.slot = -1
        self.served[victim.adapter.name] = -1
        self.slot_owner[slot] = None
        self.counters["slot_evictions"] += 1
        return slot

    def _place(self, entry: AdapterEntry, slot: int) -> None:
        self.runtime.write_slot(slot, entry.adapter)
        entry.slot = slot
        self.slot_owner[slot] = entry.adapter.name
        self.served[entry.adapter.name] = slot
        self.counters["slot_loads"] += 1

    def _prune(self, now: float) -> None:
        for rid, t in list(self.tracked.items()):
            if not t.seen and now - t.refined_at > 600.0:
                self.tracked.pop(rid, None)
                entry = self.entries.get(t.name)
                if entry is not None:
                    entry.inflight.pop(rid, None)

    # -- reporting ------------------------------------------------------------------------------
    def waiting_for_slot(self) -> int:
        with self.lock:
            return sum(1 for t in self.tracked.values() if t.seen and not t.bound)

    def describe(self) -> list[dict[str, Any]]:
        """One record per known adapter (for ``GET /v1/lora_adapters``)."""
        with self.lock:
            return [
                {
                    "name": name,
                    "path": e.adapter.path,
                    "rank": e.adapter.rank,
                    "alpha": e.adapter.alpha,
                    "modules": e.adapter.modules,
                    "slot": e.slot,
                    "resident": e.slot >= 0,
                    "requests_in_flight": len(e.inflight),
                    "unloading": e.unloading,
                }
                for name, e in self.entries.items()
            ]

    def metrics(self) -> dict[str, float]:
        with self.lock:
            out = {
                "lora_adapters_known": float(len(self.entries)),
                "lora_adapters_resident": float(sum(1 for o in self.slot_owner if o is not None)),
                "lora_slots_total": float(len(self.slot_owner)),
                "lora_requests_waiting_for_slot": float(self.waiting_for_slot()),
                "lora_max_adapters_per_step": float(self.runtime.max_slots_in_step),
                "lora_max_kinds_per_step": float(self.runtime.max_kinds_in_step),
                "lora_steps": float(self.runtime.steps),
            }
            out.update({f"lora_{k}": float(v) for k, v in self.counters.items()})
            return out
