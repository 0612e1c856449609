"""The C++ CPU kernels of the torch backends: built with the machine's compiler on first use, one variant per CPU.

The kernels (``layer_ops.cpp``, ``attention.cpp``, ``lowbit_matmul.cpp`` beside this module, with the ``.h``
files they include) include no torch header. Each instruction-set variant of
:data:`~mindie_host.backends.cpu_profile.ISAS` is a small shared library built from them with its own
flags (:data:`VARIANT_FLAGS`, never ``-march=native``), one compiler process per source, in parallel:
seconds. ``binding.cpp`` is the one torch extension (built through ``torch.utils.cpp_extension``, the
same for every variant): it checks tensors, allocates outputs and calls a variant's table. A process
builds only the variant its CPU profile names (:mod:`~mindie_host.backends.cpu_profile`), beside the
binding, and loads them from the cache after that: ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``), under ``mindie_host/py<X.Y>-torch<version>/``; a variant's file name
carries a digest of its sources, flags and compiler, so any change rebuilds it.

Without a compiler, or with ``MINDIE_HOST_CPU_KERNELS=0``, :func:`kernels` returns None and every caller
stays on torch's operators (logged once). The backend self-checks each kernel against torch on its
model's shapes before using it (:mod:`~mindie_host.backends.cpu_selfcheck`) and turns off any that
disagrees (:func:`turn_off`).

Processes that start together (the ranks of a tensor-parallel group, a test run's servers) build
one at a time under an ``flock`` of the build's folder, which the kernel releases when its holder
exits however it exits. torch's own ``lock`` file is not released by a builder that is killed, and
every later build would wait on it forever; under the ``flock`` no other builder can be running, so
such a file is stale and is removed (with a warning). A build that cannot get the ``flock`` within
:data:`BUILD_WAIT_S` gives up, and torch's operators serve.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from . import cpu_profile

try:
    import fcntl
except ImportError:  # not POSIX: builds are not serialised across processes, as torch's own are not
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("mindie_host.backends")

#: how long a process waits for another one's build of the same kernel before it serves on torch's operators
BUILD_WAIT_S = 600.0

HERE = Path(__file__).parent

#: the kernel sources of every variant library, and the torch extension that calls them
SOURCES = ("layer_ops.cpp", "attention.cpp", "lowbit_matmul.cpp", "lowbit_q8_rows.cpp", "kernel_table.cpp")
BINDING = "binding.cpp"

#: compiler flags of every variant: -ffp-contract=off keeps each product and sum rounded as the source writes it
#: (the rotation gives torch's bits; a fused multiply-add appears only where the source asks for one)
COMMON_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off", "-fno-math-errno")

#: each variant's instruction-set flags, by architecture ("*": any other)
VARIANT_FLAGS: dict[str, dict[str, tuple[str, ...]]] = {
    "portable": {"x86_64": ("-march=x86-64", "-mtune=generic"), "aarch64": ("-march=armv8-a",), "*": ()},
    "avx2": {"x86_64": ("-march=x86-64-v3", "-mtune=generic")},
    "avx512": {"x86_64": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=generic")},
    "neon": {"aarch64": ("-march=armv8-a", "-DMINDIE_HOST_NEON=1")},
}

#: the kernels the self-check can turn off one by one
KERNELS = ("layer_ops", "decode_attention", "prompt_attention", "lowbit_matmul", "silu_mul",
           "lowbit_q8_rows")


def enabled() -> bool:
    """Whether the C++ kernels may be used (``MINDIE_HOST_CPU_KERNELS=0`` turns them off)."""
    return os.environ.get("MINDIE_HOST_CPU_KERNELS", "1") != "0"


def build_root() -> Path:
    """The folder that holds this interpreter's and this torch's kernel builds."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / "mindie_host" / f"py{sys.version_info.major}.{sys.version_info.minor}-torch{torch.__version__}"


def headers_digest(folder: Path) -> str:
    """A digest of the ``.h`` files beside the kernels: torch rebuilds the binding when a source or a flag changes,
    not a header, so the digest goes in as a macro and a changed header is a changed flag."""
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
    """One C++ torch extension file, built and loaded at most once per process.

    ``what`` names it in the warning logged when it cannot be built; ``fakes`` maps each torch operator the
    file registers (``"namespace::name"``) to its output-shape function, registered once the module loads, so
    compiled graphs can trace the operator; ``extra_flags`` are more compiler flags.
    """

    def __init__(self, name: str, source: str, what: str,
                 fakes: dict[str, Callable[..., Any]] | None = None, extra_flags: tuple[str, ...] = ()) -> None:
        self.name = name
        self.source = HERE / source
        self.what = what
        self.fakes = fakes or {}
        self.extra_flags = list(extra_flags)
        #: the loaded module, once :meth:`get` has built it (read it while tracing: it never builds)
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
                    for op, shape in self.fakes.items():
                        torch.library.register_fake(op)(shape)
                    self.module = module
                except Exception as exc:  # no compiler, no headers, a build held too long: torch's operators serve
                    log.warning("the CPU %s could not be built (%s); torch's operators serve", self.what,
                                first_line(exc))
                self._tried = True
        return self.module

    def _build(self) -> Any:
        from torch.utils.cpp_extension import load

        flags = ["-O2", f"-DMINDIE_HOST_HEADERS={headers_digest(self.source.parent)}", *openmp_flags(),
                 *self.extra_flags]
        build_dir = build_root() / self.name
        with exclusive_build(build_dir):
            return load(name=self.name, sources=[str(self.source)], extra_cflags=flags, build_directory=str(build_dir),
                        extra_ldflags=list(openmp_flags()), verbose=False)


def openmp_flags() -> tuple[str, ...]:
    """``-fopenmp`` when torch's own thread pool is OpenMP's (its Linux builds), else nothing.

    at::parallel_for is a header template whose parallel region is an OpenMP pragma: compiled without
    ``-fopenmp`` it runs every range on the calling thread, and the kernels lose the second core (issue 36's
    speed regression: decode steps 40-60% slower on 2 cores)."""
    if sys.platform == "darwin" or "OpenMP" not in torch.__config__.parallel_info().split("parallel backend:")[-1][:40]:
        return ()
    return ("-fopenmp",)


def first_line(exc: BaseException) -> str:
    """An exception's first line (its type when it has no message)."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def compiler() -> str | None:
    """The C++ compiler variants are built with (``CXX``, else ``c++``), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


def variant_flags(isa: str, machine: str | None = None) -> tuple[str, ...]:
    """The compiler flags of variant ``isa`` on ``machine`` (this one by default)."""
    machine = cpu_profile.CpuFeatures(machine, frozenset()).arch if machine else cpu_profile.features().arch
    by_arch = VARIANT_FLAGS[isa]
    if machine in by_arch:
        return by_arch[machine]
    if "*" in by_arch:
        return by_arch["*"]
    raise RuntimeError(f"the {isa} kernels are for {cpu_profile.ARCH[isa].replace('_', '-')}, not {machine}")


def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout.split("\n")[0]


def variant_library(isa: str, cxx: str | None = None) -> Path:
    """Where variant ``isa``'s library is (or will be) built: its name carries a digest of the sources, headers,
    flags and compiler."""
    cxx = cxx or compiler() or "c++"
    digest = hashlib.sha256()
    for name in (*SOURCES, *sorted(p.name for p in HERE.glob("*.h"))):
        digest.update(name.encode() + b"\0" + (HERE / name).read_bytes())
    digest.update(repr((COMMON_FLAGS, variant_flags(isa), _compiler_version(cxx))).encode())
    return build_root() / "kernels" / f"mindie_host_kernels_{isa}-{digest.hexdigest()[:16]}.so"


def compile_variant(isa: str, out: Path, cxx: str, flags: tuple[str, ...] | None = None, link: bool = True) -> None:
    """Compile the kernel sources as variant ``isa`` (one process per source, side by side) and link them into
    ``out``; ``flags`` replace the variant's own (a cross compiler's), ``link=False`` only compiles."""
    work = out.with_name(out.name + f".{os.getpid()}.tmp")
    work.mkdir(parents=True, exist_ok=True)
    flags = variant_flags(isa) if flags is None else flags
    try:
        def one(source: str) -> Path:
            obj = work / (Path(source).stem + ".o")
            run = subprocess.run([cxx, *COMMON_FLAGS, *flags, "-c", str(HERE / source), "-o", str(obj)],
                                 capture_output=True, text=True, check=False)
            if run.returncode != 0:
                raise RuntimeError(f"{cxx} failed on {source}: {run.stderr.strip()[-2000:]}")
            return obj

        with ThreadPoolExecutor(max_workers=len(SOURCES)) as pool:
            objects = list(pool.map(one, SOURCES))
        if not link:
            return
        linked = work / out.name
        run = subprocess.run([cxx, "-shared", "-o", str(linked), *map(str, objects)], capture_output=True, text=True,
                             check=False)
        if run.returncode != 0:
            raise RuntimeError(f"{cxx} could not link the {isa} kernels: {run.stderr.strip()[-2000:]}")
        os.replace(linked, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_variant(isa: str) -> Path:
    """Variant ``isa``'s library, built unless the cache has it (under the build folder's ``flock``)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    out = variant_library(isa, cxx)
    if out.exists():
        return out
    with exclusive_build(out.parent):
        if not out.exists():
            start = time.monotonic()
            compile_variant(isa, out, cxx)
            log.info("built the %s CPU kernels in %.1f s", isa, time.monotonic() - start)
    return out


def _lowbit_matmul_shape(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, n: int,
                         group_size: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], n), dtype=torch.float32)


def _decode_attention_shape(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return q.new_empty(q.shape, dtype=torch.float32)


#: the torch extension every variant is called through
_BINDING = CppExtension("mindie_host_cpu_binding", BINDING, "kernels' binding to torch",
                        fakes={"mindie_host_cpu::lowbit_matmul": _lowbit_matmul_shape,
                               "mindie_host_cpu::decode_attention": _decode_attention_shape})


class _Loaded:
    """The variants loaded in this process (their libraries stay open for the process's life) and the active one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.variants: dict[str, Any] = {}  # isa -> the binding's Kernels object
        self.libraries: dict[str, ctypes.CDLL] = {}
        self.failed: dict[str, str] = {}  # isa -> why it could not be built or loaded
        #: the kernels the layers use (None: torch's operators) and the ones the self-check turned off
        self.active: Any = None
        self.off: frozenset[str] = frozenset()


_STATE = _Loaded()


def load_variant(isa: str) -> Any:
    """Variant ``isa``'s kernels (the binding's ``Kernels``), built and loaded once per process; None when it cannot
    be (logged once). The variant must be one this CPU executes (:meth:`CpuFeatures.runs`)."""
    if isa in _STATE.variants or isa in _STATE.failed:
        return _STATE.variants.get(isa)
    with _STATE.lock:
        if isa in _STATE.variants or isa in _STATE.failed:
            return _STATE.variants.get(isa)
        if not cpu_profile.features().runs(isa):
            raise RuntimeError(f"this CPU cannot execute the {isa} kernels")
        try:
            with ThreadPoolExecutor(max_workers=2) as pool:  # the binding and the variant build side by side
                binding_future = pool.submit(_BINDING.get)
                path = pool.submit(build_variant, isa).result()
                binding = binding_future.result()
            if binding is None:
                raise RuntimeError("the binding to torch could not be built")
            library, kernels = _open(path, binding)
            if kernels.variant != isa:
                raise RuntimeError(f"{path.name} holds the {kernels.variant} kernels")
        except Exception as exc:  # no compiler, a failed build: torch's operators serve
            _STATE.failed[isa] = first_line(exc)
            log.warning("the %s CPU kernels could not be built (%s); torch's operators serve", isa, first_line(exc))
            return None
        _STATE.libraries[isa] = library
        _STATE.variants[isa] = kernels
        return kernels


def _open(path: Path, binding: Any) -> tuple[ctypes.CDLL, Any]:
    library = ctypes.CDLL(str(path))
    library.mindie_host_kernels.restype = ctypes.c_void_p
    return library, binding.Kernels(library.mindie_host_kernels())


def load_library(path: Path) -> Any:
    """The kernels of a variant library at ``path`` (another build of the sources, e.g. an earlier commit's), loaded
    beside this process's own and kept open; activate them with :func:`using`. For benchmarks that alternate two
    builds in one process (bench/verify_step.py ``--compare``)."""
    binding = _BINDING.get()
    if binding is None:
        raise RuntimeError("the binding to torch could not be built")
    library, kernels = _open(path, binding)
    _STATE.libraries[str(path)] = library
    return kernels


def activate(kernels: Any, off: frozenset[str] = frozenset()) -> None:
    """Make ``kernels`` (a loaded variant, or None for torch's operators) the ones the layers and the registered
    operators use, with the kernels named in ``off`` turned off."""
    _STATE.active = kernels
    _STATE.off = frozenset(off)
    if _BINDING.module is not None:  # the registered operators call a loaded variant only (not a test's stand-in)
        _BINDING.module.activate(kernels if isinstance(kernels, _BINDING.module.Kernels) else None)


def kernels() -> Any:
    """The active kernels, building and activating this profile's variant the first time (or when the profile
    changed); None when kernels are off or cannot be built. The kernels the self-check turned off stay off."""
    if not enabled():
        return None
    isa = cpu_profile.profile().isa
    current = _STATE.active
    if current is not None and current.variant == isa:
        return current
    loaded = load_variant(isa)
    if loaded is not None:
        activate(loaded, _STATE.off if current is None else frozenset())
    return loaded


def load_variants(isas: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Every variant of ``isas`` (default: each one this CPU executes) built side by side and loaded: isa -> its
    kernels, or None where it could not be built. For tests and benchmarks that compare variants."""
    isas = isas or tuple(isa for isa in cpu_profile.ISAS if cpu_profile.features().runs(isa))
    with ThreadPoolExecutor(max_workers=len(isas) + 1) as pool:
        pool.submit(_BINDING.get)
        for future in [pool.submit(build_variant, isa) for isa in isas]:
            with contextlib.suppress(Exception):  # load_variant logs the failure
                future.result()
    return {isa: load_variant(isa) for isa in isas}


@contextlib.contextmanager
def using(kernels: Any, off: frozenset[str] = frozenset()) -> Iterator[Any]:
    """Activate ``kernels`` (with ``off`` turned off) for the ``with`` block, then restore what was active."""
    before = _STATE.active, _STATE.off
    activate(kernels, off)
    try:
        yield kernels
    finally:
        activate(*before)


def active(kernel: str) -> Any:
    """The active kernels when ``kernel`` (one of :data:`KERNELS`) may run on them, else None; never builds."""
    current = _STATE.active
    return None if current is None or kernel in _STATE.off or not enabled() else current


def turn_off(names: set[str] | frozenset[str]) -> None:
    """Turn the named kernels off for the rest of the process (torch's operators serve them)."""
    _STATE.off = _STATE.off | frozenset(names)


def turned_off() -> frozenset[str]:
    """The kernels turned off since the active variant was loaded."""
    return _STATE.off
