"""The front end's part of one PD-disaggregated request (``inferMode: "dmi"``).

:mod:`mindie_host.server.pd` runs a request's protocol route as usual with a :class:`PDCall`
in :data:`current_call`; :meth:`Host.new_request` and :meth:`Host.generate` consult it:

* on a **P** instance (:data:`PREFILL`), the engine request is marked for export. Its first
  output (the first token) reaches the route as an ordinary output; when the route asks for the
  next one the call is *handed off*: :attr:`PDCall.handed_off` is set and the output stream
  ends (:class:`HandedOff`); what the route sends after that is discarded. Whatever the route sent until then (a stream's
  first event) is P's answer. A request without a seed that samples gets one derived from
  ``req-id``, so a recompute reproduces its tokens.
* on a **D** instance (:data:`DECODE`), the engine request imports P's KV and continues from
  the first token. Each output is a *unit*: :attr:`PDCall.on_unit` is called when the route
  has sent everything for output ``k`` (it asks for output ``k+1``), so the caller can push
  one envelope per token on ``/dresult``.

Requests that dmi mode cannot serve get the spec's 422 here (``stop``,
``include_stop_str_in_output``, an adapter), as do several choices in one request and prompt
logprobs, which P computes and D never sees.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

from ..engine.request import EngineRequest, KVTransfer, RequestError, RequestOutput

PREFILL, DECODE = "prefill", "decode"


class HandedOff(RequestError):
    """Ends a P route's output stream once D has the request; the caller discards what the route does next."""

    def __init__(self) -> None:
        super().__init__("the request continues on the decode instance", status=200)


def seed_for(req_id: str) -> int:
    """The sampling seed of a PD request that set none: the same for every attempt of ``req_id``."""
    return int.from_bytes(hashlib.sha256(req_id.encode()).digest()[:8], "big") >> 1


def _unsupported(name: str) -> RequestError:
    return RequestError(f"Request param {name} is not support in dmi mode.", status=422, field=name)


@dataclass
class PDCall:
    """One request's PD role on this instance, and what the caller watches."""

    kind: str
    req_id: str
    #: D: where P's KV is (its connector address) and the handle P offered it as
    source: str = ""
    handle: str = ""
    #: P: set once the first token is out and the rest belongs to D
    handed_off: asyncio.Event = field(default_factory=asyncio.Event)
    #: P: the engine request id whose blocks P holds for D
    engine_request_id: str | None = None
    #: D: called with ``k`` once the route has sent everything for output ``k``
    on_unit: Callable[[int], None] | None = None
    #: D: the engine's failure, (status, message), when the request failed on D
    failure: tuple[int, str] | None = None
    requests: int = 0

    def check(self, request: EngineRequest, body: dict[str, Any]) -> None:
        """Refuse what a disaggregated request cannot do (spec: "... is not support in dmi mode")."""
        self.requests += 1
        if self.requests > 1:
            raise RequestError("several choices or prompts in one request (n > 1, best_of, a prompt list) are not "
                               "supported in dmi mode; send one request each", status=422, field="n")
        params = request.sampling
        if params.stop:
            raise _unsupported("stop")
        if params.include_stop_str_in_output:
            raise _unsupported("include_stop_str_in_output")
        if body.get("adapter_id") is not None or request.variant >= 0:
            raise _unsupported("adapter_id")
        if params.prompt_logprobs is not None:
            raise _unsupported("decoder_input_details")

    def run(self, request: EngineRequest,
            generate: Callable[[EngineRequest], AsyncIterator[RequestOutput]]) -> AsyncIterator[RequestOutput]:
        """The outputs the route sees for ``request`` (``generate`` is the engine's stream)."""
        if self.kind == PREFILL:
            return self._prefill(request, generate)
        return self._decode(request, generate)

    async def _prefill(self, request: EngineRequest,
                       generate: Callable[[EngineRequest], AsyncIterator[RequestOutput]]) -> AsyncIterator[RequestOutput]:
        if not request.sampling.greedy and request.sampling.seed is None:
            request.sampling = replace(request.sampling, seed=seed_for(self.req_id))
        request.kv_transfer = KVTransfer("export")
        self.engine_request_id = request.request_id
        async for out in generate(request):
            if out.finish_reason != "handoff":
                yield out
                continue
            yield replace(out, finished=False, finish_reason=None)
            self.handed_off.set()  # the route has sent what it makes of the first token; D continues
            raise HandedOff()

    async def _decode(self, request: EngineRequest,
                      generate: Callable[[EngineRequest], AsyncIterator[RequestOutput]]) -> AsyncIterator[RequestOutput]:
        request.kv_transfer = KVTransfer("import", source=self.source, handle=self.handle)
        index = 0
        async for out in generate(request):
            if out.finish_reason == "error" and self.failure is None:
                self.failure = (out.error_status or 500, out.error or "generation failed")
            yield out
            if self.on_unit is not None:
                self.on_unit(index)
            index += 1


#: The PD call of the request being handled (None: an ordinary request).
current_call: ContextVar[PDCall | None] = ContextVar("mindie_host_pd_call", default=None)
