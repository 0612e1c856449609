"""The KV connector contract: how a P instance hands a prefilled sequence's KV blocks to a D instance.

PD disaggregation (``inferMode: "dmi"``, docs/scale-out.md) splits a request in two: a
prefill (P) instance computes the prompt and the first token, a decode (D) instance
continues from there. The KV blocks of the prompt move between them through a
:class:`KVConnector`, which the ``mindie_host_kv_connector`` hook provides, so RDMA, HCCL or
NIXL-style transports can be plugins. The host's own (:mod:`mindie_host.pd.tcp_connector`)
runs over TCP.

The engine (:mod:`.handoff`) drives a connector from its step loop and never blocks on it:

* on P, :meth:`KVConnector.offer` announces held blocks; the connector reads them with the
  ``read_blocks`` callable given to :meth:`~KVConnector.start` when a D asks, and reports
  :data:`SENT` once D has acknowledged a complete copy (or :data:`SEND_FAILED`); only then
  does the engine free them;
* on D, :meth:`KVConnector.pull` fetches in the background and reports :data:`RECEIVED` with
  the block contents, or :data:`FAILED`. A transfer is applied whole or not at all.

Both sides describe their cache with a :class:`KVLayout`; a connector compares them before any
byte of KV moves and refuses a pair that disagrees.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

#: P: D acknowledged a complete copy; the blocks may be freed
SENT = "sent"
#: P: the transfer failed or was refused; the blocks may be freed (the request is recomputed elsewhere)
SEND_FAILED = "send_failed"
#: D: every block arrived (``tensors`` and ``meta`` are set)
RECEIVED = "received"
#: D: the pull failed (``error`` says why); nothing was applied
FAILED = "failed"

#: ``read_blocks(block_ids)``: the contents of those blocks, one CPU tensor per cache tensor
BlockReader = Callable[[list[int]], list[torch.Tensor]]


@dataclass(frozen=True)
class KVLayout:
    """What a block of KV cache holds; P and D must agree on every field before a transfer."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    #: the shape of one block in each cache tensor, in order (K and V of every layer for the torch backend)
    block_shapes: list[list[int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def mismatch(self, other: dict[str, Any]) -> str | None:
        """Why ``other`` (a peer's layout as a dict) cannot exchange blocks with this one; None when it can."""
        mine = self.to_dict()
        diffs = [f"{k} {mine[k]!r} here, {other.get(k)!r} at the peer" for k in mine if other.get(k) != mine[k]]
        return "; ".join(diffs) or None


@dataclass
class TransferEvent:
    """A finished transfer, as :meth:`KVConnector.poll` reports it."""

    kind: str
    handle: str
    peer: str = ""
    tensors: list[torch.Tensor] | None = None
    meta: dict[str, Any] | None = None
    error: str = ""


class KVConnector(abc.ABC):
    """Moves KV blocks between a P and a D instance. Called from the engine thread; must not block it."""

    @abc.abstractmethod
    def start(self, layout: KVLayout, read_blocks: BlockReader) -> str:
        """Start serving; return the address a D instance pulls this instance's offers from."""

    @abc.abstractmethod
    def offer(self, handle: str, blocks: list[int], meta: dict[str, Any]) -> None:
        """P: ``blocks`` hold a sequence's prompt KV (in order) and stay untouched until :data:`SENT`,
        :data:`SEND_FAILED` or :meth:`withdraw`; ``meta`` (JSON values) travels with them."""

    @abc.abstractmethod
    def withdraw(self, handle: str) -> None:
        """P: the engine released ``handle`` (expired or aborted): refuse later pulls of it."""

    @abc.abstractmethod
    def pull(self, handle: str, source: str) -> None:
        """D: fetch what ``source`` offered as ``handle``, in the background."""

    @abc.abstractmethod
    def poll(self) -> list[TransferEvent]:
        """Transfers finished since the last call (never blocks)."""

    def linked_peers(self) -> list[str]:
        """D: the P addresses pulled from successfully, and not failed since (``/v1/status`` ``peers``)."""
        return []

    def close(self) -> None:  # noqa: B027 - optional
        """Stop serving and drop every transfer in flight."""
