"""Value types of the MindIE Client API: Input, RequestedOutput, Result, AsyncRequest, MindIEClientException."""

from __future__ import annotations

import json
import re
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

MAX_NAME_LEN = 1000
MAX_TOKENS_PER_INPUT = 16000
MAX_PROMPT_CHARS = 512000
MAX_RESPONSE_BYTES = 10 * 1024 * 1024
MAX_MESSAGE_CHARS = 512000
_MODEL_NAME = re.compile(r"^[A-Za-z0-9._-]{1,1000}$")


class MindIEClientException(Exception):
    """Every error the client raises: bad arguments, HTTP status != 200, transport failures, timeouts.

    ``status`` is the HTTP status code when the server answered, else ``None``.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        message = str(message) or "unknown client error"
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 3] + "..."
        super().__init__(message)
        self.message = message
        self.status = status

    def get_message(self) -> str:
        """The error text."""
        return self.message


def check_model_name(model_name: Any) -> str:
    """``model_name``: 1..1000 characters of ``[A-Za-z0-9._-]``."""
    if not isinstance(model_name, str) or not _MODEL_NAME.match(model_name):
        raise MindIEClientException(
            f"model_name must be 1..{MAX_NAME_LEN} characters of [A-Za-z0-9._-], got {model_name!r}")
    return model_name


def check_model_version(model_version: Any) -> str:
    """``model_version``: a string ("" means none; a non-empty one selects the /versions/{v}/ path)."""
    if not isinstance(model_version, str) or len(model_version) > MAX_NAME_LEN:
        raise MindIEClientException(f"model_version must be a string of at most {MAX_NAME_LEN} characters")
    if model_version and not _MODEL_NAME.match(model_version):
        raise MindIEClientException("model_version must consist of [A-Za-z0-9._-]")
    return model_version


def check_request_id(request_id: Any) -> str:
    """``request_id``: "" gets a random id; otherwise 1..1000 characters."""
    if request_id is None or request_id == "":
        return uuid.uuid4().hex
    if not isinstance(request_id, str) or not 1 <= len(request_id) <= MAX_NAME_LEN:
        raise MindIEClientException(f"request_id must be a string of length [1, {MAX_NAME_LEN}]")
    return request_id


def check_prompt(prompt: Any) -> str:
    """``prompt``: a string of length [1, 512000]."""
    if not isinstance(prompt, str) or not 1 <= len(prompt) <= MAX_PROMPT_CHARS:
        raise MindIEClientException(f"prompt must be a string of length [1, {MAX_PROMPT_CHARS}]")
    return prompt


def _check_shape(shape: Any) -> list[int]:
    if (not isinstance(shape, (list, tuple)) or len(shape) != 2 or not all(isinstance(d, int) for d in shape)
            or shape[0] != 1 or not 1 <= shape[1] <= MAX_TOKENS_PER_INPUT):
        raise MindIEClientException(f"shape must be [1, n] with 1 <= n <= {MAX_TOKENS_PER_INPUT}, got {shape!r}")
    return [int(shape[0]), int(shape[1])]


class Input:
    """One input tensor of token ids for :meth:`MindIEHTTPClient.infer` (shape ``[1, n]``, datatype UINT32)."""

    def __init__(self, name: str, shape: list[int], datatype: str) -> None:
        if not isinstance(name, str) or len(name) > MAX_NAME_LEN:
            raise MindIEClientException(f"input name must be a string of at most {MAX_NAME_LEN} characters")
        if datatype != "UINT32":
            raise MindIEClientException(f"datatype must be 'UINT32', got {datatype!r}")
        self._name = name or "input0"
        self._shape = _check_shape(shape)
        self._datatype = datatype
        self._data: np.ndarray | None = None

    def get_input_name(self) -> str:
        """The tensor name."""
        return self._name

    def get_input_shape(self) -> list[int]:
        """The shape ``[1, n]``."""
        return list(self._shape)

    def set_input_shape(self, shape: list[int]) -> None:
        """Change the shape (same constraint: ``[1, n]``, n <= 16000)."""
        self._shape = _check_shape(shape)

    def get_input_data_type(self) -> str:
        """Always ``"UINT32"``."""
        return self._datatype

    def initialize_data(self, input_tensor: np.ndarray) -> None:
        """Attach the token ids; the array must be uint32 and match the declared shape."""
        if not isinstance(input_tensor, np.ndarray):
            raise MindIEClientException("input_tensor must be a numpy array")
        if input_tensor.dtype != np.uint32:
            raise MindIEClientException(f"input_tensor dtype must be uint32 for UINT32, got {input_tensor.dtype}")
        if list(input_tensor.shape) != self._shape:
            raise MindIEClientException(f"input_tensor shape {list(input_tensor.shape)} != declared {self._shape}")
        self._data = input_tensor

    def get_input_tensor(self) -> dict[str, Any]:
        """The wire form ``{"name","shape","datatype","data"}``; raises before :meth:`initialize_data`."""
        if self._data is None:
            raise MindIEClientException(f"input {self._name!r} has no data: call initialize_data() first")
        return {"name": self._name, "shape": list(self._shape), "datatype": self._datatype,
                "data": [int(x) for x in self._data.reshape(-1)]}


class RequestedOutput:
    """The output tensor a caller asks :meth:`MindIEHTTPClient.infer` to return."""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or len(name) > MAX_NAME_LEN:
            raise MindIEClientException(f"output name must be a string of at most {MAX_NAME_LEN} characters")
        self._name = name or "output0"

    def get_output_name(self) -> str:
        """The output name."""
        return self._name

    def get_output_tensor(self) -> dict[str, Any]:
        """The wire form ``{"name": ...}``."""
        return {"name": self._name}


_DTYPES = {"UINT32": np.uint32, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32,
           "FP16": np.float16, "FP64": np.float64, "BOOL": np.bool_, "INT8": np.int8, "UINT8": np.uint8}


class Result:
    """A server response: ``get_response()`` gives the parsed JSON; numpy accessors read ``outputs``."""

    def __init__(self, response: str | bytes | dict[str, Any], verbose: bool = False) -> None:
        if isinstance(response, (str, bytes)):
            if len(response) > MAX_RESPONSE_BYTES:
                raise MindIEClientException(f"response is larger than {MAX_RESPONSE_BYTES} bytes")
            try:
                parsed = json.loads(response) if response else {}
            except json.JSONDecodeError as exc:
                raise MindIEClientException(f"response is not JSON: {exc}") from exc
        else:
            parsed = response
        self._response: Any = parsed
        self.verbose = verbose
        if verbose:
            print(f"Result: {parsed}")

    def get_response(self) -> Any:
        """The parsed JSON response."""
        return self._response

    def _outputs(self) -> list[dict[str, Any]]:
        outputs = self._response.get("outputs") if isinstance(self._response, dict) else None
        if not isinstance(outputs, list):
            raise MindIEClientException('response has no "outputs"')
        return outputs

    @staticmethod
    def _to_numpy(output: dict[str, Any]) -> np.ndarray:
        dtype = _DTYPES.get(str(output.get("datatype", "UINT32")).upper(), np.uint32)
        arr = np.asarray(output.get("data", []), dtype=dtype)
        shape = output.get("shape")
        if isinstance(shape, list) and shape and int(np.prod(shape)) == arr.size:
            arr = arr.reshape([int(d) for d in shape])
        return arr

    def retrieve_output_index_to_numpy(self, index: int) -> np.ndarray:
        """Output ``index`` (0 <= index < number of outputs) as a numpy array."""
        outputs = self._outputs()
        if not isinstance(index, int) or not 0 <= index < len(outputs):
            raise MindIEClientException(f"output index must be in [0, {len(outputs)}), got {index!r}")
        return self._to_numpy(outputs[index])

    def retrieve_output_name_to_numpy(self, name: str) -> np.ndarray:
        """The output named ``name`` as a numpy array."""
        for output in self._outputs():
            if output.get("name") == name:
                return self._to_numpy(output)
        raise MindIEClientException(f"response has no output named {name!r}")


class AsyncRequest:
    """A pending :meth:`MindIEHTTPClient.async_infer`; ``get_result`` waits for its :class:`Result`.

    MindIE wraps a greenlet; here the handle is a :class:`concurrent.futures.Future` from the client's
    worker pool (the ``greenlet`` argument keeps the spec's name).
    """

    def __init__(self, greenlet: Future[Result], verbose: bool = False) -> None:
        self._future = greenlet
        self.verbose = verbose

    def get_result(self, timeout: float | None = None) -> Result:
        """Wait (at most ``timeout`` seconds, a float > 0, or forever for None) and return the Result."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or timeout <= 0):
            raise MindIEClientException(f"timeout must be a number > 0 or None, got {timeout!r}")
        try:
            return self._future.result(timeout=timeout)
        except FutureTimeout as exc:
            raise MindIEClientException(f"async request did not finish within {timeout} s") from exc
