"""The running host: config + plugins + backend + tokenizer + engine, as protocol modules see it.

Protocol modules and plugins talk to the server through this object only:
:meth:`Host.generate` to run a request, :meth:`Host.new_request` to build one
(tokenized, length-checked and refined by the request-parsing hooks), and a few
facts (model names, tokenizer, config, statistics).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from .backends.base import ModelBackend, ModelInfo
from .config import Config
from .config.support import no_effect, unsupported
from .engine.async_engine import AsyncEngine
from .engine.block_pool import RefCountedBlockPool
from .engine.core import EngineLimits, LLMEngine
from .engine.kv_transfer import KVConnector, KVLayout
from .engine.policy import SchedulerLimits
from .engine.request import EngineRequest, RequestError, RequestOutput, SamplingParams
from .engine.swap import SwapSpace
from .host_state import HostCaches, ServerRuntime
from .kv_sizing import plan_kv_pool
from .models.default import default_model_path
from .models.weights import resolve_model
from .pd.call import current_call
from .plugins import PluginError, PluginHost, install_hint
from .tokenizer import load_tokenizer

log = logging.getLogger("mindie_host")

#: The spec's "1MB" token cap on inputs, read as a token count.
SPEC_TOKEN_CAP = 1 << 20

#: Where each protocol takes the output length from (named by the length rule's 4xx).
OUTPUT_LENGTH_FIELDS: dict[str, str] = {
    "openai": "max_tokens",
    "vllm": "max_tokens",
    "tgi": "parameters.max_new_tokens",
    "native": "parameters.max_new_tokens",
    "triton": "parameters.max_new_tokens",
}


class Host:
    """Everything a protocol module or plugin needs from the server."""

    def __init__(self, config: Config, plugins: PluginHost | None = None) -> None:
        self.config = config
        self.plugins = plugins or PluginHost()
        self.plugins.bind(config, config.model, self)
        self.model_config = config.model
        self.model_name = self.model_config.modelName
        self.created = int(time.time())
        self.started_at = time.time()
        self.ready = False
        self.draining = False
        self.backend: ModelBackend | None = None
        self.info: ModelInfo | None = None
        self.tokenizer: Any = None
        self.engine: AsyncEngine | None = None
        self.llm: LLMEngine | None = None
        self.runtime = ServerRuntime()  # the server's loop, stop signals, gates and pools
        self.caches = HostCaches()  # values the server's modules compute once per host
        self._request_counter = 0
        self._counter_lock = threading.Lock()

    # -- startup ----------------------------------------------------------------------------
    def load(self, progress: Callable[[int, int, str], None] | None = None) -> None:
        """Enable plugins, load tokenizer and weights, size the KV cache, build the engine."""
        cfg = self.config
        refused = unsupported(cfg)
        if refused:
            raise PluginError("config.json asks for what this server cannot do:\n  " + "\n  ".join(refused))
        for note in no_effect(cfg):
            log.warning("%s", note)
        self.plugins.enable_from_config(cfg)
        errors = self.plugins.validate(cfg)
        if errors:
            raise PluginError("plugin configuration rejected:\n  " + "\n  ".join(errors))
        instances = cfg.BackendConfig.modelInstanceNumber
        if instances > 1 and not cfg.server.engineProcess:
            log.info("BackendConfig.modelInstanceNumber is %d: each instance runs in its own engine process "
                     "(as with ServerConfig.engineProcess true)", instances)
        if cfg.server.engineProcess or instances > 1:  # the model loads in engine processes (engine/process.py)
            from .engine.process import load_front_end

            load_front_end(self, show_progress=progress is not None)
            return
        mc = self.model_config
        backend = self.create_backend()
        if progress is not None and hasattr(backend, "progress"):
            backend.progress = progress
        if mc.worldSize > 1 or cfg.BackendConfig.multiNodesInferEnabled:
            backend = self._parallel(backend)
        self.backend = backend
        source = resolve_model(mc.modelWeightPath or str(default_model_path()))
        self.tokenizer = load_tokenizer(source, trust_remote_code=mc.trustRemoteCode)
        self.info = backend.load()
        if not self.info.eos_token_ids and self.tokenizer.eos_token_id is not None:
            self.info.eos_token_ids = [self.tokenizer.eos_token_id]
        self._attach_linear_deltas(backend, self.info)
        self._build_engine()
        self.plugins.hook.mindie_host_startup(host=self)

    def create_backend(self) -> ModelBackend:
        """The backend of ``backendType`` from the ``mindie_host_model_backend`` hook (not loaded yet)."""
        mc = self.model_config
        backend = self.plugins.hook.mindie_host_model_backend(
            backend_type=mc.backendType, model_config=mc, config=self.config
        )
        if backend is None:
            known = ", ".join(self.plugins.backend_types()) or "none"
            raise PluginError(
                f"no installed plugin serves backendType {mc.backendType!r} (served: {known}); "
                f"{install_hint(mc.backendType)}"
            )
        return backend

    def register_specs(self, specs: list[tuple[str, str, bytes]]) -> None:
        """Register plugins sent from another process (``engine.process.plugin_specs``)."""
        import importlib
        import pickle

        for name, kind, data in specs:
            plugin = importlib.import_module(data.decode()) if kind == "module" else pickle.loads(data)
            self.plugins.register(plugin, name)

    def world(self) -> tuple[int, dict[int, int], str]:
        """``(world size, {local rank: device}, rendezvous address)`` of this model instance.

        One node: ``worldSize`` ranks on ``npuDeviceIds[0]``, rendezvous on a free local port.
        ``multiNodesInferEnabled``: the rank table's world (``RANKTABLEFILE``; mindie_host/distributed/rank_table.py).
        """
        be, mc = self.config.BackendConfig, self.model_config
        if be.multiNodesInferEnabled:
            from .distributed.rank_table import load_plan

            plan = load_plan(be.multiNodesInferPort)
            return plan.world_size, plan.local, plan.address
        from .distributed.ranks import local_address

        return mc.worldSize, dict(enumerate(be.npuDeviceIds[0])), local_address()

    def _parallel(self, backend: ModelBackend) -> ModelBackend:
        """Rank 0 of the instance's tensor-parallel ranks around ``backend`` (``mindie_host.distributed``)."""
        from .distributed.ranks import ParallelBackend, spawn_rank
        from .engine.process import plugin_specs

        world, local, address = self.world()
        key = ("the rank table's device count (RANKTABLEFILE)" if self.config.BackendConfig.multiNodesInferEnabled
               else "BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize")
        errors = backend.parallel_errors(world, key)
        if errors:
            raise PluginError("config.json asks for what this server cannot do:\n  " + "\n  ".join(errors))
        specs = plugin_specs(self)
        config = self.config
        return ParallelBackend(
            backend, world_size=world, local=local, address=address,
            make_worker=lambda rank, device, addr, threads: spawn_rank(config, specs, rank, world, device, addr,
                                                                       threads),
            dist_backend=backend.platform.dist_backend,  # type: ignore[attr-defined]
        )

    def _attach_linear_deltas(self, backend: ModelBackend, info: ModelInfo) -> None:
        """Give the backend the per-row linear deltas a plugin provides (``mindie_host_linear_deltas``)."""
        impls = self.plugins.hook.mindie_host_linear_deltas.get_hookimpls()
        deltas = self.plugins.hook.mindie_host_linear_deltas(info=info)
        if deltas is not None and not backend.set_linear_deltas(deltas):
            owners = ", ".join(i.plugin_name for i in impls) or "a plugin"
            raise PluginError(
                f"{owners} provides per-row linear deltas (mindie_host_linear_deltas) but backendType "
                f"{self.model_config.backendType!r} cannot apply them (ModelBackend.set_linear_deltas returned False)"
            )

    def _build_engine(self) -> None:
        assert self.backend is not None and self.info is not None
        sc = self.config.schedule
        deploy = self.config.deploy
        on_cpu = self.info.device == "cpu"
        if deploy.maxSeqLen > self.info.max_position_embeddings:
            log.warning("ModelDeployConfig.maxSeqLen %d is above the model's max_position_embeddings %d: positions "
                        "past it are extrapolated with the model's RoPE, as transformers does, and outputs there may "
                        "degrade", deploy.maxSeqLen, self.info.max_position_embeddings)
        self.backend.set_max_positions(deploy.maxSeqLen)
        plan = plan_kv_pool(self.config, self.backend, self.info.device)
        num_blocks, block_size = plan.num_blocks, plan.block_size
        if num_blocks * block_size < deploy.maxSeqLen:
            raise PluginError(
                f"KV cache budget too small: {num_blocks} blocks of {block_size} tokens cannot hold one "
                f"sequence of maxSeqLen={deploy.maxSeqLen} ({plan.limited_by}); raise "
                f"{'cpuMemSize' if on_cpu else 'npuMemSize'} or lower maxSeqLen"
            )
        self.backend.allocate_kv_cache(num_blocks, block_size)
        self.backend.warmup()
        kv = self.plugins.hook.mindie_host_kv_cache_manager(num_blocks=num_blocks, block_size=block_size, config=self.config)
        limits = SchedulerLimits(
            max_batch_size=sc.maxBatchSize,
            max_prefill_batch_size=sc.maxPrefillBatchSize or sc.maxBatchSize,
            max_prefill_tokens=sc.maxPrefillTokens,
            max_queue_delay_s=sc.maxQueueDelayMicroseconds / 1e6,
            support_select_batch=sc.supportSelectBatch,
            prefill_time_ms_per_req=sc.prefillTimeMsPerReq,
            decode_time_ms_per_req=sc.decodeTimeMsPerReq,
        )
        swap = self._swap_space()
        connector = self._kv_connector(block_size) if self.config.server.inferMode == "dmi" else None
        self.llm = LLMEngine(
            backend=self.backend,
            model_info=self.info,
            tokenizer=self.tokenizer,
            kv=kv,
            scheduler_limits=limits,
            limits=EngineLimits(max_seq_len=deploy.maxSeqLen, max_iter_times=sc.maxIterTimes),
            hook=self.plugins.hook,
            config=self.config,
            swap=swap,
            connector=connector,
        )
        self.engine = AsyncEngine(self.llm, self.plugins)
        log.info("%s", plan.describe(self.info.device))

    def _kv_connector(self, block_size: int) -> KVConnector:
        """PD disaggregation: the KV connector, started with this engine's cache layout; its address goes
        into ``info.extra["kv_address"]`` (the front end puts it in the requests it hands to D)."""
        assert self.backend is not None and self.info is not None
        shapes = self.backend.kv_block_shapes()
        if shapes is None:
            raise PluginError(f"ServerConfig.inferMode 'dmi': backendType {self.model_config.backendType!r} cannot "
                              "export and import KV blocks (with kvCacheDtype int8 neither can the torch backend)")
        connector = self.plugins.hook.mindie_host_kv_connector(config=self.config)
        layout = KVLayout(model=self.info.name, num_layers=self.info.num_layers, num_kv_heads=self.info.num_kv_heads,
                          head_dim=self.info.head_dim, dtype=shapes[0], block_size=block_size,
                          block_shapes=shapes[1])
        self.info.extra["kv_address"] = connector.start(layout, self.backend.export_blocks)
        return connector

    def _swap_space(self) -> SwapSpace | None:
        """The CPU swap space for preempted sequences: ``cpuMemSize`` GB when ``maxPreemptCount`` > 0."""
        assert self.backend is not None
        count, gb = self.config.schedule.maxPreemptCount, self.model_config.cpuMemSize
        if count == 0:
            return None
        per_block = self.backend.swap_block_bytes()
        blocks = gb * (1 << 30) // per_block if per_block else 0
        if blocks == 0 or not self.backend.allocate_swap_space(blocks):
            log.warning("ScheduleConfig.maxPreemptCount is %d but backendType %r cannot swap KV blocks to CPU "
                        "memory (or cpuMemSize holds none): preempted sequences are recomputed instead",
                        count, self.model_config.backendType)
            return None
        log.info("swap space: %d KV blocks (cpuMemSize %d GB); at most %d swap preemptions per step",
                 blocks, gb, count)
        return SwapSpace(RefCountedBlockPool(blocks), max_per_step=count)

    def start(self, engine_thread: bool = True) -> None:
        """Mark the server ready; start the engine worker thread unless the caller
        steps the engine itself (``engine.run_here()`` on the main thread)."""
        assert self.engine is not None
        if engine_thread:
            self.engine.start()
        self.ready = True

    def shutdown(self) -> None:
        """Stop the engine and tell plugins."""
        self.ready = False
        if self.engine is not None:
            self.engine.stop()
        if self.llm is not None and self.llm.handoff is not None:
            self.llm.handoff.connector.close()
        self.plugins.hook.mindie_host_shutdown(host=self)
        if self.backend is not None:
            self.backend.shutdown()

    # -- facts --------------------------------------------------------------------------------
    @property
    def served_model_names(self) -> list[str]:
        """The base model name followed by the names plugins serve (``mindie_host_served_models``)."""
        names = [self.model_name]
        for extra in self.plugins.hook.mindie_host_served_models():
            names.extend(n for n in extra or () if n not in names)
        return names

    @property
    def max_input_tokens(self) -> int:
        """min(maxInputTokenLen, maxSeqLen - 1, max_position_embeddings, 1M) (spec §0.3)."""
        deploy = self.config.deploy
        limit = min(deploy.maxInputTokenLen, deploy.maxSeqLen - 1, SPEC_TOKEN_CAP)
        if self.info is not None:
            limit = min(limit, self.info.max_position_embeddings)
        return limit

    @property
    def vocab_size(self) -> int:
        assert self.info is not None
        return self.info.vocab_size

    def new_request_id(self, prefix: str = "endpoint_common") -> str:
        """A unique id like MindIE's ``endpoint_common_12``."""
        with self._counter_lock:
            self._request_counter += 1
            return f"{prefix}_{self._request_counter}_{uuid.uuid4().hex[:8]}"

    def stats(self) -> dict[str, float]:
        """Engine statistics plus every plugin's metrics."""
        stats: dict[str, float] = {}
        if self.llm is not None:
            stats.update(self.llm.stats())
        else:  # engine process: the statistics its last step sent
            stats.update(getattr(self.engine, "engine_stats", {}))
        if self.engine is not None:
            stats["num_active_requests"] = float(self.engine.num_active)
        stats.update(self.plugin_metrics())
        return stats

    def plugin_metrics(self) -> dict[str, float]:
        """Every plugin's ``mindie_host_metrics``: this process's, and those the engine process sent with its last step."""
        metrics: dict[str, float] = dict(getattr(self.engine, "engine_plugin_metrics", None) or {})
        for extra in self.plugins.hook.mindie_host_metrics(host=self):
            metrics.update(extra or {})
        return metrics

    # -- requests --------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            **kwargs: Any) -> str:
        """Render chat messages with the tokenizer's template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template; use a completions endpoint", field="messages")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as exc:  # a template error is the request's fault (bad roles, ...)
            raise RequestError(f"messages could not be rendered by the chat template: {exc}", field="messages") from exc

    def new_request(
        self,
        *,
        protocol: str,
        body: dict[str, Any],
        sampling: SamplingParams,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        add_special_tokens: bool = True,
        truncate: int | None = None,
        priority: int = 3,
        timeout: float | None = None,
        field: str = "prompt",
    ) -> EngineRequest:
        """Tokenize, check lengths (spec §0.3), and run the request-refinement hooks."""
        if prompt_token_ids is None:
            if prompt is None:
                raise RequestError(f"{field} is required", field=field)
            prompt_token_ids = self.tokenize(prompt, add_special_tokens=add_special_tokens)
        ids = list(prompt_token_ids)
        if not ids:
            raise RequestError(f"{field} must not be empty", field=field)
        if self.info is not None:
            bad = next((t for t in ids if not 0 <= t < self.info.vocab_size), None)
            if bad is not None:
                raise RequestError(f"{field} has token id {bad} outside [0, {self.info.vocab_size - 1}]", field=field)
        if truncate is not None and len(ids) > truncate:
            ids = ids[-truncate:]
        limit = self.max_input_tokens
        if len(ids) > limit:
            if self.config.deploy.truncation:
                ids = ids[-limit:]
            else:
                raise RequestError(
                    f"{field} has {len(ids)} tokens; the limit is {limit} "
                    f"(min of maxInputTokenLen, maxSeqLen-1, max_position_embeddings)",
                    field=field,
                )
        self._check_output_length(len(ids), sampling, protocol)
        if sampling.top_k and self.info is not None and sampling.top_k >= self.info.vocab_size:
            sampling = replace(sampling, top_k=0)  # >= vocabSize means the whole vocabulary (a copy: never mutated)
        timeout = timeout if timeout is not None else self.config.server.requestTimeoutSeconds
        req = EngineRequest(
            request_id=request_id or self.new_request_id(),
            prompt_token_ids=ids,
            sampling=sampling,
            prompt=prompt,
            priority=priority,
            timeout=timeout,
        )
        self.plugins.hook.mindie_host_refine_request(request=req, body=body, protocol=protocol, host=self)
        call = current_call.get()
        if call is not None:  # one half of a PD-disaggregated request: refuse what dmi mode cannot serve
            call.check(req, body)
        return req

    def _check_output_length(self, prompt_len: int, sampling: SamplingParams, protocol: str) -> None:
        """The output length rule (spec §0.3), the one place it lives.

        The effective output is at most ``min(maxIterTimes, max_tokens)`` (the spec's rule;
        a request cut there ends with finish reason ``length``), and prompt plus output must
        fit ``maxSeqLen``. A request that asks for more new tokens than its prompt leaves room
        for gets a 4xx naming the field and the range, as vLLM (400) and TGI (422) answer,
        never a silent clamp. Without ``max_tokens`` the output budget is what the prompt
        leaves, up to ``maxIterTimes``, and the engine stops there with ``length``.
        """
        if sampling.max_tokens is None:
            return
        deploy = self.config.deploy
        room = deploy.maxSeqLen - prompt_len
        wanted = min(sampling.max_tokens, self.config.schedule.maxIterTimes)
        if wanted > room:
            field = OUTPUT_LENGTH_FIELDS.get(protocol, "max_tokens")
            raise RequestError(
                f"{field} asks for {wanted} new tokens but the prompt has {prompt_len} tokens and "
                f"maxSeqLen is {deploy.maxSeqLen}; allowed for this prompt: an integer in [1, {room}]",
                field=field,
            )

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Run ``request`` and stream its outputs (cumulative ``text``, incremental ``new_text``)."""
        if self.engine is None or not self.ready:
            raise RequestError("The service is not ready.", status=503)
        if self.draining:
            raise RequestError("The service has been stopped.", status=503)
        call = current_call.get()
        outputs = self.engine.generate(request) if call is None else call.run(request, self.engine.generate)
        async for out in outputs:
            yield out

    async def engine_command(self, target: str, command: str, payload: Any = None) -> list[Any]:
        """Run plugin ``target``'s ``command`` where the engine lives (``mindie_host_engine_command``).

        For plugins whose state sits beside the model: the answer of every engine
        instance, in order (one with a single instance). A refusal raises its
        :class:`RequestError`; a stopped or restarting engine gives 503.
        """
        if self.engine is None:
            raise RequestError("The service is not ready.", status=503)
        return await self.engine.command(target, command, payload)

    async def generate_full(self, request: EngineRequest) -> RequestOutput:
        """Run ``request`` to the end and return its last output, with every token id and all logprobs."""
        last: RequestOutput | None = None
        logprobs = []
        async for out in self.generate(request):
            logprobs.extend(out.logprobs)
            last = out
        assert last is not None
        last.logprobs = logprobs
        return last
