"""Tests for the Triton binary tensor data extension codec."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as tritonhttp
import tritonclient.utils as tritonutils
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mindie_host.server.triton_binary import (
    TRITON_DATATYPES,
    TensorCodecError,
    bytes_to_tensor,
    decode_infer_request,
    encode_infer_response,
    json_to_tensor,
    tensor_to_bytes,
    tensor_to_json,
    wants_binary_output,
)

FIXED = [name for name, dtype in TRITON_DATATYPES.items() if dtype is not None and name != "BYTES"]
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    """Arrays are equal in dtype, shape and value (NaNs compared bit for bit)."""
    assert got.shape == want.shape
    assert got.dtype == want.dtype
    if want.dtype == object:
        assert got.ravel().tolist() == want.ravel().tolist()
    else:
        assert got.tobytes() == want.tobytes()


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def build_body(header: dict, *blobs: bytes) -> tuple[bytes, int]:
    head = json.dumps(header).encode()
    return head + b"".join(blobs), len(head)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("datatype", FIXED)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_round_trip_fixed_size(datatype: str, data: st.DataObject) -> None:
    array = data.draw(hnp.arrays(TRITON_DATATYPES[datatype], SHAPES))
    raw = tensor_to_bytes(array, datatype)
    assert len(raw) == array.size * array.dtype.itemsize
    back = bytes_to_tensor(raw, datatype, list(array.shape))
    assert_same(back, array)
    assert back.flags.writeable


@settings(max_examples=100, deadline=None)
@given(bits=hnp.arrays(np.uint16, SHAPES))
def test_round_trip_bf16(bits: np.ndarray) -> None:
    array = bf16_values(bits)
    raw = tensor_to_bytes(array, "BF16")
    assert raw == bits.astype("<u2").tobytes()
    assert_same(bytes_to_tensor(raw, "BF16", list(array.shape)), array)


@settings(max_examples=100, deadline=None)
@given(
    array=hnp.arrays(
        object,
        SHAPES,
        elements=st.binary(max_size=20),
        fill=st.nothing(),
    )
)
def test_round_trip_bytes(array: np.ndarray) -> None:
    raw = tensor_to_bytes(array, "BYTES")
    assert len(raw) == sum(4 + len(x) for x in array.ravel())
    assert_same(bytes_to_tensor(raw, "BYTES", list(array.shape)), array)


@settings(max_examples=50, deadline=None)
@given(
    array=hnp.arrays(np.float32, SHAPES, elements=st.floats(allow_nan=False, allow_infinity=False, width=32))
)
def test_round_trip_json_fp32(array: np.ndarray) -> None:
    data = json.loads(json.dumps(tensor_to_json(array, "FP32")))
    assert_same(json_to_tensor(data, "FP32", list(array.shape)), array)


def test_byte_layout() -> None:
    assert tensor_to_bytes(np.array([1, 2], dtype=np.uint32), "UINT32") == b"\x01\0\0\0\x02\0\0\0"
    assert tensor_to_bytes(np.array([True, False, True]), "BOOL") == b"\x01\x00\x01"
    assert tensor_to_bytes(np.array([b"ab", "c"], dtype=object), "BYTES") == b"\x02\0\0\0ab\x01\0\0\0c"
    # Fortran-ordered input is still written row-major.
    fortran = np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3))
    assert tensor_to_bytes(fortran, "INT16") == np.arange(6, dtype="<i2").tobytes()
    # Big-endian arrays are converted to little-endian.
    assert tensor_to_bytes(np.array([1], dtype=">i4"), "INT32") == b"\x01\0\0\0"


def test_bf16_rounding_and_nan() -> None:
    values = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf], dtype=np.float32)
    bits = np.frombuffer(tensor_to_bytes(values, "BF16"), dtype="<u2")
    # 1 + 2^-8 is a tie and rounds to even (1.0); 1 + 3*2^-8 rounds up.
    assert bits.tolist() == [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x7F80]
    nan = np.array([0x7F800001], dtype=np.uint32).view(np.float32)
    (nan_bits,) = np.frombuffer(tensor_to_bytes(nan, "BF16"), dtype="<u2")
    assert np.isnan(bf16_values(np.array([nan_bits])))[0]


def test_bool_decodes_nonzero_as_true() -> None:
    assert bytes_to_tensor(b"\x00\x01\x02", "BOOL", [3]).tolist() == [False, True, True]


def test_coercion_rules() -> None:
    assert bytes_to_tensor(tensor_to_bytes([1, 2, 3], "UINT8"), "UINT8", [3]).tolist() == [1, 2, 3]
    with pytest.raises(TensorCodecError, match="out of range"):
        tensor_to_bytes(np.array([256]), "UINT8")
    with pytest.raises(TensorCodecError):
        tensor_to_bytes(np.array([1.5]), "INT32")
    with pytest.raises(TensorCodecError):
        tensor_to_bytes(np.array([1, 0]), "BOOL")
    with pytest.raises(TensorCodecError) as info:
        tensor_to_bytes(np.array([1]), "INT128")
    assert info.value.field == "datatype"


# --------------------------------------------------------------------------- JSON form


def test_json_to_tensor_nested_and_flat() -> None:
    nested = json_to_tensor([[1, 2, 3], [4, 5, 6]], "INT64", [2, 3])
    flat = json_to_tensor([1, 2, 3, 4, 5, 6], "INT64", [2, 3])
    assert_same(nested, flat)
    assert json_to_tensor(["hé", ""], "BYTES", [2]).tolist() == ["hé".encode(), b""]
    assert json_to_tensor([], "FP32", [0, 3]).shape == (0, 3)


@pytest.mark.parametrize(
    ("data", "datatype", "shape"),
    [
        ([1, 2], "INT32", [3]),  # count mismatch
        ([1, True], "INT32", [2]),  # bool is not an int
        ([1.0], "INT32", [1]),  # float is not an int
        ([-1], "UINT32", [1]),  # out of range
        ([1], "BOOL", [1]),  # BOOL needs true/false
        ([1], "BYTES", [1]),  # BYTES needs strings
        (["1"], "FP32", [1]),  # floats need numbers
        ([1e300], "FP32", [1]),  # overflows fp32
        (5, "INT32", []),  # not a list
        ([1], "INT32", [-1]),  # bad shape
    ],
)
def test_json_to_tensor_rejects(data: object, datatype: str, shape: list[int]) -> None:
    with pytest.raises(TensorCodecError):
        json_to_tensor(data, datatype, shape)  # type: ignore[arg-type]


def test_tensor_to_json() -> None:
    assert tensor_to_json(np.array([[1, 2], [3, 4]], dtype=np.uint64), "UINT64") == [1, 2, 3, 4]
    assert tensor_to_json(np.array([b"a", "b"], dtype=object), "BYTES") == ["a", "b"]
    assert tensor_to_json(np.array([True]), "BOOL") == [True]
    with pytest.raises(TensorCodecError, match="UTF-8"):
        tensor_to_json(np.array([b"\xff"], dtype=object), "BYTES")


# --------------------------------------------------------------------------- requests


def test_spec_example_request() -> None:
    header = {
        "model_name": "mymodel",
        "inputs": [
            {"name": "input0", "shape": [2, 2], "datatype": "UINT32", "parameters": {"binary_data_size": 16}},
            {"name": "input1", "shape": [3], "datatype": "BOOL", "parameters": {"binary_data_size": 3}},
        ],
        "outputs": [{"name": "output0", "parameters": {"binary_data": True}}],
    }
    blob0 = struct.pack("<4I", 1, 2, 3, 4)
    body, length = build_body(header, blob0, b"\x01\x00\x01")
    assert len(body) == length + 19
    parsed, tensors = decode_infer_request(body, length)
    assert parsed["model_name"] == "mymodel"
    assert tensors["input0"].tolist() == [[1, 2], [3, 4]]
    assert tensors["input0"].dtype == np.uint32
    assert tensors["input1"].tolist() == [True, False, True]
    assert wants_binary_output(parsed, "output0")


def test_json_only_request_and_data_removed() -> None:
    header = {"inputs": [{"name": "input0", "shape": [1, 3], "datatype": "UINT32", "data": [396, 1, 2]}]}
    parsed, tensors = decode_infer_request(json.dumps(header).encode(), None)
    assert tensors["input0"].tolist() == [[396, 1, 2]]
    assert "data" not in parsed["inputs"][0]


def test_wants_binary_output_precedence() -> None:
    header = {
        "parameters": {"binary_data_output": True},
        "outputs": [{"name": "a", "parameters": {"binary_data": False}}, {"name": "b"}],
    }
    assert not wants_binary_output(header, "a")
    assert wants_binary_output(header, "b")
    assert wants_binary_output(header, "not-listed")
    assert not wants_binary_output({}, "a")
    assert wants_binary_output({"outputs": [{"name": "a", "parameters": {"binary_data": True}}]}, "a")
    with pytest.raises(TensorCodecError) as info:
        wants_binary_output({"parameters": {"binary_data_output": "yes"}}, "a")
    assert info.value.field == "parameters.binary_data_output"


def _two_binary_inputs() -> tuple[dict, bytes, bytes]:
    header = {
        "inputs": [
            {"name": "first", "shape": [2], "datatype": "INT32", "parameters": {"binary_data_size": 8}},
            {"name": "second", "shape": [2], "datatype": "FP16", "parameters": {"binary_data_size": 4}},
        ]
    }
    return header, np.array([1, 2], "<i4").tobytes(), np.array([1, 2], "<f2").tobytes()


def _error(body: bytes, header_length: int | None, **kwargs: object) -> TensorCodecError:
    with pytest.raises(TensorCodecError) as info:
        decode_infer_request(body, header_length, **kwargs)  # type: ignore[arg-type]
    assert info.value.field in str(info.value)
    return info.value


def test_error_truncated_body() -> None:
    header, blob0, blob1 = _two_binary_inputs()
    body, length = build_body(header, blob0, blob1[:-1])
    err = _error(body, length)
    assert err.field == "inputs[1].parameters.binary_data_size"
    assert "second" in err.message


def test_error_extra_bytes() -> None:
    header, blob0, blob1 = _two_binary_inputs()
    body, length = build_body(header, blob0, blob1, b"\x00")
    err = _error(body, length)
    assert err.field == "inputs[1].parameters.binary_data_size"
    assert "second" in err.message and "unused" in err.message


def test_error_extra_bytes_without_binary_inputs() -> None:
    body, length = build_body(
        {"inputs": [{"name": "x", "shape": [1], "datatype": "INT8", "data": [1]}]}, b"zz"
    )
    assert _error(body, length).field == "Inference-Header-Content-Length"


def test_error_header_length_beyond_body() -> None:
    header, blob0, blob1 = _two_binary_inputs()
    body, _ = build_body(header, blob0, blob1)
    assert _error(body, len(body) + 1).field == "Inference-Header-Content-Length"
    assert _error(body, -5).field == "Inference-Header-Content-Length"


def test_error_negative_size() -> None:
    header, blob0, blob1 = _two_binary_inputs()
    header["inputs"][0]["parameters"]["binary_data_size"] = -8
    body, length = build_body(header, blob0, blob1)
    err = _error(body, length)
    assert err.field == "inputs[0].parameters.binary_data_size"
    assert "first" in err.message


def test_error_shape_mismatch() -> None:
    header, blob0, blob1 = _two_binary_inputs()
    header["inputs"][1]["shape"] = [3]
    header["inputs"][1]["parameters"]["binary_data_size"] = 4
    body, length = build_body(header, blob0, blob1)
    err = _error(body, length)
    assert err.field == "inputs[1].parameters.binary_data_size"
    assert "second" in err.message
    json_header = {"inputs": [{"name": "j", "shape": [2, 2], "datatype": "INT8", "data": [1, 2, 3]}]}
    assert _error(json.dumps(json_header).encode(), None).field == "inputs[0].data"


def test_error_unknown_datatype() -> None:
    header, blob0, blob1 = _two_binary_inputs()
    header["inputs"][1]["datatype"] = "FP8"
    body, length = build_body(header, blob0, blob1)
    err = _error(body, length)
    assert err.field == "inputs[1].datatype"
    assert "second" in err.message


def test_error_data_and_binary_size() -> None:
    header, blob0, blob1 = _two_binary_inputs()
    header["inputs"][0]["data"] = [1, 2]
    body, length = build_body(header, blob0, blob1)
    err = _error(body, length)
    assert err.field == "inputs[0].parameters.binary_data_size"
    assert "first" in err.message


@pytest.mark.parametrize(
    ("header", "field"),
    [
        ({"inputs": [{"name": "a", "shape": [1], "datatype": "INT8"}]}, "inputs[0].data"),
        ({"inputs": [{"name": "a", "shape": [-1], "datatype": "INT8", "data": [1]}]}, "inputs[0].shape"),
        ({"inputs": [{"name": "a", "shape": [1], "datatype": "INT8", "data": [1]}] * 2}, "inputs[1].name"),
        ({"inputs": [{"shape": [1], "datatype": "INT8", "data": [1]}]}, "inputs[0].name"),
        ({"inputs": {}}, "inputs"),
        ({}, "inputs"),
        (
            {"inputs": [], "outputs": [{"name": "o", "parameters": {"binary_data": 1}}]},
            "outputs[0].parameters.binary_data",
        ),
    ],
)
def test_error_malformed_header(header: dict, field: str) -> None:
    assert _error(json.dumps(header).encode(), None).field == field


def test_error_invalid_json() -> None:
    assert _error(b"{not json", None).field == "body"
    assert _error(b"[1]", None).field == "body"
    assert _error(b"\xff\xfe", None).field == "body"


def test_binary_size_without_header_length() -> None:
    header = {
        "inputs": [{"name": "a", "shape": [1], "datatype": "INT8", "parameters": {"binary_data_size": 1}}]
    }
    assert _error(json.dumps(header).encode(), None).field == "inputs[0].parameters.binary_data_size"


# --------------------------------------------------------------------------- raw binary requests


def test_raw_binary_request_variable_dim() -> None:
    body = np.arange(4, dtype="<u4").tobytes()
    header, tensors = decode_infer_request(
        body, 0, raw_input_name="input0", raw_input_datatype="UINT32", raw_input_shape=[1, -1]
    )
    assert tensors["input0"].tolist() == [[0, 1, 2, 3]]
    assert header["inputs"][0]["shape"] == [1, 4]
    assert header["inputs"][0]["parameters"]["binary_data_size"] == 16
    assert wants_binary_output(header, "output0")


def test_raw_binary_request_fixed_shape_and_bytes() -> None:
    body = np.ones((2, 2), dtype="<f4").tobytes()
    _, tensors = decode_infer_request(
        body, 0, raw_input_name="x", raw_input_datatype="FP32", raw_input_shape=[2, 2]
    )
    assert tensors["x"].tolist() == [[1.0, 1.0], [1.0, 1.0]]
    _, tensors = decode_infer_request(
        b"raw \xff text", 0, raw_input_name="s", raw_input_datatype="BYTES", raw_input_shape=[1]
    )
    assert tensors["s"].tolist() == [b"raw \xff text"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "Inference-Header-Content-Length"),
        (
            {"raw_input_name": "x", "raw_input_datatype": "UINT32", "raw_input_shape": [-1, -1]},
            "inputs[0].shape",
        ),
        (
            {"raw_input_name": "x", "raw_input_datatype": "UINT32", "raw_input_shape": [-1, 3]},
            "inputs[0].parameters.binary_data_size",
        ),
        (
            {"raw_input_name": "x", "raw_input_datatype": "UINT32", "raw_input_shape": [5]},
            "inputs[0].parameters.binary_data_size",
        ),
        ({"raw_input_name": "x", "raw_input_datatype": "BYTES", "raw_input_shape": [-1]}, "inputs[0].shape"),
        (
            {"raw_input_name": "x", "raw_input_datatype": "NOPE", "raw_input_shape": [-1]},
            "inputs[0].datatype",
        ),
    ],
)
def test_raw_binary_request_errors(kwargs: dict, field: str) -> None:
    assert _error(b"\x00" * 16, 0, **kwargs).field == field


# --------------------------------------------------------------------------- responses


def test_spec_example_response() -> None:
    out = np.arange(6, dtype=np.float32).reshape(3, 2)
    body, length = encode_infer_response({}, [("output0", "FP32", out, True)])
    assert length is not None and len(body) == length + 24
    head = json.loads(body[:length])
    assert head == {
        "outputs": [
            {"name": "output0", "datatype": "FP32", "shape": [3, 2], "parameters": {"binary_data_size": 24}}
        ]
    }
    assert body[length:] == out.astype("<f4").tobytes()


def test_plain_json_response() -> None:
    body, length = encode_infer_response(
        {"id": "42", "model_name": "m"}, [("output0", "UINT32", np.array([[1, 396]], dtype=np.uint32), False)]
    )
    assert length is None
    assert json.loads(body) == {
        "id": "42",
        "model_name": "m",
        "outputs": [{"name": "output0", "datatype": "UINT32", "shape": [1, 2], "data": [1, 396]}],
    }


def test_response_non_utf8_bytes_falls_back_to_binary() -> None:
    array = np.array([b"\xff\x00"], dtype=object)
    body, length = encode_infer_response({}, [("o", "BYTES", array, False)])
    assert length is not None
    assert json.loads(body[:length])["outputs"][0]["parameters"] == {"binary_data_size": 6}


def test_response_empty_binary_output_still_binary() -> None:
    body, length = encode_infer_response({}, [("o", "INT8", np.zeros((0, 2), np.int8), True)])
    assert length == len(body)


def test_response_error_names_output() -> None:
    with pytest.raises(TensorCodecError) as info:
        encode_infer_response(
            {}, [("ok", "INT8", np.zeros(1, np.int8), True), ("bad", "INT8", np.array([1000]), True)]
        )
    assert info.value.field == "outputs[1].data"
    assert "bad" in info.value.message


# --------------------------------------------------------------------------- tritonclient cross-checks

needs_client = pytest.mark.usefixtures()  # tritonclient[http] is a test dependency: the cross-checks always run
CLIENT_SAMPLES: dict[str, np.ndarray] = (
    {}
    if tritonhttp is None
    else {
        "BOOL": np.array([[True, False, True], [False, False, True]]),
        "UINT8": np.array([0, 255, 7], dtype=np.uint8),
        "UINT16": np.array([0, 65535], dtype=np.uint16),
        "UINT32": np.array([[396, 4294967295]], dtype=np.uint32),
        "UINT64": np.array([0, 2**64 - 1], dtype=np.uint64),
        "INT8": np.array([-128, 127], dtype=np.int8),
        "INT16": np.array([[-32768], [32767]], dtype=np.int16),
        "INT32": np.arange(-6, 6, dtype=np.int32).reshape(2, 3, 2),
        "INT64": np.array([-(2**63), 2**63 - 1], dtype=np.int64),
        "FP16": np.array([0.5, -65504.0, 1e-3], dtype=np.float16),
        "FP32": np.array([[1.5, -2.25e-20, 3.4e38]], dtype=np.float32),
        "FP64": np.array([np.pi, -1e-300], dtype=np.float64),
        "BF16": np.array([1.0, -3.140625, 1e20], dtype=ml_dtypes.bfloat16),
        "BYTES": np.array([[b"hello", "wörld".encode()], [b"", b"x" * 300]], dtype=object),
    }
)
EMPTY_SAMPLES = {name: sample.reshape(-1)[:0].reshape(0, 2) for name, sample in CLIENT_SAMPLES.items()}


def _expected(array: np.ndarray, datatype: str) -> np.ndarray:
    return array.astype(np.float32) if datatype == "BF16" else array


def _client_input(name: str, datatype: str, array: np.ndarray, binary: bool):
    tensor = tritonhttp.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


@needs_client
@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("samples", [CLIENT_SAMPLES, EMPTY_SAMPLES], ids=["values", "empty"])
@pytest.mark.parametrize("datatype", list(CLIENT_SAMPLES))
def test_tritonclient_request(datatype: str, binary: bool, samples: dict) -> None:
    array = samples[datatype]
    if datatype == "BF16" and not binary:
        with pytest.raises(tritonutils.InferenceServerException):  # tritonclient refuses to send BF16 as JSON
            _client_input("in", datatype, array, binary)
        return
    inputs = [_client_input("in", datatype, array, binary)]
    outputs = [tritonhttp.InferRequestedOutput("out", binary_data=binary)]
    body, json_size = tritonhttp.InferenceServerClient.generate_request_body(inputs, outputs=outputs)
    header, tensors = decode_infer_request(body, json_size)
    assert_same(tensors["in"], _expected(array, datatype))
    assert wants_binary_output(header, "out") is binary


@needs_client
def test_tritonclient_mixed_request() -> None:
    names = list(CLIENT_SAMPLES)
    inputs = [
        _client_input(f"in{i}", dt, CLIENT_SAMPLES[dt], binary=(dt == "BF16" or i % 2 == 0))
        for i, dt in enumerate(names)
    ]
    body, json_size = tritonhttp.InferenceServerClient.generate_request_body(inputs, request_id="7")
    assert json_size is not None
    header, tensors = decode_infer_request(body, json_size)
    assert header["id"] == "7"
    assert wants_binary_output(header, "anything")  # no outputs listed -> client asks for binary_data_output
    for i, dt in enumerate(names):
        assert_same(tensors[f"in{i}"], _expected(CLIENT_SAMPLES[dt], dt))


def _parse_response(body: bytes, length: int | None):
    return tritonhttp.InferResult.from_response_body(body, header_length=length)


@needs_client
@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("datatype", list(CLIENT_SAMPLES))
def test_tritonclient_response(datatype: str, binary: bool) -> None:
    array = _expected(CLIENT_SAMPLES[datatype], datatype)
    body, length = encode_infer_response({"model_name": "m"}, [("out", datatype, array, binary)])
    assert (length is not None) is binary
    got = _parse_response(body, length).as_numpy("out")
    if datatype == "BF16":
        got = got.astype(np.float32)
    if datatype == "BYTES" and not binary:
        got = np.vectorize(lambda s: s.encode(), otypes=[object])(got)
    assert_same(got, array)


@needs_client
def test_tritonclient_response_several_outputs_in_order() -> None:
    outputs = [
        (f"o{i}", dt, _expected(CLIENT_SAMPLES[dt], dt), i % 3 != 1) for i, dt in enumerate(CLIENT_SAMPLES)
    ]
    body, length = encode_infer_response({"id": "1"}, outputs)
    result = _parse_response(body, length)
    assert [o["name"] for o in result.get_response()["outputs"]] == [o[0] for o in outputs]
    for name, dt, array, binary in outputs:
        got = result.as_numpy(name)
        if dt == "BF16":
            got = got.astype(np.float32)
        if dt == "BYTES" and not binary:
            got = np.vectorize(lambda s: s.encode(), otypes=[object])(got)
        assert_same(got, array)


@needs_client
@settings(max_examples=60, deadline=None)
@given(array=hnp.arrays(object, SHAPES, elements=st.binary(max_size=12), fill=st.nothing()))
def test_serialize_byte_tensor_compatible(array: np.ndarray) -> None:
    serialized = tritonutils.serialize_byte_tensor(array)
    expected = serialized.item() if serialized.size else b""
    assert tensor_to_bytes(array, "BYTES") == expected
