"""Suite-wide memory hygiene (the whole test run must stay well under 8 GB), and private file modes.

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
    """After the last test of a module, once its module-scoped fixtures (servers, hosts) are finalised."""
    if nextitem is None or nextitem.module is not item.module:
        _trim()
