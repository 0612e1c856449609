"""Suite-wide memory hygiene (the whole test run must stay well under 8 GB), private file modes, and which
test modules never run at the same time under pytest-xdist.

Most integration tests run a real server in this process (on a thread), so model weights, KV pools and
transformers reference models come and go module by module. Freed tensors return to glibc's heaps, which
keep them unless asked: each module's leftovers would add up. So the process uses few malloc arenas, and
after every test module the garbage is collected and the heaps are trimmed back to the OS.
``MINDIE_HOST_TEST_MEMLOG=FILE`` appends each module's memory to FILE (time at its end, worker, module, seconds,
RSS before, peak and after, PSS before and after): the modules that leave a worker bigger than they found it.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import time

import pytest

# Files the tests write are private (0600, directories 0700), as an operator's umask 077 makes them: the
# MINDIE_CHECK_INPUTFILES_PERMISSION check, on by default, refuses configs above 0640 and keys above 0600.
# Tests of the check itself set modes explicitly.
os.umask(0o077)

# httpx waits 5 s for an answer unless told otherwise, and ~140 calls in the tests don't say: on a loaded CI machine
# (two workers, servers in both) a short generation can take longer. Tests that test a timeout set their own.
try:
    from httpx._config import DEFAULT_TIMEOUT_CONFIG as _HTTPX_DEFAULT_TIMEOUT

    _HTTPX_DEFAULT_TIMEOUT.read = _HTTPX_DEFAULT_TIMEOUT.write = _HTTPX_DEFAULT_TIMEOUT.pool = 120.0
    _HTTPX_DEFAULT_TIMEOUT.connect = 30.0
except (ImportError, AttributeError):  # another httpx: its own default stands
    pass


def _share_the_cores_among_workers() -> None:
    """Under pytest-xdist, give each worker's torch (and every server, engine and rank process its tests start,
    which inherit the environment) its share of the cores instead of a thread per core.

    Each OpenMP thread that reaches the end of a parallel region spins a while for the others, so two workers with
    a thread per core each, plus the servers they start, kept both cores busy spinning for threads the OS had
    descheduled: on 2 cores the suite took 26 minutes (the MS cluster's cache-affinity test 100 s against 9 s
    alone), and 17 with one thread a worker. A value the environment already sets is kept; tests that need a
    thread count set it themselves (torch.set_num_threads)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    from mindie_host.distributed.cores import core_share  # torch-free: torch must not load before the variable

    threads = core_share(workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch = sys.modules.get("torch")  # imported already (a pytest plugin did): its pool is sized, resize it
    if torch is not None:
        torch.set_num_threads(threads)


_share_the_cores_among_workers()

_M_ARENA_MAX = -8  # mallopt parameter (glibc malloc.h)

try:
    _libc: ctypes.CDLL | None = ctypes.CDLL("libc.so.6")
    _libc.mallopt(_M_ARENA_MAX, 2)
except (OSError, AttributeError):  # not glibc: nothing to tune
    _libc = None


def _trim() -> None:
    _forget_fastapi_endpoints()
    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)


def _forget_fastapi_endpoints() -> None:
    """FastAPI memoizes the kind of each endpoint callable in module-level ``lru_cache``s (4096 entries) that keep
    the endpoint functions alive, and with them the host their closures hold: every in-process server a module
    ran (its model, KV and swap space) outlived the module. Cleared when the heaps are trimmed."""
    models = sys.modules.get("fastapi.dependencies.models")
    for name in ("_is_gen_callable_cached", "_is_async_gen_callable_cached", "_is_coroutine_callable_cached"):
        cache_clear = getattr(getattr(models, name, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test of a module, once its module-scoped fixtures (servers, hosts) are finalised; in the
    heavy modules after every test, since a default-model host a test made lives on in reference cycles until
    collected (3.4 GB in float32 with its packed copies: test_default_model held two at once, 6.9 GB)."""
    last = nextitem is None or nextitem.module is not item.module
    if last or _module_of(item) in HEAVY_MODULES:
        _trim()
    if last and _MEMLOG:
        _memlog_module_end(item)


# -- MINDIE_HOST_TEST_MEMLOG=FILE: each module's memory in the process that ran it, one line a module -------------
#: where to append the lines (unset: nothing is measured)
_MEMLOG = os.environ.get("MINDIE_HOST_TEST_MEMLOG", "")
_memlog_start: dict[str, float] = {}


def _memory_gib() -> dict[str, float]:
    """This process's VmRSS, VmHWM (peak RSS since the last reset) and Pss, in GiB (Linux ``/proc``)."""
    found: dict[str, float] = {}
    for name, keys in (("/proc/self/status", ("VmRSS:", "VmHWM:")), ("/proc/self/smaps_rollup", ("Pss:",))):
        with open(name) as f:
            for line in f:
                if line.startswith(keys):
                    found[line.split(":")[0]] = int(line.split()[1]) / 2**20
    return found


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the first test of a module (its module fixtures not yet made): note the memory, reset the peak."""
    if _MEMLOG and _memlog_start.get("module") != id(item.module):
        _memlog_start.clear()
        _memlog_start.update(_memory_gib(), module=id(item.module), time=time.monotonic())
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS


def _memlog_module_end(item: pytest.Item) -> None:
    now, start = _memory_gib(), _memlog_start
    with open(_MEMLOG, "a") as f:
        f.write(f"{time.strftime('%H:%M:%S')}\t{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{_module_of(item)}\t"
                f"{time.monotonic() - start['time']:.0f}s\tRSS {start['VmRSS']:.2f} -> peak {now['VmHWM']:.2f} -> "
                f"{now['VmRSS']:.2f} GiB\tPSS {start['Pss']:.2f} -> {now['Pss']:.2f} GiB\n")


# -- pytest-xdist: the modules that hold the most memory run one after another, in one worker ---------------------
#: Modules whose peak memory is a large share of the suite's budget (MindSpore's runtime, several default-model
#: loads at once: test_pd.py's three default-model servers peak at 4.2 GB alone, test_ms_cluster.py's two at 3.4). Under ``-n 2 --dist loadgroup`` (the README's test line) they form one group, so two of them
#: never overlap in the two workers; every other module is its own group, so module fixtures stay in one worker.
HEAVY_MODULES = frozenset({
    "plugins/backends_ms/tests/test_backends_ms_correctness.py",
    "plugins/backends_ms/tests/test_backends_ms_server.py",
    "tests/test_default_model.py",
    "tests/test_cpu_profiles.py",
    "tests/test_tensor_parallel.py",
    "tests/test_pd.py",
    "tests/test_ms_cluster.py",
})


def _module_of(item: pytest.Item) -> str:
    return item.path.relative_to(item.config.rootpath).as_posix()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test an ``xdist_group``: the heavy group, or its own module.

    pytest-xdist 3.8 names a test's group by assigning ``item._nodeid``, which pytest 9.2 no longer reads (it
    keeps a structured ``_id``), so its groups never form: the group is appended to the id here, as xdist's
    worker means to."""
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # an older pytest: xdist's own renaming works
        NodeId = None  # noqa: N806
    rename = NodeId is not None and bool(config.getoption("loadgroup", default=False))
    for item in items:
        module = _module_of(item)
        group = "heavy-memory" if module in HEAVY_MODULES else module
        item.add_marker(pytest.mark.xdist_group(group))
        if rename:
            item._id = NodeId.parse(f"{item.nodeid}@{group}")
