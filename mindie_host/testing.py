"""Test helpers shipped with the host so plugin packages can test against a real server.

* :func:`make_tiny_llama` writes a small random Llama (HF format) with the
  default model's real tokenizer and chat template, so tests run fast but go
  through the real loader, tokenizer, engine and protocols;
  :func:`make_tiny_model` does the same for any family from transformers' own
  config and model classes.
* :func:`server_config` builds a config dict for a model path, with small memory
  budgets and free ports.
* :class:`RunningServer` starts the real HTTP server on free loopback ports in a
  background thread and stops it again.
* :class:`ForcedTokens` makes a model write a given text (a tool call, a reasoning block).
* :func:`load_host` loads a host as the server would, without listeners;
  :func:`loaded_host` loads one with the engine in this process, for :func:`run_engine`.
* :func:`child_process` runs functions in a fresh spawned process, whose memory (MindSpore's runtime, a model's
  weights) goes back to the OS when it ends; :func:`release_memory` gives back what a test dropped.
* :class:`CopyProposer` drafts a known reference output, often wrongly, for speculative decoding's tests;
  :func:`run_with_plugin` runs requests with a plugin object registered for the run only.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ctypes
import gc
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import hookimpl
from .bench.datasets import DatasetError as BenchDatasetError  # noqa: F401 - public, for load_bench_items
from .config import Config, config_from_dict, default_config_dict

if TYPE_CHECKING:
    from .api import DraftOutcome, DraftRequest, Drafts

_PORTS_GIVEN: set[int] = set()
_PORTS_LOCK = threading.Lock()


def free_port() -> int:
    """An unused TCP port on 127.0.0.1, never one this process was given before.

    The kernel may hand a port that was just released out again, so ports picked one after another for the
    servers of one cluster could collide before any of them listens; remembering them rules that out.
    """
    with _PORTS_LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _PORTS_GIVEN:
                _PORTS_GIVEN.add(port)
                return port


def private_copy(path: str | os.PathLike[str]) -> str:
    """A copy of a config file with mode 0640, for files a git checkout leaves at 0644 (the file-mode check refuses those).

    The copy lives in a fresh temporary directory; relative paths inside the config then start there.
    """
    import tempfile

    from .file_modes import CONFIG_MODE, write_file

    target = Path(tempfile.mkdtemp(prefix="mindie-config-")) / Path(path).name
    return str(write_file(target, Path(path).read_bytes(), CONFIG_MODE))


def make_tiny_llama(
    directory: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write a random tiny Llama with the SmolLM2 tokenizer into ``directory``; returns the path.

    The tokenizer comes from the default model, or from ``tokenizer_dir`` (an HF directory
    holding it, e.g. where the default model's package is not installed; the environment
    variable ``MINDIE_HOST_TEST_TOKENIZER`` sets it too).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    return make_tiny_model(
        directory, LlamaConfig, LlamaForCausalLM, seed=seed, tokenizer_dir=tokenizer_dir,
        hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
    )


def tiny_tokenizer(tokenizer_dir: str | Path | None = None) -> Any:
    """The tokenizer tiny test models get: the default model's, or the one in ``tokenizer_dir`` (or
    ``MINDIE_HOST_TEST_TOKENIZER``)."""
    from transformers import AutoTokenizer

    from .models.default import default_model_path
    from .models.weights import resolve_model
    from .tokenizer import load_tokenizer

    tokenizer_dir = tokenizer_dir or os.environ.get("MINDIE_HOST_TEST_TOKENIZER")
    if tokenizer_dir:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return load_tokenizer(resolve_model(default_model_path()))


def make_tiny_model(directory: str | Path, config_class: Any, model_class: Any, *, seed: int = 0,
                    tokenizer_dir: str | Path | None = None, head_scale: float = 8.0, **config: Any) -> Path:
    """Write a random model of transformers' ``model_class`` built from ``config_class(**config)`` (the vocabulary,
    special tokens and dtype filled in from the test tokenizer), saved with ``save_pretrained`` beside that
    tokenizer; returns the path. A directory that already holds a model is returned as it is.

    The LM head is multiplied by ``head_scale`` so that logits spread wide and greedy ties are vanishingly rare.
    A multimodal config (one with ``text_config``) gets the vocabulary and special tokens in its text config.
    """
    import torch

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    tokenizer = tiny_tokenizer(tokenizer_dir)
    tokens = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = {**tokens, **config["text_config"]}
    else:
        config = {**tokens, **config}
    torch.manual_seed(seed)
    cfg = config_class(**config, torch_dtype="float32")
    model = model_class(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(head_scale)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def server_config(model_path: str | Path | None, **overrides: Any) -> dict[str, Any]:
    """A config dict for tests: free ports, small KV budget, the given model.

    ``overrides`` are dotted-free section updates: ``server={...}``, ``model={...}``,
    ``schedule={...}``, ``deploy={...}``, ``plugins={...}``.
    """
    cfg = copy.deepcopy(default_config_dict())
    server = cfg["ServerConfig"]
    server.update({"ipAddress": "127.0.0.1", "managementIpAddress": "127.0.0.1", "port": free_port(),
                   "managementPort": free_port(), "metricsPort": free_port(), "httpsEnabled": False})
    deploy = cfg["BackendConfig"]["ModelDeployConfig"]
    deploy.update({"maxSeqLen": 1024, "maxInputTokenLen": 768})
    model = deploy["ModelConfig"][0]
    model.update({"modelName": "tiny", "modelWeightPath": str(model_path) if model_path else "", "cpuMemSize": 1,
                  "worldSize": 1})
    if model_path is None:
        model["modelName"] = "SmolLM2-135M-Instruct"
    sched = cfg["BackendConfig"]["ScheduleConfig"]
    sched.update({"cacheBlockSize": 16, "maxPrefillTokens": 4096, "maxIterTimes": 512, "maxBatchSize": 32,
                  "maxPrefillBatchSize": 16})
    server.update(overrides.pop("server", {}))
    model.update(overrides.pop("model", {}))
    sched.update(overrides.pop("schedule", {}))
    deploy.update(overrides.pop("deploy", {}))
    cfg.setdefault("Plugins", {}).update(overrides.pop("plugins", {}))
    if overrides:
        raise TypeError(f"unknown override sections: {sorted(overrides)}")
    return cfg


class RunningServer:
    """The real server (all planes) on loopback ports, in a background thread.

    Use as a context manager. ``url`` is the business plane, ``management_url``
    and ``metrics_url`` the others. ``host`` is the live :class:`~mindie_host.host.Host`.
    ``source_path`` names the file ``config`` was written to, as ``mindie-host serve --config`` would
    (its hot update is then watched).
    """

    def __init__(self, config: dict[str, Any], *, plugins: list[tuple[object, str]] | None = None,
                 timeout: float = 120.0, source_path: str | None = None) -> None:
        from .host import Host

        self.config = config_from_dict(config, source_path=source_path)
        forced = os.environ.get("MINDIE_HOST_TEST_ENGINE_PROCESS")  # "0"/"1": run a test file in one mode
        if forced in ("0", "1"):
            self.config.server.engineProcess = forced == "1"
        self.host = Host(self.config)
        for plugin, name in plugins or []:
            self.host.plugins.register(plugin, name)
        s = self.config.server
        scheme = "https" if s.httpsEnabled else "http"
        self.url = f"{scheme}://{s.ipAddress}:{s.port}"
        self.management_url = f"{scheme}://{s.managementIpAddress}:{s.managementPort}"
        self.metrics_url = f"{scheme}://{s.managementIpAddress}:{s.metricsPort}"
        self.timeout = timeout
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _run(self) -> None:
        from .runtime import load_host
        from .server.runner import serve

        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(serve(self.host, load=lambda: load_host(self.host), on_ready=self._ready.set))
        except BaseException as exc:  # reported to the test thread
            self._error = exc
            self._ready.set()
        finally:
            loop.close()

    def start(self) -> RunningServer:
        self._thread = threading.Thread(target=self._run, name="mindie-test-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.timeout):
            # stop it all the same: an engine process still loading would otherwise outlive the test, and
            # multiprocessing's exit handler would wait for it (and its supervisor's restarts) forever
            self.stop()
            raise TimeoutError(f"server did not become ready within {self.timeout:g} s")
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        stop = self.host.runtime.stop_event
        loop = self._loop
        if stop is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout=60)

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        """Run coroutine ``coro`` on the server's event loop (``host.engine_command`` ...) and return its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Wait until no request is active and return the engine stats."""
        deadline = time.monotonic() + timeout
        stats = self.host.stats()
        while time.monotonic() < deadline:
            stats = self.host.stats()
            if not stats.get("num_active_requests") and not stats.get("num_running") and not stats.get("num_waiting"):
                return stats
            time.sleep(0.05)
        return stats

    def __enter__(self) -> RunningServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ForcedTokens:
    """``EngineRequest.logits_constraint`` that makes any model write exactly ``token_ids``, then end.

    A random tiny model does not write a tool call or a reasoning block by itself; a test plugin
    sets this constraint in ``mindie_host_refine_request`` so the real engine, detokenizer and
    protocol parsers see the text a trained model of the family would write. ``end_ids`` are the
    model's end-of-sequence ids.
    """

    def __init__(self, token_ids: list[int], end_ids: list[int]) -> None:
        self.token_ids = list(token_ids)
        self.end_ids = list(end_ids)

    def __call__(self, output_token_ids: list[int]) -> list[int]:
        n = len(output_token_ids)
        return [self.token_ids[n]] if n < len(self.token_ids) else self.end_ids


def rank_pids(engine_pid: int) -> list[int]:
    """The tensor-parallel rank processes an engine process started (Linux ``/proc``; rank 0 is the engine)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) != engine_pid:
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"multiprocessing" in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def wait_for(predicate: Any, timeout: float, what: str) -> float:
    """Poll ``predicate()`` every 50 ms until it is true; returns the seconds it took. Fails after ``timeout`` s."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start >= timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


@contextlib.contextmanager
def child_process() -> Iterator[Executor]:
    """One fresh Python process (spawned: nothing inherited but ``sys.path`` and the environment) to run functions
    in, as ``child.submit(fn, *args).result()``; it exits when the block ends.

    Memory a process has once used mostly stays with it (glibc's heaps, MindSpore's runtime, which keeps what its
    graphs allocated until exit), so a test module that loads a large model in the test process leaves it to every
    module after it. Run there, the work returns plain results (lists, floats) for the test to assert on, and its
    memory is the OS's again when the module's fixture closes the block. ``fn`` and its arguments must pickle: a
    module-level function of an importable module. An exception in the child is raised by ``result()``."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def release_memory() -> None:
    """Collect garbage (a loaded host lives in reference cycles until collected) and hand the heaps' free pages back
    to the OS (glibc's ``malloc_trim``; nothing to do elsewhere), so what a test dropped stops counting against the
    suite's memory before its next load."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def loaded_host(config: dict[str, Any], *, plugins: list[tuple[object, str]] | None = None) -> Any:
    """A :class:`~mindie_host.host.Host` with the model loaded but no server and no worker thread.

    The engine is built in this process (``ServerConfig.engineProcess`` false), so
    ``host.llm`` and ``host.backend`` are there: drive it synchronously with :func:`run_engine`.
    """
    cfg = config_from_dict(config)
    cfg.server.engineProcess = False
    return load_host(new_host(cfg, plugins=plugins))


class LoadedHosts:
    """Hosts a test module loads with :func:`loaded_host`, shut down together when it is done (a dropped host
    keeps its engine, its KV pool and any device memory until the garbage collector runs)."""

    def __init__(self) -> None:
        self.hosts: list[Any] = []

    def load(self, config: dict[str, Any], **kwargs: Any) -> Any:
        """:func:`loaded_host`, remembered for :meth:`shutdown`."""
        host = loaded_host(config, **kwargs)
        self.hosts.append(host)
        return host

    def shutdown(self) -> None:
        """Shut every remembered host down, the last loaded first."""
        while self.hosts:
            self.hosts.pop().shutdown()


def new_host(config: dict[str, Any] | Config, *, plugins: list[tuple[object, str]] | None = None) -> Any:
    """A :class:`~mindie_host.host.Host` for ``config`` (a config dict, or a :class:`~mindie_host.api.Config`),
    with ``plugins`` (object, name) registered and nothing loaded yet: :func:`load_host` loads it."""
    from .host import Host

    host = Host(config if isinstance(config, Config) else config_from_dict(config))
    for plugin, name in plugins or []:
        host.plugins.register(plugin, name)
    return host


def load_host(host: Any) -> Any:
    """Load ``host`` as ``mindie-host serve`` does, without listeners and without starting its engine: plugins
    enabled and checked, the model in engine processes with ``ServerConfig.engineProcess`` or here. A config or
    plugin error raises as it does at startup. ``host`` is a host from :func:`new_host`, or a config (dict or
    :class:`~mindie_host.api.Config`) to make one from; returns the host."""
    from .runtime import load_host as load

    if isinstance(host, (dict, Config)):
        host = new_host(host)
    load(host)
    return host


def plugin_manager(config: dict[str, Any] | Config) -> Any:
    """The plugin manager (:class:`~mindie_host.plugins.PluginHost`) with the builtins and the plugins ``config``
    enables, as a server builds it before it loads a model: ``registered_names()``, ``backend_types()``, ``hook``."""
    from .plugins import PluginHost

    plugins = PluginHost()
    plugins.enable_from_config(config if isinstance(config, Config) else config_from_dict(config))
    return plugins


def no_effect_notes(config: dict[str, Any] | Config) -> list[str]:
    """What startup logs, and ``mindie-host config validate`` prints, as keys of ``config`` that have no effect here
    (one note a key, naming it)."""
    from .config.support import no_effect

    return no_effect(config if isinstance(config, Config) else config_from_dict(config))


def run_bench(argv: list[str]) -> int:
    """``mindie-host bench`` with ``argv`` in this process; returns its exit code."""
    from .bench.cli import main

    return main(argv)


def load_bench_items(dataset_type: str, path: str, **options: Any) -> Any:
    """The benchmark's requests from a dataset file, as ``mindie-host bench --DatasetType`` reads them
    (:func:`mindie_host.bench.datasets.load_items`); a bad file raises :class:`BenchDatasetError`."""
    from .bench.datasets import load_items

    return load_items(dataset_type, path, **options)


def run_engine(host: Any, requests: list[Any], *, max_steps: int = 100_000) -> dict[str, Any]:
    """Add ``requests`` (EngineRequest) to the host's engine, step until all finish, return final outputs by id.

    Token ids and logprobs of every step are accumulated into the final output.
    """
    llm = host.llm
    for req in requests:
        llm.add_request(req)
    finals: dict[str, Any] = {}
    logprobs: dict[str, list[Any]] = {}
    steps = 0
    while llm.has_work():
        steps += 1
        if steps > max_steps:
            raise RuntimeError("engine did not finish")
        for out in llm.step():
            logprobs.setdefault(out.request_id, []).extend(out.logprobs)
            if out.finished:
                out.logprobs = logprobs.pop(out.request_id, [])
                finals[out.request_id] = out
    return finals


class CopyProposer:
    """A draft proposer (``mindie_host_propose_drafts``) that drafts the continuation of a known reference
    output, every ``every``-th draft corrupted, so it is often right and often wrong: a speculative path must
    give the reference's tokens whatever it proposes. ``reference`` maps a request id to its tokens without
    drafts; ``outcomes`` collects what the engine reported (``mindie_host_drafts_accepted``)."""

    def __init__(self, reference: dict[str, list[int]], k: int = 4, every: int = 3) -> None:
        self.reference = reference
        self.k = k
        self.every = every
        self.outcomes: list[DraftOutcome] = []
        self.calls = 0

    @hookimpl
    def mindie_host_propose_drafts(self, ctx: Any, seqs: list[DraftRequest]) -> list[Drafts | None]:
        """Up to ``k`` tokens of each sequence's reference after what it has written, some corrupted."""
        from .api import Drafts

        self.calls += 1
        out: list[Drafts | None] = []
        for s in seqs:
            ref = self.reference.get(s.request_id, [])
            done = len(s.token_ids) - s.prompt_len
            tokens = list(ref[done : done + min(self.k, s.max_drafts)])
            for i in range(len(tokens)):
                if (done + i) % self.every == self.every - 1:
                    tokens[i] = (tokens[i] + 7) % 1000
            out.append(Drafts(tokens) if tokens else None)
        return out

    @hookimpl
    def mindie_host_drafts_accepted(self, ctx: Any, outcomes: list[DraftOutcome]) -> None:
        """Keep the step's outcomes for the test."""
        self.outcomes.extend(outcomes)


def run_with_plugin(host: Any, plugin: object, requests: list[Any], *, alone: bool = False,
                    name: str = "test_plugin") -> dict[str, Any]:
    """:func:`run_engine` with ``plugin`` registered (as ``name``) for this run only: ``requests`` in one batch,
    or each alone (``alone``)."""
    host.plugins.register(plugin, name)
    try:
        if alone:
            out: dict[str, Any] = {}
            for req in requests:
                out.update(run_engine(host, [req]))
            return out
        return run_engine(host, requests)
    finally:
        host.plugins.pm.unregister(plugin)
        host.plugins.enabled.remove(name)


#: llama-cpp-python's sdist whose vendored llama.cpp holds the converter (``scripts/fetch-llama-cpp.sh`` unpacks it)
LLAMA_CPP_PYTHON = "0.3.36"


def llama_cpp_converter() -> Path | None:
    """llama.cpp's own ``convert_hf_to_gguf.py`` (with its ``gguf-py``), from the llama-cpp-python sdist that
    ``scripts/fetch-llama-cpp.sh`` unpacks under ``$LLAMA_BUILD_DIR`` (default ``~/.cache/mindie-bench/llama.cpp``,
    where ``bench/build_llama_server.sh`` builds llama-server from); None when it is not there."""
    root = Path(os.environ.get("LLAMA_BUILD_DIR") or Path.home() / ".cache" / "mindie-bench" / "llama.cpp")
    script = root / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    return script if script.is_file() and (script.parent / "conversion").is_dir() else None


_CONVERT = """
import json
import sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf
for model, outfile, outtype in json.loads(sys.argv[2]):
    sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", outfile, "--outtype", outtype]
    convert_hf_to_gguf.main()
"""


def convert_to_gguf(jobs: list[tuple[Path, Path, str]]) -> None:
    """Run llama.cpp's converter on each ``(HF directory, output file, outtype)`` (``f16``, ``q8_0`` ...), all in one
    process (the converter's imports take longer than converting a tiny model); raises when it fails."""
    import json
    import subprocess
    import sys

    script = llama_cpp_converter()
    if script is None:
        raise FileNotFoundError("llama.cpp's convert_hf_to_gguf.py is not unpacked: run scripts/fetch-llama-cpp.sh")
    args = json.dumps([[str(model), str(out), kind] for model, out, kind in jobs])
    done = subprocess.run([sys.executable, "-c", _CONVERT, str(script.parent), args], capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({done.returncode}): {done.stderr[-3000:]}")
