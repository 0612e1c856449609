"""The running host, the request facade: config + plugins + tokenizer + engine handle, as protocol modules see it.

Protocol modules and plugins talk to the server through this object only (typed against its
protocol, :class:`mindie_host.host_protocol.Host`): :meth:`Host.generate` to run a request,
:meth:`Host.new_request` to build one (tokenized, length-checked and refined by the
request-parsing hooks), and a few facts (model names, tokenizer, config, statistics). What
fills it (the tokenizer, the model, the engine, the engine processes) is the runtime's job:
``mindie_host.runtime.load_host(host)``.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .engine.request import EngineRequest, RequestError, RequestOutput, SamplingParams
from .host_state import HostCaches, ServerRuntime
from .pd.call import current_call
from .plugins import PluginHost

if TYPE_CHECKING:
    from .backends.base import ModelBackend, ModelInfo
    from .config import Config
    from .engine.core import LLMEngine
    from .engine.handle import EngineHandle

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
    """Everything a protocol module or plugin needs from the server (the runtime fills it: ``load_host``)."""

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
        self.engine: EngineHandle | None = None
        #: the engine when it steps in this process (None in the front end of engine processes)
        self.llm: LLMEngine | None = None
        #: what the runtime built for this host, released in order at :meth:`shutdown` (connector, backend)
        self.teardown: list[Callable[[], None]] = []
        self.runtime = ServerRuntime()  # the server's loop, stop signals, gates and pools
        self.caches = HostCaches()  # values the server's modules compute once per host
        self._request_counter = 0
        self._counter_lock = threading.Lock()

    def start(self, engine_thread: bool = True) -> None:
        """Mark the server ready; start the engine worker thread unless the caller
        steps the engine itself (``engine.run_here()`` on the main thread)."""
        assert self.engine is not None
        if engine_thread:
            self.engine.start()
        self.ready = True

    def shutdown(self) -> None:
        """Stop the engine, tell plugins, and release what the runtime built (:attr:`teardown`)."""
        self.ready = False
        if self.engine is not None:
            self.engine.stop()
        self.plugins.hook.mindie_host_shutdown()
        for release in self.teardown:
            release()
        self.teardown = []

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
        for extra in self.plugins.hook.mindie_host_metrics():
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
        self.plugins.hook.mindie_host_refine_request(request=req, body=body, protocol=protocol)
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
