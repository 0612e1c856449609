"""mindie-host plugin ``llma``: inference with reference (LLMA, also called prompt lookup), a draft-token proposer.

Summaries, answers over retrieved documents, code edits and chat over a document repeat their
input. Each step this plugin looks for the last few tokens of every decoding sequence earlier
in its own tokens (prompt and output, longest n-gram first) and proposes the tokens that followed
there as drafts; the engine verifies them in the step's one forward pass (the output is the
model's own, token for token under greedy decoding) and every accepted draft is a token gained
for nearly nothing: a decode step on CPU reads all the weights whether it checks one row or five.
There is no extra model and the lookup costs microseconds per sequence.

Enabled per model::

    "ModelConfig": [{"plugin_params": "{\\"plugin_type\\":\\"llma\\"}", ...}]
    "Plugins": {"llma": {"numSpeculativeTokens": 8, "maxNgram": 3, "minNgram": 1, "shortMatch": 2,
                         "shortMatchDrafts": 2, "maxBatchSize": 8, "maxStepDrafts": 8}}

A request opts out with ``"speculative_decoding": false`` in its body.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, StrictInt, model_validator

from mindie_host.api import (
    DraftOutcome,
    DraftRequest,
    Drafts,
    EngineContext,
    EngineRequest,
    HostContext,
    hookimpl,
    opted_out,
    read_opt_out,
    speculation_metrics,
)

from .lookup import NgramIndex

__all__ = ["PLUGIN_NAME", "NgramIndex", "Params", "State", "next_k"]

PLUGIN_NAME = "llma"


class Params(BaseModel):
    """``Plugins.llma``."""

    #: the most draft tokens proposed per sequence and step (k)
    numSpeculativeTokens: StrictInt = Field(default=8, ge=1, le=16)
    #: the longest n-gram looked up (tried first)
    maxNgram: StrictInt = Field(default=3, ge=1, le=16)
    #: the shortest n-gram looked up: the minimum match length
    minNgram: StrictInt = Field(default=1, ge=1, le=16)
    #: a match of at most this many tokens (the n-gram and the agreeing tokens before it) is often chance: it
    #: proposes at most ``shortMatchDrafts`` (0: no such cap)
    shortMatch: StrictInt = Field(default=2, ge=0, le=16)
    #: the most drafts a short match proposes
    shortMatchDrafts: StrictInt = Field(default=2, ge=1, le=16)
    #: no drafts in a step with more decoding sequences than this: verification then costs more than it saves
    maxBatchSize: StrictInt = Field(default=8, ge=1, le=4096)
    #: the most drafts in one step, shared evenly by its decoding sequences (at least one each): a verification
    #: row costs about what a batch row does, so a batch of several sequences verifies fewer drafts each
    maxStepDrafts: StrictInt = Field(default=8, ge=1, le=4096)

    @model_validator(mode="after")
    def _ngram_range(self) -> Params:
        if self.minNgram > self.maxNgram:
            raise ValueError(f"minNgram ({self.minNgram}) must be at most maxNgram ({self.maxNgram})")
        return self


class State:
    """One n-gram index per live request, and how many drafts it gets next (adapted to what it accepts)."""

    def __init__(self) -> None:
        self.indexes: dict[str, NgramIndex] = {}
        self.k: dict[str, int] = {}


def next_k(k_max: int, proposed: int, accepted: int) -> int:
    """A request's next k: twice what it proposed after a fully accepted run, else one more than it accepted."""
    return min(k_max, 2 * proposed if accepted == proposed else accepted + 1)


@hookimpl
def mindie_host_refine_request(ctx: HostContext, request: EngineRequest, body: dict[str, Any]) -> None:
    """``speculative_decoding: false`` turns the drafts off for this request (a non-boolean is a 400)."""
    read_opt_out(request, body)


@hookimpl
def mindie_host_propose_drafts(ctx: EngineContext, seqs: list[DraftRequest]) -> list[Drafts | None] | None:
    """Copy what followed an earlier occurrence of each sequence's last n-gram (the first one at or after where
    its copy had reached, else the latest: :class:`NgramIndex`)."""
    params: Params = ctx.params
    if len(seqs) > params.maxBatchSize:
        return None
    indexes = ctx.state.indexes
    share = max(1, params.maxStepDrafts // max(1, sum(not opted_out(s) for s in seqs)))
    out: list[Drafts | None] = []
    for s in seqs:
        if opted_out(s):
            out.append(None)
            continue
        index = indexes.get(s.request_id)
        if index is None:
            index = indexes[s.request_id] = NgramIndex(params.minNgram, params.maxNgram, params.shortMatch,
                                                       params.shortMatchDrafts)
        k = ctx.state.k.get(s.request_id, params.numSpeculativeTokens)
        tokens = index.propose(s.token_ids, min(k, share, s.max_drafts))
        out.append(Drafts(tokens) if tokens else None)
    return out


@hookimpl
def mindie_host_drafts_accepted(ctx: EngineContext, outcomes: list[DraftOutcome]) -> None:
    """Move each request's copy cursor past what it accepted, and adapt its k: twice as many after a fully
    accepted run (a copy in progress: up to ``numSpeculativeTokens``), else one more than it accepted, so a
    request whose text does not repeat verifies few rows (a row costs compute even when the step is bound by
    reading the weights)."""
    k_max = ctx.params.numSpeculativeTokens
    for o in outcomes:
        if o.finished:
            continue
        index = ctx.state.indexes.get(o.request_id)
        if index is not None:
            index.accepted(o.accepted)
        ctx.state.k[o.request_id] = next_k(k_max, o.proposed, o.accepted)


@hookimpl
def mindie_host_request_finished(ctx: HostContext, request: EngineRequest) -> None:
    """Drop the request's index."""
    ctx.state.indexes.pop(request.request_id, None)
    ctx.state.k.pop(request.request_id, None)


@hookimpl
def mindie_host_metrics(ctx: HostContext) -> dict[str, float] | None:
    """Drafts proposed and accepted, the acceptance rate and the mean accepted length (/metrics, /metrics-json)."""
    return speculation_metrics(ctx.host) if ctx.host is not None else None
