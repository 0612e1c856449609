"""From sampled tokens to what a request streams: token appending, stop rules, detokenization, outputs.

:class:`OutputProcessor` appends the tokens a step produced for a sequence (one per step in the
builtin loop, or several at once), applies the stop rules after each one (EOS unless
``ignore_eos``, stop token ids, stop strings, ``min_tokens``, the sequence's token budget),
detokenizes incrementally, and builds each :class:`~.request.RequestOutput` increment. It never
ends a sequence itself: :meth:`~OutputProcessor.append_tokens` returns the finish reason and the
engine ends it (the scheduler frees its blocks).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Tokens
from typing import Any

import torch

from .detokenizer import Detokenizer
from .request import RequestOutput, TokenLogprob
from .sequence import Sequence, SequenceStatus


class OutputProcessor:
    """Appends sampled tokens to sequences, applies the stop rules, detokenizes and builds outputs."""

    def __init__(self, tokenizer: Any, eos_token_ids: Tokens[int], vocab_size: int) -> None:
        self.detok = Detokenizer(tokenizer)
        self.eos_ids = set(eos_token_ids)
        self.vocab_size = vocab_size

    def start(self, seq: Sequence) -> None:
        """Prepare a new sequence's incremental detokenization."""
        seq.detok_state = self.detok.start(seq.prompt_len)

    # -- stop rules ----------------------------------------------------------------------------
    def banned_tokens(self, seq: Sequence, ahead: int = 0) -> list[int] | None:
        """EOS and stop tokens may not be sampled until ``min_tokens`` outputs exist (counting ``ahead`` tokens
        not appended yet: the draft tokens before a verification row)."""
        params = seq.request.sampling
        if seq.num_output_tokens + ahead >= params.min_tokens:
            return None
        banned = [t for t in params.stop_token_ids if 0 <= t < self.vocab_size]  # ids the model cannot emit need no ban
        if not params.ignore_eos:
            banned.extend(self.eos_ids)
        return banned or None

    def append_tokens(
        self, seq: Sequence, tokens: Tokens[int], logprobs: Tokens[TokenLogprob | None], now: float
    ) -> tuple[int, str | None]:
        """Append ``tokens`` (with their logprobs) to ``seq`` one by one, applying the stop rules after each.

        :return: how many of ``tokens`` were taken (those after a stop are not) and the finish reason
            (``"stop"`` or ``"length"``) when a rule ended the sequence, else None. The caller ends it.
        """
        for i, (token, lp) in enumerate(zip(tokens, logprobs)):
            reason = self._append(seq, token, lp, now)
            if reason is not None:
                return i + 1, reason
        return len(tokens), None

    def _append(self, seq: Sequence, token: int, lp: TokenLogprob | None, now: float) -> str | None:
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
            return "stop"
        self._detokenize(seq)
        if params.stop and self._match_stop_string(seq):
            return "stop"
        if n_out >= seq.max_new_tokens:
            return "length"
        return None

    def _detokenize(self, seq: Sequence) -> None:
        seq.output_text += self.detok.step(seq.token_ids, seq.detok_state, seq.request.sampling.skip_special_tokens)

    @staticmethod
    def _match_stop_string(seq: Sequence) -> bool:
        """Whether the text now holds a stop string; if so cut the text there and record it as the stop reason."""
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
        return True

    # -- outputs --------------------------------------------------------------------------------
    @staticmethod
    def record_prompt_logprobs(seq: Sequence, rows: torch.Tensor, start: int) -> None:
        """Logprob of each prompt token given the tokens before it (TGI ``decoder_input_details``), from the
        logits ``rows`` of prompt positions ``start`` onwards."""
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

    @staticmethod
    def make_output(seq: Sequence) -> RequestOutput:
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
