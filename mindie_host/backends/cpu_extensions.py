"""The C++ CPU kernels of the torch backends, built with the machine's compiler on first use.

Each kernel is one ``.cpp`` file beside this module (package data, with the ``.h`` files it
includes). :class:`CppExtension` builds it through ``torch.utils.cpp_extension`` the first time a
process asks for it (tens of seconds, with ``-march=native`` so it uses what this CPU has) and
loads it from the build cache after that: ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``), under ``mindie_host/py<X.Y>-torch<version>/<kernel>``. Without a
compiler, or with ``MINDIE_HOST_CPU_KERNELS=0``, :meth:`CppExtension.get` returns None and the
caller stays on torch's operators (logged once).

Processes that start together (the ranks of a tensor-parallel group, a test run's servers) build
one at a time under an ``flock`` of the kernel's build folder, which the kernel releases when its
holder exits however it exits. torch's own ``lock`` file is not released by a builder that is
killed, and every later build would wait on it forever; under the ``flock`` no other builder can
be running, so such a file is stale and is removed (with a warning). A build that cannot get the
``flock`` within :data:`BUILD_WAIT_S` gives up, and torch's operators serve.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # not POSIX: builds are not serialised across processes, as torch's own are not
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("mindie_host.backends")

#: how long a process waits for another one's build of the same kernel before it serves on torch's operators
BUILD_WAIT_S = 600.0


def enabled() -> bool:
    """Whether the C++ kernels may be used (``MINDIE_HOST_CPU_KERNELS=0`` turns them off)."""
    return os.environ.get("MINDIE_HOST_CPU_KERNELS", "1") != "0"


def build_root() -> Path:
    """The folder that holds this interpreter's and this torch's kernel builds."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / "mindie_host" / f"py{sys.version_info.major}.{sys.version_info.minor}-torch{torch.__version__}"


def headers_digest(folder: Path) -> str:
    """A digest of the ``.h`` files beside the kernels: torch rebuilds when a source or a flag changes, not a
    header, so the digest goes in as a macro and a changed header is a changed flag."""
    digest = hashlib.sha256()
    for header in sorted(folder.glob("*.h")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def exclusive_build(build_dir: Path, wait_s: float | None = None) -> Iterator[None]:
    """Hold the ``flock`` of ``build_dir`` (waiting up to ``wait_s``, default :data:`BUILD_WAIT_S`, for another
    process's build) and clear a ``lock`` file a killed build left behind; raises TimeoutError when the wait runs
    out."""
    wait_s = BUILD_WAIT_S if wait_s is None else wait_s
    build_dir.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    with open(build_dir.with_name(build_dir.name + ".flock"), "a+") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"another process held the build of {build_dir.name} for {wait_s:.0f} s") from None
                time.sleep(0.2)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing %s, left by a kernel build that was killed", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class CppExtension:
    """One C++ kernel file, built and loaded at most once per process.

    ``what`` names the kernel in the warning logged when it cannot be built; ``fast_math`` adds
    ``-ffast-math`` (for kernels that allow the compiler to reorder their float operations).
    ``fakes`` maps each torch operator the file registers (``"namespace::name"``) to its output-shape
    function, registered once the module loads, so compiled graphs can trace the operator;
    ``usable`` says whether a loaded module can run on this CPU (default: yes); ``extra_flags`` are more compiler
    flags.
    """

    def __init__(self, name: str, source: str, what: str, fast_math: bool = False,
                 fakes: dict[str, Callable[..., Any]] | None = None,
                 usable: Callable[[Any], bool] | None = None, extra_flags: tuple[str, ...] = ()) -> None:
        self.name = name
        self.source = Path(__file__).with_name(source)
        self.what = what
        self.fast_math = fast_math
        self.fakes = fakes or {}
        self.usable = usable
        self.extra_flags = list(extra_flags)
        #: the loaded module, once :meth:`get` has built it and found it usable (read it while tracing: it never builds)
        self.module: Any = None
        self._tried = False
        self._lock = threading.Lock()

    def get(self) -> Any:
        """The built extension module, or None when kernels are off or it cannot be built (tried once)."""
        if self._tried or not enabled():
            return self.module
        with self._lock:
            if not self._tried:
                try:
                    module = self._build()
                    if self.usable is None or self.usable(module):
                        for op, shape in self.fakes.items():
                            torch.library.register_fake(op)(shape)
                        self.module = module
                except Exception as exc:  # no compiler, no headers, a build held too long: torch's operators serve
                    log.warning("the CPU %s kernel could not be built (%s); it runs on torch's operators", self.what,
                                str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                self._tried = True
        return self.module

    def _build(self) -> Any:
        from torch.utils.cpp_extension import load

        flags = ["-O3", "-march=native", "-fopenmp", f"-DMINDIE_HOST_HEADERS={headers_digest(self.source.parent)}"]
        if self.fast_math:
            flags.append("-ffast-math")
        flags += self.extra_flags
        build_dir = build_root() / self.name
        with exclusive_build(build_dir):
            return load(name=self.name, sources=[str(self.source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                        build_directory=str(build_dir), verbose=False)
