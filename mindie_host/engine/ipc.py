"""Wire format between the HTTP front end and the engine-core process.

Messages are msgpack (msgspec) frames over ZeroMQ. Requests and outputs cross as
their dataclasses (:class:`EngineRequest`, :class:`RequestOutput`), which msgspec
encodes field by field. Two request fields may hold arbitrary Python objects
(``logits_constraint`` and ``payload``): when set, they travel as one
pickled blob next to the plain fields, so the common request costs no pickle.

Front end -> engine: ``(ADD, request, blob)``, ``(ABORT, request_id)``, ``(ABORT_ALL,)``,
``(COMMAND, id, blob)`` (a plugin's engine command, :mod:`mindie_host.engine.commands`),
``(SHUTDOWN,)``. Engine -> front end: ``(READY, info_blob)``, ``(OUTPUTS, [outputs...], engine stats, plugin metrics)``
once per step, ``(RESULT, id, blob)`` per command, ``(FAILED, message)`` when the engine
could not start. Command arguments and answers are pickled: plugins choose what they send.
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Any

import msgspec

from .request import EngineRequest, RequestOutput

ADD, ABORT, ABORT_ALL, COMMAND, SHUTDOWN = "add", "abort", "abort_all", "command", "shutdown"
READY, OUTPUTS, RESULT, FAILED = "ready", "outputs", "result", "failed"

#: Request fields that may hold any Python object; pickled only when set.
OPAQUE_FIELDS = ("logits_constraint", "payload")

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()
_request_decoder = msgspec.msgpack.Decoder(EngineRequest)
_outputs_decoder = msgspec.msgpack.Decoder(list[RequestOutput])


def encode_request(request: EngineRequest) -> list[bytes]:
    """Frames of an ``ADD`` message: kind, the plain request, the pickled opaque fields (or b"")."""
    opaque = {name: getattr(request, name) for name in OPAQUE_FIELDS if getattr(request, name)}
    plain = replace(request, logits_constraint=None, payload=None) if opaque else request
    blob = pickle.dumps(opaque, protocol=pickle.HIGHEST_PROTOCOL) if opaque else b""
    return [ADD.encode(), _encoder.encode(plain), blob]


def decode_request(frames: list[bytes]) -> EngineRequest:
    """The :class:`EngineRequest` of an ``ADD`` message's frames."""
    request = _request_decoder.decode(frames[1])
    if request.span_keys is not None:
        request.span_keys = [tuple(span) for span in request.span_keys]  # type: ignore[misc]
    if frames[2]:
        for name, value in pickle.loads(frames[2]).items():
            setattr(request, name, value)
    return request


def decode_plain_request(frames: list[bytes]) -> EngineRequest:
    """The plain fields of an ``ADD`` message (its opaque fields left out): enough to fail it."""
    return _request_decoder.decode(frames[1])


def encode(kind: str, *parts: Any) -> list[bytes]:
    """Frames of a control or output message: kind, then one msgpack frame per part."""
    return [kind.encode(), *(_encoder.encode(p) for p in parts)]


def decode_outputs(frame: bytes) -> list[RequestOutput]:
    """The batch of one ``OUTPUTS`` message."""
    return _outputs_decoder.decode(frame)


def decode(frame: bytes) -> Any:
    """A msgpack frame as plain Python values."""
    return _decoder.decode(frame)


def encode_blob(kind: str, ident: int, value: Any) -> list[bytes]:
    """Frames of a ``COMMAND`` or ``RESULT`` message: kind, the command's id, the pickled value."""
    return [kind.encode(), _encoder.encode(ident), pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)]


def decode_blob(frames: list[bytes]) -> tuple[int, Any]:
    """``(id, value)`` of a ``COMMAND`` or ``RESULT`` message."""
    return _decoder.decode(frames[1]), pickle.loads(frames[2])
