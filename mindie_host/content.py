"""Typed content items (``{"type": "image_url", "image_url": ...}``) in prompts: the protocol seam.

Every protocol that takes a list of content parts (OpenAI ``messages[].content``, vLLM
``prompt``, TGI and MindIE ``inputs``, Triton ``text_input``) joins the text parts into
the prompt and asks :func:`media_text` what stands for each media part. With no media
handler (the ``multimodal`` plugin off) that is a 422 naming the part: media are never
silently dropped. A plugin that serves media registers a :class:`MediaHandler` for its
host at startup (:func:`register_media_handler`); it returns the placeholder text (e.g. ``"<image>"``) that the chat template and
the tokenizer carry to the request-refinement hook, where the plugin expands it and
attaches the media (``EngineRequest.payload``).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Protocol

from .engine.request import RequestError
from .host_state import CacheSlot

#: content-part types that carry media rather than text (spec §0.4)
MEDIA_TYPES: tuple[str, ...] = ("image_url", "video_url", "audio_url")


class MediaHandler(Protocol):
    """What a media-serving plugin provides to the protocol parsers."""

    def placeholder(self, kind: str, item: dict[str, Any], field: str) -> str:
        """The prompt text standing for media part ``item`` (of type ``kind``) at ``field``.

        Raise :class:`~mindie_host.api.RequestError` (422) for a type the model does not
        take or an empty URL; fetching and decoding happen later, in the refinement hook.
        """
        ...


#: the host whose request this task is parsing (bound by ``mindie_host.server.app.read_json``)
_current_host: ContextVar[Any] = ContextVar("mindie_host_current_host", default=None)


def bind_host(host: Any) -> None:
    """Remember which host parses the current request (each server plane calls this per request)."""
    _current_host.set(host)


#: the media handler a plugin registered, per host
MEDIA_HANDLER: CacheSlot[MediaHandler] = CacheSlot("media handler")


def register_media_handler(host: Any, handler: MediaHandler) -> None:
    """Serve ``host``'s media parts with ``handler`` (a plugin calls this at startup)."""
    host.caches.put(MEDIA_HANDLER, handler)


def unregister_media_handler(host: Any) -> None:
    """Stop serving media parts on ``host``."""
    host.caches.put(MEDIA_HANDLER, None)


def media_text(kind: str, item: dict[str, Any], field: str) -> str:
    """The placeholder text of a media part, or a 422 when no plugin serves media on this host."""
    host = _current_host.get()
    handler = host.caches.get(MEDIA_HANDLER) if host is not None else None
    if handler is None:
        raise RequestError(
            f"{field}.type {kind!r} is not supported by this text-only model "
            "(multimodal input needs the multimodal plugin: plugin_type \"multimodal\")",
            field=f"{field}.type",
        )
    return handler.placeholder(kind, item, field)
