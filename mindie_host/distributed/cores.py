"""The cores this process may use, and an even share of them.

Torch-free, so that what starts before torch loads (the test suite's conftest, the ``cluster`` command's
servers) can size its threads with it.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one, else every core)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def core_share(parts: int) -> int:
    """Compute the threads of each of ``parts`` processes or ranks that share this process's cores: at least one."""
    return max(1, usable_cores() // max(1, parts))
