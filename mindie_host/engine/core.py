"""The step loop: schedule -> backend.execute -> sample -> emit.

:class:`LLMEngine` is synchronous and single-threaded; :mod:`.async_engine` runs
it on a worker thread. Scheduling decisions come from the policy hooks, block
accounting from the KV-cache manager hook, the forward pass from the backend.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ..backends.base import ModelBackend, ModelInfo, ModelInput, PayloadSlice
from .detokenizer import Detokenizer
from .handoff import Handoff
from .kv_cache import KVCacheManager
from .kv_transfer import KVConnector
from .policy import SchedulerLimits, SchedulerState, StepPlan, least_urgent
from .request import EngineRequest, RequestError, RequestOutput, TokenLogprob
from .sampling import Sampler, make_generator
from .sequence import Sequence, SequenceStatus
from .swap import SwapSpace

log = logging.getLogger("mindie_host.engine")


@dataclass
class EngineLimits:
    """Per-request length limits (from ``ModelDeployConfig`` / ``ScheduleConfig``)."""

    max_seq_len: int
    max_iter_times: int


class LLMEngine:
    """Continuous batching over a paged KV cache."""

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
        self.detok = Detokenizer(tokenizer)
        self.kv = kv
        self.scheduler_limits = scheduler_limits
        self.limits = limits
        self.hook = hook
        self.config = config
        self.sampler = Sampler()
        self.eos_ids = set(model_info.eos_token_ids)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        #: preempted sequences whose KV waits in the swap space (``swap``), oldest first
        self.swapped: list[Sequence] = []
        self.swap = swap
        self._swaps_this_step = 0
        self.by_request: dict[str, Sequence] = {}
        self.plan_memo: dict[str, Any] = {}
        self._next_seq_id = 0
        self.counters: Counter[str] = Counter()
        self.last_step_time = 0.0
        #: PD disaggregation (inferMode dmi): KV held for D instances, or pulled from P instances
        self.handoff = Handoff(self, connector) if connector is not None else None
        #: set when KV usage changed without an output (a handoff's blocks freed): the engine process reports it
        self.stats_dirty = False

    # -- request lifecycle ------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> Sequence:
        """Queue a tokenized request. Lengths must already be validated by the caller."""
        if request.request_id in self.by_request:
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
        seq.detok_state = self.detok.start(seq.prompt_len)
        if not params.greedy:
            # the request's sampling parameters are never changed here: a drawn seed lives on the sequence
            seq.seed = params.seed if params.seed is not None else random.getrandbits(63)
            seq.generator = make_generator(seq.seed)
        transfer = request.kv_transfer
        if transfer is not None and self.handoff is None:
            raise RequestError("this instance has no KV connector (ServerConfig.inferMode is not 'dmi')", status=400)
        self.by_request[request.request_id] = seq
        if transfer is not None and transfer.direction == "import":
            assert self.handoff is not None
            self.handoff.start_import(seq)
        else:
            self.waiting.append(seq)
        self.counters["requests_received"] += 1
        return seq

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Stop a request now and free its blocks (also blocks held for a D instance); returns its final
        output, if it was live."""
        seq = self.by_request.get(request_id)
        if seq is None:
            if self.handoff is not None:
                self.handoff.release(request_id, "aborted")
            return None
        seq.aborted = True
        self._finish(seq, reason)
        return self._make_output(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or (self.handoff and self.handoff.busy()))

    # -- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling + forward + sampling round; return outputs for every touched request."""
        now = time.monotonic()
        outputs = self._expire(now)
        if self.handoff is not None:
            outputs.extend(self.handoff.poll(now))
        plan = self._schedule(now)
        if not plan:
            if not outputs and self.handoff is not None and self.handoff.busy():
                time.sleep(0.002)  # only transfers in flight: poll them without spinning a core
            return outputs
        batch, samplers = self._build_input(plan)
        t0 = time.perf_counter()
        try:
            logits = self.backend.execute(batch)
        except Exception:  # one batch fails, the server goes on
            log.exception("backend failed on a batch of %d sequences", len(plan.scheduled))
            for seq, _ in plan.scheduled:
                seq.error = "backend error: the model failed on this request's batch; the server log has the details"
                self._finish(seq, "error")
                outputs.append(self._make_output(seq))
            self.counters["batch_errors"] += 1
            return outputs
        self.last_step_time = time.perf_counter() - t0
        self.counters["steps"] += 1
        self.counters["batched_tokens"] += len(batch.input_ids)
        outputs.extend(self._process(plan, logits, samplers))
        return outputs

    # -- scheduling ---------------------------------------------------------------------------
    def _expire(self, now: float) -> list[RequestOutput]:
        out = []
        pulling = self.handoff.waiting_sequences() if self.handoff is not None else []
        for seq in [*self.running, *self.waiting, *self.swapped, *pulling]:
            timeout = seq.request.timeout
            if timeout is not None and now - seq.arrival_time > timeout:
                seq.error = f"request timed out after {timeout:g} s"
                self._finish(seq, "timeout")
                out.append(self._make_output(seq))
        return out

    def _schedule(self, now: float) -> StepPlan:
        self._swaps_this_step = 0
        if self.swapped:
            self._swap_in()
        if len(self.waiting) > 1:
            ordered = self.hook.mindie_host_order_waiting(waiting=list(self.waiting), config=self.config, now=now)
            if ordered is not None:
                self.waiting = list(ordered)
        for seq in self.waiting[: self.scheduler_limits.max_batch_size]:
            if seq.request.sampling.prompt_logprobs is None:
                # what the cache could supply now (a pure query: the blocks are held only on admission);
                # a request scoring its prompt computes every position: cached blocks give no logits
                seq.num_computed = self.kv.match_prefix(seq)
        waiting = list(self.waiting)
        if waiting:
            for allowed in self.hook.mindie_host_filter_waiting(waiting=list(waiting)):
                if allowed is not None:
                    keep = {s.seq_id for s in allowed}
                    waiting = [s for s in waiting if s.seq_id in keep]
        state = SchedulerState(
            running=list(self.running),
            waiting=waiting,
            kv=self.kv,
            limits=self.scheduler_limits,
            config=self.config,
            now=now,
            memo=self.plan_memo,
        )
        plan = self.hook.mindie_host_plan_step(state=state) or StepPlan()
        return self._apply_plan(plan, now)

    def _apply_plan(self, plan: StepPlan, now: float) -> StepPlan:
        """Allocate blocks in plan order, preempting running sequences if the pool runs dry."""
        done: list[tuple[Sequence, int]] = []
        in_step: set[int] = set()
        preempted: set[int] = set()
        for view, n in plan.scheduled:
            seq = self.by_request.get(view.request_id)
            if seq is None or seq.status == SequenceStatus.FINISHED or seq.seq_id in preempted or n <= 0:
                continue
            if seq.status == SequenceStatus.WAITING:
                self._acquire_prefix(seq)
            n = min(n, seq.num_uncomputed)
            while not self.kv.can_allocate(seq, n):
                # a running sequence that cannot grow is itself a candidate: the policy may keep it over another
                victim = self._pick_victim(seq, exclude=in_step)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.add(victim.seq_id)
                if victim is seq:
                    break
            if seq.seq_id in preempted:
                continue
            if not self.kv.can_allocate(seq, n):
                if seq.status == SequenceStatus.RUNNING:
                    self._preempt(seq)
                    preempted.add(seq.seq_id)
                else:  # it waits: let go of the cached blocks it took on admission
                    self.kv.free(seq)
                    seq.num_computed = 0
                continue
            if seq.status == SequenceStatus.WAITING:
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = SequenceStatus.RUNNING
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = now
            self.kv.allocate(seq, n)
            done.append((seq, n))
            in_step.add(seq.seq_id)
        return StepPlan(done)  # type: ignore[arg-type]

    def _acquire_prefix(self, seq: Sequence) -> None:
        """Admit ``seq``'s cached prefix: hold the blocks the KV manager matched. If some were evicted
        since the match, computing starts earlier; what this step leaves, a later step computes."""
        if seq.request.sampling.prompt_logprobs is None:
            seq.num_computed = seq.num_cached_tokens = self.kv.acquire_prefix(seq)

    def _pick_victim(self, needed_by: Sequence, exclude: set[int]) -> Sequence | None:
        """The running sequence to preempt for ``needed_by``: the ``mindie_host_preemption_victim`` hook's choice."""
        candidates = [s for s in self.running if s.seq_id not in exclude]
        if not candidates:
            return None
        victim = self.hook.mindie_host_preemption_victim(running=list(candidates), needed_by=needed_by)
        if not any(victim is s for s in candidates):
            log.error("mindie_host_preemption_victim answered %r, not a candidate; using the builtin choice", victim)
            victim = least_urgent(candidates)
        return victim  # type: ignore[return-value]

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks. With a swap space and room in this step's ``maxPreemptCount``,
        its KV is copied out and comes back later; otherwise it waits and is recomputed (no request is dropped)."""
        if self._swap_out(seq):
            return
        self.kv.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.waiting.insert(0, seq)
        self.counters["preemptions"] += 1
        log.info("preempted request %s (recompute later)", seq.request_id)

    # -- swap ---------------------------------------------------------------------------------
    def _swap_out(self, seq: Sequence) -> bool:
        """Copy ``seq``'s computed KV to the swap space and free its cache blocks; False when it cannot."""
        swap = self.swap
        table = self.kv.block_table(seq)[: -(-seq.num_computed // self.kv.block_size)]
        if (swap is None or not table or self._swaps_this_step >= swap.max_per_step
                or swap.pool.num_free() < len(table)):
            return False
        seq.swap_blocks = [swap.pool.allocate() for _ in table]
        self.backend.swap_out(table, seq.swap_blocks)
        self.kv.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.SWAPPED
        seq.num_preemptions += 1
        self.swapped.append(seq)
        self._swaps_this_step += 1
        self.counters["preemptions"] += 1
        self.counters["swapped_out"] += 1
        log.info("preempted request %s (swapped %d blocks to CPU)", seq.request_id, len(table))
        return True

    def _swap_in(self) -> None:
        """Bring swapped sequences back, oldest first, while the cache has room for them and a next token."""
        limit = self.scheduler_limits.max_batch_size
        while self.swapped and len(self.running) < limit:
            seq = self.swapped[0]
            computed = seq.num_computed
            seq.num_computed = 0
            if self.kv.blocks_needed(seq, computed + 1) > self.kv.num_free_blocks():
                seq.num_computed = computed
                return
            self.kv.allocate(seq, computed)
            seq.num_computed = computed
            self.backend.swap_in(seq.swap_blocks, self.kv.block_table(seq))
            self._release_swap(seq)
            self.swapped.pop(0)
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            self.counters["swapped_in"] += 1

    def _release_swap(self, seq: Sequence) -> None:
        if self.swap is not None:
            for block in seq.swap_blocks:
                self.swap.pool.free(block)
        seq.swap_blocks = []

    # -- forward input ------------------------------------------------------------------------
    def _build_input(self, plan: StepPlan) -> tuple[ModelInput, list[tuple[Sequence, int, int]]]:
        """Flatten the plan; returns the input and (seq, first logits row, rows) for sampling."""
        ids: list[int] = []
        positions: list[int] = []
        q_lens: list[int] = []
        ctx_lens: list[int] = []
        tables: list[list[int]] = []
        logits_idx: list[int] = []
        variants: list[int] = []
        prompt_lens: list[int] = []
        samplers: list[tuple[Sequence, int, int]] = []
        payloads: list[PayloadSlice] | None = None
        for seq, n in plan.scheduled:  # type: ignore[assignment]
            start = seq.num_computed
            flat0 = len(ids)
            if seq.request.payload is not None:  # plugin-owned (e.g. images); the backend reads it
                payloads = payloads or []
                payloads.append(PayloadSlice(len(q_lens), flat0, start, n, seq.request.payload))
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            q_lens.append(n)
            ctx_lens.append(start + n)
            tables.append(self.kv.block_table(seq))
            variants.append(seq.variant)
            prompt_lens.append(seq.prompt_len)
            want_prompt = seq.request.sampling.prompt_logprobs is not None and start < seq.prompt_len
            completes = start + n == seq.num_tokens
            if want_prompt:
                rows = list(range(flat0, flat0 + n))
            elif completes:
                rows = [flat0 + n - 1]
            else:
                rows = []
            if rows:
                samplers.append((seq, len(logits_idx), len(rows)))
                logits_idx.extend(rows)
        return (
            ModelInput(
                input_ids=ids, positions=positions, query_lens=q_lens, context_lens=ctx_lens,
                block_tables=tables, logits_indices=logits_idx or [len(ids) - 1], row_variants=variants,
                payloads=payloads, prompt_lens=prompt_lens,
            ),
            samplers,
        )

    # -- after the forward pass ------------------------------------------------------------------
    def _process(
        self, plan: StepPlan, logits: torch.Tensor, samplers: list[tuple[Sequence, int, int]]
    ) -> list[RequestOutput]:
        for seq, n in plan.scheduled:  # type: ignore[assignment]
            seq.num_computed += n
            self.kv.on_computed(seq)
        rows: list[int] = []
        to_sample: list[Sequence] = []
        failed: list[RequestOutput] = []
        for seq, first, count in samplers:
            # every row of a prompt chunk predicts the next prompt token, even a chunk of one (splitfuse)
            if seq.request.sampling.prompt_logprobs is not None and seq.num_computed - count < seq.prompt_len:
                try:
                    self._record_prompt_logprobs(seq, logits[first : first + count], seq.num_computed - count)
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
            try:
                self._append_token(seq, token, lp, now)
                transfer = seq.request.kv_transfer
                if transfer is not None and transfer.direction == "export" and seq.status == SequenceStatus.RUNNING:
                    assert self.handoff is not None
                    self.handoff.export(seq)  # the first token is out: D decodes the rest
                outputs.append(self._make_output(seq))
            except Exception as exc:  # stop handling or detokenisation failed: only this request ends
                outputs.append(self._fail(seq, "stop handling or detokenisation", exc))
        self.counters["generation_tokens"] += len(to_sample)
        return outputs

    def _sample(
        self, sel: torch.Tensor, seqs: list[Sequence], failed: list[RequestOutput]
    ) -> tuple[list[int | None], list[TokenLogprob | None]]:
        """Sample every row at once; if that raises, row by row, failing only the rows that raise."""
        allowed: list[list[int] | None] = []
        for seq in list(seqs):
            try:
                allowed.append(seq.request.logits_constraint(seq.output_token_ids)
                               if seq.request.logits_constraint else None)
            except Exception as exc:
                failed.append(self._fail(seq, "the logits constraint", exc))
                allowed.append(None)
        live = [i for i, s in enumerate(seqs) if s.status != SequenceStatus.FINISHED]
        tokens: list[int | None] = [None] * len(seqs)
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if not live:
            return tokens, logprobs
        try:
            got, lps = self._sample_rows(sel[live] if len(live) != len(seqs) else sel,
                                         [seqs[i] for i in live], [allowed[i] for i in live])
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
            [self._banned_tokens(s) for s in seqs],
        )

    def _fail(self, seq: Sequence, stage: str, exc: Exception) -> RequestOutput:
        """End one sequence with ``finish_reason`` error after ``stage`` raised; the batch goes on."""
        log.error("request %s failed in %s: %s: %s", seq.request_id, stage, type(exc).__name__, exc,
                  exc_info=exc)
        seq.error = f"generation failed for this request in {stage}; the server log has the details"
        self._finish(seq, "error")
        self.counters["request_errors"] += 1
        return self._make_output(seq)

    def fail_active(self, message: str) -> list[RequestOutput]:
        """End the sequences a failed step was serving and free their blocks; the engine goes on.

        The running sequences are the ones the step served; when none runs, the
        failure came from scheduling the waiting ones, so those end instead.
        """
        victims = list(self.running) or [*self.waiting, *self.swapped]
        outputs = []
        for seq in victims:
            seq.error = message
            self._finish(seq, "error")
            outputs.append(self._make_output(seq))
        self.counters["batch_errors"] += 1
        return outputs

    def _banned_tokens(self, seq: Sequence) -> list[int] | None:
        """EOS and stop tokens may not be sampled until ``min_tokens`` outputs exist."""
        params = seq.request.sampling
        if seq.num_output_tokens >= params.min_tokens:
            return None
        vocab = self.info.vocab_size
        banned = [t for t in params.stop_token_ids if 0 <= t < vocab]  # ids the model cannot emit need no ban
        if not params.ignore_eos:
            banned.extend(self.eos_ids)
        return banned or None

    def _record_prompt_logprobs(self, seq: Sequence, rows: torch.Tensor, start: int) -> None:
        """Logprob of each prompt token given the tokens before it (TGI ``decoder_input_details``)."""
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None] * seq.prompt_len
        lp = torch.log_softmax(rows.float(), dim=-1)
        k = seq.request.sampling.prompt_logprobs or 0
        for j in range(rows.shape[0]):
            target = start + j + 1
            if target < seq.prompt_len:
                tok = seq.token_ids[target]
                top: list[tuple[int, float]] = []
                if k:
                    vals, idx = torch.topk(lp[j], k)
                    top = list(zip(idx.tolist(), vals.tolist()))
                seq.prompt_logprobs[target] = TokenLogprob(tok, float(lp[j, tok]), top)

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprob | None, now: float) -> None:
        params = seq.request.sampling
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_times.append(now)
        if lp is not None:
            seq.pending_logprobs.append(lp)
        n_out = seq.num_output_tokens
        stop_token = token in params.stop_token_ids
        eos = token in self.eos_ids and not params.ignore_eos
        if (eos or stop_token) and n_out > params.min_tokens:
            if not params.include_stop_str_in_output or eos:
                seq.token_ids.pop()  # the stop token is not part of the output
                if lp is not None:
                    seq.pending_logprobs.pop()
            else:
                self._detokenize(seq)
            seq.stop_reason = token if stop_token else None
            self._finish(seq, "stop")
            return
        self._detokenize(seq)
        if params.stop and self._check_stop_strings(seq):
            return
        if n_out >= seq.max_new_tokens:
            self._finish(seq, "length")

    def _detokenize(self, seq: Sequence) -> None:
        seq.output_text += self.detok.step(seq.token_ids, seq.detok_state, seq.request.sampling.skip_special_tokens)

    def _check_stop_strings(self, seq: Sequence) -> bool:
        params = seq.request.sampling
        longest = max(len(s) for s in params.stop)
        search_from = max(0, seq.emitted_text_len - longest)
        best: tuple[int, str] | None = None
        for stop in params.stop:
            i = seq.output_text.find(stop, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return False
        i, stop = best
        seq.output_text = seq.output_text[: i + len(stop)] if params.include_stop_str_in_output else seq.output_text[:i]
        seq.stop_reason = stop
        self._finish(seq, "stop")
        return True

    def _finish(self, seq: Sequence, reason: str, free: bool = True) -> None:
        """End ``seq``; ``free=False`` keeps its blocks (a handoff: :mod:`.handoff` frees them later)."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self._release_swap(seq)
        elif seq.status == SequenceStatus.TRANSFERRING and self.handoff is not None:
            self.handoff.forget(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if free:
            self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.counters[f"finished_{reason}"] += 1
        self.counters["prompt_tokens"] += seq.prompt_len
        self.by_request.pop(seq.request_id, None)
        try:
            self.hook.mindie_host_request_finished(request=seq.request, reason=reason)
        except Exception:  # a plugin's bookkeeping must not take the engine down
            log.exception("mindie_host_request_finished failed for %s", seq.request_id)

    def _make_output(self, seq: Sequence) -> RequestOutput:
        """The increment since the last output of ``seq``; holds back text that may start a stop string."""
        finished = seq.status == SequenceStatus.FINISHED
        text = seq.output_text
        visible = len(text)
        if not finished and seq.request.sampling.stop:
            visible = max(seq.emitted_text_len, len(text) - (max(len(s) for s in seq.request.sampling.stop) - 1))
        new_text = text[seq.emitted_text_len : visible]
        seq.emitted_text_len = visible
        out_ids = seq.output_token_ids
        new_ids = out_ids[seq.emitted_tokens :]
        first = seq.emitted_tokens == 0  # the prompt's logprobs come with the first output and the last
        seq.emitted_tokens = len(out_ids)
        logprobs, seq.pending_logprobs = seq.pending_logprobs, []
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            text=text[:visible],
            token_ids=out_ids,
            num_prompt_tokens=seq.prompt_len,
            finished=finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=logprobs,
            prompt_logprobs=seq.prompt_logprobs if finished or first else None,
            num_cached_tokens=seq.num_cached_tokens,
            error=seq.error,
            seed=seq.seed,
            arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time,
            first_token_time=seq.first_token_time,
            finished_time=time.monotonic() if finished else None,
            token_times=list(seq.token_times) if finished else [],
        )

    # -- statistics ------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Queue depths, KV usage and counters, for metrics."""
        s: dict[str, float] = {
            "num_running": float(len(self.running)),
            "num_waiting": float(len(self.waiting)),
            "num_swapped": float(len(self.swapped)),
            "num_held_for_decode": float(len(self.handoff.held)) if self.handoff is not None else 0.0,
            "swap_usage": self.swap.usage() if self.swap is not None else 0.0,
        }
        s.update(self.kv.stats())
        counters = dict(self.counters)  # one C-level copy: the engine thread may be counting meanwhile
        s.update({k: float(v) for k, v in counters.items()})
        return s
