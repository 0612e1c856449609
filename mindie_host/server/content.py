"""Typed content items (``{"type": "image_url", "image_url": ...}``) in prompts: the protocol seam.

Every protocol that takes a list of content parts (OpenAI ``messages[].content``, vLLM
``prompt``, TGI and MindIE ``inputs``, Triton ``text_input``) joins the text parts into
the prompt and asks :func:`media_text` what stands for each media part. With no media
handler (the ``multimodal`` plugin off) that is a 422 naming the part: media are never
silently dropped. A plugin that serves media registers a :class:`MediaHandler` at
startup; it returns the placeholder text (e.g. ``"<image>"``) that the chat template and
the tokenizer carry to the request-refinement hook, where the plugin expands it and
attaches the media (``EngineRequest.payload``).
"""

from __future__ import annotations

from typing import Any, Protocol

from ..engine.request import RequestError

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


_handlers: list[MediaHandler] = []


def register_media_handler(handler: MediaHandler) -> None:
    """Serve media parts with ``handler`` (the latest registered wins) until it is unregistered."""
    _handlers.append(handler)


def unregister_media_handler(handler: MediaHandler) -> None:
    """Stop serving media parts with ``handler`` (no error if it was not registered)."""
    if handler in _handlers:
        _handlers.remove(handler)


def media_text(kind: str, item: dict[str, Any], field: str) -> str:
    """The placeholder text of a media part, or a 422 when no plugin serves media."""
    if not _handlers:
        raise RequestError(
            f"{field}.type {kind!r} is not supported by this text-only model "
            "(multimodal input needs the multimodal plugin: plugin_type \"multimodal\")",
            field=f"{field}.type",
        )
    return _handlers[-1].placeholder(kind, item, field)
