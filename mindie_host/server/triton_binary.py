"""Codec for the Triton / KServe v2 binary tensor data extension.

An HTTP body that carries binary tensors is ``<JSON header><blob 1><blob 2>...``.
``Inference-Header-Content-Length`` gives the size of the JSON part, and each
tensor sent in binary has ``parameters.binary_data_size`` in its JSON entry.
The blobs follow in the order the tensors appear in ``inputs`` (for requests)
or ``outputs`` (for responses). Blobs are little-endian and row-major with no
padding. BOOL takes one byte per element, BF16 takes two bytes (the upper half
of an IEEE fp32), and each BYTES element is a uint32 LE length followed by that
many bytes.

This module only converts between bytes and numpy arrays. It does not know
about any HTTP framework: the server passes in the body and the header value
and gets back arrays, or a body and the header value to send.

How tensors look in numpy:

* numeric and BOOL tensors use the native numpy dtype in ``TRITON_DATATYPES``;
* BF16 tensors are decoded to ``float32``, since numpy has no bfloat16.
  ``ml_dtypes.bfloat16`` arrays are also accepted when encoding;
* BYTES tensors are ``object`` arrays whose elements are ``bytes``. ``str``
  elements are accepted when encoding and are written as UTF-8.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from ..engine.request import RequestError
from .validation import has_lone_surrogate

__all__ = [
    "TRITON_DATATYPES",
    "TensorCodecError",
    "bytes_to_tensor",
    "decode_infer_request",
    "encode_infer_response",
    "json_to_tensor",
    "tensor_to_bytes",
    "tensor_to_json",
    "wants_binary_output",
]

#: Triton datatype name -> numpy dtype of the arrays this module returns.
#: BF16 is ``None``: numpy has no bfloat16, so BF16 tensors are returned as float32.
TRITON_DATATYPES: dict[str, np.dtype | None] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BF16": None,
    "BYTES": np.dtype(np.object_),
}

_BF16_HOST = np.dtype(np.float32)
_LEN_PREFIX = 4  # bytes in the uint32 length that precedes each BYTES element


class TensorCodecError(ValueError):
    """A tensor or request body that the binary/JSON codec cannot accept.

    ``field`` is a JSON path to the offending value. The standalone codec
    functions give it relative to the tensor object (``"shape"``, ``"data"``,
    ``"parameters.binary_data_size"``). :func:`decode_infer_request` and
    :func:`encode_infer_response` give it from the root of the body
    (``"inputs[1].parameters.binary_data_size"``). HTTP header problems use the
    header name (``"Inference-Header-Content-Length"``).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple:
        return (type(self), (self.field, self.message))

    def within(self, prefix: str, label: str) -> TensorCodecError:
        """Return a copy with ``field`` under ``prefix`` and ``label`` (e.g. ``input 'x'``) in the message."""
        return TensorCodecError(f"{prefix}.{self.field}", f"{label}: {self.message}")


# --------------------------------------------------------------------------- helpers


def _check_datatype(datatype: object) -> str:
    if not isinstance(datatype, str) or datatype not in TRITON_DATATYPES:
        raise TensorCodecError(
            "datatype", f"unknown datatype {datatype!r}; expected one of {', '.join(TRITON_DATATYPES)}"
        )
    return datatype


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_shape(shape: object, allow_variable: bool = False) -> list[int]:
    if not isinstance(shape, (list, tuple)) or not all(_is_int(d) for d in shape):
        raise TensorCodecError("shape", f"shape must be a list of integers, got {shape!r}")
    lowest = -1 if allow_variable else 0
    if any(d < lowest for d in shape):
        raise TensorCodecError("shape", f"shape dimensions must be >= {lowest}, got {list(shape)}")
    return [int(d) for d in shape]


def _item_size(datatype: str) -> int:
    if datatype == "BF16":
        return 2
    dtype = TRITON_DATATYPES[datatype]
    assert dtype is not None and datatype != "BYTES"
    return dtype.itemsize


def _bf16_bits(array: np.ndarray) -> np.ndarray:
    """Convert an array to bfloat16 bit patterns (uint16), rounding to nearest even."""
    if array.dtype.name == "bfloat16":  # ml_dtypes.bfloat16
        return np.ascontiguousarray(array).view(np.uint16)
    if array.dtype.kind not in "biuf":
        raise TensorCodecError("datatype", f"cannot encode a {array.dtype} array as BF16")
    f32 = np.ascontiguousarray(array, dtype=np.float32)
    bits = f32.view(np.uint32)
    upper = (bits >> 16).astype(np.uint16)
    # uint32 wrap-around can only happen for NaN patterns, which are replaced below.
    rounded = ((bits + (0x7FFF + (upper & 1))) >> 16).astype(np.uint16)
    # Keep NaN a NaN: truncating its mantissa may leave zero, which would read as Inf.
    nan_bits = np.where((upper & 0x7F) == 0, upper | 0x40, upper).astype(np.uint16)
    return np.where(np.isnan(f32), nan_bits, rounded).astype(np.uint16)


def _bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _coerce(array: Any, datatype: str) -> np.ndarray:
    """Return ``array`` with the numpy dtype of a fixed-size ``datatype`` (not BF16/BYTES)."""
    arr = np.asarray(array)
    target = TRITON_DATATYPES[datatype]
    assert target is not None
    if arr.dtype == target:
        return arr
    kind = arr.dtype.kind
    if target.kind == "b":
        ok = kind == "b"
    elif target.kind in "iu":
        ok = kind in "biu"
    else:
        ok = kind in "biuf"
    if not ok:
        raise TensorCodecError("datatype", f"cannot encode a {arr.dtype} array as {datatype}")
    if target.kind in "iu" and kind in "iu" and arr.size:
        info = np.iinfo(target)
        if int(arr.min()) < info.min or int(arr.max()) > info.max:
            raise TensorCodecError("data", f"values out of range for {datatype}")
    return arr.astype(target)


def _bytes_items(array: Any) -> list[bytes]:
    """Return the elements of a BYTES tensor as a flat row-major list of ``bytes``."""
    arr = np.asarray(array, dtype=object) if not isinstance(array, np.ndarray) else array
    items: list[bytes] = []
    for item in arr.ravel(order="C").tolist():
        if isinstance(item, (bytes, bytearray, memoryview)):
            items.append(bytes(item))
        elif isinstance(item, str):
            items.append(item.encode("utf-8"))
        else:
            raise TensorCodecError("data", f"BYTES elements must be bytes or str, got {type(item).__name__}")
    return items


def _utf8_or_none(items: list[bytes]) -> list[str] | None:
    try:
        return [item.decode("utf-8") for item in items]
    except UnicodeDecodeError:
        return None


def _object_array(items: list[Any], shape: list[int]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out.reshape(shape)


def _flatten(data: list) -> list:
    if not any(isinstance(v, list) for v in data):
        return data
    flat: list = []
    for value in data:
        if isinstance(value, list):
            flat.extend(_flatten(value))
        else:
            flat.append(value)
    return flat


# --------------------------------------------------------------------------- tensor codec


def tensor_to_bytes(array: np.ndarray, datatype: str) -> bytes:
    """Serialise ``array`` as the binary form of a ``datatype`` tensor.

    Output is little-endian and row-major. BOOL uses one byte (0/1) per
    element. BYTES elements each get a uint32 LE length prefix. BF16 is the
    upper 16 bits of the fp32 value, rounded to nearest even.
    Raises :class:`TensorCodecError` if the array cannot represent the datatype.
    """
    datatype = _check_datatype(datatype)
    if datatype == "BYTES":
        parts = []
        for item in _bytes_items(array):
            if len(item) > 0xFFFFFFFF:
                raise TensorCodecError("data", "BYTES element longer than 4 GiB")
            parts.append(len(item).to_bytes(_LEN_PREFIX, "little"))
            parts.append(item)
        return b"".join(parts)
    if datatype == "BF16":
        return _bf16_bits(np.asarray(array)).astype("<u2").tobytes()
    arr = _coerce(array, datatype)
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes(order="C")


def bytes_to_tensor(raw: bytes, datatype: str, shape: list[int]) -> np.ndarray:
    """Parse the binary form of a ``datatype`` tensor with the given ``shape``.

    The byte count must match the shape exactly. For BYTES, the number of
    length-prefixed elements must match and there must be no trailing bytes.
    Returns a new writable array (BF16 comes back as float32, BYTES as an
    object array of ``bytes``). Raises :class:`TensorCodecError`.
    """
    datatype = _check_datatype(datatype)
    shape = _check_shape(shape)
    count = math.prod(shape)
    size_field = "parameters.binary_data_size"
    raw = bytes(raw)
    if datatype == "BYTES":
        items: list[bytes] = []
        pos = 0
        while pos < len(raw):
            if len(items) == count:
                raise TensorCodecError(
                    size_field, f"{len(raw) - pos} bytes left after the {count} elements of shape {shape}"
                )
            if pos + _LEN_PREFIX > len(raw):
                raise TensorCodecError(size_field, f"truncated length prefix of BYTES element {len(items)}")
            length = int.from_bytes(raw[pos : pos + _LEN_PREFIX], "little")
            pos += _LEN_PREFIX
            if pos + length > len(raw):
                raise TensorCodecError(
                    size_field, f"BYTES element {len(items)} needs {length} bytes, only {len(raw) - pos} left"
                )
            items.append(raw[pos : pos + length])
            pos += length
        if len(items) != count:
            raise TensorCodecError(
                size_field, f"got {len(items)} BYTES elements, shape {shape} needs {count}"
            )
        return _object_array(items, shape)
    expected = count * _item_size(datatype)
    if len(raw) != expected:
        raise TensorCodecError(size_field, f"got {len(raw)} bytes, {datatype} shape {shape} needs {expected}")
    if datatype == "BF16":
        return _bf16_to_float32(np.frombuffer(raw, dtype="<u2")).reshape(shape)
    if datatype == "BOOL":
        return (np.frombuffer(raw, dtype=np.uint8) != 0).reshape(shape)
    native = TRITON_DATATYPES[datatype]
    assert native is not None
    return np.frombuffer(raw, dtype=native.newbyteorder("<")).astype(native).reshape(shape)


def json_to_tensor(data: list, datatype: str, shape: list[int]) -> np.ndarray:
    """Build a tensor from the JSON ``data`` form, flat or nested (row-major).

    Nested lists are flattened without checking that the nesting follows
    ``shape``. Only the total element count must match. Element types are
    strict: BOOL needs JSON booleans, integer types need integers within
    range, float types need numbers, and BYTES needs strings (stored as UTF-8
    ``bytes``). Raises :class:`TensorCodecError`.
    """
    datatype = _check_datatype(datatype)
    shape = _check_shape(shape)
    if not isinstance(data, list):
        raise TensorCodecError("data", f"data must be a JSON array, got {type(data).__name__}")
    flat = _flatten(data)
    count = math.prod(shape)
    if len(flat) != count:
        raise TensorCodecError("data", f"got {len(flat)} elements, shape {shape} needs {count}")

    def reject(allowed: tuple[type, ...], what: str) -> None:
        for value in flat:
            if type(value) not in allowed:
                raise TensorCodecError("data", f"{datatype} elements must be {what}, got {value!r}")

    if datatype == "BYTES":
        reject((str,), "strings")
        return _object_array([s.encode("utf-8") for s in flat], shape)
    if datatype == "BOOL":
        reject((bool,), "true/false")
        return np.array(flat, dtype=np.bool_).reshape(shape)
    target = TRITON_DATATYPES[datatype]
    if target is not None and target.kind in "iu":
        reject((int,), "integers")
        info = np.iinfo(target)
        if flat and (min(flat) < info.min or max(flat) > info.max):
            raise TensorCodecError("data", f"values out of range for {datatype} [{info.min}, {info.max}]")
        return np.array(flat, dtype=target).reshape(shape)
    reject((int, float), "numbers")
    try:
        wide = np.array(flat, dtype=np.float64)
    except OverflowError as exc:
        raise TensorCodecError("data", f"value out of range for {datatype}") from exc
    if datatype == "BF16":
        narrow = _bf16_to_float32(_bf16_bits(wide))
    else:
        assert target is not None
        with np.errstate(over="ignore"):
            narrow = wide.astype(target)
    if np.any(np.isinf(narrow) & np.isfinite(wide)):
        raise TensorCodecError("data", f"value out of range for {datatype}")
    return narrow.reshape(shape)


def tensor_to_json(array: Any, datatype: str) -> list:
    """Return the JSON ``data`` form of a tensor: a flat row-major list.

    BYTES elements are returned as ``str``. If an element is not valid
    UTF-8, :class:`TensorCodecError` is raised (send such tensors in binary).
    BF16 values are rounded to bfloat16 precision first, so the JSON and
    binary forms agree.
    """
    datatype = _check_datatype(datatype)
    if datatype == "BYTES":
        texts = _utf8_or_none(_bytes_items(array))
        if texts is None:
            raise TensorCodecError("data", "BYTES element is not valid UTF-8; request binary output")
        return texts
    if datatype == "BF16":
        return _bf16_to_float32(_bf16_bits(np.asarray(array))).ravel().tolist()
    return _coerce(array, datatype).ravel(order="C").tolist()


# --------------------------------------------------------------------------- requests


def _bool_param(params: object, key: str, field: str) -> bool | None:
    if params is None:
        return None
    if not isinstance(params, dict):
        raise TensorCodecError(field.rsplit(".", 1)[0], "parameters must be a JSON object")
    value = params.get(key)
    if value is not None and not isinstance(value, bool):
        raise TensorCodecError(field, f"{key} must be true or false, got {value!r}")
    return value


def _raw_request(body: bytes, name: str | None, datatype: str | None, shape: list[int] | None) -> dict:
    """Build the implied JSON header of a raw binary request (header length 0)."""
    field = "Inference-Header-Content-Length"
    if name is None or datatype is None or shape is None:
        raise TensorCodecError(field, "raw binary request (header length 0) is not supported for this model")
    try:
        datatype = _check_datatype(datatype)
        dims = _check_shape(shape, allow_variable=True)
    except TensorCodecError as exc:
        raise exc.within("inputs[0]", f"input '{name}'") from None
    variable = [i for i, d in enumerate(dims) if d == -1]
    if datatype == "BYTES":
        # Triton treats the whole body as one BYTES element; the length prefix is implied.
        if variable or math.prod(dims) != 1:
            raise TensorCodecError(
                "inputs[0].shape", f"input '{name}': raw BYTES input needs shape [1], model has {dims}"
            )
    else:
        if len(variable) > 1:
            raise TensorCodecError(
                "inputs[0].shape",
                f"input '{name}': raw input shape {dims} has more than one variable dimension",
            )
        fixed = math.prod(d for d in dims if d != -1) * _item_size(datatype)
        if variable:
            if fixed == 0 or len(body) % fixed:
                raise TensorCodecError(
                    "inputs[0].parameters.binary_data_size",
                    f"input '{name}': {len(body)} bytes do not fill whole rows of {fixed} bytes for shape {dims}",
                )
            dims[variable[0]] = len(body) // fixed
    entry = {"name": name, "datatype": datatype, "shape": dims, "parameters": {"binary_data_size": len(body)}}
    return {"inputs": [entry], "parameters": {"binary_data_output": True}}


def decode_infer_request(
    body: bytes,
    header_length: int | None,
    *,
    raw_input_name: str | None = None,
    raw_input_datatype: str | None = None,
    raw_input_shape: list[int] | None = None,
) -> tuple[dict, dict[str, np.ndarray]]:
    """Split and decode a ``/v2/models/{m}/infer`` request body.

    ``header_length`` is the value of ``Inference-Header-Content-Length``.
    With ``None`` the whole body is JSON. With ``0`` the request is a *raw
    binary request*: the body holds the bytes of the model's only input, which
    ``raw_input_name``/``raw_input_datatype``/``raw_input_shape`` describe. The
    shape may have one ``-1`` dimension, which is inferred from the byte count.
    For a batching model, pass the shape with a leading batch dimension of 1.

    Each input takes either ``binary_data_size`` bytes from the binary section
    (in input order) or its JSON ``data``. Every byte after the JSON header
    must be used. Returns the parsed header and ``{input name: array}``. The
    ``data`` of each input is removed from the header, so it is small enough
    to log. A raw request's implied header sets
    ``parameters.binary_data_output = true``, as the spec requires.
    Raises :class:`TensorCodecError`; its ``field`` names the offending input.
    """
    body = bytes(body)
    hl_field = "Inference-Header-Content-Length"
    if header_length is None:
        header_bytes, binary = body, b""
    elif header_length < 0 or header_length > len(body):
        raise TensorCodecError(
            hl_field, f"header length {header_length} is outside the body of {len(body)} bytes"
        )
    elif header_length == 0:
        header = _raw_request(body, raw_input_name, raw_input_datatype, raw_input_shape)
        entry = header["inputs"][0]
        if entry["datatype"] == "BYTES":
            array = _object_array([body], entry["shape"])
        else:
            try:
                array = bytes_to_tensor(body, entry["datatype"], entry["shape"])
            except TensorCodecError as exc:
                raise exc.within("inputs[0]", f"input '{entry['name']}'") from None
        return header, {entry["name"]: array}
    else:
        header_bytes, binary = body[:header_length], body[header_length:]

    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise TensorCodecError("body", f"inference header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise TensorCodecError("body", "inference header must be a JSON object")
    try:
        lone_surrogate = has_lone_surrogate(header_bytes, header)
    except RequestError:
        raise TensorCodecError("body", "inference header is nested too deeply") from None
    if lone_surrogate:
        raise TensorCodecError("body", "inference header holds a lone UTF-16 surrogate; strings must be valid Unicode")
    _bool_param(header.get("parameters"), "binary_data_output", "parameters.binary_data_output")
    _check_requested_outputs(header.get("outputs"))

    inputs = header.get("inputs")
    if not isinstance(inputs, list):
        raise TensorCodecError("inputs", "inputs must be a JSON array")
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    last_binary: tuple[int, str] | None = None
    for index, entry in enumerate(inputs):
        where = f"inputs[{index}]"
        if not isinstance(entry, dict):
            raise TensorCodecError(where, "input must be a JSON object")
        name = entry.get("name")
        if not isinstance(name, str):
            raise TensorCodecError(f"{where}.name", "input name must be a string")
        if name in tensors:
            raise TensorCodecError(f"{where}.name", f"duplicate input '{name}'")
        try:
            datatype = _check_datatype(entry.get("datatype"))
            shape = _check_shape(entry.get("shape"))
            params = entry.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise TensorCodecError("parameters", "parameters must be a JSON object")
            size = (params or {}).get("binary_data_size")
            if size is not None:
                if "data" in entry:
                    raise TensorCodecError(
                        "parameters.binary_data_size", "has both binary_data_size and data"
                    )
                if type(size) is not int or size < 0:
                    raise TensorCodecError(
                        "parameters.binary_data_size", f"must be a non-negative integer, got {size!r}"
                    )
                if offset + size > len(binary):
                    raise TensorCodecError(
                        "parameters.binary_data_size",
                        f"needs {size} bytes at offset {offset} of the binary data, which has only {len(binary)} bytes",
                    )
                tensors[name] = bytes_to_tensor(binary[offset : offset + size], datatype, shape)
                offset += size
                last_binary = (index, name)
            elif "data" in entry:
                tensors[name] = json_to_tensor(entry.pop("data"), datatype, shape)
            else:
                raise TensorCodecError("data", "input has neither data nor parameters.binary_data_size")
        except TensorCodecError as exc:
            raise exc.within(where, f"input '{name}'") from None

    if offset != len(binary):
        extra = len(binary) - offset
        if last_binary is None:
            raise TensorCodecError(
                hl_field, f"{extra} bytes follow the JSON header but no input has binary_data_size"
            )
        index, name = last_binary
        raise TensorCodecError(
            f"inputs[{index}].parameters.binary_data_size",
            f"input '{name}': {extra} unused bytes after the last binary input",
        )
    return header, tensors


def _check_requested_outputs(outputs: object) -> None:
    if outputs is None:
        return
    if not isinstance(outputs, list):
        raise TensorCodecError("outputs", "outputs must be a JSON array")
    for index, entry in enumerate(outputs):
        where = f"outputs[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise TensorCodecError(where, "requested output must be an object with a string name")
        _bool_param(entry.get("parameters"), "binary_data", f"{where}.parameters.binary_data")


def wants_binary_output(header: dict, output_name: str) -> bool:
    """Tell whether ``output_name`` should be returned as binary data.

    ``outputs[].parameters.binary_data`` on the matching requested output
    wins. Otherwise the request-level ``parameters.binary_data_output``
    decides. The default is ``False`` (JSON).
    """
    for index, entry in enumerate(header.get("outputs") or []):
        if isinstance(entry, dict) and entry.get("name") == output_name:
            where = f"outputs[{index}].parameters.binary_data"
            choice = _bool_param(entry.get("parameters"), "binary_data", where)
            if choice is not None:
                return choice
            break
    return bool(_bool_param(header.get("parameters"), "binary_data_output", "parameters.binary_data_output"))


# --------------------------------------------------------------------------- responses


def _json_default(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def encode_infer_response(
    response_header: dict,
    outputs: list[tuple[str, str, np.ndarray, bool]],
) -> tuple[bytes, int | None]:
    """Encode an inference response body.

    ``response_header`` holds the other top-level fields (``id``,
    ``model_name`` and so on). Its ``outputs`` is replaced by one entry per
    ``(name, datatype, array, as_binary)`` tuple, in the given order. A binary
    output gets ``parameters.binary_data_size`` and its blob is appended after
    the JSON. A JSON output gets ``data``. A BYTES output that is asked for as
    JSON but is not valid UTF-8 is sent as binary instead.

    Returns ``(body, header_length)``. ``header_length`` is the value for
    ``Inference-Header-Content-Length``. It is ``None`` when no output is
    binary; the body is then plain JSON and the header must not be sent.
    """
    header = dict(response_header)
    entries: list[dict] = []
    blobs: list[bytes] = []
    any_binary = False
    for index, (name, datatype, array, as_binary) in enumerate(outputs):
        arr = np.asarray(array)
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": [int(d) for d in arr.shape]}
        try:
            _check_datatype(datatype)
            if not as_binary and datatype == "BYTES":
                texts = _utf8_or_none(_bytes_items(arr))
                as_binary = texts is None
                if texts is not None:
                    entry["data"] = texts
            elif not as_binary:
                entry["data"] = tensor_to_json(arr, datatype)
            if as_binary:
                blob = tensor_to_bytes(arr, datatype)
                entry["parameters"] = {"binary_data_size": len(blob)}
                blobs.append(blob)
                any_binary = True
        except TensorCodecError as exc:
            raise exc.within(f"outputs[{index}]", f"output '{name}'") from None
        entries.append(entry)
    header["outputs"] = entries
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False, default=_json_default).encode(
        "utf-8"
    )
    if not any_binary:
        return head, None
    return head + b"".join(blobs), len(head)
