"""What a running host keeps besides its model: typed, one field per thing, each owned by one module.

:class:`ServerRuntime` is the server's own machinery (set by ``server/runner.py`` and the engine
process client). :class:`HostCaches` holds values computed once per host, on first use, by the module
named beside each field. Plugins keep their own state in ``ctx.state`` (:mod:`mindie_host.context`).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .chat_template import TemplateProfile
    from .content import MediaHandler
    from .server.metrics import ServingMetrics
    from .server.native import ClientIds
    from .server.security import LinkGate
    from .structured.vocab import Vocab


@dataclass
class ServerRuntime:
    """The running server's event loop, stop signals, gates and pools."""

    #: the event loop serving HTTP (server/runner.py)
    loop: asyncio.AbstractEventLoop | None = None
    #: set to stop gracefully (SIGTERM, /stopService), and to stop at once (a second signal)
    stop_event: asyncio.Event | None = None
    force_stop_event: asyncio.Event | None = None
    #: why the model failed to load while the listeners were already up
    load_error: BaseException | None = None
    #: ``maxLinkNum``: concurrent business requests (server/runner.py, server/security.py)
    link_gate: LinkGate | None = None
    #: ``tokenizerProcessNumber`` threads for tokenising and decoding tensors (server/app.py)
    request_pool: ThreadPoolExecutor | None = None
    #: the torch thread count before the engine process took the cores (engine/process.py)
    front_end_threads_before: int | None = None
    #: this instance's PD role and peers, once PD disaggregation assigns them (server/management.py)
    #: PD disaggregation (inferMode dmi): the role, channels and held KV (server/pd.py's PDState)
    pd: Any = None
    #: the business app behind the PD gate, for requests a P instance hands to this D instance
    business_app: Any = None
    #: tasks the server started that no request awaits (D's replays); kept referenced until they end
    background: set[Any] = field(default_factory=set)


@dataclass
class HostCaches:
    """Values computed once per host on first use."""

    #: the model's generation_config.json sampling defaults (server/params.py)
    sampling_defaults: dict[str, Any] | None = None
    #: the tokenizer's special token ids (server/textgen.py)
    special_token_ids: set[int] | None = None
    #: the tool-call parser for the model family (server/tool_calls.py)
    tool_parser: Any = None
    #: the reasoning parser for the model family, False when the model does not reason (server/reasoning.py)
    reasoning_parser: Any = None
    #: what the tokenizer's chat template renders (chat_template.py)
    chat_template_profile: TemplateProfile | None = None
    #: the tokenizer's vocabulary for the builtin grammar engine (structured/vocab.py)
    vocab: Vocab | None = None
    #: llguidance's view of the tokenizer (structured/llg.py)
    llg_tokenizer: Any = None
    #: the handler of typed media content items a plugin registered (content.py)
    media_handler: MediaHandler | None = None
    #: MindIE native client-id bookkeeping (server/native.py)
    client_ids: ClientIds | None = None
    #: the Prometheus histograms (server/metrics.py)
    serving_metrics: ServingMetrics | None = None
