"""The running host as protocol modules and plugins see it: a :class:`typing.Protocol`.

Protocol modules (``server/``), structured outputs (``structured/``), the plugin contract
(``hookspecs``, ``context``, ``plugins``) and plugins annotate with this :class:`Host`, so none of
them imports the concrete class (:class:`mindie_host.host.Host`) or what builds it
(:mod:`mindie_host.runtime`). It sits on the floor of the plugin contract, below the server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from .engine.hook_relay import HookRelay

if TYPE_CHECKING:
    from .backends.base import ModelBackend, ModelInfo
    from .config import Config, ModelConfig
    from .engine.handle import EngineHandle
    from .engine.request import EngineRequest, RequestOutput, SamplingParams
    from .host_state import HostCaches, ServerRuntime


class HostPlugins(HookRelay, Protocol):
    """What the server asks of the plugin manager: call hooks, notify observers, enable config's plugins."""

    def enable_from_config(self, config: Config) -> None:
        """Import and register every plugin ``config`` enables (idempotent)."""
        ...


class Host(Protocol):
    """Config and model facts, the tokenizer, the engine handle, and the request path."""

    config: Config
    model_config: ModelConfig
    #: the base model's name (``modelName``)
    model_name: str
    #: when the host was made (``created`` in ``/v1/models``), and started (seconds since the epoch)
    created: int
    started_at: float
    #: readiness: the model is loaded and the engine is serving
    ready: bool
    #: stopping: new requests are refused while those in flight finish
    draining: bool
    tokenizer: Any
    #: the loaded model's facts (vocabulary, EOS ids, dtype ...); None until loaded
    info: ModelInfo | None
    #: the model backend when it lives in this process (None in the front end of an engine process)
    backend: ModelBackend | None
    engine: EngineHandle | None
    plugins: HostPlugins
    #: the server's loop, stop signals and pools
    runtime: ServerRuntime
    #: values modules compute once per host, each in its own typed slot
    caches: HostCaches

    @property
    def served_model_names(self) -> list[str]:
        """The base model name followed by the names plugins serve (``mindie_host_served_models``)."""
        ...

    @property
    def max_input_tokens(self) -> int:
        """min(maxInputTokenLen, maxSeqLen - 1, max_position_embeddings, 1M) (spec §0.3)."""
        ...

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size."""
        ...

    def new_request_id(self, prefix: str = "endpoint_common") -> str:
        """A unique id like MindIE's ``endpoint_common_12``."""
        ...

    def stats(self) -> dict[str, float]:
        """Engine statistics plus every plugin's metrics."""
        ...

    def plugin_metrics(self) -> dict[str, float]:
        """Every plugin's ``mindie_host_metrics``, with those the engine process sent."""
        ...

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **kwargs: Any
    ) -> str:
        """Render chat messages with the tokenizer's template (a 4xx naming ``messages`` when it cannot)."""
        ...

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
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Run ``request`` and stream its outputs."""
        ...

    async def generate_full(self, request: EngineRequest) -> RequestOutput:
        """Run ``request`` to the end and return its last output, with every token id and all logprobs."""
        ...

    async def engine_command(self, target: str, command: str, payload: Any = None) -> list[Any]:
        """Run plugin ``target``'s ``command`` where the engine lives: the answer of every engine instance."""
        ...

    def start(self, engine_thread: bool = True) -> None:
        """Mark the host ready, starting the engine's worker thread unless the caller steps it."""
        ...

    def shutdown(self) -> None:
        """Stop the engine, tell plugins, release what was built for it."""
        ...
