"""MindIE Client (mindie_host.client) against the real server on the tiny model."""

from __future__ import annotations

import asyncio
import threading

import httpx
import numpy as np
import pytest
from test_tls import PKI, https_server, pki  # noqa: F401 - the PKI and https server fixtures

from mindie_host.client import (
    AsyncMindIEHTTPClient,
    AsyncRequest,
    Input,
    MindIEClientException,
    MindIEHTTPClient,
    RequestedOutput,
    Result,
)
from mindie_host.testing import RunningServer, free_port

MODEL = "tiny"
GREEDY = {"do_sample": False, "max_new_tokens": 8}


@pytest.fixture()
def client(tiny_server: RunningServer):
    c = MindIEHTTPClient(tiny_server.url, enable_management=True, management_url=tiny_server.management_url,
                         concurrency=4, network_timeout=60.0, connection_timeout=10.0)
    yield c
    c.close()


def prompt_ids(tiny_server: RunningServer, text: str) -> list[int]:
    return tiny_server.host.tokenize(text)


# -- health and metadata -------------------------------------------------------------------------------
def test_health_and_readiness(client: MindIEHTTPClient) -> None:
    assert client.is_server_live() is True
    assert client.is_server_ready() is True
    assert client.is_model_ready(MODEL) is True
    assert client.is_model_ready("no-such-model") is False


def test_health_false_when_nothing_listens() -> None:
    port = free_port()
    c = MindIEHTTPClient(f"http://127.0.0.1:{port}", enable_management=True,
                         management_url=f"http://127.0.0.1:{port}", connection_timeout=2.0, retries=0)
    assert c.is_server_live() is False
    assert c.is_server_ready() is False
    with pytest.raises(MindIEClientException):
        c.get_server_metadata()
    c.close()


def test_metadata_and_config(client: MindIEHTTPClient, tiny_server: RunningServer) -> None:
    meta = client.get_server_metadata()
    assert meta["name"] == "MindIE Server"
    assert meta["extensions"]["max_iter_times"] == tiny_server.config.schedule.maxIterTimes
    model = client.get_model_metadata(MODEL)
    assert model["name"] == MODEL
    assert model["inputs"][0]["datatype"] == "UINT32"
    assert model["outputs"][0]["name"] == "output0"
    config = client.get_model_config(MODEL)
    assert config["model_name"] == MODEL
    assert config["max_seq_len"] == tiny_server.config.deploy.maxSeqLen
    with pytest.raises(MindIEClientException) as err:
        client.get_model_metadata("no-such-model")
    assert err.value.status is not None and 400 <= err.value.status < 500


def test_slot_count(client: MindIEHTTPClient, tiny_server: RunningServer) -> None:
    tiny_server.wait_idle()
    result = client.get_slot_count(MODEL)
    assert isinstance(result, Result)
    slots = result.get_response()
    assert slots["total_slots"] == tiny_server.config.schedule.maxBatchSize
    assert 0 <= slots["free_slots"] <= slots["total_slots"]
    assert slots["available_tokens_length"] > 0


# -- token inference -----------------------------------------------------------------------------------
def _input(ids: list[int], name: str = "input0") -> Input:
    inp = Input(name, [1, len(ids)], "UINT32")
    inp.initialize_data(np.asarray(ids, dtype=np.uint32)[None, :])
    return inp


def test_infer_matches_openai_completion(client: MindIEHTTPClient, tiny_server: RunningServer) -> None:
    ids = prompt_ids(tiny_server, "The capital of France is")
    result = client.infer(MODEL, [_input(ids)], outputs=[RequestedOutput("output0")], request_id="inf1",
                          parameters=GREEDY)
    assert result.get_response()["id"] == "inf1"
    by_index = result.retrieve_output_index_to_numpy(0)
    by_name = result.retrieve_output_name_to_numpy("output0")
    assert np.array_equal(by_index, by_name)
    assert by_index.dtype == np.uint32 and by_index.ndim == 2 and by_index.shape[0] == 1
    generated = [int(x) for x in by_index.reshape(-1)]
    generated = generated[len(ids):] if generated[: len(ids)] == ids else generated
    # the same greedy continuation through the OpenAI completions endpoint, from the same token ids
    body = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0}
    text = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert tiny_server.host.tokenizer.decode(generated) == text
    with pytest.raises(MindIEClientException):
        result.retrieve_output_index_to_numpy(5)
    with pytest.raises(MindIEClientException):
        result.retrieve_output_name_to_numpy("nope")


def test_async_infer(client: MindIEHTTPClient, tiny_server: RunningServer) -> None:
    ids = prompt_ids(tiny_server, "Once upon a time")
    reqs = [client.async_infer(MODEL, [_input(ids)], parameters=GREEDY) for _ in range(3)]
    assert all(isinstance(r, AsyncRequest) for r in reqs)
    arrays = [r.get_result(timeout=60).retrieve_output_index_to_numpy(0) for r in reqs]
    assert all(np.array_equal(arrays[0], a) for a in arrays)  # greedy: identical
    with pytest.raises(MindIEClientException):
        reqs[0].get_result(timeout=0)


# -- text generation -------------------------------------------------------------------------------------
def test_generate_and_stream_agree(client: MindIEHTTPClient) -> None:
    prompt = "My name is Olivier and I"
    full = client.generate(MODEL, prompt, request_id="gen1", parameters={**GREEDY, "details": True})
    data = full.get_response()
    assert data["id"] == "gen1" and data["model_name"] == MODEL
    assert data["details"]["generated_tokens"] <= 8
    pieces = list(client.generate_stream(MODEL, prompt, parameters=GREEDY))
    assert 1 <= len(pieces) <= 8
    assert "".join(pieces) == data["text_output"]


def test_generate_stream_with_details(client: MindIEHTTPClient) -> None:
    steps = list(client.generate_stream_with_details(MODEL, "Hello there", parameters={**GREEDY, "details": True}))
    assert steps and all("text_output" in s for s in steps)
    assert all(isinstance(s["batch_size"], int) and s["batch_size"] >= 1 for s in steps)
    assert all(s["queue_wait_time"] is not None and s["queue_wait_time"] >= 0 for s in steps)
    assert steps[-1]["finish_reason"] in ("length", "eos_token")
    assert [s["generated_tokens"] for s in steps] == list(range(1, len(steps) + 1))
    plain = list(client.generate_stream_with_details(MODEL, "Hello there", parameters=GREEDY))
    assert "".join(s["text_output"] for s in plain) == "".join(s["text_output"] for s in steps)


def test_generate_stream_self_matches_completion(client: MindIEHTTPClient, tiny_server: RunningServer) -> None:
    ids = prompt_ids(tiny_server, "Write a poem about the sea")
    pieces = list(client.generate_stream_self(np.asarray(ids, dtype=np.int64), parameters=GREEDY))
    assert pieces
    body = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0}
    text = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert "".join(pieces) == text


def test_generate_chat_and_stream(client: MindIEHTTPClient, tiny_server: RunningServer) -> None:
    from openai import OpenAI

    text = client.generate_chat(MODEL, "What is 2+2?", parameters=GREEDY)
    streamed = "".join(client.generate_chat_stream(MODEL, "What is 2+2?", parameters=GREEDY))
    assert text == streamed
    ref = OpenAI(base_url=f"{tiny_server.url}/v1", api_key="x").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=8, temperature=0)
    assert ref.choices[0].message.content == text


def test_cancel_stops_a_running_stream(client: MindIEHTTPClient) -> None:
    params = {"do_sample": False, "max_new_tokens": 500}
    pieces: list[str] = []
    first = threading.Event()
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            for piece in client.generate_stream(MODEL, "Tell me a very long story", request_id="cancel-me",
                                                parameters=params):
                pieces.append(piece)
                first.set()
        except MindIEClientException as exc:  # a stream cut short may end with an error event
            errors.append(exc)
        finally:
            first.set()

    worker = threading.Thread(target=consume)
    worker.start()
    assert first.wait(60)
    assert client.cancel(MODEL, "cancel-me") is True
    worker.join(60)
    assert not worker.is_alive()
    assert len(pieces) < 500


def test_cancel_unknown_id_is_false(client: MindIEHTTPClient) -> None:
    assert client.cancel(MODEL, "never-submitted-id") is False


# -- argument checks and errors -------------------------------------------------------------------------
def test_argument_validation(client: MindIEHTTPClient) -> None:
    with pytest.raises(MindIEClientException):
        client.generate("bad name!", "hi")
    with pytest.raises(MindIEClientException):
        client.generate(MODEL, "")
    with pytest.raises(MindIEClientException, match="temperature"):
        client.generate(MODEL, "hi", parameters={"temperature": 0})
    with pytest.raises(MindIEClientException, match="top_p"):
        client.generate(MODEL, "hi", parameters={"top_p": 1.5})
    with pytest.raises(MindIEClientException, match="request_id"):
        client.generate(MODEL, "hi", request_id="x" * 1001)
    with pytest.raises(MindIEClientException):
        client.infer(MODEL, [])
    with pytest.raises(MindIEClientException):
        client.cancel(MODEL, "")
    with pytest.raises(MindIEClientException):
        Input("input0", [2, 3], "UINT32")
    with pytest.raises(MindIEClientException):
        Input("input0", [1, 16001], "UINT32")
    with pytest.raises(MindIEClientException):
        Input("input0", [1, 3], "INT64")
    inp = Input("", [1, 3], "UINT32")
    assert inp.get_input_name() == "input0" and inp.get_input_data_type() == "UINT32"
    with pytest.raises(MindIEClientException):
        inp.get_input_tensor()
    with pytest.raises(MindIEClientException):
        inp.initialize_data(np.arange(3, dtype=np.int64)[None, :])
    with pytest.raises(MindIEClientException):
        inp.initialize_data(np.arange(4, dtype=np.uint32)[None, :])
    inp.set_input_shape([1, 4])
    inp.initialize_data(np.arange(4, dtype=np.uint32)[None, :])
    assert inp.get_input_tensor()["data"] == [0, 1, 2, 3]
    assert RequestedOutput("").get_output_name() == "output0"
    assert RequestedOutput("OUT").get_output_tensor() == {"name": "OUT"}
    with pytest.raises(MindIEClientException):
        Result('{"id": 1}').retrieve_output_index_to_numpy(0)
    assert MindIEClientException("boom").get_message() == "boom"


def test_constructor_validation(tiny_server: RunningServer) -> None:
    for kwargs in ({"url": "ftp://127.0.0.1:1"}, {"url": tiny_server.url, "concurrency": 0},
                   {"url": tiny_server.url, "concurrency": 1001}, {"url": tiny_server.url, "network_timeout": 0},
                   {"url": tiny_server.url, "greenlet_size": 0},
                   {"url": tiny_server.url, "enable_management": True, "management_url": "https://127.0.0.1:1"},
                   {"url": "https://127.0.0.1:1", "ssl_options": None},
                   {"url": "https://127.0.0.1:1", "enable_ssl": False}):
        with pytest.raises(MindIEClientException):
            MindIEHTTPClient(**kwargs)


def test_server_error_becomes_exception(client: MindIEHTTPClient, tiny_server: RunningServer) -> None:
    too_long = " ".join(["word"] * 2000)  # more tokens than maxInputTokenLen
    with pytest.raises(MindIEClientException) as err:
        client.generate(MODEL, too_long, parameters=GREEDY)
    assert err.value.status is not None and 400 <= err.value.status < 500


def test_close_then_use_raises(tiny_server: RunningServer) -> None:
    c = MindIEHTTPClient(tiny_server.url)
    c.close()
    with pytest.raises(MindIEClientException, match="closed"):
        c.get_server_metadata()


# -- asyncio variant --------------------------------------------------------------------------------------
def test_async_client(tiny_server: RunningServer) -> None:
    async def run() -> None:
        async with AsyncMindIEHTTPClient(tiny_server.url, enable_management=True,
                                         management_url=tiny_server.management_url, concurrency=4) as c:
            assert await c.is_server_live() and await c.is_server_ready() and await c.is_model_ready(MODEL)
            assert (await c.get_server_metadata())["name"] == "MindIE Server"
            assert (await c.get_model_metadata(MODEL))["name"] == MODEL
            assert (await c.get_model_config(MODEL))["model_name"] == MODEL
            ids = prompt_ids(tiny_server, "Once upon a time")
            direct = (await c.infer(MODEL, [_input(ids)], parameters=GREEDY)).retrieve_output_index_to_numpy(0)
            pending = [c.async_infer(MODEL, [_input(ids)], parameters=GREEDY) for _ in range(2)]
            for p in pending:
                assert np.array_equal((await p.get_result(60)).retrieve_output_index_to_numpy(0), direct)
            full = (await c.generate(MODEL, "Hi there", parameters=GREEDY)).get_response()["text_output"]
            assert "".join([t async for t in c.generate_stream(MODEL, "Hi there", parameters=GREEDY)]) == full
            details = [d async for d in c.generate_stream_with_details(MODEL, "Hi there",
                                                                       parameters={**GREEDY, "details": True})]
            assert details[-1]["finish_reason"] in ("length", "eos_token")
            token_text = "".join([t async for t in c.generate_stream_self(np.asarray(ids), parameters=GREEDY)])
            assert token_text
            chat = await c.generate_chat(MODEL, "What is 2+2?", parameters=GREEDY)
            assert "".join([t async for t in c.generate_chat_stream(MODEL, "What is 2+2?", parameters=GREEDY)]) \
                == chat
            assert await c.cancel(MODEL, "never-submitted") is False
            assert (await c.get_slot_count(MODEL)).get_response()["total_slots"] >= 1

    asyncio.run(run())


# -- TLS and mutual TLS (certificates and https server from test_tls.py) ---------------------------------


def test_mutual_tls(https_server: RunningServer, pki: PKI, tmp_path) -> None:  # noqa: F811 - fixtures
    import os
    import shutil

    cert, key = pki.client("good")
    private = tmp_path / "client.key.pem"
    shutil.copy(key, private)
    os.chmod(private, 0o600)
    crl = str(pki.root / "security" / "certs" / "server_crl.pem")
    opts = {"ca_certs": pki.ca_file(), "certfile": cert, "keyfile": str(private), "crlfile": crl}
    with MindIEHTTPClient(https_server.url, ssl_options=opts, enable_management=True,
                          management_url=https_server.management_url) as c:
        assert str(c.valid_url).startswith("https://")
        assert c.is_server_ready() is True
        assert c.generate(MODEL, "Hello", parameters=GREEDY).get_response()["text_output"] is not None
    # no client certificate: the server refuses the handshake
    with MindIEHTTPClient(https_server.url, ssl_options={"ca_certs": pki.ca_file()}, retries=0) as c:
        with pytest.raises(MindIEClientException):
            c.get_server_metadata()
        assert c.is_server_live() is False
    # a certificate from another CA is refused too
    other_cert, other_key = pki.client("stranger")
    shutil.copy(other_key, private)
    os.chmod(private, 0o600)
    with MindIEHTTPClient(https_server.url, retries=0, ssl_options={"ca_certs": pki.ca_file(),
                                                                    "certfile": other_cert, "keyfile": str(private)}) as c:
        with pytest.raises(MindIEClientException):
            c.get_server_metadata()
    # a private key readable by others is rejected before connecting
    os.chmod(private, 0o644)
    with pytest.raises(MindIEClientException, match="chmod 600"):
        MindIEHTTPClient(https_server.url, ssl_options={**opts, "keyfile": str(private)})
