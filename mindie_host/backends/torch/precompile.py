"""A child process that compiles a torch backend's decode step, to fill torch.compile's on-disk caches.

With ``compile: true`` on CPU, :meth:`TorchBackend.warmup <mindie_host.backends.torch.backend.TorchBackend.warmup>`
returns at once and the engine serves eager steps while a background thread compiles. Compiling
from a cold cache takes minutes of Python (dynamo's tracing, inductor's lowering) that would hold the
serving process's GIL; run here first, it holds only this process's, and the serving process's own
compile then finds every artifact on disk and takes seconds. It runs at the lowest CPU priority, so
it compiles in the time the server leaves idle. This process builds the same backend
(same class, settings, rotary table length and cache shape, so the cache keys match), compiles, and
exits; it exits early if its parent goes away. It is started as
``python -m mindie_host.backends.torch.precompile`` with a pickled :class:`PrecompileSpec` on stdin.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class PrecompileSpec:
    """How to build the backend whose decode step is compiled."""

    backend: str  # "module:qualname" of the backend class
    kwargs: dict[str, Any]  # its constructor's keyword arguments, platform aside
    platform: str  # the platform's name (select_platform)
    threads: int  # torch's intra-op threads: generated kernels are specialized on it
    max_positions: int  # the rotary tables' length
    num_blocks: int
    block_size: int


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main() -> None:
    spec: PrecompileSpec = pickle.load(sys.stdin.buffer)
    os.nice(19)  # the lowest CPU priority: the serving process's steps come first, this uses idle time
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    import torch

    from ..platform import select_platform

    torch.set_num_threads(spec.threads)
    module, _, qualname = spec.backend.partition(":")
    cls = getattr(importlib.import_module(module), qualname)
    backend = cls(**spec.kwargs, platform=select_platform(spec.platform))
    backend.load()
    backend.set_max_positions(spec.max_positions)
    backend.allocate_kv_cache(spec.num_blocks, spec.block_size)
    backend.compile_now(backend.model)


if __name__ == "__main__":
    main()
