"""Draft tokens, verified in the target's forward pass: the engine's side of speculative decoding.

Each step, before the forward pass, the engine offers the step's decoding sequences to the
proposer hook (``mindie_host_propose_drafts``): a plugin answers with up to ``max_drafts`` draft
tokens per sequence (and, when it drew them from a distribution, that distribution ``q``). A
sequence with ``m`` drafts brings ``m + 1`` rows to the step, its last token and the drafts, each
presented to the backend as a one-token decode row of its own at its own position, over the
sequence's block table: every row is computed exactly as a plain decode step would compute it
there (the generated-row products, the decode attention over the context up to that row), so a
greedy row's argmax is the token plain decoding would have produced.

:class:`Speculator` then walks each sequence's rows (:meth:`Speculator.verify`): greedy rows
accept a draft while the target's argmax equals it; sampled rows accept draft ``d`` with
probability ``min(1, p(d)/q(d))`` (``q`` one-hot for a deterministic proposer) and otherwise draw
from the normalised residual ``max(0, p - q)``, where ``p`` is the target's processed distribution
(penalties counted over the draft prefix, ``logit_bias``, the ``min_tokens`` ban, temperature,
top-k/top-p/min-p/typical-p), so every emitted token has the target's distribution exactly. The
first rejected row's own token, or the row after the last draft, gives one more token, so a step
always makes at least one. Logprobs are the target's. The KV of rejected drafts is dropped
(:meth:`Speculator.settle`: ``num_computed`` counts accepted tokens only, the blocks past them are
freed, and a prefix cache keys only blocks of accepted tokens); the proposer hears what was
accepted (``mindie_host_drafts_accepted``) so it can roll its own state back.

A sequence with a logits constraint (structured outputs) takes drafts when its constraint can ``fork``
(an independent copy at the same point: the builtin JSON, llguidance and after-reasoning constraints can):
the drafts are walked on a fork, cut at the first one the grammar does not allow, and each verification
row is masked with the allowed set at its position, as plain decoding masks its one row, so a constrained
output with drafts is the output without them. Sequences with a constraint that cannot fork, a backend
payload (images), a KV export (a PD prefill instance) or no budget left for a draft are not offered: they
decode one token a step as before.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence as Tokens
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .kv_cache import KVCacheManager
from .outputs import OutputProcessor
from .policy import StepPlan
from .request import EngineRequest, RequestError, SamplingParams, TokenLogprob
from .sampling import constrain_row, filter_logits, top_logprobs
from .sequence import Sequence

log = logging.getLogger("mindie_host.engine")


@dataclass(frozen=True)
class DraftRequest:
    """What a proposer sees of one decoding sequence (read-only: never mutate ``token_ids``).

    :ivar seq_id: the engine's sequence id (stable while the request lives; a preempted
        sequence keeps it and recomputes its KV).
    :ivar request_id: the request's id.
    :ivar token_ids: the sequence's tokens so far, prompt then output (the engine's own list).
    :ivar prompt_len: how many of ``token_ids`` are the prompt.
    :ivar sampling: the request's sampling parameters.
    :ivar extensions: the request's per-plugin data (``EngineRequest.extensions``), e.g. an opt-out.
    :ivar variant: the model variant the sequence runs (-1: the base model).
    :ivar max_drafts: the most draft tokens the engine verifies for it this step (its token
        budget minus the one token every step makes); always >= 1.
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    prompt_len: int
    sampling: SamplingParams
    extensions: dict[str, Any]
    variant: int
    max_drafts: int


@dataclass
class Drafts:
    """A proposer's draft tokens for one sequence.

    :ivar tokens: the drafts, in order (those past ``max_drafts`` are dropped).
    :ivar probs: ``[len(tokens), vocab]`` float: row ``i`` is the distribution ``tokens[i]`` was
        drawn from (a draft model sampling), or ``None`` for a deterministic proposer (``q``
        one-hot at the token).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class DraftOutcome:
    """What became of one sequence's drafts in a step.

    :ivar seq_id: the sequence.
    :ivar request_id: its request.
    :ivar proposed: how many drafts were verified.
    :ivar accepted: how many leading drafts were accepted (their KV is kept).
    :ivar num_tokens: the sequence's token count after the step (prompt and output).
    :ivar finished: whether the sequence ended in this step.
    """

    seq_id: int
    request_id: str
    proposed: int
    accepted: int
    num_tokens: int
    finished: bool


class Speculator:
    """Asks the proposer for drafts, makes room for them in the KV cache, verifies them and rolls back."""

    def __init__(
        self, hook: Any, kv: KVCacheManager, outputs: OutputProcessor, counters: Counter[str], vocab_size: int
    ) -> None:
        self.hook = hook
        self.kv = kv
        self.outputs = outputs
        self.counters = counters
        self.vocab_size = vocab_size
        #: this step's allowed sets of constrained sequences: seq_id -> one per verification row
        self.masks: dict[int, list[Any]] = {}

    def active(self) -> bool:
        """Whether any plugin implements the proposer hook."""
        return bool(self.hook.mindie_host_propose_drafts.get_hookimpls())

    @staticmethod
    def _eligible(seq: Sequence, n: int) -> int:
        """How many drafts ``seq`` may take this step (0: it is not offered)."""
        req = seq.request
        if n != 1 or seq.num_computed + 1 != seq.num_tokens:
            return 0
        if req.logits_constraint is not None and not callable(getattr(req.logits_constraint, "fork", None)):
            return 0
        if req.payload is not None:
            return 0
        if req.kv_transfer is not None and req.kv_transfer.direction == "export":  # P hands over after one token
            return 0
        return max(0, seq.max_new_tokens - seq.num_output_tokens - 1)

    def propose(self, plan: StepPlan) -> dict[int, Drafts]:
        """The drafts of this step's decoding sequences, by ``seq_id``, with KV blocks allocated for them."""
        self.masks = {}
        seqs: list[Sequence] = []
        views: list[DraftRequest] = []
        for seq, n in plan.scheduled:  # type: ignore[assignment]
            room = self._eligible(seq, n)  # type: ignore[arg-type]
            if room:
                seqs.append(seq)  # type: ignore[arg-type]
                req = seq.request  # type: ignore[attr-defined]
                views.append(DraftRequest(seq.seq_id, seq.request_id, seq.token_ids, seq.prompt_len, req.sampling,
                                          req.extensions, req.variant, room))
        if not views:
            return {}
        try:
            answer = self.hook.mindie_host_propose_drafts(seqs=views)
        except Exception:
            log.exception("the draft proposer failed; this step decodes without drafts")
            self.counters["spec_proposer_errors"] += 1
            return {}
        if answer is None:
            return {}
        if len(answer) != len(views):
            log.error("the draft proposer answered %d entries for %d sequences; ignoring its answer",
                      len(answer), len(views))
            self.counters["spec_proposer_errors"] += 1
            return {}
        drafts: dict[int, Drafts] = {}
        for seq, view, got in zip(seqs, views, answer):
            if got is None or not got.tokens:
                continue
            tokens = [int(t) for t in list(got.tokens)[: view.max_drafts]]
            if any(not 0 <= t < self.vocab_size for t in tokens) or (
                got.probs is not None and tuple(got.probs.shape[-1:]) != (self.vocab_size,)
            ):
                log.error("the draft proposer gave token ids or a distribution outside the vocabulary for %s",
                          seq.request_id)
                self.counters["spec_proposer_errors"] += 1
                continue
            constraint = seq.request.logits_constraint
            if constraint is not None:
                try:
                    masks = draft_masks(constraint, seq.output_token_ids, tokens)
                except Exception:
                    log.exception("the logits constraint of %s failed on its drafts; it decodes without them",
                                  seq.request_id)
                    continue
                if masks is None:
                    continue
                tokens = tokens[: len(masks) - 1]
            m = len(tokens)
            while m and not self.kv.can_allocate(seq, 1 + m):
                m -= 1  # the cache is short: fewer drafts (never a preemption for a draft)
            if not m:
                continue
            self.kv.allocate(seq, 1 + m)
            probs = None if got.probs is None else got.probs[:m].float().cpu()
            drafts[seq.seq_id] = Drafts(tokens[:m], probs)
            if constraint is not None:
                self.masks[seq.seq_id] = masks[: m + 1]
        return drafts

    def verify(self, seq: Sequence, rows: torch.Tensor, drafts: Drafts) -> tuple[list[int], list[TokenLogprob | None], int]:
        """Walk ``seq``'s verification rows (``rows[i]`` predicts the token after draft ``i``).

        :return: the tokens to append (the accepted drafts, then the target's own token), their
            logprobs (when the request asks), and how many drafts were accepted.
        """
        params = seq.request.sampling
        tokens = drafts.tokens
        rows = rows.float()
        penalties = params.needs_penalties
        masks = self.masks.pop(seq.seq_id, None)
        # a row is changed before it is read when any of these apply (the ban only ever lifts along the rows)
        processed = (penalties or params.logit_bias or not params.greedy or masks is not None
                     or self.outputs.banned_tokens(seq, 0) is not None)
        if not processed and params.logprobs is None:  # plain greedy: every row's argmax in one call
            best = rows.argmax(dim=-1).tolist()
            accepted = 0
            while accepted < len(tokens) and best[accepted] == tokens[accepted]:
                accepted += 1
            return best[: accepted + 1], [None] * (accepted + 1), accepted
        if processed and rows.is_inference():
            rows = rows.clone()
        prompt = seq.token_ids[: seq.prompt_len] if penalties else []
        output = seq.output_token_ids if penalties else []
        out: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        for i in range(len(tokens) + 1):
            row = rows[i]
            banned = self.outputs.banned_tokens(seq, i)
            allowed = masks[i] if masks is not None else None
            if penalties or banned or params.logit_bias or not params.greedy or allowed is not None:
                constrain_row(row, params, prompt, output + tokens[:i] if penalties else output, allowed, banned)
            if params.greedy:
                token = int(row.argmax().item())
                accepted = i < len(tokens) and token == tokens[i]
            else:
                token, accepted = self._draw(row, params, seq.generator, tokens, drafts.probs, i)
            out.append(token)
            if params.logprobs is not None:
                logprobs.append(top_logprobs(torch.log_softmax(row, dim=-1), token, int(params.logprobs)))
            else:
                logprobs.append(None)
            if not accepted:
                return out, logprobs, i
        return out, logprobs, len(tokens)

    @staticmethod
    def _draw(row: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, tokens: Tokens[int],
              q: torch.Tensor | None, i: int) -> tuple[int, bool]:
        """Rejection sampling at row ``i``: (the token, whether it is the accepted draft ``tokens[i]``)."""
        p = filter_logits(row, params)
        if i == len(tokens):  # past the last draft: the target's own draw
            return int(torch.multinomial(p, 1, generator=generator).item()), False
        d = tokens[i]
        q_d = 1.0 if q is None else float(q[i, d])
        u = float(torch.rand((), generator=generator).item())
        if q_d > 0.0 and u * q_d < float(p[d]):
            return d, True
        if q is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - q[i].to(p.dtype)).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q (up to rounding): nothing left to correct
            residual = p
        return int(torch.multinomial(residual, 1, generator=generator).item()), False

    def settle(self, seq: Sequence, accepted: int) -> None:
        """After the accepted tokens were appended: keep the KV of the accepted drafts, free the blocks past it."""
        seq.num_computed += accepted
        self.kv.on_computed(seq)
        self.kv.free_tail(seq)

    def count(self, outcomes: list[DraftOutcome]) -> None:
        """Add a step's outcomes to the counters and tell the proposer."""
        for o in outcomes:
            self.counters["spec_verifications"] += 1
            self.counters["spec_draft_tokens"] += o.proposed
            self.counters["spec_accepted_tokens"] += o.accepted
        if outcomes:
            try:
                self.hook.mindie_host_drafts_accepted(outcomes=outcomes)
            except Exception:
                log.exception("the draft proposer failed on the step's outcomes")
                self.counters["spec_proposer_errors"] += 1


def draft_masks(constraint: Any, output: list[int], drafts: list[int]) -> list[Any] | None:
    """The allowed sets of a constrained sequence's verification rows: entry ``i`` is what ``constraint`` allows
    after ``output + drafts[:i]``; the list stops after the first draft it does not allow (so ``len - 1`` drafts
    stand). Walked on a fork: the constraint itself does not move. None when it cannot fork."""
    twin = constraint.fork()
    if twin is None:
        return None
    masks = [twin(output)]
    for i, token in enumerate(drafts):
        if not _allows(masks[-1], token):
            break
        masks.append(twin(output + drafts[: i + 1]))
    return masks


def _allows(allowed: Any, token: int) -> bool:
    if allowed is None:  # the constraint lets everything through
        return True
    if isinstance(allowed, torch.Tensor | np.ndarray):
        return bool((allowed == token).any())
    return token in allowed


#: The request body field (any protocol, top level) that turns speculative decoding off for one request.
OPT_OUT_FIELD = "speculative_decoding"
#: Where a proposer plugin records the opt-out (``EngineRequest.extensions``).
OPT_OUT_KEY = "speculative_decoding"


def read_opt_out(request: EngineRequest, body: dict[str, Any]) -> None:
    """Read ``speculative_decoding`` (true/false, default true) from a request body into ``request.extensions``;
    a proposer skips a sequence whose request said false (:func:`opted_out`).

    :raises RequestError: (400) when the field is there and not a boolean.
    """
    value = body.get(OPT_OUT_FIELD) if isinstance(body, dict) else None
    if value is None:
        return
    if not isinstance(value, bool):
        raise RequestError(f"{OPT_OUT_FIELD} must be true or false, got {value!r}", field=OPT_OUT_FIELD, status=400)
    if not value:
        request.extensions[OPT_OUT_KEY] = False


def opted_out(seq: DraftRequest) -> bool:
    """Whether ``seq``'s request turned speculative decoding off (:func:`read_opt_out`)."""
    return seq.extensions.get(OPT_OUT_KEY) is False


def speculation_metrics(host: Any) -> dict[str, float] | None:
    """A proposer plugin's gauges (return them from ``mindie_host_metrics``): drafts verified and accepted, the
    acceptance rate, and the mean tokens a verified sequence made per step (the accepted drafts plus the target's
    own token), from the engine's counters. ``None`` in a front end whose engine runs in its own process: the
    engine process reports the plugin's gauges itself (never ``host.stats()`` here: it asks every plugin's
    metrics, this one included)."""
    llm = getattr(host, "llm", None)
    if llm is None:
        return None
    stats = llm.stats()
    verified = stats.get("spec_verifications", 0.0)
    drafted = stats.get("spec_draft_tokens", 0.0)
    accepted = stats.get("spec_accepted_tokens", 0.0)
    return {
        "spec_decode_draft_tokens": drafted,
        "spec_decode_accepted_tokens": accepted,
        "spec_decode_acceptance_rate": accepted / drafted if drafted else 0.0,
        "spec_decode_mean_accepted_length": (accepted + verified) / verified if verified else 0.0,
    }
