"""PD disaggregation in the coordinator (``deploy_mode: pd_separate``): routing a request to a P and a D, the join.

The instances come from the controller's refresh with ``static_info.role`` 80 (P) or 68 (D) and,
for a D, ``static_info.inter_comm_port`` (where a P reaches it).

**D result channels**: :mod:`.dresult` keeps one ``GET /dresult`` per D; a request waits on
its D's channel for its envelopes, and a broken channel hands it a :class:`~.dresult.DFailed`.

**One user request** (:class:`PDForwarder`): inference requests (``POST`` to the five API
families' generating routes, :data:`INFERENCE_PATHS`) take the PD path; every other request
(``/v1/tokenizer``, model listings, ...) is forwarded single-node style to any instance.

1. Admission and limits as in single_node (:class:`~.limits.Scheduler`): a P by ``load_balance``
   over the available P instances, a D by ``load_balance`` over the available D instances with a
   connected channel; either side empty is a 503 naming what is missing.
2. A unique numeric ``req-id`` (a counter that starts at the coordinator's start time in
   microseconds, so ids do not repeat across restarts); the waiter is registered on the D; the
   original method, path, query, body and headers go to P with ``req-id``, ``d-target``
   (``D-ip:inter_comm_port``, or the bare IP when the D gave no port) and ``req-type: prefill``.
   A P that cannot be reached (nothing received yet) or answers 503 is replaced by another, at
   most ``max_retry`` more times, as the single-node forwarder does.
3. P's answer: a status other than 200 is passed to the client unchanged (status, body,
   content-type). A 200 envelope with ``isLastResp`` true is the whole answer (``output`` with the
   envelope's ``contentType``). Otherwise a stream starts at once (``contentType``), P's ``output``
   is stream unit 0 and every D envelope's ``output`` follows as it arrives (unit ``seq``), until
   the envelope with ``isLastResp``; nothing is buffered. A non-stream request waits for D's final
   envelope and answers its ``output`` (content type from P's envelope).
4. Errors: an envelope (P's or D's) with ``error.recompute`` false ends the request with its
   ``output`` (non-stream: with ``error.status``; stream: written, then the stream ends).
5. **Recompute**: when the D fails (its channel broke while the request waited: the D leaves
   rotation) or an envelope says ``error.recompute`` true, the same request goes to a P again with
   ``is-recompute: true``, the same ``req-id`` and another D when one is available (else the same
   D, if it is still in rotation). Stream units the client already has are skipped (unit ``k`` is
   written only when ``k`` >= the number delivered), so the client sees every unit once, in order.
   At most ``max_retry`` recomputes; then the request ends with a clear error (stream: an error
   event in the stream's format; non-stream: 500, or 503 when no D is left).
6. Deadlines: every wait (for P, for D's envelopes) is bounded by ``infer_timeout``, and the wait
   for P's first envelope (the first token) by ``first_token_timeout`` too (0 switches one off),
   with the single-node messages (504 before the answer started, an error event after).

A request counts as in flight (``/v1/instances/tasks``, per-instance caps) on both its P and its D
until it ends.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import Response

from .config import CoordinatorConfig
from .dresult import DChannel, DFailed, DResultHub, Event
from .instances import ROLE_DECODE, ROLE_PREFILL, Instance, InstanceTable
from .limits import NOT_READY, Refused
from .proxy import (
    BYTES_PER_TOKEN,
    FIRST_TOKEN_TIMEOUT,
    INFER_TIMEOUT,
    Forwarder,
    _RelayResponse,
    _within,
    error_response,
    request_info,
    stream_error_event,
)

log = logging.getLogger("mindie_host.ms.coordinator")

#: The generating routes of the five API families: these take the PD path.
INFERENCE_PATHS = re.compile(
    r"^/(v1/chat/completions|v1/completions|generate|generate_stream|infer|infer_token"
    r"|v2/models/[^/]+(/versions/[^/]+)?/(generate|generate_stream|infer))?$"
)
PD_HEADERS = frozenset({"req-id", "d-target", "req-type", "is-recompute"})
NO_PREFILL = f"{NOT_READY}: no prefill (P) instance is available"
NO_DECODE = f"{NOT_READY}: no decode (D) instance is available"


class _Recompute(Exception):
    """The D failed: run the request again (``is-recompute: true``) with another D."""


class _Ended(Exception):
    """The request ends with an error: ``message`` and the HTTP ``status`` for a non-stream answer."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class PDForwarder:
    """Serves user requests in pd_separate: P and D chosen, P's envelope and D's results joined."""

    def __init__(self, config: CoordinatorConfig, forwarder: Forwarder, table: InstanceTable,
                 hub: DResultHub) -> None:
        self.config = config
        self.forwarder = forwarder
        self.scheduler = forwarder.scheduler
        self.table = table
        self.hub = hub
        self._ids = itertools.count(time.time_ns() // 1000)
        self.recomputes = 0

    def next_id(self) -> str:
        """A fresh ``req-id``."""
        return str(next(self._ids))

    @staticmethod
    def is_prefill(inst: Instance) -> bool:
        """A P instance."""
        return inst.role == ROLE_PREFILL

    def is_decode(self, inst: Instance) -> bool:
        """A D instance whose ``/dresult`` channel is open."""
        return inst.role == ROLE_DECODE and self.hub.connected(inst)

    @property
    def ready(self) -> bool:
        """At least one P and one D (with its channel open) in rotation."""
        available = self.table.available()
        return any(self.is_prefill(i) for i in available) and any(self.is_decode(i) for i in available)

    async def handle(self, request: Request) -> Response:
        """Serve one user request; every refusal is an error in the protocol's shape."""
        path = request.url.path
        if request.method != "POST" or not INFERENCE_PATHS.match(path):
            return await self.forwarder.handle(request)
        try:
            body = await self.forwarder._read_body(request)
            self.scheduler.admit()
        except Refused as refused:
            return error_response(path, refused)
        job = _PDJob(self, request, path, body)
        try:
            response = await job.start()
        except Refused as refused:
            job.finish()
            self.scheduler.leave()
            return error_response(path, refused)
        except BaseException:
            job.finish()
            self.scheduler.leave()
            raise
        if not isinstance(response, _RelayResponse):
            job.finish()
            self.scheduler.leave()
        return response


class _PDJob:
    """One user request's way through P and D, recomputes included."""

    def __init__(self, pd: PDForwarder, request: Request, path: str, body: bytes) -> None:
        self.pd = pd
        self.cfg = pd.config
        self.scheduler = pd.scheduler
        self.path = path
        self.method = request.method
        self.body = body
        self.url_path = path + (f"?{request.url.query}" if request.url.query else "")
        self.headers = [(k, v) for k, v in pd.forwarder._headers(request) if k.lower() not in PD_HEADERS]
        self.info = request_info(path, body, False)
        pd.forwarder.sizes.add_input(self.info.est_tokens)
        self.req_id = pd.next_id()
        loop = asyncio.get_running_loop()
        now = loop.time()
        self.deadline = now + self.cfg.infer_timeout if self.cfg.infer_timeout else None
        first = now + self.cfg.first_token_timeout if self.cfg.first_token_timeout else None
        self.first_deadline = min(first, self.deadline) if first and self.deadline else (first or self.deadline)
        self.p: Instance | None = None
        self.d: Instance | None = None
        self.channel: DChannel | None = None
        self.queue: asyncio.Queue[Event] | None = None
        self.failed_p: set[int] = set()
        self.failed_d: set[int] = set()
        self.recomputes = 0
        self.delivered = 0
        self.answered = False  # P's first envelope arrived (the first token exists)
        self.content_type = "application/json"
        self.streaming = False

    # -- bookkeeping ------------------------------------------------------------------------------
    def _release(self) -> None:
        if self.channel is not None and self.queue is not None:
            self.channel.unregister(self.req_id, self.queue)
        self.channel, self.queue = None, None
        for inst in (self.p, self.d):
            if inst is not None:
                self.scheduler.release(inst, self.info)
        self.p = self.d = None

    def finish(self) -> None:
        """Hand back the P and the D and stop waiting for D's results (idempotent)."""
        self._release()

    def _wait_deadline(self) -> float | None:
        return self.deadline if self.answered else self.first_deadline

    def _timeout(self) -> _Ended:
        first = not self.answered and self.first_deadline is not None and self.first_deadline != self.deadline
        return _Ended(FIRST_TOKEN_TIMEOUT if first else INFER_TIMEOUT, 504)

    # -- one leg: a P and a D -------------------------------------------------------------------
    async def _acquire_d(self) -> Instance:
        try:
            return await self.scheduler.acquire(self.info, frozenset(self.failed_d), accept=self.pd.is_decode,
                                                missing=NO_DECODE)
        except Refused as refused:
            if refused.message != NO_DECODE or not self.failed_d:
                raise
        # no other D: the one that failed, when it is still in rotation (an error envelope, not a dead channel)
        return await self.scheduler.acquire(self.info, accept=self.pd.is_decode, missing=NO_DECODE)

    async def _leg(self, recompute: bool) -> dict[str, Any] | Response:
        """Send the request to a P (with a D registered); P's 200 envelope, or P's refusal as a Response."""
        attempts = self.cfg.max_retry + 1
        last_failure = ""
        for attempt in range(attempts):
            self._release()
            try:
                p = self.p = await self.scheduler.acquire(self.info, frozenset(self.failed_p),
                                                          accept=self.pd.is_prefill, missing=NO_PREFILL)
            except Refused as refused:
                if refused.message == NO_PREFILL and last_failure:
                    raise Refused(f"{NO_PREFILL}: {last_failure}", 503) from None
                raise
            d = self.d = await self._acquire_d()
            self.channel, self.queue = self.pd.hub.register(d, self.req_id)
            target = f"{d.ip}:{d.inter_comm_port}" if d.inter_comm_port else d.ip
            headers = [*self.headers, ("req-id", self.req_id), ("d-target", target), ("req-type", "prefill")]
            if recompute:
                headers.append(("is-recompute", "true"))
            url = f"{self.pd.forwarder.scheme}://{p.ip}:{p.port}{self.url_path}"
            try:
                async with await _within(self._wait_deadline(), self.pd.forwarder.client.request(
                        self.method, url, data=self.body, headers=headers)) as resp:
                    if resp.status == 503:
                        raise _PRetry("the P instance answered 503 (not ready or overloaded)")
                    content = await _within(self._wait_deadline(), resp.read())
                    status, content_type = resp.status, resp.headers.get("content-type", "application/json")
            except aiohttp.ClientError as exc:
                p.mark_failed(f"{type(exc).__name__}: {exc}")
                last_failure = f"{type(exc).__name__}: {exc or 'connection failed'}"
            except _PRetry as retry:
                last_failure = str(retry)
            except (asyncio.TimeoutError, TimeoutError):
                raise self._timeout() from None
            else:
                if status != 200:  # P's refusal, in the protocol's own format
                    return Response(content, status_code=status, headers={
                        "content-type": content_type, "server": self.cfg.server_name})
                try:
                    envelope = json.loads(content)
                except (ValueError, UnicodeDecodeError):
                    envelope = None
                if not isinstance(envelope, dict):
                    log.error("P instance error: Receive messages from p instance failed: instance %d (%s) answered "
                              "200 without an envelope: %r", p.id, p.base_url, content[:200])
                    raise _Ended(f"P instance error: instance {p.base_url} answered without a PD envelope", 502)
                self.answered = True
                return envelope
            self.failed_p.add(p.id)
            self.pd.forwarder.retries += 1
            log.warning("Send messges to p instance failed: instance %d (%s): %s; attempt %d of %d", p.id,
                        p.base_url, last_failure, attempt + 1, attempts)
        raise _Ended(f"Send messges to p instance failed after {attempts} attempts: {last_failure}", 503)

    def _recompute_or_end(self, why: str) -> None:
        """Count a recompute (raise :class:`_Ended` when ``max_retry`` are spent)."""
        self.recomputes += 1
        if self.recomputes > self.cfg.max_retry:
            raise _Ended(f"the decode (D) instance failed and the request could not be completed after "
                         f"{self.cfg.max_retry} recompute(s): {why}", 500)
        self.pd.recomputes += 1
        log.warning("request %s: %s; recompute %d of %d", self.req_id, why, self.recomputes, self.cfg.max_retry)

    def _d_failed(self, why: str, dead: bool) -> None:
        if self.d is not None:
            self.failed_d.add(self.d.id)
            if dead:
                self.d.mark_failed(why)
        self._recompute_or_end(why)

    async def _next_event(self) -> Event:
        assert self.queue is not None
        try:
            return await _within(self._wait_deadline(), self.queue.get())
        except (asyncio.TimeoutError, TimeoutError):
            raise self._timeout() from None

    # -- non-stream and the start of a stream -----------------------------------------------------
    async def start(self) -> Response:
        """Run until the answer is complete (non-stream) or a stream starts; the Response to send."""
        recompute = False
        while True:
            try:
                leg = await self._leg(recompute)
            except _Ended as ended:
                raise Refused(ended.message, ended.status) from None
            if isinstance(leg, Response):
                return leg
            recompute = True
            try:
                result = self._p_envelope(leg)
                if result is not None:
                    return result
                if self.streaming:
                    return _RelayResponse(self._stream(leg), self._close, status_code=200, headers={
                        "content-type": self.content_type, "server": self.cfg.server_name})
                return await self._wait_final()
            except _Recompute:
                continue
            except _Ended as ended:
                raise Refused(ended.message, ended.status) from None

    def _p_envelope(self, envelope: dict[str, Any]) -> Response | None:
        """P's envelope before the answer started: a final Response, or None (stream or wait for D)."""
        self.content_type = str(envelope.get("contentType") or self.content_type)
        if isinstance(envelope.get("error"), dict) or envelope.get("isLastResp"):
            return self._last(envelope, "P could not hand the request to D")
        self.streaming = bool(envelope.get("isStream"))
        return None

    def _last(self, envelope: dict[str, Any], recompute_reason: str) -> Response:
        """The answer a last (or error) envelope gives; raises :class:`_Recompute` when it asks for a recompute."""
        error = envelope.get("error")
        if not isinstance(error, dict):
            return self._final(str(envelope.get("output") or ""), 200)
        if error.get("recompute"):
            self._d_failed(f"{recompute_reason}: {error.get('message', '')}", dead=False)
            raise _Recompute
        return self._final(str(envelope.get("output") or ""), _error_status(error))

    def _final(self, output: str, status: int) -> Response:
        data = output.encode()
        self.pd.forwarder.sizes.add_output(len(data) // BYTES_PER_TOKEN)
        return Response(data, status_code=status, headers={"content-type": self.content_type,
                                                           "server": self.cfg.server_name})

    async def _wait_final(self) -> Response:
        """Non-stream: D's final envelope as the answer."""
        while True:
            event = await self._next_event()
            if isinstance(event, DFailed):
                self._d_failed(f"the D's /dresult channel broke: {event.reason}", dead=True)
                raise _Recompute
            if event.get("isLastResp"):
                return self._last(event, "D reported")

    # -- the stream ---------------------------------------------------------------------------------
    async def _close(self) -> None:
        self.finish()
        self.scheduler.leave()

    def _unit(self, k: int, output: str) -> bytes:
        """Stream unit ``k`` when the client does not have it yet (else nothing)."""
        if k < self.delivered:
            return b""
        self.delivered = k + 1
        return output.encode()

    async def _stream(self, envelope: dict[str, Any]) -> AsyncIterator[bytes]:
        """The stream's chunks: P's unit 0, then D's units in order, recomputing when the D fails."""
        pending: dict[str, Any] | None = envelope
        try:
            while True:
                try:
                    if pending is not None:  # P's envelope: unit 0 (skipped after a recompute)
                        pieces, pending = self._stream_envelope(pending, unit=0), None
                        for piece in pieces:
                            if piece is None:
                                return
                            if piece:
                                yield piece
                    async for piece in self._d_units():
                        yield piece
                    self.pd.forwarder.sizes.add_output(self.delivered)
                    return
                except _Recompute:
                    leg = await self._leg(recompute=True)
                    if isinstance(leg, Response):
                        text = bytes(leg.body)[:300].decode(errors="replace")
                        raise _Ended(f"P refused the recomputed request ({leg.status_code}): {text}",
                                     leg.status_code) from None
                    pending = leg
        except (_Ended, Refused) as ended:
            self.pd.forwarder.failed_streams += 1
            yield stream_error_event(self.path, self.content_type, ended.message)

    def _stream_envelope(self, envelope: dict[str, Any], unit: int) -> list[bytes | None]:
        """Chunks for one envelope in a running stream; a trailing None means the stream is over."""
        error = envelope.get("error")
        if isinstance(error, dict):
            if error.get("recompute"):
                self._d_failed(f"reported: {error.get('message', '')}", dead=False)
                raise _Recompute
            return [str(envelope.get("output") or "").encode(), None]
        output = str(envelope.get("output") or "")
        if envelope.get("isLastResp") and unit == 0:  # P finished it alone: its output holds every unit
            return [_skip_events(output, self.delivered), None]
        chunks: list[bytes | None] = [self._unit(unit, output)]
        if envelope.get("isLastResp"):
            chunks.append(None)
        return chunks

    async def _d_units(self) -> AsyncIterator[bytes]:
        """D's envelopes as chunks until ``isLastResp``; raises :class:`_Recompute` when the D fails."""
        while True:
            event = await self._next_event()
            if isinstance(event, DFailed):
                self._d_failed(f"the D's /dresult channel broke: {event.reason}", dead=True)
                raise _Recompute
            seq = event.get("seq")
            unit = seq if isinstance(seq, int) and not isinstance(seq, bool) else self.delivered
            for piece in self._stream_envelope(event, unit=max(1, unit)):
                if piece is None:
                    return
                if piece:
                    yield piece


class _PRetry(Exception):
    """P answered 503: try another P."""


def _error_status(error: dict[str, Any]) -> int:
    """An envelope error's HTTP status (500 when it gives none that is valid)."""
    status = error.get("status")
    return status if isinstance(status, int) and not isinstance(status, bool) and 400 <= status <= 599 else 500


def _skip_events(text: str, count: int) -> bytes:
    """``text`` (a whole SSE answer) without its first ``count`` events (blank-line separated)."""
    if count <= 0:
        return text.encode()
    parts = text.split("\n\n")
    events, tail = parts[:-1], parts[-1]
    rest = "".join(e + "\n\n" for e in events[count:]) + tail
    return rest.encode()
