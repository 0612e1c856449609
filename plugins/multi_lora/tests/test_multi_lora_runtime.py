"""Slot residency (a non-resident adapter loads when a slot frees), runtime load/unload over the
management plane, and prefix-cache isolation between adapters."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from mindie_host.testing import RunningServer, server_config, wait_for
from multi_lora_helpers import PROMPTS, hf_greedy, lora_config
from transformers import AutoTokenizer

MAX_NEW = 12


@pytest.fixture(scope="module")
def tokenizer(lora_base: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(str(lora_base))


def complete(server: RunningServer, model: str, prompt: list[int], max_tokens: int = MAX_NEW) -> dict:
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_one_slot_many_adapters(lora_base: Path, lora_adapters: dict[str, Path], tokenizer,  # noqa: ANN001
                                hf_reference: Callable) -> None:
    """maxLoras=1: concurrent requests on three adapters and the base wait for the slot in turn; all correct."""
    with RunningServer(lora_config(lora_base, maxLoras=1)) as server:
        jobs = [(m, i) for i in range(len(PROMPTS)) for m in ("alpha", "beta", "gamma", "tiny")]
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: complete(server, job[0], PROMPTS[job[1]]), jobs))
        for (model, i), body in zip(jobs, results):
            adapter = None if model == "tiny" else model
            want = tokenizer.decode(hf_reference(adapter, i, MAX_NEW), skip_special_tokens=True)
            assert body["choices"][0]["text"] == want, (model, i)
        stats = server.wait_idle()
        assert stats["lora_slot_evictions"] >= 2  # three adapters went through one slot
        assert stats["lora_adapters_resident"] == 1 and stats["lora_max_adapters_per_step"] == 1
        assert stats["lora_requests_waiting_for_slot"] == 0
        # sequential alternation keeps working and stays correct
        for model in ("gamma", "alpha", "gamma"):
            want = tokenizer.decode(hf_reference(model, 0, MAX_NEW), skip_special_tokens=True)
            assert complete(server, model, PROMPTS[0])["choices"][0]["text"] == want


def test_runtime_load_and_unload(lora_base: Path, lora_adapters: dict[str, Path], tokenizer,  # noqa: ANN001
                                 hf_reference: Callable) -> None:
    root = str(lora_adapters["delta"].parent)
    with RunningServer(lora_config(lora_base, maxLoras=2, runtimeAdapterDir=root)) as server:
        mgmt = server.management_url
        r = httpx.post(mgmt + "/v1/load_lora_adapter", json={"lora_name": "delta", "lora_path": str(lora_adapters["delta"])})
        assert r.status_code == 200, r.text
        assert "delta" in [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
        want = tokenizer.decode(hf_reference("delta", 1, MAX_NEW), skip_special_tokens=True)
        assert complete(server, "delta", PROMPTS[1])["choices"][0]["text"] == want
        # refusals name the field
        r = httpx.post(mgmt + "/v1/load_lora_adapter", json={"lora_name": "delta", "lora_path": str(lora_adapters["delta"])})
        assert r.status_code == 409 and "delta" in r.text
        r = httpx.post(mgmt + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "does-not-exist"})
        assert r.status_code == 422 and r.json()["field"] == "lora_path" and "'x'" in r.json()["error"]
        r = httpx.post(mgmt + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/does/not/exist"})
        assert r.status_code == 403 and r.json()["field"] == "lora_path"
        r = httpx.post(mgmt + "/v1/load_lora_adapter", json={"lora_path": "/p"})
        assert r.status_code == 422 and r.json()["field"] == "lora_name"
        r = httpx.post(mgmt + "/v1/unload_lora_adapter", json={"lora_name": "zeta"})
        assert r.status_code == 404 and "zeta" in r.text
        listed = {a["name"]: a for a in httpx.get(mgmt + "/v1/lora_adapters").json()["adapters"]}
        assert listed["delta"]["rank"] == 2 and set(listed) == {"alpha", "beta", "gamma", "delta"}

        # unload while a long request runs on the adapter: the request finishes first
        started, finished = threading.Event(), {}

        def long_stream() -> None:
            body = {"model": "delta", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            chunks = []
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        started.set()
            finished["time"] = time.monotonic()
            finished["reasons"] = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]

        t = threading.Thread(target=long_stream)
        t.start()
        assert started.wait(60)
        unload: dict = {}

        def do_unload() -> None:
            unload["response"] = httpx.post(mgmt + "/v1/unload_lora_adapter", json={"lora_name": "delta"}, timeout=120)
            unload["time"] = time.monotonic()

        u = threading.Thread(target=do_unload)
        u.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until the unload is pending
            adapters = {a["name"]: a for a in httpx.get(mgmt + "/v1/lora_adapters").json()["adapters"]}
            if adapters.get("delta", {}).get("unloading"):
                break
            time.sleep(0.01)
        assert "time" not in unload and not finished  # the unload waits on the running request ...
        # ... and meanwhile new requests on the adapter are refused, never sent to the base model
        r = httpx.post(server.url + "/v1/completions", json={"model": "delta", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404 and "delta" in r.text
        u.join(120)
        t.join(60)
        r, unloaded_at = unload["response"], unload["time"]
        assert r.status_code == 200, r.text
        # the in-flight request ended normally, all 400 tokens, while the unload waited (checked above). The two
        # client threads' clocks are not compared: each reads its own connection, so the unload's reply can be
        # read a few microseconds before the stream thread has taken its last, already-sent chunk.
        assert "length" in finished["reasons"]
        assert finished["time"] <= unloaded_at + 1.0
        assert "delta" not in [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
        r = httpx.post(server.url + "/v1/completions", json={"model": "delta", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404
        # load it again under the same name: served again, correct again
        r = httpx.post(mgmt + "/v1/load_lora_adapter", json={"lora_name": "delta", "lora_path": str(lora_adapters["delta"])})
        assert r.status_code == 200
        assert complete(server, "delta", PROMPTS[1])["choices"][0]["text"] == want


def test_unload_times_out_while_busy(lora_base: Path, lora_adapters: dict[str, Path]) -> None:
    with RunningServer(lora_config(lora_base, unloadTimeoutS=0.2)) as server:
        started = threading.Event()

        def long_stream() -> None:
            body = {"model": "alpha", "prompt": PROMPTS[0], "max_tokens": 600, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as resp:
                for _ in resp.iter_lines():
                    started.set()

        t = threading.Thread(target=long_stream)
        t.start()
        assert started.wait(60)
        r = httpx.post(server.management_url + "/v1/unload_lora_adapter", json={"lora_name": "alpha"})
        t.join(60)
        assert r.status_code == 409 and "in flight" in r.text
        assert complete(server, "alpha", PROMPTS[2], 2)["choices"][0]["text"] is not None  # still served


def test_runtime_updates_can_be_disabled(lora_base: Path, lora_adapters: dict[str, Path]) -> None:
    with RunningServer(lora_config(lora_base, runtimeUpdates=False)) as server:
        r = httpx.post(server.management_url + "/v1/unload_lora_adapter", json={"lora_name": "alpha"})
        assert r.status_code == 403 and "runtimeUpdates" in r.text


def test_prefix_cache_never_shares_kv_across_adapters(lora_base: Path, lora_adapters: dict[str, Path], tokenizer,  # noqa: ANN001
                                                       hf_reference: Callable) -> None:
    """With prefix_cache on, the same prompt on the base model and two adapters reuses KV only within one adapter."""
    cfg = server_config(
        lora_base,
        model={"plugin_params": json.dumps({"plugin_type": "multi_lora,prefix_cache"})},
        schedule={"enablePrefixCache": True},
        plugins={"multi_lora": {}},
    )
    prompt = PROMPTS[1] * 4  # 56 tokens: three full blocks of 16
    with RunningServer(cfg) as server:
        def cached(model: str) -> tuple[int, str]:
            """(prompt tokens served from the prefix cache, text) of one request."""
            def hits() -> float:
                return server.host.stats().get("prefix_cache_hit_tokens", 0.0)

            before = hits()
            body = complete(server, model, prompt)
            return int(hits() - before), body["choices"][0]["text"]

        assert cached("tiny")[0] == 0
        assert cached("tiny")[0] == 48  # the base model reuses its own blocks: the cache is on
        hit, text_a = cached("alpha")
        assert hit == 0  # same tokens, different adapter: no shared KV
        assert cached("beta")[0] == 0
        hit, again = cached("alpha")
        assert hit == 48 and again == text_a  # reuse within one adapter, same answer
        want = tokenizer.decode(
            hf_greedy(lora_base, lora_adapters["alpha"], prompt, MAX_NEW),
            skip_special_tokens=True,
        )
        assert text_a == want


def test_engine_restart_keeps_startup_adapters_and_forgets_runtime_ones(
        lora_base: Path, lora_adapters: dict[str, Path], tokenizer, hf_reference: Callable) -> None:  # noqa: ANN001
    """engineProcess (the default): SIGKILL the engine process; it comes back with the startup adapters only."""
    root = str(lora_adapters["delta"].parent)
    cfg = lora_config(lora_base, maxLoras=2, runtimeAdapterDir=root)
    cfg["ServerConfig"].update({"engineProcess": True, "engineRestartBackoffSeconds": 0.1})
    with RunningServer(cfg) as server:
        mgmt, engine = server.management_url, server.host.engine
        r = httpx.post(mgmt + "/v1/load_lora_adapter", json={"lora_name": "delta", "lora_path": str(lora_adapters["delta"])})
        assert r.status_code == 200, r.text
        listed = httpx.get(mgmt + "/v1/lora_adapters").json()
        assert {a["name"] for a in listed["adapters"]} == {"alpha", "beta", "gamma", "delta"}
        os.kill(engine.process.pid, signal.SIGKILL)
        wait_for(lambda: engine.restarts == 1 and httpx.get(mgmt + "/v2/health/ready").status_code == 200, 120,
                 "the engine restarted")
        models = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
        assert "delta" not in models and {"alpha", "beta", "gamma"} <= set(models)
        r = httpx.post(server.url + "/v1/completions", json={"model": "delta", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404 and "delta" in r.text
        want = tokenizer.decode(hf_reference("beta", 2, MAX_NEW), skip_special_tokens=True)
        assert complete(server, "beta", PROMPTS[2])["choices"][0]["text"] == want
        # loading it again works, and it serves correctly in the new engine
        r = httpx.post(mgmt + "/v1/load_lora_adapter", json={"lora_name": "delta", "lora_path": str(lora_adapters["delta"])})
        assert r.status_code == 200, r.text
        want = tokenizer.decode(hf_reference("delta", 1, MAX_NEW), skip_special_tokens=True)
        assert complete(server, "delta", PROMPTS[1])["choices"][0]["text"] == want
