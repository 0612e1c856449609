"""Stopping ``mindie-host serve`` with signals (issue 15, point 13), on a real server process.

The first SIGINT/SIGTERM drains: new requests get 503, in-flight streams may go on for
``shutdownDrainSeconds`` and then end with a normal final event (never a 500). A second
signal ends them the same way at once and the process exits without waiting.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mindie_host.testing import make_tiny_llama, server_config

LONG = 7000  # tokens: far longer than any wait below, so the stream is cut by the stop, not by its length


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("long-model"), max_position_embeddings=LONG + 512)


class Served:
    """``mindie-host serve`` in a subprocess, with its config written to a file."""

    def __init__(self, model: Path, tmp: Path, drain_seconds: int, own_group: bool = False) -> None:
        cfg = server_config(model, server={"shutdownDrainSeconds": drain_seconds},
                            deploy={"maxSeqLen": LONG + 256, "maxInputTokenLen": 128},
                            schedule={"maxIterTimes": LONG})
        path = tmp / "config.json"
        path.write_text(json.dumps(cfg))
        s = cfg["ServerConfig"]
        self.url = f"http://127.0.0.1:{s['port']}"
        self.ready_url = f"http://127.0.0.1:{s['managementPort']}/v2/health/ready"
        self.log = tmp / "serve.log"
        self.own_group = own_group
        self.proc = subprocess.Popen([sys.executable, "-m", "mindie_host.cli", "serve", "--config", str(path)],
                                     stdout=subprocess.DEVNULL, stderr=self.log.open("w"), start_new_session=own_group)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(self.ready_url, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not become ready")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def group_alive(self) -> bool:
        """Whether any process of the server's own process group (``own_group``) is still running."""
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.fixture
def serve(long_model: Path, tmp_path: Path) -> Iterator[Any]:
    started: list[Served] = []

    def start(drain_seconds: int, own_group: bool = False) -> Served:
        started.append(Served(long_model, tmp_path, drain_seconds, own_group))
        return started[-1]

    yield start
    for s in started:
        s.close()
        if s.own_group and s.group_alive():
            os.killpg(s.proc.pid, signal.SIGKILL)


class Stream:
    """A long streaming completion read on a thread; ``events`` holds every SSE data line."""

    def __init__(self, url: str) -> None:
        self.events: list[str] = []
        self.status = 0
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()
        assert self.first.wait(60), "no first event"

    def _read(self, url: str) -> None:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": LONG, "stream": True,
                "ignore_eos": True, "temperature": 0}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()
        finally:
            self.first.set()

    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]


def assert_clean_end(stream: Stream) -> None:
    stream.thread.join(30)
    assert not stream.thread.is_alive()
    chunks = stream.chunks()
    assert stream.status == 200
    assert not [c for c in chunks if "error" in c], chunks[-3:]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"  # the final event: a normal end
    assert stream.events[-1] == "[DONE]"
    generated = sum(1 for c in chunks if c["choices"][0]["text"])
    assert 0 < generated < LONG  # cut by the stop


def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> float:
    t0 = time.monotonic()
    proc.wait(timeout)
    return time.monotonic() - t0


def test_first_signal_drains_then_ends_streams_cleanly(serve: Any) -> None:
    server = serve(drain_seconds=2)
    stream = Stream(server.url)
    server.proc.send_signal(signal.SIGINT)
    # no new work while draining
    deadline = time.monotonic() + 5
    status = 0
    while time.monotonic() < deadline and status != 503:
        status = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                            timeout=10).status_code
    assert status == 503
    assert stream.thread.is_alive()  # the in-flight stream goes on during the drain
    waited = wait_exit(server.proc, 30)
    assert server.proc.returncode == 0, server.log.read_text()
    assert waited < 2 + 10  # the drain time, then out (teardown is slower on a loaded machine)
    assert_clean_end(stream)
    log = server.log.read_text()
    assert "Traceback" not in log
    assert "send the signal again to stop now" in log


def test_second_signal_stops_at_once(serve: Any) -> None:
    server = serve(drain_seconds=120)
    stream = Stream(server.url)
    server.proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert server.proc.poll() is None  # the first signal drains: the stream still has 120 s
    server.proc.send_signal(signal.SIGTERM)  # Ctrl-C then SIGTERM, or twice either
    waited = wait_exit(server.proc, 60)
    assert waited < 10, f"took {waited:.1f} s to exit after the second signal"
    assert server.proc.returncode == 0, server.log.read_text()
    assert_clean_end(stream)
    assert "Traceback" not in server.log.read_text()


def test_sigterm_to_the_whole_process_group_drains_and_exits(serve: Any) -> None:
    """`kill -TERM -- -PGID` (CI, a terminal's hang-up) reaches the engine process too: it keeps serving through
    the drain, the front end stops it, and every process of the group exits. The front end is frozen when the
    signal comes (SIGSTOP, as a paused container or a stalled machine): it acts on it once it runs again."""
    server = serve(drain_seconds=2, own_group=True)
    stream = Stream(server.url)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        os.killpg(server.proc.pid, signal.SIGTERM)
        time.sleep(0.5)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    time.sleep(0.5)
    assert stream.thread.is_alive()  # the engine process did not die with the signal: the stream goes on
    waited = wait_exit(server.proc, 30)
    assert server.proc.returncode == 0, server.log.read_text()
    assert waited < 2 + 10
    assert_clean_end(stream)
    deadline = time.monotonic() + 15
    while server.group_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not server.group_alive()  # no engine process left behind
    log = server.log.read_text()
    assert "Traceback" not in log and " stopped" in log
