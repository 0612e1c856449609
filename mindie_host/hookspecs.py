"""The whole plugin contract of mindie-host: every hook the host calls.

A plugin is a module or object with functions marked ``@mindie_host.hookimpl``
whose names match the specs below. It is found through the entry-point group
``mindie_host.plugins`` and switched on per model in ``config.json``
(``ModelConfig[].plugin_params`` = ``{"plugin_type": "name[,name...]"}``).
The host's own defaults (FCFS policy, Standard planner, plain KV-cache manager,
the ``torch`` backend, the protocol frontends) are registered the same way, as
builtins, so a plugin replaces a default through the same door.

Hooks marked *firstresult* stop at the first implementation that returns a
value other than ``None``; plugins registered later are called first, so an
enabled plugin wins over a builtin. Other hooks call every implementation and
collect the results in a list.

The hooks fall into five concerns:

* lifecycle: validating a plugin's own config, startup, shutdown, metrics;
* request parsing: protocol routes, refining an engine request, tool-call and reasoning parsers;
* scheduling policy: ordering the waiting queue, planning each step's batch, proposing draft tokens;
* KV-cache management: the block manager (allocate, share, free, evict), and the connector that
  moves blocks between prefill and decode instances;
* model backend: the runner for a ``backendType``, and the model families (architectures) it can load.

Every hook takes a ``ctx`` argument first: a frozen, typed context built for
the implementing plugin, one class per shape (:mod:`mindie_host.context`:
:class:`HostContext` for the lifecycle and request-parsing hooks,
:class:`EngineContext` for the scheduling and KV-cache hooks,
:class:`BackendContext` for the model-backend hooks). It carries the config
(``ctx.config``), the model entry (``ctx.model``), the running host where there
is one (``ctx.host``), the plugin's validated ``Params``, its logger
(``mindie_host.plugins.<name>``) and its per-engine ``State``. The other
arguments are what the hook is about, never what ``ctx`` already carries.

This is plugin contract 3 (:data:`mindie_host.api.CONTRACT_VERSION`). An
implementation takes ``ctx`` and any subset of its spec's other arguments, so a
spec that grows an argument never breaks an existing plugin; one that names an
argument its spec does not have (contract 2's ``config``, ``model_config`` and
``host``) is refused when its plugin is registered, with one message naming the
plugin, the hook and the migration (docs/plugins.md, "Migrating to contract 3").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from fastapi import FastAPI

    from .backends.base import LinearDeltas, ModelBackend, ModelInfo
    from .context import BackendContext, EngineContext, HostContext
    from .engine.kv_cache import KVCacheManager
    from .engine.kv_transfer import KVConnector
    from .engine.policy import SchedulerState, StepPlan
    from .engine.request import EngineRequest, RequestOutput
    from .engine.sequence import SequenceView
    from .engine.speculation import DraftOutcome, DraftRequest, Drafts
    from .models.architecture import Architecture

hookspec = pluggy.HookspecMarker("mindie_host")


# ---------------------------------------------------------------------------------------------
# lifecycle
# ---------------------------------------------------------------------------------------------
@hookspec
def mindie_host_validate_config(ctx: HostContext) -> list[str] | None:
    """Check this plugin's own settings before anything is loaded.

    ``ctx.config`` is the whole parsed config, ``ctx.model`` the ``ModelConfig``
    entry being checked (called once per entry; ``ctx.model.plugin_options`` holds
    the extra keys of ``plugin_params``), ``ctx.params`` the plugin's validated
    ``Params`` (a plugin without ``Params`` reads ``ctx.config.Plugins.get(name)``
    itself), and ``ctx.host`` is ``None``: nothing is loaded yet.

    :return: a list of error messages (each naming the key, the value given and
        the allowed range), or ``None``/``[]`` when the config is fine. Any error
        stops startup. Called for every enabled plugin; not firstresult.
    """


@hookspec
def mindie_host_startup(ctx: HostContext) -> None:
    """Called once the model is loaded and the engine is built, before serving.

    ``ctx.host`` is the running :class:`~mindie_host.host_protocol.Host` (config, tokenizer,
    model info, engine statistics). Use it to load adapters, register
    metrics, start background work. Not firstresult; return value ignored.
    """


@hookspec
def mindie_host_shutdown(ctx: HostContext) -> None:
    """Called once when the server stops, after in-flight requests have drained.

    ``ctx.host`` is the same host :func:`mindie_host_startup` saw.
    Not firstresult; return value ignored.
    """


@hookspec
def mindie_host_metrics(ctx: HostContext) -> dict[str, float] | None:
    """Contribute gauges to the JSON metrics and the Prometheus exporter (``ctx.host``: the running host).

    :return: a mapping of metric name to value (e.g.
        ``{"npu_prefix_cache_hit_rate": 0.42}``), or ``None``. Called on every
        metrics scrape for every plugin; results are merged. Not firstresult.
    """


@hookspec
def mindie_host_step_outputs(ctx: HostContext, outputs: list[RequestOutput]) -> None:
    """Observe the outputs of one engine step, in the front end, before they reach their clients.

    :param outputs: one :class:`~mindie_host.engine.request.RequestOutput` per
        request the step touched (new tokens, finished requests). Do not mutate them.
    Called once per step on the thread that delivers outputs (the engine thread,
    or the front end's IPC reader when ``engineProcess`` is on): keep it cheap.
    An exception is logged and does not reach the requests. Serving metrics and
    the native protocol's client-id bookkeeping use it. Not firstresult.
    """


@hookspec(firstresult=True)
def mindie_host_engine_command(ctx: HostContext, target: str, command: str, payload: Any) -> Any | None:
    """Run one of a plugin's own commands where the engine lives, between two steps.

    The front end asks with ``await host.engine_command(target, command, payload)``
    (a management route loading a LoRA adapter, say); the call runs on the engine
    thread, or in the engine process when ``engineProcess`` is on, so the plugin
    can change state that only exists beside the model (adapter slots, pools).

    :param target: the plugin the command is for: answer only when it is
        ``ctx.plugin``, and return ``None`` otherwise.
    :param command: the plugin's own command name.
    :param payload: the command's arguments (plain data, or anything picklable).
    :return: the answer (not ``None``; plain data or anything picklable). It
        reaches the caller once per engine instance (a list).
    :raises mindie_host.api.RequestError: reaches the caller with its status and
        field. Any other exception is logged in the engine and reaches the caller
        as a 500 without its text. firstresult.
    """


@hookspec
def mindie_host_engine_restarted(ctx: HostContext) -> None:
    """Called in the front end when the supervisor has brought a dead engine process back.

    The new engine process was built from ``config.json`` alone: state that
    plugins changed at run time through :func:`mindie_host_engine_command` is gone
    (``multi_lora`` forgets the adapters loaded at run time). Called on the
    supervisor's thread before readiness answers 200 again. Not firstresult.
    """


# ---------------------------------------------------------------------------------------------
# request parsing
# ---------------------------------------------------------------------------------------------
@hookspec
def mindie_host_add_routes(ctx: HostContext, app: FastAPI, plane: str) -> None:
    """Register HTTP routes for a protocol (``ctx.host``: the running host; protocol modules call
    ``ctx.host.generate(...)``).

    :param app: the FastAPI application of one plane.
    :param plane: ``"business"`` (inference port), ``"management"``
        (management port) or ``"metrics"`` (``metricsPort``: Prometheus
        ``/metrics``). Each builtin protocol module (openai, tgi, vllm,
        triton, native, management, metrics) implements this. Not firstresult.
    """


@hookspec
def mindie_host_refine_request(ctx: HostContext, request: EngineRequest, body: dict[str, Any], protocol: str) -> None:
    """Adjust an engine request after a protocol module has parsed it.

    :param request: the :class:`~mindie_host.engine.request.EngineRequest`,
        already tokenized and range-checked; mutate it in place (e.g. set
        ``variant``, ``cache_salt`` and your own entry in ``extensions``). This is also the
        input-processing seam for typed content items (images): the protocol
        parsers put the text a media handler gives for each item
        (:mod:`mindie_host.content`) into the prompt; the plugin then
        rewrites ``prompt_token_ids`` (placeholder spans, re-checking the length
        limit), sets ``payload`` (opaque to the engine, handed to the backend in
        ``ModelInput.payloads`` with every step that computes the request) and
        ``span_keys`` (``(start, end, key)``: a prefix cache mixes ``key`` into the
        hash of every block overlapping the span, e.g. an image's content hash).
    :param body: the raw JSON body as received.
    :param protocol: ``"openai"``, ``"tgi"``, ``"vllm"``, ``"triton"`` or ``"native"``.
    :raises mindie_host.api.RequestError: to refuse the request with a 4xx that
        names the field. Called for every plugin; not firstresult.
    """


@hookspec
def mindie_host_request_arrived(ctx: HostContext, request: EngineRequest) -> None:
    """Called when the engine accepts a request into its waiting queue, before any step runs it.

    :param request: the request as the engine will run it: with ``engineProcess``
        this is the engine process's own copy, the object that
        :func:`mindie_host_request_finished` later receives (the one refined in
        the front end stays there).
    :raises mindie_host.api.RequestError: fails this request alone with its
        message (for example when what the front end resolved no longer exists
        in the engine). Called on the engine thread; keep it cheap. Not firstresult.
    """


@hookspec
def mindie_host_request_finished(ctx: HostContext, request: EngineRequest, reason: str) -> None:
    """Called when a request leaves the engine, whatever the cause.

    :param request: the request as the engine ran it (``variant``,
        ``extensions`` ... as refined).
    :param reason: ``"stop"``, ``"length"``, ``"abort"``, ``"timeout"`` or ``"error"``.
    Called on the engine thread, once per request that reached the engine; keep
    it cheap. Plugins use it to release per-request resources (``multi_lora``
    unpins the request's adapter slot). Not firstresult; return value ignored.
    """


@hookspec(firstresult=True)
def mindie_host_tool_call_parser(ctx: HostContext, model_type: str) -> Any | None:
    """Provide the tool-call parser for a model family (``ctx.host``: the running host, whose tokenizer
    carries the chat template).

    :param model_type: the model's family (``"llama"``, ``"qwen2"``, ...).
    :return: an object with ``parse(text) -> list[dict] | None`` turning generated
        text into OpenAI ``tool_calls``; ``None`` to let another plugin answer.
        It may also have ``content(text) -> str`` (text left beside the calls) and
        ``might_be_call(prefix) -> bool`` (streams hold such text back); subclass
        :class:`mindie_host.api.ToolParser` to get defaults for these and for the
        prompt used when the chat template ignores ``tools``. Called once per
        server (the result is cached); the builtins answer last, with the format the
        model's chat template writes calls in (``<tool_call>``, DeepSeek's tool-call
        tokens, ``[TOOL_CALLS]``, GLM-4's ``<|observation|>`` turns), else the one of
        ``model_type``'s family, else bare JSON. firstresult.
    """


@hookspec(firstresult=True)
def mindie_host_reasoning_parser(ctx: HostContext, model_type: str) -> Any | None:
    """Provide the reasoning parser for a model family (``ctx.host``: the running host, whose tokenizer
    carries the chat template).

    :param model_type: the model's family (``"qwen3"``, ``"deepseek_v3"``, ...).
    :return: a :class:`mindie_host.api.ReasoningParser` (subclass it to change the
        ``start``/``end`` tags or how an answer splits) whose reasoning the OpenAI chat
        endpoint returns as ``reasoning_content`` and whose content it parses for tool
        calls; ``None`` to let another plugin answer. The builtin, registered last,
        returns the ``<think>…</think>`` parser when the model's chat template writes
        ``</think>`` and ``None`` otherwise. Called once per server (the result is
        cached). firstresult.
    """


@hookspec
def mindie_host_served_models(ctx: HostContext) -> list[str] | None:
    """Names besides the base model that requests may put in ``model`` (listed by ``/v1/models``).

    :return: the names this plugin serves (``multi_lora``: its adapters), or ``None``.
    Called on every request that names a model and every model listing: keep it
    cheap. Not firstresult; the lists are concatenated after the base model's name.
    """


# ---------------------------------------------------------------------------------------------
# scheduling policy
# ---------------------------------------------------------------------------------------------
@hookspec(firstresult=True)
def mindie_host_order_waiting(ctx: EngineContext, waiting: list[SequenceView], now: float) -> list[SequenceView] | None:
    """Order the waiting queue: the first sequence is admitted first (``ctx.config.schedule`` holds
    ``prefillPolicyType``, ``policyType`` ...).

    :param waiting: sequences not yet admitted (new, or preempted and waiting to
        be recomputed). Do not mutate them.
    :param now: ``time.monotonic()`` of this step.
    :return: the same sequences in admission order, or ``None`` to defer to the
        next implementation. firstresult; the builtin honours
        ``prefillPolicyType`` (0/1 FCFS, 2 priority, 3 MLFQ) and ``policyType``
        (4 shortest job first, 5 longest job first, 6 Skip-Join MLFQ).
    """


@hookspec(firstresult=True)
def mindie_host_order_running(ctx: EngineContext, running: list[SequenceView], now: float) -> list[SequenceView] | None:
    """Order the running batch (the sequences holding KV blocks) for this step (``ctx.config.schedule`` holds
    ``decodePolicyType``, ``policyType`` ...).

    The planner sees them in this order: with more running than ``maxBatchSize``
    the first decode, blocks for growing go to them first, and the preemption
    victims' candidates come in this order.

    :param running: the running sequences, in the order of the last step (admission
        order at first). Do not mutate them.
    :param now: ``time.monotonic()`` of this step.
    :return: the same sequences in order, or ``None`` to defer. firstresult; the
        builtin honours ``decodePolicyType`` (0 FCFS keeps the admission order, 1 STATE,
        2 priority, 3 MLFQ) and ``policyType`` 6 (Skip-Join MLFQ).
    """


@hookspec
def mindie_host_filter_waiting(ctx: EngineContext, waiting: list[SequenceView]) -> list[SequenceView] | None:
    """Hold back waiting sequences that cannot run yet.

    :param waiting: the ordered waiting queue of this step (do not mutate the
        sequences).
    :return: the subset of ``waiting`` that may be admitted now (order does not
        matter), or ``None`` to allow all. The engine keeps only sequences every
        implementation allows, and the planner sees only those. Called on the
        engine thread once per step while the queue is non-empty, before
        ``mindie_host_plan_step``; an implementation may bind resources to the
        sequences it lets through (``multi_lora`` binds a resident adapter slot,
        loading the adapter when a slot is free). Not firstresult.
    """


@hookspec(firstresult=True)
def mindie_host_plan_step(ctx: EngineContext, state: SchedulerState) -> StepPlan | None:
    """Build one step's batch.

    :param state: a :class:`~mindie_host.engine.policy.SchedulerState` with the
        running and (ordered) waiting sequences, the batch limits and read-only
        access to the KV-cache manager.
    :return: a :class:`~mindie_host.engine.policy.StepPlan` listing
        ``(sequence, num_tokens)`` pairs, or ``None`` to defer. The engine
        allocates blocks in plan order and preempts (by recomputation) running
        sequences if blocks run out. firstresult; the builtin is MindIE's
        ``Standard`` template (prefill and decode in separate steps).
    """


@hookspec(firstresult=True)
def mindie_host_preemption_victim(ctx: EngineContext, running: list[SequenceView],
                                  needed_by: SequenceView) -> SequenceView | None:
    """Choose the running sequence that gives its KV blocks back when the pool runs dry.

    :param running: the candidates: running sequences not computed in this step yet,
        in admission order (never empty). Do not mutate them.
    :param needed_by: the sequence the step is making room for.
    :return: one of ``running``, or ``None`` to defer. The engine frees the victim's
        blocks and puts it back at the head of the waiting queue; it is recomputed when
        admitted again (its generated tokens are kept, so its output does not change).
        It asks again until ``needed_by`` fits or no candidate is left (then
        ``needed_by`` itself waits). firstresult; the builtin picks the least urgent
        (highest ``priority`` number), latest-arrived sequence. An answer that is not
        among ``running`` is an error: the engine logs it and uses the builtin's choice.
    """


@hookspec(firstresult=True)
def mindie_host_propose_drafts(ctx: EngineContext, seqs: list[DraftRequest]) -> list[Drafts | None] | None:
    """Propose draft tokens for the decoding sequences of one step (speculative decoding).

    :param seqs: one :class:`~mindie_host.engine.speculation.DraftRequest` per sequence that
        decodes in this step and may take drafts (read-only: its tokens so far, the request's
        sampling parameters and ``extensions``, ``max_drafts``). Called once per step with the
        whole batch, so a draft model runs one batched pass, not one per sequence.
    :return: a list aligned with ``seqs``: for each, a :class:`~mindie_host.engine.speculation.Drafts`
        (up to ``max_drafts`` tokens, and ``probs``, the distributions a sampling draft model drew
        them from, or ``None`` for a deterministic proposer) or ``None`` for no drafts; or ``None``
        to defer. The engine verifies every draft in the step's one forward pass of the target
        model, exactly: the output distribution is the target's (greedy output token-identical to
        decoding without drafts), only faster when drafts are accepted. Called on the engine
        thread, before the forward pass: keep it cheap; an exception or a malformed answer is
        logged and the step runs without drafts. firstresult.
    """


@hookspec
def mindie_host_drafts_accepted(ctx: EngineContext, outcomes: list[DraftOutcome]) -> None:
    """Hear what became of the drafts of one step, to roll the proposer's own state back.

    :param outcomes: one :class:`~mindie_host.engine.speculation.DraftOutcome` per sequence
        whose drafts were verified: how many were proposed and accepted, the sequence's token
        count after the step, and whether it finished. Tokens past the accepted drafts were
        never appended (a draft model drops its KV of them). Called once per step on the
        engine thread, after the outputs are made. Not firstresult.
    """


# ---------------------------------------------------------------------------------------------
# KV-cache management
# ---------------------------------------------------------------------------------------------
@hookspec(firstresult=True)
def mindie_host_kv_cache_manager(ctx: EngineContext, num_blocks: int, block_size: int) -> KVCacheManager | None:
    """Create the KV-cache block manager.

    :param num_blocks: blocks that fit the memory budget.
    :param block_size: tokens per block (``cacheBlockSize``).
    :return: a :class:`~mindie_host.engine.kv_cache.KVCacheManager` (or subclass:
        ``prefix_cache`` returns one that shares blocks by chained hash), or
        ``None`` to defer. firstresult.
    """


@hookspec(firstresult=True)
def mindie_host_kv_connector(ctx: EngineContext) -> KVConnector | None:
    """Create the transport that moves KV blocks between prefill and decode instances.

    Called once per engine (in the engine process), only when ``ServerConfig.inferMode`` is
    ``"dmi"`` (PD disaggregation). The engine starts it with its cache layout and a block
    reader, offers the blocks of each handed-off sequence on a P instance, and pulls them on a
    D instance; the contract, and what "never applied in part" means, is
    :class:`~mindie_host.engine.kv_transfer.KVConnector`.

    ``ctx.config.server.ipAddress`` is where peers reach this instance.

    :return: a :class:`~mindie_host.engine.kv_transfer.KVConnector`, or ``None`` to defer (the host's
        builtin TCP connector answers last). firstresult.
    """


# ---------------------------------------------------------------------------------------------
# model backend
# ---------------------------------------------------------------------------------------------
@hookspec(firstresult=True)
def mindie_host_model_backend(ctx: BackendContext, backend_type: str) -> ModelBackend | None:
    """Create the model runner for a ``backendType`` (``ctx.model``: the model entry, with the weights
    path, dtype, device and memory budgets; ``ctx.config``: the whole config).

    :param backend_type: ``ModelConfig.backendType`` (``"torch"``, ``"ms"``, ``"atb"`` ...).
    :return: an unloaded :class:`~mindie_host.backends.base.ModelBackend` if this
        plugin serves ``backend_type``, else ``None``. Raise ``RuntimeError``
        with an install hint if the type is yours but a dependency is missing.
        firstresult.
    """


@hookspec(firstresult=True)
def mindie_host_linear_deltas(ctx: BackendContext, info: ModelInfo) -> LinearDeltas | None:
    """Contribute per-row deltas to the model's named linear layers: per-request model variants.

    :param info: the loaded model (dimensions, dtype, device).
    :return: a :class:`~mindie_host.api.LinearDeltas` (``prepare(batch)`` once per step,
        ``apply(name, layer, x, y)`` after each of ``"qkv"``, ``"o"``, ``"gate_up"``,
        ``"down"``), or ``None``. The host attaches it with
        ``ModelBackend.set_linear_deltas`` right after the model loads, and refuses to
        start if the backend cannot apply it. A request runs a variant when a plugin
        sets ``EngineRequest.variant`` >= 0 (and salts ``cache_salt``, so that a prefix
        cache never shares its blocks with another variant); the backend sees it in
        ``ModelInput.row_variants``. ``multi_lora`` implements this with batched LoRA.
        Called once, in the process that runs the model. firstresult.
    """


@hookspec
def mindie_host_model_architectures(ctx: BackendContext) -> list[Architecture] | None:
    """Provide model families: how a checkpoint of a ``model_type`` is read and built.

    :return: :class:`~mindie_host.models.architecture.Architecture` objects (import the base class and the
        torch layers from :mod:`mindie_host.backend_api`), each serving the ``config.json`` ``model_type`` values
        its ``model_types`` lists: its config mapping, its tensors' names (fused tensors split, unused ones
        skipped), their tensor-parallel slices, and optionally its own decoder layers. ``None`` or ``[]`` when
        the plugin provides none. Called for every registered plugin, once per engine (backends read the
        answers through ``ctx.architectures``); when two plugins serve a model type, the one registered later
        wins, so an enabled plugin wins over the builtin Llama family. An installed plugin that declares a
        model type in the ``mindie_host.architectures`` entry-point group is enabled without a config entry
        when a checkpoint of that type is served. Not firstresult.
    """


@hookspec
def mindie_host_backend_types(ctx: BackendContext) -> list[str] | None:
    """Names of the ``backendType`` values this plugin can serve (for
    ``mindie-host plugins`` and config validation). Not firstresult."""
