"""Suite-wide memory hygiene (the whole test run must stay well under 8 GB), private file modes, and which
test modules never run at the same time under pytest-xdist.

Most integration tests run a real server in this process (on a thread), so model weights, KV pools and
transformers reference models come and go module by module. Freed tensors return to glibc's heaps, which
keep them unless asked: each module's leftovers would add up. So the process uses few malloc arenas, and
after every test module the garbage is collected and the heaps are trimmed back to the OS.
"""

from __future__ import annotations

import ctypes
import gc
import os

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

_M_ARENA_MAX = -8  # mallopt parameter (glibc malloc.h)

try:
    _libc: ctypes.CDLL | None = ctypes.CDLL("libc.so.6")
    _libc.mallopt(_M_ARENA_MAX, 2)
except (OSError, AttributeError):  # not glibc: nothing to tune
    _libc = None


def _trim() -> None:
    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test of a module, once its module-scoped fixtures (servers, hosts) are finalised; in the
    heavy modules after every test, since a default-model host a test made lives on in reference cycles until
    collected (3.4 GB in float32 with its packed copies: test_default_model held two at once, 6.9 GB)."""
    if nextitem is None or nextitem.module is not item.module or _module_of(item) in HEAVY_MODULES:
        _trim()


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
