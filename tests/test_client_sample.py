"""The spec's MindIE Client sample runs as printed against a real server (issue 15, point 16).

The sample (seed-tools-client-ms.md §3.7) talks HTTPS with mutual TLS to the business plane on
127.0.0.1 and the management plane on 127.0.0.2, sends tensors named ``INPUT0``/``OUTPUT0`` and
serves model ``llama_65b``. Only its placeholders are filled: the ports (free ones), the certificate
file names (absolute paths), ``n`` and the ``...`` argument lists. Also here: ``/metrics-json``
carries an installed plugin's gauges.
"""

from __future__ import annotations

import json
import os
import re
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from test_tls import issue, make_ca, write_crl, write_pem

from mindie_host.client import Input, MindIEHTTPClient, RequestedOutput
from mindie_host.testing import RunningServer, server_config

#: The sample exactly as the spec prints it (§3.7, "Sample usage (abridged)").
SPEC_SAMPLE = '''\
client = MindIEHTTPClient(url="https://127.0.0.1:1025", verbose=True, enable_ssl=True,
    ssl_options={"ca_certs":"ca.pem","certfile":"client.pem","keyfile":"client.key.pem","crlfile":"crl.pem"},
    concurrency=n, management_url="https://127.0.0.2:1026")
inp = Input("INPUT0",[1,16],"UINT32"); inp.initialize_data(np.arange(16,dtype=np.uint32)[None,:])
r = client.infer("llama_65b",[inp],outputs=[RequestedOutput("OUTPUT0")]); r.retrieve_output_name_to_numpy("OUTPUT0")
reqs=[client.async_infer(...) for _ in range(n)]; [q.get_result() for q in reqs]
client.generate("llama_65b","My name is Olivier and I",request_id="1",parameters={...,"details":True})
for t in client.generate_stream(...): ...;  client.cancel("llama_65b","1")
client.get_slot_count("llama_65b").get_response()
'''
SPEC_FILE = Path(__file__).resolve().parents[2] / "shared" / "spec" / "seed-tools-client-ms.md"


def test_the_embedded_sample_is_the_spec_text() -> None:
    if not SPEC_FILE.exists():
        # CI always has shared/ beside the clone; a checkout without the spec cannot compare, so says so
        pytest.skip("the spec is not next to this checkout")
    text = SPEC_FILE.read_text()
    block = re.search(r"### 3\.7 Sample usage.*?```python\n(.*?)```", text, re.S)
    assert block and block.group(1) == SPEC_SAMPLE


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sample-pki")
    ca = make_ca("sample root")
    (root / "ca.pem").write_bytes(write_pem(root / "tmp", "ca", ca)[0].read_bytes())
    server = issue(ca, "server", server_ips=("127.0.0.1", "127.0.0.2"))
    write_pem(root, "server", server)
    client_cert, client_key = write_pem(root, "client", issue(ca, "sample client"))
    write_crl(root / "crl.pem", ca, [])
    os.chmod(client_key, 0o600)
    os.chmod(root, 0o700)
    return root


@pytest.fixture(scope="module")
def sample_server(tiny_model: Path, certs: Path) -> Iterator[RunningServer]:
    tls = {"tlsCaPath": f"{certs}/", "tlsCaFile": ["ca.pem"], "tlsCert": str(certs / "server.pem"),
           "tlsPk": str(certs / "server.key.pem"), "tlsPkPwd": "", "tlsCrlPath": f"{certs}/", "tlsCrlFiles": ["crl.pem"]}
    management = {"managementTlsCaFile": ["ca.pem"], "managementTlsCert": str(certs / "server.pem"),
                  "managementTlsPk": str(certs / "server.key.pem"), "managementTlsCrlPath": f"{certs}/",
                  "managementTlsCrlFiles": ["crl.pem"]}
    cfg = server_config(tiny_model, server={"httpsEnabled": True, "managementIpAddress": "127.0.0.2", **tls,
                                            **management},
                        model={"modelName": "llama_65b",
                               "plugin_params": json.dumps({"plugin_type": "prefix_cache"})},
                        schedule={"enablePrefixCache": True})
    with RunningServer(cfg) as server:
        yield server


def filled_in(server: RunningServer, certs: Path) -> str:
    """The sample with its placeholders filled (ports, certificate paths, n, the elided arguments)."""
    code = SPEC_SAMPLE
    code = code.replace("https://127.0.0.1:1025", server.url).replace("https://127.0.0.2:1026", server.management_url)
    for name in ("ca.pem", "client.pem", "client.key.pem", "crl.pem"):
        code = code.replace(f'"{name}"', json.dumps(str(certs / name)))
    code = code.replace("client.async_infer(...)",
                        'client.async_infer("llama_65b",[inp],outputs=[RequestedOutput("OUTPUT0")])')
    code = code.replace("parameters={...,", 'parameters={"max_new_tokens":8,')
    code = code.replace("client.generate_stream(...)",
                        'client.generate_stream("llama_65b","My name is Olivier and I",request_id="1",'
                        'parameters={"max_new_tokens":8})')
    return "n = 4\n" + code


def test_spec_client_sample_runs_as_printed(sample_server: RunningServer, certs: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert sample_server.management_url.startswith("https://127.0.0.2:")
    code = filled_in(sample_server, certs)
    namespace: dict[str, Any] = {"MindIEHTTPClient": MindIEHTTPClient, "Input": Input,
                                 "RequestedOutput": RequestedOutput, "np": np}
    exec(compile(code, "spec-sample", "exec"), namespace)  # raises on any failure, as the sample would
    result = namespace["r"]
    ids = result.retrieve_output_name_to_numpy("OUTPUT0")
    assert ids.size > 0 and ids.dtype == np.uint32
    assert [q.get_result().retrieve_output_name_to_numpy("OUTPUT0").size > 0 for q in namespace["reqs"]] == [True] * 4
    slots = namespace["client"].get_slot_count("llama_65b").get_response()
    assert {"total_slots", "free_slots", "available_tokens_length"} <= set(slots)
    # management queries went to the management plane (the business port does not serve them)
    out = capsys.readouterr().out  # verbose=True prints each request
    assert f"GET {sample_server.management_url}/v2/models/llama_65b/getSlotCount" in out
    namespace["client"].close()


def test_metrics_json_carries_the_plugin_gauges(sample_server: RunningServer, certs: Path) -> None:
    verify = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    verify.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key.pem"))
    body = httpx.get(sample_server.management_url + "/metrics-json", verify=verify, timeout=30).json()
    names = [item["metric"][0]["__name__"] for item in body["result"]]
    assert names[:5] == ["TTFT", "TBT", "waitingInferRequestNum", "processingInferRequestNum", "remainBlocks"]
    assert "npu_prefix_cache_hit_rate" in names[5:]  # the prefix_cache plugin's gauge, from its entry point
