"""Tokenizer routes on the business port: MindIE's token count and vLLM's tokenize / detokenize.

- ``POST /v1/tokenizer`` (MindIE, spec §4.2.7.6): ``{"inputs": str}`` with ``inputs`` of
  0 to 4*1024*1024 characters answers ``{"token_number": n, "tokens": [str, ...]}``. ``tokens``
  are the decoded pieces; tokens that only decode together (a CJK character spread over
  several byte tokens) are merged into one piece, so there may be fewer pieces than
  ``token_number``. Errors use MindIE's ``{"type", "error", "field"}`` body.
- ``POST /tokenize`` (vLLM): ``{model?, prompt, add_special_tokens=true}`` or
  ``{model?, messages, add_generation_prompt=true, add_special_tokens=false}``, plus
  ``return_token_strs``, answers ``{"count", "max_model_len", "tokens"}`` (and ``token_strs``).
- ``POST /detokenize`` (vLLM): ``{model?, tokens}`` answers ``{"prompt"}``.

The vLLM routes answer errors in OpenAI's ``{"error": {...}}`` body; a field they do not
know is refused (400) rather than ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .. import hookimpl
from ..chat_template import fit_roles, template_kwargs, template_profile
from ..context import HostContext
from ..engine.request import RequestError
from .app import error_response, json_response, mindie_error_body, offload, read_json
from .openai import openai_error
from .openai_parse import chat_messages, make_fields
from .validation import Fields

if TYPE_CHECKING:
    from ..host_protocol import Host

#: MindIE's limit on ``inputs`` (characters)
MAX_INPUTS = 4 * 1024 * 1024
TOKENIZE_KEYS = ("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs",
                 "chat_template_kwargs")
DETOKENIZE_KEYS = ("model", "tokens")


def merged_pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    """Decode ``ids`` piece by piece, joining tokens until they decode to whole characters."""
    pieces: list[str] = []
    pending: list[int] = []
    for token in ids:
        pending.append(token)
        text = tokenizer.decode(pending)
        if "\ufffd" in text and len(pending) < 8:  # a character split over byte tokens: wait for the rest
            continue
        pieces.append(text)
        pending = []
    if pending:
        pieces.append(tokenizer.decode(pending))
    return pieces


def refuse_unknown(body: dict[str, Any], known: tuple[str, ...]) -> None:
    for key in body:
        if key not in known:
            raise RequestError(f"unsupported field {key!r}; this route accepts {list(known)}", status=400, field=key)


def check_model(host: Host, f: Fields) -> None:
    """``model`` is optional; when sent it must name a served model."""
    model = f.str("model", None)
    if model is not None and model not in host.served_model_names:
        raise RequestError(f"The model `{model}` does not exist; served: {host.served_model_names}",
                           status=404, field="model")


class TokenizeServer:
    """Handlers of the tokenizer routes for one host."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def count(self, body: Any) -> dict[str, Any]:
        """MindIE's ``/v1/tokenizer``."""
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object", field="body")
        refuse_unknown(body, ("inputs",))
        if "inputs" not in body:
            raise RequestError("inputs is required", field="inputs")
        text = Fields(body).str("inputs", max_len=MAX_INPUTS)
        assert text is not None
        ids = self.host.tokenize(text) if text else []
        return {"token_number": len(ids), "tokens": merged_pieces(self.host.tokenizer, ids)}

    def vllm_fields(self, body: Any, known: tuple[str, ...]) -> Fields:
        """A vLLM route's body: an object of known fields whose ``model``, if sent, is served."""
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object", status=400, field="body")
        refuse_unknown(body, known)
        f = make_fields(self.host, body)
        check_model(self.host, f)
        return f

    def tokenize(self, body: Any) -> dict[str, Any]:
        """vLLM's ``/tokenize``."""
        host = self.host
        f = self.vllm_fields(body, TOKENIZE_KEYS)
        has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
        if has_prompt == has_messages:
            raise RequestError("send exactly one of prompt and messages", status=400,
                               field="messages" if has_messages else "prompt")
        if has_prompt:
            prompt = f.str("prompt")
            assert prompt is not None
            if body.get("add_generation_prompt") is not None:
                raise RequestError("add_generation_prompt applies to messages only", status=400,
                                   field="add_generation_prompt")
            if body.get("chat_template_kwargs") is not None:
                raise RequestError("chat_template_kwargs applies to messages only", status=400,
                                   field="chat_template_kwargs")
            special = bool(f.bool("add_special_tokens", True))
        else:  # rendered as the chat endpoint renders them (fitted to the template, its own variables)
            profile = template_profile(host)
            kwargs = template_kwargs(f.raw("chat_template_kwargs"), profile)
            messages = fit_roles(chat_messages(f), profile)
            generation = bool(f.bool("add_generation_prompt", True))
            if generation:
                prompt = host.apply_chat_template(messages, **kwargs)
            else:
                prompt = host.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                                            **kwargs)
            special = bool(f.bool("add_special_tokens", False))
        ids = host.tokenize(prompt, add_special_tokens=special)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": host.config.deploy.maxSeqLen, "tokens": ids}
        if f.bool("return_token_strs", False):
            out["token_strs"] = host.tokenizer.convert_ids_to_tokens(ids)
        return out

    def detokenize(self, body: Any) -> dict[str, Any]:
        """vLLM's ``/detokenize``."""
        host = self.host
        self.vllm_fields(body, DETOKENIZE_KEYS)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise RequestError("tokens must be a list of token ids", status=400, field="tokens")
        vocab = host.info.vocab_size if host.info is not None else None
        for i, t in enumerate(tokens):
            if t < 0 or (vocab is not None and t >= vocab):
                raise RequestError(f"tokens[{i}] must be a token id in [0, {(vocab or 1) - 1}], got {t}",
                                   status=400, field=f"tokens[{i}]")
        return {"prompt": host.tokenizer.decode(tokens)}


@hookimpl
def mindie_host_add_routes(ctx: HostContext, app: FastAPI, plane: str) -> None:
    host = ctx.host
    assert host is not None  # routes are added for a running host
    if plane != "business":
        return
    server = TokenizeServer(host)

    routes = (("/v1/tokenizer", server.count, mindie_error_body),  # MindIE's error body
              ("/tokenize", server.tokenize, None),  # vLLM's routes answer in OpenAI's format
              ("/detokenize", server.detokenize, None))
    for path, handle, render in routes:
        app.add_api_route(path, _endpoint(host, handle, render), methods=["POST"])


def _endpoint(host: Host, handle: Any, render: Any) -> Any:
    """A POST route: read the JSON body, run ``handle`` off the event loop, render its errors."""

    async def endpoint(request: Request) -> Response:
        try:
            body = await read_json(request, host)
            return json_response(await offload(host, handle, body))
        except RequestError as err:
            return error_response(err, render) if render is not None else openai_error(err)

    return endpoint
