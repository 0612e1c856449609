"""The C++ CPU kernels of the torch backends, built with the machine's compiler on first use.

Each kernel is one ``.cpp`` file beside this module (package data). :class:`CppExtension` builds
it through ``torch.utils.cpp_extension`` the first time a process asks for it (tens of seconds,
with ``-march=native`` so it uses what this CPU has) and loads it from torch's extension cache
after that (``TORCH_EXTENSIONS_DIR``). Without a compiler, or with ``MINDIE_HOST_CPU_KERNELS=0``,
:meth:`CppExtension.get` returns None and the caller stays on torch's operators (logged once).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("mindie_host.backends")


def enabled() -> bool:
    """Whether the C++ kernels may be used (``MINDIE_HOST_CPU_KERNELS=0`` turns them off)."""
    return os.environ.get("MINDIE_HOST_CPU_KERNELS", "1") != "0"


class CppExtension:
    """One C++ kernel file, built and loaded at most once per process.

    ``what`` names the kernel in the warning logged when it cannot be built; ``fast_math`` adds
    ``-ffast-math`` (for kernels that allow the compiler to reorder their float operations).
    ``fakes`` maps each torch operator the file registers (``"namespace::name"``) to its output-shape
    function, registered once the module loads, so compiled graphs can trace the operator;
    ``usable`` says whether a loaded module can run on this CPU (default: yes).
    """

    def __init__(self, name: str, source: str, what: str, fast_math: bool = False,
                 fakes: dict[str, Callable[..., Any]] | None = None,
                 usable: Callable[[Any], bool] | None = None) -> None:
        self.name = name
        self.source = Path(__file__).with_name(source)
        self.what = what
        self.fast_math = fast_math
        self.fakes = fakes or {}
        self.usable = usable
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
                    from torch.utils.cpp_extension import load

                    flags = ["-O3", "-march=native", "-fopenmp"] + (["-ffast-math"] if self.fast_math else [])
                    module = load(name=self.name, sources=[str(self.source)], extra_cflags=flags,
                                  extra_ldflags=["-fopenmp"], verbose=False)
                    if self.usable is None or self.usable(module):
                        for op, shape in self.fakes.items():
                            torch.library.register_fake(op)(shape)
                        self.module = module
                except Exception as exc:  # no compiler, no headers: torch's operators serve instead
                    log.warning("the CPU %s kernel could not be built (%s); it runs on torch's operators", self.what,
                                str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                self._tried = True
        return self.module
