"""Importing and configuring MindSpore once per process.

MindSpore is imported lazily (``mindie-host plugins`` and config validation never
pay for it). The CPU wheels of MindSpore 2.10 were built against NumPy 1.x: with
NumPy 2 installed, the first Python-level tensor operator of a process fails once
while MindSpore's argument parser initialises its NumPy bridge, and every later
call works. :func:`mindspore_module` runs that first operator itself, with the
noise it prints on stderr suppressed, so the model never sees the failure.
"""

from __future__ import annotations

import contextlib
import os
import threading
from types import ModuleType
from typing import Any

INSTALL_HINT = "pip install 'mindspore>=2.7' (or: pip install mindie-plugin-backends-ms)"

_lock = threading.Lock()
_module: ModuleType | None = None


class MindSporeMissing(RuntimeError):
    """MindSpore cannot be imported in this environment."""


@contextlib.contextmanager
def _quiet_stderr() -> Any:
    """Silence file descriptor 2 (C++ and Python writers alike) for the duration."""
    try:
        saved = os.dup(2)
    except OSError:  # no usable stderr: nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def mindspore_module(num_threads: int | None = None) -> ModuleType:
    """Import MindSpore, select the CPU PyNative runtime and prime its NumPy bridge.

    :param num_threads: MindSpore's CPU runtime thread count (applied on first import only).
    :raises MindSporeMissing: when ``import mindspore`` fails, with the install command.
    """
    global _module
    with _lock:
        if _module is not None:
            return _module
        try:
            with _quiet_stderr():
                import mindspore as ms
        except Exception as exc:  # ImportError, or a broken native library
            raise MindSporeMissing(f"backendType 'ms' needs MindSpore, which failed to import ({exc}); {INSTALL_HINT}") from exc
        with _quiet_stderr():
            ms.set_context(mode=ms.PYNATIVE_MODE)
            if num_threads:
                with contextlib.suppress(Exception):  # older releases name it differently; default is fine
                    ms.set_context(runtime_num_threads=int(num_threads))
            import numpy as np

            probe = ms.Tensor(np.ones((1,), np.float32))
            for _ in range(2):  # first call may fail once (see module docstring)
                with contextlib.suppress(SystemError):
                    (probe * probe).asnumpy()
        _module = ms
        return ms
