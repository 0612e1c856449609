"""One step's forward input: the scheduler's plan, and the proposer's drafts, flattened into the backend's
:class:`~mindie_host.backends.base.ModelInput`.

Each planned sequence brings its next ``n`` uncomputed tokens as one query over its block table; the rows
whose logits the step reads are those that complete the sequence (sampled), or every row of a prompt chunk
whose prompt logprobs are asked for. Generated tokens computed again (a sequence preempted by recompute) come as
one-token decode rows after its prompt's query, so each gets the bits it got when it was generated. A sequence
with drafts brings its last token and the drafts, each as a one-token decode row of its own (a query of one at
its position, over the sequence's block table, with the context up to it): the backend computes every such row as
it computes a plain decode row there.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.base import ModelInput, PayloadSlice
from .kv_cache import KVCacheManager
from .policy import StepPlan
from .sequence import Sequence
from .speculation import Drafts


@dataclass
class StepInput:
    """What one step runs, and where the engine reads each sequence's logits back.

    :ivar batch: the backend's input.
    :ivar samplers: ``(sequence, first logits row, rows)`` of each sequence sampled or scored in this step.
    :ivar verifying: ``(sequence, first logits row, drafts)`` of each sequence whose drafts the step verifies.
    """

    batch: ModelInput
    samplers: list[tuple[Sequence, int, int]]
    verifying: list[tuple[Sequence, int, Drafts]]


def build_step_input(plan: StepPlan, drafts: dict[int, Drafts], kv: KVCacheManager) -> StepInput:
    """Flatten ``plan`` (with the drafts of its sequences, by ``seq_id``) over ``kv``'s block tables."""
    verifying: list[tuple[Sequence, int, Drafts]] = []
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
        draft = drafts.get(seq.seq_id)
        if draft is not None:
            table = kv.block_table(seq)
            for j, token in enumerate([seq.token_ids[start], *draft.tokens]):
                ids.append(token)
                positions.append(start + j)
                q_lens.append(1)
                ctx_lens.append(start + j + 1)
                tables.append(table)
                variants.append(seq.variant)
                prompt_lens.append(seq.prompt_len)
            verifying.append((seq, len(logits_idx), draft))
            logits_idx.extend(range(flat0, len(ids)))
            continue
        if seq.request.payload is not None:  # plugin-owned (e.g. images); the backend reads it
            payloads = payloads or []
            payloads.append(PayloadSlice(len(q_lens), flat0, start, n, seq.request.payload))
        # the prompt tokens as one query; generated tokens computed again (after a preemption that freed their
        # blocks) each as a one-token decode row, as they were computed the first time
        table = kv.block_table(seq)
        prompt_part = max(0, min(n, seq.prompt_len - start))
        queries = [(start, prompt_part)] if prompt_part else []
        queries += [(p, 1) for p in range(start + prompt_part, start + n)]
        for begin, size in queries:
            ids.extend(seq.token_ids[begin : begin + size])
            positions.extend(range(begin, begin + size))
            q_lens.append(size)
            ctx_lens.append(begin + size)
            tables.append(table)
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
    batch = ModelInput(
        input_ids=ids,
        positions=positions,
        query_lens=q_lens,
        context_lens=ctx_lens,
        block_tables=tables,
        logits_indices=logits_idx or [len(ids) - 1],
        row_variants=variants,
        payloads=payloads,
        prompt_lens=prompt_lens,
    )
    return StepInput(batch, samplers, verifying)
