"""vLLM 0.2.6-compatible ``POST /generate`` (spec §2.2).

The path is shared with TGI; :mod:`mindie_host.server.tgi` registers the route and
hands bodies with ``prompt`` to :meth:`VLLMServer.generate`. Non-stream answers
``{"text": [prompt + completion]}``; the stream is ``{"text": [delta]}`` objects each
followed by a NUL byte (cumulative generated text with ``fullTextEnabled``).
``model`` names a LoRA adapter (``"None"`` = the base model). Errors use MindIE's
``{"type", "error", "field"}`` body.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from ..engine.request import EngineRequest, RequestError, RequestOutput
from .app import error_response, json_response, mindie_error_body, offload, streaming_response, until_disconnect
from .params import build_sampling
from .textgen import check_adapter, failure, primed, text_input
from .validation import INT32_MAX, Fields, check_seed

if TYPE_CHECKING:
    from ..host_protocol import Host

PROTOCOL = "vllm"
#: The stream's object separator.
NUL = b"\0"


def _chunk(data: dict[str, Any]) -> bytes:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + NUL


class VLLMServer:
    """Handler of the vLLM ``/generate`` body for one host."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def parse(self, body: dict[str, Any]) -> tuple[str, bool, EngineRequest]:
        """Validate the body (every field is top level; ``null`` means "not sent")."""
        host = self.host
        f = Fields(body, nullable=True)
        prompt = text_input(f.raw("prompt"), "prompt")
        values = {
            "temperature": f.float("temperature", lo=0.0),
            "top_k": f.int("top_k", lo=0, hi=INT32_MAX, lo_open=True, allow=(-1,)),
            "top_p": f.float("top_p", lo=1e-6, hi=1.0, lo_open=True),
            "repetition_penalty": f.float("repetition_penalty", lo=0.0, hi=2.0, lo_open=True),
            "presence_penalty": f.float("presence_penalty", lo=-2.0, hi=2.0),
            "frequency_penalty": f.float("frequency_penalty", lo=-2.0, hi=2.0),
        }
        stream = bool(f.bool("stream", False))
        model = f.str("model", "None", min_len=1)
        sampling = build_sampling(
            host,
            values,
            None,  # do_sample is not part of this API and is not validated (spec §4.1)
            seed=check_seed(f, "seed", zero_allowed=False),
            max_tokens=f.int("max_tokens", None, lo=0, hi=INT32_MAX, lo_open=True),
            stop=f.stop_list("stop", max_items=None, item_max=None, total_max=32768, str_max=32768),
            stop_token_ids=f.int_list("stop_token_ids"),
            include_stop_str_in_output=f.bool("include_stop_str_in_output", False),
            skip_special_tokens=f.bool("skip_special_tokens", True),
            ignore_eos=f.bool("ignore_eos", False),
        )
        req = host.new_request(protocol=PROTOCOL, body=body, sampling=sampling, prompt=prompt,
                               request_id=host.new_request_id("vllm"))
        check_adapter(host, req, model, "model")
        return prompt, stream, req

    async def generate(self, request: Request, body: dict[str, Any]) -> Response:
        """``POST /generate`` with a vLLM body."""
        try:
            prompt, stream, req = await offload(self.host, self.parse, body)
            if stream:
                outputs = await primed(self.host.generate(req))
                return streaming_response(self.chunks(outputs), media_type="text/plain; charset=utf-8")
            out: RequestOutput = await until_disconnect(request, self.host.generate_full(req))
            err = failure(out)
            if err is not None:
                raise err
            return json_response({"text": [prompt + out.text]})
        except RequestError as err:
            return error_response(err, mindie_error_body)

    async def chunks(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[bytes]:
        """``{"text": [...]}\\0`` per increment of text."""
        full_text = self.host.config.server.fullTextEnabled
        sent = False
        try:
            async for out in outputs:
                err = failure(out)
                if err is not None:
                    yield _chunk(mindie_error_body(err))
                    return
                if out.new_text or (out.finished and not sent):
                    sent = True
                    yield _chunk({"text": [out.text if full_text else out.new_text]})
        except RequestError as err:
            yield _chunk(mindie_error_body(err))
