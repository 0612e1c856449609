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
"""

from __future__ import annotations

import base64
import hashlib
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from .kv_transfer import FAILED, RECEIVED, SEND_FAILED, SENT, KVConnector, TransferEvent
from .request import RequestOutput
from .sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from .core import LLMEngine

log = logging.getLogger("mindie_host.engine")

#: How long P holds a handed-off sequence's blocks for D to take them.
HOLD_SECONDS = 30.0
#: Status of a refused or failed transfer on D: the request may be recomputed (the front end reads it).
TRANSFER_FAILED_STATUS = 502


def prompt_digest(token_ids: list[int]) -> str:
    """A short digest of a prompt: P and D compare them before D uses P's blocks."""
    return hashlib.sha256(repr(token_ids).encode()).hexdigest()[:32]


class Handoff:
    """Sequences held for a D instance (P) and sequences waiting for their KV (D)."""

    def __init__(self, engine: LLMEngine, connector: KVConnector) -> None:
        self.engine = engine
        self.connector = connector
        #: P: request id -> (sequence, deadline); its blocks are still allocated
        self.held: OrderedDict[str, tuple[Sequence, float]] = OrderedDict()
        #: D: handle -> sequence whose KV is being pulled
        self.pulling: dict[str, Sequence] = {}
        #: D: sequences whose KV arrived, waiting for cache room, oldest first, with (tensors, meta)
        self.arrived: list[tuple[Sequence, list[torch.Tensor], dict[str, Any]]] = []

    def busy(self) -> bool:
        """Transfers in flight or blocks held: the engine loop keeps polling."""
        return bool(self.held or self.pulling or self.arrived)

    def waiting_sequences(self) -> list[Sequence]:
        return [*self.pulling.values(), *(seq for seq, _, _ in self.arrived)]

    # -- P ------------------------------------------------------------------------------------
    def export(self, seq: Sequence) -> None:
        """Take ``seq`` (its first token just appended) out of the batch and offer its prompt KV."""
        engine = self.engine
        blocks = engine.kv.block_table(seq)[: -(-seq.prompt_len // engine.kv.block_size)]
        gen = seq.generator.get_state() if seq.generator is not None else None
        meta = {
            "first_token": seq.token_ids[seq.prompt_len],
            "prompt_len": seq.prompt_len,
            "prompt_digest": prompt_digest(seq.token_ids[: seq.prompt_len]),
            "seed": seq.seed,
            "generator": base64.b64encode(gen.numpy().tobytes()).decode() if gen is not None else None,
        }
        self.connector.offer(seq.request_id, blocks, meta)
        engine._finish(seq, "handoff", free=False)
        self.held[seq.request_id] = (seq, time.monotonic() + HOLD_SECONDS)
        engine.counters["handoffs"] += 1

    def release(self, request_id: str, why: str) -> bool:
        """Free a held sequence's blocks; False when ``request_id`` is not held."""
        item = self.held.pop(request_id, None)
        if item is None:
            return False
        self.engine.kv.free(item[0])
        self.engine.stats_dirty = True
        self.connector.withdraw(request_id)
        if why != "sent":
            log.info("request %s: KV held for D released (%s)", request_id, why)
        return True

    # -- D ------------------------------------------------------------------------------------
    def start_import(self, seq: Sequence) -> None:
        """Park ``seq`` until its KV arrives."""
        spec = seq.request.kv_transfer
        assert spec is not None
        seq.status = SequenceStatus.TRANSFERRING
        self.pulling[spec.handle] = seq
        self.connector.pull(spec.handle, spec.source)

    def forget(self, seq: Sequence) -> None:
        """``seq`` ended while waiting for its KV (aborted, timed out): drop it (a late arrival is discarded)."""
        spec = seq.request.kv_transfer
        if spec is not None:
            self.pulling.pop(spec.handle, None)
        self.arrived = [item for item in self.arrived if item[0] is not seq]

    def admit(self, now: float) -> list[RequestOutput]:
        """Write arrived KV into fresh blocks, oldest first, while the cache and the batch have room."""
        engine = self.engine
        outputs = []
        while self.arrived and len(engine.running) < engine.scheduler_limits.max_batch_size:
            seq, tensors, meta = self.arrived[0]
            if engine.kv.blocks_needed(seq, seq.prompt_len + 1) > engine.kv.num_free_blocks():
                break
            self.arrived.pop(0)
            engine.kv.allocate(seq, seq.prompt_len)
            blocks = engine.kv.block_table(seq)[: tensors[0].shape[0]] if tensors else []
            try:
                engine.backend.import_blocks(blocks, tensors)
            except Exception as exc:
                outputs.append(engine._fail(seq, "writing the KV received from P", exc))
                continue
            seq.num_computed = seq.prompt_len
            engine.kv.on_computed(seq)
            if meta.get("seed") is not None:
                seq.seed = int(meta["seed"])
            if seq.generator is not None and meta.get("generator"):
                state = torch.frombuffer(bytearray(base64.b64decode(meta["generator"])), dtype=torch.uint8)
                seq.generator.set_state(state)
            seq.status = SequenceStatus.RUNNING
            engine.running.append(seq)
            seq.first_scheduled_time = now
            try:
                engine._append_token(seq, int(meta["first_token"]), None, now)
                outputs.append(engine._make_output(seq))
            except Exception as exc:
                outputs.append(engine._fail(seq, "stop handling or detokenisation", exc))
            engine.counters["imports"] += 1
        return outputs

    # -- both ---------------------------------------------------------------------------------
    def poll(self, now: float) -> list[RequestOutput]:
        """Apply what the connector finished, expire old holds, and admit arrived sequences."""
        outputs: list[RequestOutput] = []
        for event in self.connector.poll():
            outputs.extend(self._apply(event))
        for rid, (_seq, deadline) in list(self.held.items()):
            if now < deadline:
                break  # oldest first
            self.release(rid, f"D did not take it within {HOLD_SECONDS:g} s")
        outputs.extend(self.admit(now))
        return outputs

    def _apply(self, event: TransferEvent) -> list[RequestOutput]:
        if event.kind in (SENT, SEND_FAILED):
            if event.kind == SEND_FAILED:
                log.warning("request %s: the KV transfer to %s failed: %s", event.handle, event.peer, event.error)
            self.release(event.handle, "sent" if event.kind == SENT else "the transfer failed")
            return []
        seq = self.pulling.pop(event.handle, None)
        if seq is None or seq.status == SequenceStatus.FINISHED:
            return []
        if event.kind == RECEIVED:
            meta = event.meta or {}
            digest = prompt_digest(seq.token_ids[: seq.prompt_len])
            if meta.get("prompt_digest") != digest or meta.get("prompt_len") != seq.prompt_len:
                return [self._fail(seq, "P and D tokenized the prompt differently (check that both serve the same "
                                        "model and tokenizer)")]
            self.arrived.append((seq, event.tensors or [], meta))
            return []
        if event.kind == FAILED:
            return [self._fail(seq, f"the KV transfer from P ({event.peer}) failed: {event.error}")]
        log.error("unknown transfer event %r for %s", event.kind, event.handle)
        return []

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        log.warning("request %s: %s", seq.request_id, message)
        seq.error = message
        self.engine._finish(seq, "error")
        out = self.engine._make_output(seq)
        out.error_status = TRANSFER_FAILED_STATUS
        return out
