"""Turning a step's logits into next tokens: penalties, filters, greedy or seeded sampling, logprobs.

Greedy rows are an argmax over the whole batch at once. Sampled rows are drawn
one by one with the request's own ``torch.Generator``, so a seeded request gives
the same tokens whether it runs alone or in a batch.
"""

from __future__ import annotations

import numpy as np
import torch

from .request import SamplingParams, TokenLogprob


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens; presence and frequency penalties over output tokens."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        if seen.numel():
            vals = logits[seen]
            rp = params.repetition_penalty
            # clamped: a penalty near zero must not turn logits into inf (and probabilities into nan)
            logits[seen] = torch.where(vals > 0, vals / rp, vals * rp).clamp(-1e30, 1e30)
    if output and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(output, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> None:
    """Add each token's bias to its logit in place; a bias of -100 or less bans the token (OpenAI's rule)."""
    ids = torch.tensor(list(bias), dtype=torch.long)
    values = torch.tensor([float("-inf") if v <= -100 else float(v) for v in bias.values()], dtype=logits.dtype)
    logits[ids] += values


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p and typical-p on one row; returns probabilities."""
    logits = logits / max(params.temperature, 1e-5)
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.typical_p < 1.0:
        logp = torch.log(probs.clamp_min(1e-30))
        entropy = -(probs * logp).nansum()
        shifted = (-logp - entropy).abs()
        order = shifted.argsort()
        cum = probs[order].cumsum(0)
        keep = int((cum < params.typical_p).sum().item()) + 1
        mask = torch.ones_like(probs, dtype=torch.bool)
        mask[order[:keep]] = False
        probs = probs.masked_fill(mask, 0.0)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        cum = sorted_p.cumsum(0)
        drop = (cum - sorted_p) > params.top_p
        drop[0] = False
        probs = probs.scatter(0, order[drop], 0.0)
    total = probs.sum()
    return probs / total if total > 0 else torch.softmax(logits, dim=-1)


def constrain_row(
    row: torch.Tensor,
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
    allowed: list[int] | None,
    banned: list[int] | None,
) -> None:
    """Penalties, ``logit_bias``, the allowed set and the banned tokens, applied in place to one float row of
    logits: what the sampler draws from (and reports logprobs of) before temperature and the filters."""
    if params.needs_penalties:
        apply_penalties(row, params, prompt, output)
    if params.logit_bias:
        apply_logit_bias(row, params.logit_bias)
    if allowed is not None:
        # an allowed set is often most of the vocabulary (inside a JSON string): numpy builds its index from a list
        # of ints ~20x faster than torch.tensor does
        mask = torch.full_like(row, float("-inf"))
        mask[torch.from_numpy(np.asarray(allowed, dtype=np.int64))] = 0.0
        row += mask
    if banned:
        row[torch.tensor(banned, dtype=torch.long)] = float("-inf")


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded from a (possibly 64-bit) request seed."""
    g = torch.Generator()
    g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def top_logprobs(logprobs_row: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """The chosen token's log probability and the ``k`` most likely alternatives."""
    chosen = float(logprobs_row[token])
    top: list[tuple[int, float]] = []
    if k > 0:
        vals, idx = torch.topk(logprobs_row, k)
        top = [(int(i), float(v)) for i, v in zip(idx.tolist(), vals.tolist())]
    return TokenLogprob(token_id=token, logprob=chosen, top=top)


class Sampler:
    """Samples one token per row of a logits batch."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        prompts: list[list[int]],
        outputs: list[list[int]],
        generators: list[torch.Generator | None],
        allowed: list[list[int] | None],
        banned: list[list[int] | None] | None = None,
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Return the next token of every row, and its logprobs where requested.

        ``allowed[i]`` restricts row ``i`` to those token ids; ``banned[i]`` forbids
        some (EOS and stop tokens before ``min_tokens`` are reached).
        """
        banned = banned or [None] * len(params)
        logits = logits.float()
        rows = logits.shape[0]
        special = [
            i for i in range(rows)
            if params[i].needs_penalties or allowed[i] is not None or banned[i] or not params[i].greedy
            or params[i].logit_bias
        ]
        if special and logits.device.type != "cpu":
            # penalties, masks and seeded draws run on the CPU, with the request's CPU generator,
            # so a seeded request draws the same tokens on every device
            logits = logits.cpu()
        if special and logits.is_inference():
            logits = logits.clone()  # penalties and masks edit rows in place; inference tensors forbid that
        for i in special:
            constrain_row(logits[i], params[i], prompts[i], outputs[i], allowed[i], banned[i])
        tokens = logits.argmax(dim=-1).tolist()
        for i in special:
            p = params[i]
            if p.greedy:
                continue
            probs = filter_logits(logits[i], p)
            tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
        logprobs: list[TokenLogprob | None] = [None] * rows
        want = [i for i in range(rows) if params[i].logprobs is not None]
        if want:
            lp = torch.log_softmax(logits[want], dim=-1)
            for j, i in enumerate(want):
                logprobs[i] = top_logprobs(lp[j], tokens[i], int(params[i].logprobs or 0))
        return tokens, logprobs
