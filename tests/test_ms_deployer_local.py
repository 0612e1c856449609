"""The MS Deployer's local target end to end: ``mindie-host deployer`` in its own process, driven by
``mindie-host msctl``, deploying two real servers (a tiny random Llama) behind a coordinator and a controller.

Tests run in file order on one deployment: create and serve; a rolling update under streaming and
non-streaming load with no failed request, streams begun on an old instance finishing there before it stops;
a killed instance restarted; delete.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from mindie_host.testing import free_port, server_config

pytestmark = pytest.mark.slow
SERVICE_PORT = 31000 + free_port() % 1700  # a NodePort-range port; free_port keeps it clear of the others
LONG_TOKENS = 2000
STALL_SECONDS = 7  # longer than the controller's status poll waits (http_timeout_seconds 5) plus a sync period


@dataclass
class Deployment:
    workdir: Path
    home: Path
    proc: subprocess.Popen[bytes]
    files: dict[str, Path]
    url: str = f"http://127.0.0.1:{SERVICE_PORT}"
    old_pods: list[str] = field(default_factory=list)

    def msctl(self, *args: str) -> tuple[int, dict[str, Any]]:
        out = subprocess.run(
            [sys.executable, "-m", "mindie_host.cli", "msctl", *args],
            capture_output=True,
            text=True,
            env={**os.environ, "HOME": str(self.home)},
            timeout=120,
        )
        assert out.stdout, out.stderr
        return out.returncode, json.loads(out.stdout)

    def instances(self) -> list[dict[str, Any]]:
        code, answer = self.msctl("get", "infer_server", "-n", "tiny")
        assert code == 0, answer
        return answer["data"]["instances_status"]

    def wait(self, predicate: Any, timeout: float, what: str) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, "the deployer exited"
            items = self.instances()
            if predicate(items):
                return items
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {items}"
            time.sleep(0.5)

    @property
    def server_dir(self) -> Path:
        return self.workdir / "mindie" / "tiny"


def _write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=2))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("deployer-local")
    cfg = server_config(
        tiny_model,
        deploy={"maxSeqLen": 2048, "maxInputTokenLen": 256},
        schedule={"maxBatchSize": 16, "maxPrefillBatchSize": 16, "maxIterTimes": 2000},
        model={"maxKvBlocks": 600, "cpuMemSize": 1},
    )
    port = free_port()
    (tmp / "mies").mkdir()
    files = {
        "config": _write(tmp / "config.json", cfg),
        "ms_server": _write(
            tmp / "ms_server.json",
            {
                "ip": "127.0.0.1",
                "port": port,
                "ms_status_file": str(tmp / "status.json"),
                "log_info": {
                    "log_level": "INFO",
                    "run_log_path": str(tmp / "logs/run.txt"),
                    "operation_log_path": str(tmp / "logs/operation.txt"),
                },
                "server_tls_enable": False,
                "client_mindie_server_tls_enable": False,
            },
        ),
        "infer_server": _write(
            tmp / "infer_server.json",
            {
                "server_name": "tiny",
                "replicas": 2,
                "service_port": SERVICE_PORT,
                "service_type": "NodePort",
                "server_type": "mindie_single_node",
                "scheduler": "default",
                "init_delay": 300,  # a loaded machine (or a first kernel build) starts servers slowly
                "detect_server_inner_error": True,
                "liveness_timeout": 30,
                "liveness_failure_threshold": 3,
                "readiness_timeout": 30,
                "readiness_failure_threshold": 3,  # a one-token probe on a loaded machine can miss its 30 s
                "resource_requests": {"memory": 2000, "cpu_core": 1000, "npu_type": "Ascend910", "npu_chip_num": 1},
                "mindie_server_config": {
                    "mies_install_path": str(tmp / "mies"),
                    "infer_port": 1025,
                    "management_port": 1026,
                    "enable_tls": False,
                },
                "termination_grace_period_seconds": 120,
                "max_unavailable": "50%",
                "max_surge": "50%",
            },
        ),
        "update": _write(tmp / "update_server.json", {"server_name": "tiny"}),
    }
    home = tmp / "home"
    (home / ".mindie_ms").mkdir(parents=True)
    _write(
        home / ".mindie_ms" / "msctl.json",
        {
            "http": {
                "dstPort": port,
                "dstIP": "127.0.0.1",
                "tls_enable": False,
                "ca_cert": "",
                "tls_cert": "",
                "tls_key": "",
                "tls_crl": "",
                "timeout": 60,
            },
            "log_level": "INFO",
        },
    )
    log = open(tmp / "deployer.out", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mindie_host.cli",
            "deployer",
            str(files["ms_server"]),
            "--server-config",
            str(files["config"]),
            "--workdir",
            str(tmp / "work"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "MINDIE_HOST_CPU_KERNELS": "0"},  # the servers' speed is not the point: no kernel build
    )
    dep = Deployment(tmp / "work", home, proc, files)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/servers/tiny", timeout=2)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp / "deployer.out").read_text()
                time.sleep(0.2)
        yield dep
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def chat(n: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"Tell story {n}"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        **extra,
    }


def stream_once(client: httpx.Client, url: str, body: dict[str, Any], started: threading.Event | None = None) -> str:
    """One streamed chat; "ok" when it ended with finish_reason length, every token counted, and [DONE]."""
    usage, finish, events = None, None, 0
    with client.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        if resp.status_code != 200:
            return f"http {resp.status_code}: {resp.read()[:200]!r}"
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                ok = finish == "length" and usage is not None and usage["completion_tokens"] == body["max_tokens"]
                return "ok" if ok else f"ended with {finish}, usage {usage}"
            event = json.loads(payload)
            if "error" in event:
                return f"error event {event}"
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                finish = choice.get("finish_reason") or finish
                events += 1
                if started is not None:
                    started.set()
    return f"cut after {events} events"


def plain_once(client: httpx.Client, url: str, body: dict[str, Any]) -> str:
    resp = client.post(url, json=body)
    if resp.status_code != 200:
        return f"http {resp.status_code}: {resp.text[:200]}"
    usage, choice = resp.json()["usage"], resp.json()["choices"][0]
    ok = usage["completion_tokens"] == body["max_tokens"] and choice["finish_reason"] == "length"
    return "ok" if ok else f"{usage} {choice['finish_reason']}"


def test_create_get_and_serve(deployment: Deployment):
    code, answer = deployment.msctl("create", "infer_server", "-f", str(deployment.files["infer_server"]))
    assert (code, answer) == (0, {"message": "creating the server!", "status": "0"})
    items = deployment.wait(
        lambda items: len(items) == 2 and all(i["readiness"] for i in items), 600, "two ready instances"
    )
    assert all(i["liveness"] and i["pod_name"].startswith("tiny-") for i in items)
    deployment.old_pods = [i["pod_name"] for i in items]
    code, answer = deployment.msctl("get", "infer_server", "-n", "tiny")
    info = answer["data"]["model_info"]
    assert info["models"][0]["model_id"] == "tiny" and info["models"][0]["max_total_tokens"] == 2048
    resp = httpx.post(f"{deployment.url}/v1/chat/completions", json=chat(0, 8), timeout=300)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 8
    status = json.loads((deployment.workdir.parent / "status.json").read_text())
    assert [s["server_name"] for s in status["server_list"]] == ["tiny"]


def stall_first_drained(deployment: Deployment) -> bool:
    """Freeze the first old instance being drained for longer than the controller's status poll waits, as a
    loaded machine can: the controller drops it from its refresh and lists it again when it answers. The
    coordinator must still keep it out of rotation and count the requests it is finishing (it once took the
    instance back as a new one in rotation, with none). False while no instance is being drained yet."""
    lines = (deployment.workdir.parent / "logs" / "run.txt").read_text().splitlines()
    drained = [line.split("tiny: draining ")[1].strip() for line in lines if "tiny: draining tiny-" in line]
    if not drained:
        return False
    pid = _pid_of(deployment, drained[0])
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(STALL_SECONDS)
    finally:
        os.kill(pid, signal.SIGCONT)
    return True


def test_rolling_update_under_load_fails_no_request(deployment: Deployment):
    url = f"{deployment.url}/v1/chat/completions"
    results: dict[str, list[str]] = {"long": [], "stream": [], "plain": []}
    stop = threading.Event()
    long_ended: list[float] = []

    def long_stream(n: int, started: threading.Event) -> None:
        with httpx.Client(timeout=600) as client:
            results["long"].append(stream_once(client, url, chat(100 + n, LONG_TOKENS), started))
            long_ended.append(time.time())

    def loop(kind: str, n: int) -> None:
        with httpx.Client(timeout=600) as client:  # keep-alive connections to the coordinator, as a client would
            k = 0
            while not stop.is_set():
                body = chat(1000 * n + k, 24)
                results[kind].append(
                    stream_once(client, url, body) if kind == "stream" else plain_once(client, url, body)
                )
                k += 1

    started = [threading.Event() for _ in range(4)]
    threads = [threading.Thread(target=long_stream, args=(n, started[n])) for n in range(4)]
    threads += [threading.Thread(target=loop, args=(kind, n)) for kind in ("stream", "plain") for n in range(2)]
    for t in threads:
        t.start()
    try:
        assert all(e.wait(120) for e in started), "the long streams did not start"
        code, answer = deployment.msctl("update", "infer_server", "-f", str(deployment.files["update"]))
        assert (code, answer) == (0, {"message": "update server success.", "status": "0"})
        deadline = time.monotonic() + 600
        stalled = False
        while True:
            if not stalled:
                stalled = stall_first_drained(deployment)
            items = deployment.instances()
            names = {i["pod_name"] for i in items}
            if len(items) == 2 and not names & set(deployment.old_pods) and all(i["readiness"] for i in items):
                break
            assert time.monotonic() < deadline, f"the update did not finish: {items}"
            time.sleep(0.3)
        served = {kind: len(results[kind]) for kind in ("stream", "plain")}
        while any(len(results[kind]) < n + 2 for kind, n in served.items()):  # the new instances alone serve too
            assert time.monotonic() < deadline, f"no requests served after the update: {served}"
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(600)
    for kind, outcomes in results.items():
        assert outcomes and all(o == "ok" for o in outcomes), (kind, [o for o in outcomes if o != "ok"][:5])
    assert len(results["long"]) == 4
    # the long streams began on the old instances and were still running when the first of those was drained
    drains = [
        dt.datetime.strptime(line[1:24].replace(",", "."), "%Y-%m-%d %H:%M:%S.%f").timestamp()
        for line in (deployment.workdir.parent / "logs" / "run.txt").read_text().splitlines()
        if "tiny: draining tiny-" in line
    ]
    assert len(drains) == 2 and min(long_ended) > min(drains), (drains, long_ended)
    coordinator_log = (deployment.server_dir / "logs" / "coordinator.log").read_text()
    assert "Apply connection to node failed" not in coordinator_log  # no request reached a stopping server
    for k in (0, 1):  # the old servers stopped without ending anything early
        server_log = (deployment.server_dir / "logs" / f"server-{k}.log").read_text()
        assert "stopped" in server_log and "drain time" not in server_log
    print(f"update: {sum(map(len, results.values()))} requests during the update, none failed")


def _pid_of(deployment: Deployment, pod_name: str) -> int:
    """The server process of ``pod_name``, from the deployer's run log (its latest start)."""
    run_log = (deployment.workdir.parent / "logs" / "run.txt").read_text()
    pids = [int(line.split("(pid ")[1].split(",")[0]) for line in run_log.splitlines() if f" {pod_name} (pid " in line]
    assert pids, f"{pod_name} is not in the run log"
    return pids[-1]


def test_a_killed_instance_is_restarted(deployment: Deployment):
    items = deployment.instances()
    victim = items[0]["pod_name"]
    os.kill(_pid_of(deployment, victim), signal.SIGKILL)
    deployment.wait(
        lambda items: any(i["pod_name"] == victim and not i["readiness"] for i in items),
        60,
        f"{victim} to be seen down",
    )
    resp = httpx.post(f"{deployment.url}/v1/chat/completions", json=chat(7, 8), timeout=300)
    assert resp.status_code == 200  # the other instance serves meanwhile
    deployment.wait(
        lambda items: len(items) == 2 and all(i["readiness"] for i in items), 300, f"{victim} to be restarted"
    )
    assert victim in {i["pod_name"] for i in deployment.instances()}


def test_delete(deployment: Deployment):
    code, answer = deployment.msctl("delete", "infer_server", "-n", "tiny")
    assert (code, answer) == (0, {"message": "succeed to clear resources", "status": "0"})
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{deployment.url}/v1/models", timeout=5)
    code, answer = deployment.msctl("get", "infer_server", "-n", "tiny")
    assert (code, answer) == (1, {"message": "server 'tiny' not found", "status": "1"})
    assert json.loads((deployment.workdir.parent / "status.json").read_text()) == {"server_list": []}
