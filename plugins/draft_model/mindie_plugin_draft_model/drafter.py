"""The draft model beside the target: its own backend and paged KV cache, batched draft passes, rollback.

Each proposing step runs ``1 + (k - 1)`` forward passes of the draft for the whole batch: one that
catches every sequence up (its tokens the draft has not computed yet, usually the one token the
target made last step, plus any tokens accepted since), then one per further draft position. The
draft proposes greedily (its argmax), a deterministic proposer: the engine's rejection sampling
keeps sampled requests exact with a one-hot ``q``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mindie_host.api import DraftOutcome, DraftRequest, KVCacheManager, ModelBackend, ModelInput


@dataclass
class DraftSeq:
    """The draft's view of one sequence: its id and how many of its tokens have draft KV."""

    seq_id: int
    num_computed: int = 0


class Drafter:
    """Proposes with ``backend`` (loaded, its KV cache allocated) over ``kv``'s blocks."""

    def __init__(self, backend: ModelBackend, kv: KVCacheManager) -> None:
        self.backend = backend
        self.kv = kv
        self.seqs: dict[str, DraftSeq] = {}

    def propose(self, seqs: list[DraftRequest], k: int) -> list[list[int]]:
        """Up to ``min(k, max_drafts)`` greedy draft tokens per sequence (empty where the cache is short)."""
        want = [min(k, s.max_drafts) for s in seqs]
        live: list[int] = []
        for i, s in enumerate(seqs):
            d = self.seqs.get(s.request_id)
            if d is None:
                d = self.seqs[s.request_id] = DraftSeq(s.seq_id)
            d.num_computed = min(d.num_computed, len(s.token_ids) - 1)
            self.kv.free_tail(d)
            # room for the catch-up tokens and the k - 1 drafts fed back
            if self.kv.can_allocate(d, len(s.token_ids) - d.num_computed + want[i] - 1):
                live.append(i)
        drafts: list[list[int]] = [[] for _ in seqs]
        if not live:
            return drafts
        # the catch-up pass: every uncomputed token of every live sequence; the logits of its last
        ids: list[int] = []
        positions: list[int] = []
        q_lens: list[int] = []
        ctx: list[int] = []
        rows: list[int] = []
        for i in live:
            s, d = seqs[i], self.seqs[seqs[i].request_id]
            n = len(s.token_ids) - d.num_computed
            self.kv.allocate(d, n)
            ids.extend(s.token_ids[d.num_computed :])
            positions.extend(range(d.num_computed, len(s.token_ids)))
            q_lens.append(n)
            ctx.append(len(s.token_ids))
            rows.append(len(ids) - 1)
        tokens = self._run(ids, positions, q_lens, ctx, [self.seqs[seqs[i].request_id] for i in live], rows,
                           [seqs[i].prompt_len for i in live])
        for i, t in zip(live, tokens):
            drafts[i].append(t)
            self.seqs[seqs[i].request_id].num_computed = len(seqs[i].token_ids)
        # one decode pass per further draft position, for the sequences that want more
        for j in range(1, max(want[i] for i in live)):
            more = [i for i in live if want[i] > j]
            if not more:
                break
            states = [self.seqs[seqs[i].request_id] for i in more]
            for d in states:
                self.kv.allocate(d, 1)
            pos = [d.num_computed for d in states]
            tokens = self._run([drafts[i][-1] for i in more], pos, [1] * len(more), [p + 1 for p in pos], states,
                               list(range(len(more))), [seqs[i].prompt_len for i in more])
            for i, d, t in zip(more, states, tokens):
                drafts[i].append(t)
                d.num_computed += 1
        return drafts

    def _run(self, ids: list[int], positions: list[int], q_lens: list[int], ctx: list[int], states: list[DraftSeq],
             rows: list[int], prompt_lens: list[int]) -> list[int]:
        logits = self.backend.execute(ModelInput(
            input_ids=ids, positions=positions, query_lens=q_lens, context_lens=ctx,
            block_tables=[self.kv.block_table(d) for d in states], logits_indices=rows,
            row_variants=[-1] * len(q_lens), prompt_lens=prompt_lens))
        return torch.argmax(logits, dim=-1).tolist()

    def accepted(self, outcomes: list[DraftOutcome]) -> None:
        """Keep the draft KV of the accepted tokens only (the target's token after them is computed next step)."""
        for o in outcomes:
            d = self.seqs.get(o.request_id)
            if d is None:
                continue
            if o.finished:
                self.release(o.request_id)
                continue
            d.num_computed = min(d.num_computed, o.num_tokens - 1)
            self.kv.free_tail(d)

    def release(self, request_id: str) -> None:
        """Free a finished request's draft KV."""
        d = self.seqs.pop(request_id, None)
        if d is not None:
            self.kv.free(d)


def blocks_for(max_batch: int, max_seq_len: int, block_size: int) -> int:
    """Draft KV blocks for ``max_batch`` sequences of ``max_seq_len`` tokens."""
    return max_batch * math.ceil(max_seq_len / block_size) + 1
