"""Choosing an instance for a request: round_robin, cache_affinity and load_balance.

* ``round_robin`` cycles over the eligible instances.
* ``load_balance`` takes the instance with the most free slots and blocks (the share of each
  that is free, from the servers' ``/v1/status`` as the controller pushes it, less what the
  coordinator sent since), ties broken by fewer requests in flight.
* ``cache_affinity`` sends an OpenAI multi-turn conversation back to the instance that served
  its earlier turns, so the server's prefix cache holds its history. A chat request is keyed by
  a hash of its model and messages: the request's own key (all its messages) is remembered
  with the instance chosen, and a later turn looks up its *history key*, the messages without
  the trailing user turn(s) and the assistant answer before them, which is the previous turn's
  own key. When the remembered instance is not eligible, or its free slots or blocks are under
  ``slots_thresh`` / ``block_thresh`` of its total, the request falls back to round robin. The
  table keeps the ``cache_size`` most recently used conversations. Every other request (other
  APIs, first turns) goes round robin, as the spec describes for single_node.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .instances import Instance

CHAT_PATH = "/v1/chat/completions"


@dataclass
class RequestInfo:
    """What routing and queueing know of a request."""

    path: str
    size: int
    own_key: str | None = None
    history_key: str | None = None
    est_tokens: int = 0


def _key(model: Any, messages: list[Any]) -> str:
    text = json.dumps([model, messages], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def conversation_keys(body: Any) -> tuple[str | None, str | None]:
    """(own key, history key) of an OpenAI chat body; (None, None) when it is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
        return None, None
    messages = body["messages"]
    model = body.get("model")
    end = len(messages)
    while end and isinstance(messages[end - 1], dict) and messages[end - 1].get("role") == "user":
        end -= 1
    while end and isinstance(messages[end - 1], dict) and messages[end - 1].get("role") == "assistant":
        end -= 1
    history = _key(model, messages[:end]) if end and end < len(messages) and any(
        isinstance(m, dict) and m.get("role") == "assistant" for m in messages[end:]) else None
    return _key(model, messages), history


class Router:
    """Picks an instance among the eligible ones for ``algorithm``."""

    def __init__(self, algorithm: str, cache_size: int = 100, slots_thresh: float = 0.05,
                 block_thresh: float = 0.05) -> None:
        self.algorithm = algorithm
        self.cache_size = cache_size
        self.slots_thresh = slots_thresh
        self.block_thresh = block_thresh
        self.affinity: OrderedDict[str, int] = OrderedDict()
        self._next = 0
        self.affinity_hits = 0
        self.affinity_fallbacks = 0

    def _round_robin(self, eligible: list[Instance]) -> Instance:
        ordered = sorted(eligible, key=lambda i: i.id)
        choice = ordered[self._next % len(ordered)]
        self._next += 1
        return choice

    @staticmethod
    def _load_balance(eligible: list[Instance]) -> Instance:
        return max(eligible, key=lambda i: (i.slots_ratio() + i.blocks_ratio(), -i.active, -i.id))

    def _has_room(self, inst: Instance) -> bool:
        return inst.slots_ratio() >= self.slots_thresh and inst.blocks_ratio() >= self.block_thresh

    def pick(self, eligible: list[Instance], info: RequestInfo) -> Instance:
        """The instance for ``info``; ``eligible`` is never empty."""
        if self.algorithm == "load_balance":
            return self._load_balance(eligible)
        if self.algorithm == "cache_affinity" and info.history_key is not None:
            remembered = self.affinity.get(info.history_key)
            if remembered is not None:
                self.affinity.move_to_end(info.history_key)
                for inst in eligible:
                    if inst.id == remembered and self._has_room(inst):
                        self.affinity_hits += 1
                        return inst
                self.affinity_fallbacks += 1
        return self._round_robin(eligible)

    def chosen(self, inst: Instance, info: RequestInfo) -> None:
        """Remember the instance a conversation turn went to."""
        if self.algorithm != "cache_affinity" or info.own_key is None:
            return
        self.affinity[info.own_key] = inst.id
        self.affinity.move_to_end(info.own_key)
        if info.history_key is not None:  # the older turn's entry is superseded by this one
            self.affinity.pop(info.history_key, None)
        while len(self.affinity) > self.cache_size:
            self.affinity.popitem(last=False)

    def forget(self, iid: int) -> None:
        """Drop the conversations of an instance that left."""
        for key in [k for k, v in self.affinity.items() if v == iid]:
            del self.affinity[key]
