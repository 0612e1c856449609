"""The engine's side of PD disaggregation: holding KV for a D instance (P) and taking it in (D).

A request with :attr:`~.request.EngineRequest.kv_transfer` set is one half of a
disaggregated request (:mod:`.kv_transfer` has the contract):

* **export (P)**: the request is scheduled as any other; once its first token is sampled the
  sequence leaves the batch with finish reason ``"handoff"``, but its prompt blocks stay
  allocated and are offered to the connector. They are freed when the connector reports the
  copy taken (or failed), when the hold expires after :data:`HOLD_SECONDS`, or when the
  request id is aborted (the front end could not reach D, or the coordinator recomputes).
* **import (D)**: the sequence waits (status ``TRANSFERRING``) while the connector pulls. When
  the blocks arrive and the cache has room for them, they are written into fresh blocks, the
  first token is appended as if sampled here (with P's sampling seed and generator state),
  and the sequence joins the running batch at its first decode step. A failed pull ends the
  request with an error and nothing applied.

:class:`Handoff` only keeps the books of the transfers and talks to the connector: it answers
the engine's questions and reports what happened as events (:meth:`Handoff.poll`), and the
engine applies them to its own state: it frees blocks, ends requests, admits arrivals.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from .kv_transfer import FAILED, RECEIVED, SEND_FAILED, SENT, KVConnector, TransferEvent
from .sequence import Sequence, SequenceStatus

log = logging.getLogger("mindie_host.engine")

#: How long P holds a handed-off sequence's blocks for D to take them.
HOLD_SECONDS = 30.0
#: Status of a refused or failed transfer on D: the request may be recomputed (the front end reads it).
TRANSFER_FAILED_STATUS = 502


def prompt_digest(token_ids: list[int]) -> str:
    """A short digest of a prompt: P and D compare them before D uses P's blocks."""
    return hashlib.sha256(repr(token_ids).encode()).hexdigest()[:32]


@dataclass
class HoldEnded:
    """P: a held sequence's blocks may be freed (D took the copy, the transfer failed, or the hold ended)."""

    seq: Sequence


@dataclass
class PullFailed:
    """D: the KV of ``seq`` will not come (the transfer failed, or P's prompt differs): end it with ``message``."""

    seq: Sequence
    message: str


#: what :meth:`Handoff.poll` reports
HandoffEvent = HoldEnded | PullFailed


@dataclass
class Arrival:
    """D: the prompt KV of ``seq`` arrived from P, with the first token P sampled and P's sampling state."""

    seq: Sequence
    #: the blocks' contents, one CPU tensor per cache tensor (blocks along the first dimension)
    tensors: list[torch.Tensor]
    first_token: int
    seed: int | None
    #: P's generator state after the first token (``torch.Generator.get_state``), when P sampled
    generator_state: torch.Tensor | None

    @property
    def num_blocks(self) -> int:
        """How many blocks the tensors hold."""
        return self.tensors[0].shape[0] if self.tensors else 0

    def restore_sampling(self) -> None:
        """Give ``seq`` P's seed and generator state, so D samples what P would have sampled next."""
        if self.seed is not None:
            self.seq.seed = self.seed
        if self.seq.generator is not None and self.generator_state is not None:
            self.seq.generator.set_state(self.generator_state)


class Handoff:
    """The books of PD transfers: sequences whose blocks are held for a D instance (P), and sequences
    waiting for their KV (D). Drives the KV connector; changes no engine state (:meth:`poll` says what to do)."""

    def __init__(self, connector: KVConnector) -> None:
        self.connector = connector
        #: P: request id -> (sequence, deadline); its blocks are still allocated
        self.held: OrderedDict[str, tuple[Sequence, float]] = OrderedDict()
        #: D: handle -> sequence whose KV is being pulled
        self.pulling: dict[str, Sequence] = {}
        #: D: arrived KV waiting for cache room, oldest first
        self.arrived: list[Arrival] = []

    def busy(self) -> bool:
        """Transfers in flight or blocks held: the engine loop keeps polling."""
        return bool(self.held or self.pulling or self.arrived)

    def waiting_sequences(self) -> list[Sequence]:
        """D: the sequences waiting for their KV, pulled or arrived."""
        return [*self.pulling.values(), *(arrival.seq for arrival in self.arrived)]

    # -- P ------------------------------------------------------------------------------------
    def export(self, seq: Sequence, block_table: list[int], block_size: int) -> None:
        """Offer the prompt KV of ``seq`` (its first token just appended; ``block_table`` its blocks) and
        hold it. The engine ends ``seq`` keeping its blocks; :class:`HoldEnded` says when to free them."""
        blocks = block_table[: -(-seq.prompt_len // block_size)]
        gen = seq.generator.get_state() if seq.generator is not None else None
        meta = {
            "first_token": seq.token_ids[seq.prompt_len],
            "prompt_len": seq.prompt_len,
            "prompt_digest": prompt_digest(seq.token_ids[: seq.prompt_len]),
            "seed": seq.seed,
            "generator": base64.b64encode(gen.numpy().tobytes()).decode() if gen is not None else None,
        }
        self.connector.offer(seq.request_id, blocks, meta)
        self.held[seq.request_id] = (seq, time.monotonic() + HOLD_SECONDS)

    def release(self, request_id: str, why: str) -> Sequence | None:
        """Stop holding ``request_id``'s blocks; returns its sequence, whose blocks the engine frees
        (None when ``request_id`` is not held)."""
        item = self.held.pop(request_id, None)
        if item is None:
            return None
        self.connector.withdraw(request_id)
        if why != "sent":
            log.info("request %s: KV held for D released (%s)", request_id, why)
        return item[0]

    # -- D ------------------------------------------------------------------------------------
    def start_import(self, seq: Sequence) -> None:
        """Pull the KV of ``seq`` (transferring) from where its request says."""
        spec = seq.request.kv_transfer
        assert spec is not None
        self.pulling[spec.handle] = seq
        self.connector.pull(spec.handle, spec.source)

    def forget(self, seq: Sequence) -> None:
        """``seq`` ended while waiting for its KV (aborted, timed out): drop it (a late arrival is discarded)."""
        spec = seq.request.kv_transfer
        if spec is not None:
            self.pulling.pop(spec.handle, None)
        self.arrived = [arrival for arrival in self.arrived if arrival.seq is not seq]

    def oldest_arrival(self) -> Arrival | None:
        """The arrival waiting longest for cache room, if any (it stays queued until :meth:`take_arrival`)."""
        return self.arrived[0] if self.arrived else None

    def take_arrival(self) -> Arrival:
        """Dequeue the :meth:`oldest_arrival`: the engine is writing it into its cache."""
        return self.arrived.pop(0)

    # -- both ---------------------------------------------------------------------------------
    def poll(self, now: float) -> list[HandoffEvent]:
        """Take in what the connector finished and end holds past their deadline; returns what the engine
        must apply, in order. Arrived KV waits in :meth:`oldest_arrival` until the engine has room."""
        events: list[HandoffEvent] = []
        for event in self.connector.poll():
            events.extend(self._take(event))
        for rid, (_seq, deadline) in list(self.held.items()):
            if now < deadline:
                break  # oldest first
            seq = self.release(rid, f"D did not take it within {HOLD_SECONDS:g} s")
            if seq is not None:
                events.append(HoldEnded(seq))
        return events

    def _take(self, event: TransferEvent) -> list[HandoffEvent]:
        if event.kind in (SENT, SEND_FAILED):
            if event.kind == SEND_FAILED:
                log.warning("request %s: the KV transfer to %s failed: %s", event.handle, event.peer, event.error)
            held = self.release(event.handle, "sent" if event.kind == SENT else "the transfer failed")
            return [HoldEnded(held)] if held is not None else []
        seq = self.pulling.pop(event.handle, None)
        if seq is None or seq.status == SequenceStatus.FINISHED:
            return []
        if event.kind == RECEIVED:
            meta = event.meta or {}
            digest = prompt_digest(seq.token_ids[: seq.prompt_len])
            if meta.get("prompt_digest") != digest or meta.get("prompt_len") != seq.prompt_len:
                return [
                    PullFailed(
                        seq,
                        "P and D tokenized the prompt differently (check that both serve the same model and tokenizer)",
                    )
                ]
            try:
                self.arrived.append(_arrival(seq, event.tensors or [], meta))
            except (KeyError, TypeError, ValueError) as exc:
                return [PullFailed(seq, f"P sent KV with unreadable meta ({type(exc).__name__}: {exc})")]
            return []
        if event.kind == FAILED:
            return [PullFailed(seq, f"the KV transfer from P ({event.peer}) failed: {event.error}")]
        log.error("unknown transfer event %r for %s", event.kind, event.handle)
        return []


def _arrival(seq: Sequence, tensors: list[torch.Tensor], meta: dict[str, Any]) -> Arrival:
    """An :class:`Arrival` from the meta P sent with the blocks."""
    state = None
    if meta.get("generator"):
        state = torch.frombuffer(bytearray(base64.b64decode(meta["generator"])), dtype=torch.uint8)
    seed = meta.get("seed")
    return Arrival(seq, tensors, int(meta["first_token"]), int(seed) if seed is not None else None, state)
