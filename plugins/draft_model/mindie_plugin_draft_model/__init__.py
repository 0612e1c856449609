"""mindie-host plugin ``draft_model``: speculative decoding with a draft model in the engine process.

A second, smaller model with the same tokenizer proposes the next tokens of every decoding
sequence (one batched pass per draft position, over its own paged KV cache), and the engine
verifies them in the served model's forward pass: the output is the served model's own (token
for token under greedy decoding). Self-speculation uses the served model's own GGUF as the
draft, read in its low-bit form (``quantization: "auto"``), while the target runs at
``quantization: "none"``: the draft agrees with the target most of the time and reads a quarter
of the bytes.

Enabled per model::

    "ModelConfig": [{"plugin_params": "{\\"plugin_type\\":\\"draft_model\\"}", ...}]
    "Plugins": {"draft_model": {"modelWeightPath": "/models/SmolLM2-135M", "quantization": "auto",
                                "numSpeculativeTokens": 4, "maxBatchSize": 8}}

``modelWeightPath`` takes what ``ModelConfig.modelWeightPath`` takes (a directory, a GGUF file, or
empty for the default model). The draft's vocabulary must be the served model's (refused at
startup otherwise). A request opts out with ``"speculative_decoding": false``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, StrictInt, StrictStr

from mindie_host.api import (
    DraftOutcome,
    DraftRequest,
    Drafts,
    EngineContext,
    EngineRequest,
    HostContext,
    KVCacheManager,
    default_model_path,
    hookimpl,
    opted_out,
    read_opt_out,
    resolve_model,
    speculation_metrics,
)

from .drafter import Drafter, blocks_for

__all__ = ["PLUGIN_NAME", "Drafter", "Params"]

PLUGIN_NAME = "draft_model"
SCHEMES = ("auto", "none")


class Params(BaseModel):
    """``Plugins.draft_model``."""

    #: the draft model: a directory, a GGUF file, or empty for the default model
    modelWeightPath: StrictStr = ""
    #: how the draft's weights are read: "auto" (a GGUF's low-bit form) or "none" (dequantized)
    quantization: StrictStr = "auto"
    #: the most draft tokens proposed per sequence and step (k)
    numSpeculativeTokens: StrictInt = Field(default=4, ge=1, le=16)
    #: no drafts in a step with more decoding sequences than this: verification then costs more than it saves
    maxBatchSize: StrictInt = Field(default=4, ge=1, le=4096)


class State:
    """The drafter, built on first use in the process that runs the engine."""

    def __init__(self) -> None:
        self.drafter: Drafter | None = None


@hookimpl
def mindie_host_validate_config(ctx: HostContext) -> list[str]:
    """The scheme must be one the draft can be read with, and the weights must resolve."""
    if PLUGIN_NAME not in ctx.model.plugins:
        return []
    params: Params = ctx.params
    errors = []
    if params.quantization not in SCHEMES:
        errors.append(f"Plugins.draft_model.quantization: got {params.quantization!r}; allowed: {', '.join(SCHEMES)}")
    try:
        resolve_model(params.modelWeightPath or default_model_path())
    except Exception as exc:
        errors.append(f"Plugins.draft_model.modelWeightPath: got {params.modelWeightPath!r}; allowed: a model "
                      f"directory or GGUF file ({exc})")
    return errors


def build_drafter(ctx: Any) -> Drafter:
    """Load the draft model with a KV cache for ``maxBatchSize`` sequences of ``maxSeqLen`` tokens."""
    from mindie_host.backend_api import TorchBackend

    params: Params = ctx.params
    backend = TorchBackend(resolve_model(params.modelWeightPath or default_model_path()), name="draft",
                           dtype="float32", quantization=params.quantization)
    backend.load()
    block_size = ctx.config.schedule.cacheBlockSize
    blocks = blocks_for(params.maxBatchSize, ctx.config.deploy.maxSeqLen, block_size)
    backend.allocate_kv_cache(blocks, block_size)
    ctx.log.info("draft model %s loaded (quantization %s, %d KV blocks)", backend.name, params.quantization, blocks)
    return Drafter(backend, KVCacheManager(blocks, block_size))


@hookimpl
def mindie_host_startup(ctx: HostContext) -> None:
    """Refuse a draft whose vocabulary is not the served model's; load it now when the engine runs here
    (in an engine process it loads on the first step that proposes)."""
    from mindie_host.backend_api import load_arch

    host = ctx.host
    assert host is not None

    vocab = load_arch(resolve_model(ctx.params.modelWeightPath or default_model_path())).vocab_size
    if host.info is not None and vocab != host.info.vocab_size:
        raise RuntimeError(f"Plugins.draft_model.modelWeightPath: the draft's vocabulary has {vocab} tokens, the "
                           f"served model's {host.info.vocab_size}; allowed: a model with the same tokenizer")
    if getattr(host, "llm", None) is not None and ctx.state.drafter is None:
        ctx.state.drafter = build_drafter(ctx)


@hookimpl
def mindie_host_refine_request(ctx: HostContext, request: EngineRequest, body: dict[str, Any]) -> None:
    """``speculative_decoding: false`` turns the drafts off for this request (a non-boolean is a 400)."""
    read_opt_out(request, body)


@hookimpl
def mindie_host_propose_drafts(ctx: EngineContext, seqs: list[DraftRequest]) -> list[Drafts | None] | None:
    """The draft model's greedy continuation of every sequence, in one batched pass per position."""
    params: Params = ctx.params
    if len(seqs) > params.maxBatchSize:
        return None
    drafter = ctx.state.drafter
    if drafter is None:
        drafter = ctx.state.drafter = build_drafter(ctx)
    offered = [s for s in seqs if not opted_out(s)]
    proposed = dict(zip((s.seq_id for s in offered), drafter.propose(offered, params.numSpeculativeTokens)))
    return [Drafts(proposed[s.seq_id]) if proposed.get(s.seq_id) else None for s in seqs]


@hookimpl
def mindie_host_drafts_accepted(ctx: EngineContext, outcomes: list[DraftOutcome]) -> None:
    """Roll the draft's KV back to the accepted tokens."""
    if ctx.state.drafter is not None:
        ctx.state.drafter.accepted(outcomes)


@hookimpl
def mindie_host_request_finished(ctx: HostContext, request: EngineRequest) -> None:
    """Free the request's draft KV."""
    if ctx.state.drafter is not None:
        ctx.state.drafter.release(request.request_id)


@hookimpl
def mindie_host_metrics(ctx: HostContext) -> dict[str, float] | None:
    """Drafts proposed and accepted, the acceptance rate and the mean accepted length (/metrics, /metrics-json)."""
    return speculation_metrics(ctx.host) if ctx.host is not None else None
