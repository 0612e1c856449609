"""The engine loop: schedule -> build the input -> backend.execute -> sample -> emit.

:class:`LLMEngine` is synchronous and single-threaded; :mod:`.async_engine` runs it on a
worker thread. Each step the :class:`~.scheduler.Scheduler` plans what runs (the policy hooks
decide, the KV-cache manager holds the blocks), this module flattens the plan into the
backend's :class:`~mindie_host.backends.base.ModelInput` (:mod:`.step_input`), runs the forward pass and samples,
and the :class:`~.outputs.OutputProcessor` appends the tokens, applies the stop rules and
builds the outputs. With a KV connector, the :class:`~.handoff.Handoff` reports transfers as
events that the loop applies before scheduling.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Sequence as Tokens
from dataclasses import dataclass
from typing import Any

import torch

from ..backends.base import ModelBackend, ModelInfo
from .handoff import TRANSFER_FAILED_STATUS, Handoff, HoldEnded
from .kv_cache import KVCacheManager
from .kv_transfer import KVConnector
from .outputs import OutputProcessor
from .policy import SchedulerLimits, StepPlan
from .request import EngineRequest, RequestError, RequestOutput, TokenLogprob
from .sampling import Sampler, make_generator
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus
from .speculation import DraftOutcome, Drafts, Speculator
from .step_input import build_step_input
from .swap import SwapSpace

log = logging.getLogger("mindie_host.engine")


@dataclass
class EngineLimits:
    """Per-request length limits (from ``ModelDeployConfig`` / ``ScheduleConfig``)."""

    max_seq_len: int
    max_iter_times: int


class LLMEngine:
    """Continuous batching over a paged KV cache: the request lifecycle and the step loop.

    :ivar scheduler: the queues, admission, preemption and swap (:class:`~.scheduler.Scheduler`).
    :ivar outputs: token appending, stop rules, detokenization, outputs (:class:`~.outputs.OutputProcessor`).
    :ivar handoff: the PD transfers (with a KV connector), else None.
    :ivar counters: what happened since start-up (requests, steps, tokens, preemptions ...), for metrics.
    :ivar stats_dirty: KV usage changed without an output (held blocks freed): the engine process reports it.
    """

    def __init__(
        self,
        backend: ModelBackend,
        model_info: ModelInfo,
        tokenizer: Any,
        kv: KVCacheManager,
        scheduler_limits: SchedulerLimits,
        limits: EngineLimits,
        hook: Any,
        config: Any,
        swap: SwapSpace | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        self.backend = backend
        self.info = model_info
        self.kv = kv
        self.limits = limits
        self.hook = hook
        self.sampler = Sampler()
        self.counters: Counter[str] = Counter()
        self.scheduler = Scheduler(kv, scheduler_limits, hook, config, backend, self.counters, swap)
        self.outputs = OutputProcessor(tokenizer, model_info.eos_token_ids, model_info.vocab_size)
        #: draft tokens from the proposer hook, verified in each step's forward pass
        self.speculator = Speculator(hook, kv, self.outputs, self.counters, model_info.vocab_size)
        self._next_seq_id = 0
        self.last_step_time = 0.0
        #: PD disaggregation (inferMode dmi): KV held for D instances, or pulled from P instances
        self.handoff = Handoff(connector) if connector is not None else None
        self.stats_dirty = False

    # -- request lifecycle ------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> Sequence:
        """Queue a tokenized request. Lengths must already be validated by the caller."""
        if request.request_id in self.scheduler.by_request:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        # plugins see the engine's own request object (a copy, with engineProcess); one may refuse it here
        self.hook.mindie_host_request_arrived(request=request)
        # the front end refused an explicit max_tokens the prompt leaves no room for (Host.new_request); what
        # is left here is the spec's cut at maxIterTimes and, without max_tokens, the room the prompt leaves:
        # a request stopped by either ends with finish reason "length"
        room = self.limits.max_seq_len - len(request.prompt_token_ids)
        max_new = min(self.limits.max_iter_times, request.sampling.max_tokens or self.limits.max_iter_times, room)
        seq = Sequence(self._next_seq_id, request, max(1, max_new))
        self._next_seq_id += 1
        params = request.sampling
        self.outputs.start(seq)
        if not params.greedy:
            # the request's sampling parameters are never changed here: a drawn seed lives on the sequence
            seq.seed = params.seed if params.seed is not None else random.getrandbits(63)
            seq.generator = make_generator(seq.seed)
        transfer = request.kv_transfer
        if transfer is not None and self.handoff is None:
            raise RequestError("this instance has no KV connector (ServerConfig.inferMode is not 'dmi')", status=400)
        if transfer is not None and transfer.direction == "import":
            assert self.handoff is not None
            self.scheduler.add_transferring(seq)
            self.handoff.start_import(seq)
        else:
            self.scheduler.add(seq)
        self.counters["requests_received"] += 1
        return seq

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Stop a request now and free its blocks (also blocks held for a D instance); returns its final
        output, if it was live."""
        seq = self.scheduler.by_request.get(request_id)
        if seq is None:
            held = self.handoff.release(request_id, "aborted") if self.handoff is not None else None
            if held is not None:
                self._free_held(held)
            return None
        seq.aborted = True
        self._finish(seq, reason)
        return self.outputs.make_output(seq)

    def has_work(self) -> bool:
        """Whether a sequence is queued, or a transfer is in flight or holds blocks."""
        return self.scheduler.has_work() or (self.handoff is not None and self.handoff.busy())

    def _finish(self, seq: Sequence, reason: str, free: bool = True) -> None:
        """End ``seq``; ``free=False`` keeps its blocks (held for a D instance: freed on :class:`HoldEnded`)."""
        if seq.status == SequenceStatus.TRANSFERRING and self.handoff is not None:
            self.handoff.forget(seq)
        self.scheduler.finish(seq, reason, free)

    def _end_with_error(self, seq: Sequence, message: str) -> RequestOutput:
        """End ``seq`` with finish reason ``error`` and ``message``; its final output."""
        seq.error = message
        self._finish(seq, "error")
        return self.outputs.make_output(seq)

    def _fail(self, seq: Sequence, stage: str, exc: Exception) -> RequestOutput:
        """End one sequence with ``finish_reason`` error after ``stage`` raised; the batch goes on."""
        log.error("request %s failed in %s: %s: %s", seq.request_id, stage, type(exc).__name__, exc, exc_info=exc)
        self.counters["request_errors"] += 1
        return self._end_with_error(
            seq, f"generation failed for this request in {stage}; the server log has the details"
        )

    def fail_active(self, message: str) -> list[RequestOutput]:
        """End the sequences a failed step was serving and free their blocks; the engine goes on.

        The running sequences are the ones the step served; when none runs, the
        failure came from scheduling the waiting ones, so those end instead.
        """
        scheduler = self.scheduler
        victims = list(scheduler.running) or [*scheduler.waiting, *scheduler.swapped]
        outputs = [self._end_with_error(seq, message) for seq in victims]
        self.counters["batch_errors"] += 1
        return outputs

    def _expire(self, now: float) -> list[RequestOutput]:
        """End the requests past their ``timeout``."""
        out = []
        pulling = self.handoff.waiting_sequences() if self.handoff is not None else []
        for seq in [*self.scheduler.queued(), *pulling]:
            timeout = seq.request.timeout
            if timeout is not None and now - seq.arrival_time > timeout:
                seq.error = f"request timed out after {timeout:g} s"
                self._finish(seq, "timeout")
                out.append(self.outputs.make_output(seq))
        return out

    # -- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling + forward + sampling round; return outputs for every touched request."""
        now = time.monotonic()
        outputs = self._expire(now)
        if self.handoff is not None:
            outputs.extend(self._apply_transfers(now))
        plan = self.scheduler.schedule(now)
        if not plan:
            if not outputs and self.handoff is not None and self.handoff.busy():
                time.sleep(0.002)  # only transfers in flight: poll them without spinning a core
            return outputs
        drafts = self.speculator.propose(plan) if self.speculator.active() else {}
        step = build_step_input(plan, drafts, self.kv)
        t0 = time.perf_counter()
        try:
            logits = self.backend.execute(step.batch)
        except Exception:  # one batch fails, the server goes on
            log.exception("backend failed on a batch of %d sequences", len(plan.scheduled))
            message = "backend error: the model failed on this request's batch; the server log has the details"
            for seq, _ in plan.scheduled:  # type: ignore[assignment]
                outputs.append(self._end_with_error(seq, message))
            self.counters["batch_errors"] += 1
            return outputs
        self.last_step_time = time.perf_counter() - t0
        self.counters["steps"] += 1
        self.counters["batched_tokens"] += len(step.batch.input_ids)
        outputs.extend(self._process(plan, logits, step.samplers))
        if step.verifying:
            outputs.extend(self._verify(logits, step.verifying))
        return outputs

    # -- after the forward pass ------------------------------------------------------------------
    def _process(
        self, plan: StepPlan, logits: torch.Tensor, samplers: list[tuple[Sequence, int, int]]
    ) -> list[RequestOutput]:
        self.scheduler.mark_computed(plan)
        rows: list[int] = []
        to_sample: list[Sequence] = []
        failed: list[RequestOutput] = []
        for seq, first, count in samplers:
            # every row of a prompt chunk predicts the next prompt token, even a chunk of one (splitfuse)
            if seq.request.sampling.prompt_logprobs is not None and seq.num_computed - count < seq.prompt_len:
                try:
                    self.outputs.record_prompt_logprobs(seq, logits[first : first + count], seq.num_computed - count)
                except Exception as exc:
                    failed.append(self._fail(seq, "computing prompt logprobs", exc))
                    continue
            if seq.num_computed == seq.num_tokens:
                rows.append(first + count - 1)
                to_sample.append(seq)
        if not to_sample:
            return failed
        sel = logits if len(rows) == logits.shape[0] else logits[rows]
        tokens, logprobs = self._sample(sel, to_sample, failed)
        now = time.monotonic()
        outputs = failed
        for seq, token, lp in zip(to_sample, tokens, logprobs):
            if seq.status == SequenceStatus.FINISHED or token is None:
                continue
            outputs.append(self._take_tokens(seq, (token,), (lp,), now))
        self.counters["generation_tokens"] += len(to_sample)
        return outputs

    def _verify(self, logits: torch.Tensor, verifying: list[tuple[Sequence, int, Drafts]]) -> list[RequestOutput]:
        """Verify each sequence's drafts against its rows, append what is accepted (and the target's next token),
        and roll the KV of the rejected drafts back."""
        outputs: list[RequestOutput] = []
        outcomes: list[DraftOutcome] = []
        now = time.monotonic()
        for seq, first, draft in verifying:
            if seq.status == SequenceStatus.FINISHED:
                continue
            try:
                tokens, lps, accepted = self.speculator.verify(seq, logits[first : first + len(draft.tokens) + 1], draft)
            except Exception as exc:
                outputs.append(self._fail(seq, "verifying draft tokens", exc))
                continue
            outputs.append(self._take_tokens(seq, tokens, lps, now))
            finished = seq.status == SequenceStatus.FINISHED
            if not finished:
                self.speculator.settle(seq, accepted)
            self.counters["generation_tokens"] += len(tokens)
            outcomes.append(DraftOutcome(seq.seq_id, seq.request_id, len(draft.tokens), accepted, seq.num_tokens,
                                         finished))
        self.speculator.count(outcomes)
        return outputs

    def _take_tokens(
        self, seq: Sequence, tokens: Tokens[int], logprobs: Tokens[TokenLogprob | None], now: float
    ) -> RequestOutput:
        """Append ``seq``'s new tokens, end it when a stop rule says so (or hand it to a D instance after its
        first token), and return its output; a failure here ends only ``seq``."""
        try:
            _, reason = self.outputs.append_tokens(seq, tokens, logprobs, now)
            transfer = seq.request.kv_transfer
            if reason is not None:
                self._finish(seq, reason)
            elif transfer is not None and transfer.direction == "export":
                assert self.handoff is not None  # the first token is out: D decodes the rest
                self.handoff.export(seq, self.kv.block_table(seq), self.kv.block_size)
                self._finish(seq, "handoff", free=False)
                self.counters["handoffs"] += 1
            return self.outputs.make_output(seq)
        except Exception as exc:  # stop handling or detokenisation failed: only this request ends
            return self._fail(seq, "stop handling or detokenisation", exc)

    def _sample(
        self, sel: torch.Tensor, seqs: list[Sequence], failed: list[RequestOutput]
    ) -> tuple[list[int | None], list[TokenLogprob | None]]:
        """Sample every row at once; if that raises, row by row, failing only the rows that raise."""
        allowed: list[list[int] | None] = []
        for seq in list(seqs):
            try:
                allowed.append(
                    seq.request.logits_constraint(seq.output_token_ids) if seq.request.logits_constraint else None
                )
            except Exception as exc:
                failed.append(self._fail(seq, "the logits constraint", exc))
                allowed.append(None)
        live = [i for i, s in enumerate(seqs) if s.status != SequenceStatus.FINISHED]
        tokens: list[int | None] = [None] * len(seqs)
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if not live:
            return tokens, logprobs
        try:
            got, lps = self._sample_rows(
                sel[live] if len(live) != len(seqs) else sel, [seqs[i] for i in live], [allowed[i] for i in live]
            )
            for j, i in enumerate(live):
                tokens[i], logprobs[i] = got[j], lps[j]
            return tokens, logprobs
        except Exception as exc:
            if len(live) == 1:  # the one row is the faulty one
                failed.append(self._fail(seqs[live[0]], "sampling", exc))
                return tokens, logprobs
            log.warning("sampling a batch of %d rows failed; sampling row by row", len(live))
        for i in live:
            try:
                got, lps = self._sample_rows(sel[i : i + 1], [seqs[i]], [allowed[i]])
                tokens[i], logprobs[i] = got[0], lps[0]
            except Exception as exc:
                failed.append(self._fail(seqs[i], "sampling", exc))
        return tokens, logprobs

    def _sample_rows(
        self, sel: torch.Tensor, seqs: list[Sequence], allowed: list[list[int] | None]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        params = [s.request.sampling for s in seqs]
        penalties = any(p.needs_penalties for p in params)
        return self.sampler.sample(
            sel,
            params,
            [s.token_ids[: s.prompt_len] for s in seqs] if penalties else [[]] * len(params),
            [s.output_token_ids for s in seqs] if penalties else [[]] * len(params),
            [s.generator for s in seqs],
            allowed,
            [self.outputs.banned_tokens(s) for s in seqs],
        )

    # -- PD transfers ------------------------------------------------------------------------------
    def _apply_transfers(self, now: float) -> list[RequestOutput]:
        """Apply what the handoff reports, then admit the sequences whose KV arrived, oldest first, while the
        batch and the cache have room: their KV is written into fresh blocks and P's first token appended."""
        handoff = self.handoff
        assert handoff is not None
        outputs = []
        for event in handoff.poll(now):
            if isinstance(event, HoldEnded):
                self._free_held(event.seq)
            else:
                log.warning("request %s: %s", event.seq.request_id, event.message)
                out = self._end_with_error(event.seq, event.message)
                out.error_status = TRANSFER_FAILED_STATUS
                outputs.append(out)
        while (arrival := handoff.oldest_arrival()) is not None:
            seq = arrival.seq
            blocks = self.scheduler.reserve(seq, seq.prompt_len)
            if blocks is None:
                break
            handoff.take_arrival()
            try:
                self.backend.import_blocks(blocks[: arrival.num_blocks], arrival.tensors)
            except Exception as exc:
                outputs.append(self._fail(seq, "writing the KV received from P", exc))
                continue
            self.scheduler.start_running(seq, seq.prompt_len, now)
            arrival.restore_sampling()
            outputs.append(self._take_tokens(seq, (arrival.first_token,), (None,), now))
            self.counters["imports"] += 1
        return outputs

    def _free_held(self, seq: Sequence) -> None:
        """Free the blocks a finished sequence kept for a D instance."""
        self.kv.free(seq)
        self.stats_dirty = True

    # -- statistics ------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Queue depths, KV usage and counters, for metrics."""
        s = self.scheduler.stats()
        s["num_held_for_decode"] = float(len(self.handoff.held)) if self.handoff is not None else 0.0
        counters = dict(self.counters)  # one C-level copy: the engine thread may be counting meanwhile
        s.update({k: float(v) for k, v in counters.items()})
        return s
