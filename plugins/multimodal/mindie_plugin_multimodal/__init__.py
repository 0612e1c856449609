"""mindie-host plugin ``multimodal``: image input for LLaVA- and Qwen2-VL-style models (MindIE §7.4).

Enabled per model with ``"plugin_params": "{\\"plugin_type\\":\\"multimodal\\"}"`` on a
``backendType: "torch"`` model whose ``modelWeightPath`` is a transformers-format LLaVA or
Qwen2-VL directory. Optional settings, in ``config.json``'s ``Plugins`` section::

    "Plugins": {"multimodal": {"allowedLocalMediaPath": ["/data/images"], "allowHttp": false,
                               "httpTimeoutS": 10}}

* ``allowedLocalMediaPath``: directories whose files ``image_url`` may name (default none:
  server-local paths are refused);
* ``allowHttp``: fetch ``http(s)://`` image URLs (default false);
* ``httpTimeoutS``: the fetch timeout, in (0, 600].

Images given as base64 data URLs always work. Received and downloaded images are cached
under ``LOCAL_CACHE_DIR``. The hooks:

* ``mindie_host_model_backend``: the torch backend that also holds the vision tower;
* ``mindie_host_startup`` / ``mindie_host_shutdown``: (un)register the media handler that
  gives the protocol parsers the model's image text;
* ``mindie_host_refine_request``: fetch, preprocess and place the request's images;
* ``mindie_host_request_finished``: drop the request's image features.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, StrictBool, field_validator

from mindie_host import hookimpl
from mindie_host.api import (
    BackendContext,
    EngineRequest,
    HostContext,
    RequestError,
    register_media_handler,
    resolve_model,
    unregister_media_handler,
)
from mindie_host.backend_api import select_platform

from .backend import MultimodalTorchBackend
from .inputs import ImagePreprocessor, MultimodalPayload, expand, mrope_positions
from .media import MAX_MULTIMODAL_URL_NUM, MediaPolicy, default_cache_dir, load_image, url_of
from .models import ModelSpec, MultimodalModelError, read_spec

__all__ = ["NAME", "MultimodalPayload", "MultimodalTorchBackend", "collect_media"]

NAME = "multimodal"

MEDIA_KINDS = ("image_url", "video_url", "audio_url")
#: body keys that may hold a list of content parts, per protocol family
CONTENT_KEYS = ("prompt", "inputs", "text_input")


class Params(BaseModel):
    """``Plugins.multimodal``: where media may come from (validated by the host at startup)."""

    #: directories whose files ``image_url`` may name (a single path is accepted too)
    allowedLocalMediaPath: list[str] = Field(default_factory=list)
    #: fetch ``http(s)://`` image URLs
    allowHttp: StrictBool = False
    #: the fetch timeout, in seconds
    httpTimeoutS: float = Field(default=10.0, gt=0, le=600)

    @field_validator("allowedLocalMediaPath", mode="before")
    @classmethod
    def _existing_dirs(cls, value: Any) -> Any:
        dirs = [value] if isinstance(value, str) else value
        if not isinstance(dirs, list) or not all(isinstance(d, str) and Path(d).expanduser().is_dir() for d in dirs):
            raise ValueError("a list of existing directories")
        return dirs


class State:
    """Per engine: the image runtime, once the model is loaded (``None`` before startup and after shutdown)."""

    def __init__(self) -> None:
        self.runtime: ImageRuntime | None = None


@hookimpl
def mindie_host_validate_config(ctx: HostContext) -> list[str] | None:
    """The model directory must be a LLaVA or Qwen2-VL one served by the torch backend."""
    model_config = ctx.model
    if NAME not in model_config.plugins:
        return None
    errors = []
    if model_config.backendType != "torch":
        errors.append(f"plugin multimodal serves backendType 'torch' only, got {model_config.backendType!r}")
    try:
        read_spec(resolve_model(model_config.modelWeightPath).path)
    except Exception as exc:  # a missing path, a text-only model
        errors.append(f"plugin multimodal: ModelConfig.modelWeightPath: {exc}")
    return errors


@hookimpl
def mindie_host_model_backend(ctx: BackendContext, backend_type: str) -> Any:
    """The multimodal torch backend, for a ``torch`` model with this plugin enabled."""
    model_config = ctx.model
    if backend_type != "torch" or NAME not in model_config.plugins:
        return None
    return MultimodalTorchBackend(
        resolve_model(model_config.modelWeightPath),
        name=model_config.modelName,
        dtype=model_config.dtype,
        kv_cache_dtype=model_config.kvCacheDtype,
        quantization="none",
        compile_decode=model_config.compile,
        platform=select_platform(model_config.device),
    )


class ImageRuntime:
    """Per host: the model's image text, the image processor and where media may come from."""

    def __init__(self, spec: ModelSpec, tokenizer: Any, policy: MediaPolicy, max_input_tokens: int) -> None:
        self.spec = spec
        self.policy = policy
        self.max_input_tokens = max_input_tokens
        self.preprocess = ImagePreprocessor(spec)
        ids = [spec.image_token_id]
        if spec.vision_start_id is not None and spec.vision_end_id is not None:
            ids = [spec.vision_start_id, spec.image_token_id, spec.vision_end_id]
        self.image_text = "".join(tokenizer.convert_ids_to_tokens(ids))
        if tokenizer.encode(self.image_text, add_special_tokens=False) != ids:
            raise MultimodalModelError(
                f"the tokenizer does not encode the image text {self.image_text!r} as the token(s) {ids}"
            )

    # -- the protocol seam (mindie_host.api.MediaHandler) --------------------------
    def placeholder(self, kind: str, item: dict[str, Any], field: str) -> str:
        if kind != "image_url":
            raise RequestError(f"{field}.type {kind!r} is not supported by this model (allowed: text, image_url)",
                               field=f"{field}.type")
        url_of(item, kind, field)  # "Request param image_url null." before any tokenizing
        return self.image_text

    def attach(self, request: EngineRequest, parts: list[tuple[str, dict[str, Any], str]]) -> None:
        """Fetch and preprocess ``parts`` and widen the request's image tokens into placeholder spans."""
        if len(parts) > MAX_MULTIMODAL_URL_NUM:
            raise RequestError(
                f"The number of multimodal url. should be no more than {MAX_MULTIMODAL_URL_NUM}.", field=parts[0][2]
            )
        images = []
        for kind, item, field in parts:
            self.placeholder(kind, item, field)
            image, digest = load_image(url_of(item, kind, field), self.policy, f"{field}.{kind}")
            images.append(self.preprocess(image, digest))
        field = parts[0][2].split("[")[0] if parts else "prompt"
        ids = expand(request.prompt_token_ids, images, self.spec.image_token_id, field)
        if len(ids) > self.max_input_tokens:
            raise RequestError(
                f"{field} has {len(ids)} tokens with its images' placeholder tokens; the limit is "
                f"{self.max_input_tokens} (min of maxInputTokenLen, maxSeqLen-1, max_position_embeddings)",
                field=field,
            )
        payload = MultimodalPayload(images, len(ids))
        if self.spec.mrope_section is not None:
            payload.positions, payload.delta = mrope_positions(len(ids), images, self.spec.spatial_merge_size)
        request.prompt_token_ids = ids
        request.payload = payload
        request.span_keys = [(i.start, i.start + i.num_tokens, i.digest) for i in images]


def collect_media(body: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """Every media part of a request body, in prompt order: ``(kind, part, field)``.

    Looks where each protocol keeps content parts: OpenAI ``messages[].content``,
    vLLM ``prompt``, TGI / MindIE ``inputs``, Triton ``text_input``.
    """
    found: list[tuple[str, dict[str, Any], str]] = []

    def scan(parts: Any, field: str) -> None:
        if isinstance(parts, list):
            for j, part in enumerate(parts):
                if isinstance(part, dict) and part.get("type") in MEDIA_KINDS:
                    found.append((part["type"], part, f"{field}[{j}]"))

    messages = body.get("messages")
    if isinstance(messages, list):
        for i, msg in enumerate(messages):
            if isinstance(msg, dict):
                scan(msg.get("content"), f"messages[{i}].content")
    for key in CONTENT_KEYS:
        scan(body.get(key), key)
    return found


@hookimpl
def mindie_host_startup(ctx: HostContext) -> None:
    """Build the image runtime and let the protocol parsers accept image parts."""
    host = ctx.host
    if host is None or NAME not in ctx.model.plugins:
        return
    # from config.json, not the backend: with ServerConfig.engineProcess the model lives in another process
    spec = read_spec(resolve_model(ctx.model.modelWeightPath).path)
    p: Params = ctx.params
    policy = MediaPolicy(
        allowed_dirs=[Path(d).expanduser().resolve() for d in p.allowedLocalMediaPath],
        allow_http=p.allowHttp, http_timeout_s=p.httpTimeoutS, cache_dir=default_cache_dir(),
    )
    runtime = ctx.state.runtime = ImageRuntime(spec, host.tokenizer, policy, host.max_input_tokens)
    register_media_handler(host, runtime)
    ctx.log.info("multimodal on: %s, image text %r", spec.family, runtime.image_text)


@hookimpl
def mindie_host_shutdown(ctx: HostContext) -> None:
    """Stop accepting image parts for this host."""
    if ctx.state.runtime is not None and ctx.host is not None:
        ctx.state.runtime = None
        unregister_media_handler(ctx.host)


@hookimpl
def mindie_host_refine_request(ctx: HostContext, request: EngineRequest, body: dict[str, Any]) -> None:
    """Attach the body's images to the request (placeholder spans, payload, prefix-cache keys)."""
    runtime: ImageRuntime | None = ctx.state.runtime
    if runtime is None or not isinstance(body, dict):
        return
    parts = collect_media(body)
    if parts:
        runtime.attach(request, parts)
    elif runtime.spec.image_token_id in request.prompt_token_ids:
        raise RequestError(
            "the prompt holds the image placeholder text but no image part; send images as image_url parts",
            field="prompt",
        )


@hookimpl
def mindie_host_request_finished(ctx: HostContext, request: EngineRequest) -> None:
    """Free the request's image features as soon as it leaves the engine."""
    payload = request.payload
    if isinstance(payload, MultimodalPayload):
        for item in payload.images:
            item.embeds = None


@hookimpl
def mindie_host_metrics(ctx: HostContext) -> dict[str, float] | None:
    """``multimodal_images_encoded``, ``multimodal_vision_batches`` and seconds spent in the vision tower."""
    backend = ctx.host.backend if ctx.host is not None else None
    if not isinstance(backend, MultimodalTorchBackend):
        return None
    return {f"multimodal_{k}": float(v) for k, v in backend.counters.items()}
