"""How the C++ CPU kernels are built (mindie_host/backends/cpu_extensions.py), with a real compiler.

A kernel build that was killed (a server stopped with SIGKILL while it compiled) leaves torch's
``lock`` file behind, and torch's loader waits on that file forever: every later server hung
"not ready". The build now runs under an ``flock`` that dies with its holder, clears such a file,
and gives up (torch's operators serve) rather than wait forever on a live build. The extension here
is a tiny C-API module, so each build takes about a second. Each instruction-set variant of the
kernels is its own library with its own flags (never ``-march=native``), built once and cached
under a name that changes with its sources; and on an aarch64 host (mocked, with Debian's cross compiler where it
is installed) only the portable variant is built, for armv8-a with no x86 flag, the torch binding compiles for
aarch64 too, and the kernels answer right under qemu-aarch64 where that is installed.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any

import pytest

from mindie_host.backends import cpu_extensions, cpu_profile
from mindie_host.backends.cpu_extensions import CppExtension, build_root, exclusive_build, headers_digest
from mindie_host.backends.cpu_profile import CpuFeatures

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

TINY = """#include <Python.h>
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, "42"}, {nullptr, nullptr, 0, nullptr}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "NAME", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_NAME(void) { return PyModule_Create(&module); }
"""


def tiny_extension(tmp_path: Path, name: str) -> CppExtension:
    source = tmp_path / "src" / f"{name}.cpp"
    source.parent.mkdir(exist_ok=True)
    source.write_text(TINY.replace("NAME", name))
    extension = CppExtension(name, "unused.cpp", "tiny")
    extension.source = source
    return extension


def get_within(extension: CppExtension, seconds: float) -> object:
    """``extension.get()``, failing the test (instead of hanging it) when it takes longer than ``seconds``."""
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(extension.get()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"the build still waited after {seconds} s"
    return result[0]


def hold_flock(build_dir: Path) -> subprocess.Popen[bytes]:
    """Another process that holds ``build_dir``'s build lock until it is killed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    code = ("import fcntl, sys, time\n"
            f"h = open({str(build_dir) + '.flock'!r}, 'a+'); fcntl.flock(h, fcntl.LOCK_EX)\n"
            "print('held', flush=True); time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
    return holder


def test_a_lock_file_left_by_a_killed_build_is_cleared_and_the_kernel_builds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    extension = tiny_extension(tmp_path, "mindie_test_stale_lock")
    stale = build_root() / extension.name / "lock"
    stale.parent.mkdir(parents=True)
    stale.touch()  # what torch's loader leaves when its process is killed mid-build
    with caplog.at_level(logging.WARNING, "mindie_host.backends"):
        module = get_within(extension, 300)
    assert module is not None and module.answer() == 42  # type: ignore[attr-defined]
    assert not stale.exists()
    assert any("left by a kernel build that was killed" in r.getMessage() for r in caplog.records)


def test_a_live_build_elsewhere_is_waited_for_and_a_killed_one_releases_its_lock(tmp_path: Path) -> None:
    build_dir = tmp_path / "cache" / "kernel"
    holder = hold_flock(build_dir)
    try:
        with pytest.raises(TimeoutError, match="held the build of kernel"):
            with exclusive_build(build_dir, wait_s=0.5):
                pass
    finally:
        holder.kill()  # SIGKILL: nothing of the holder's runs, and the kernel drops its flock
        holder.wait()
    (build_dir / "lock").touch()
    with exclusive_build(build_dir, wait_s=10):
        assert not (build_dir / "lock").exists()


def test_a_build_held_past_the_wait_falls_back_to_torch_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_extensions, "BUILD_WAIT_S", 0.5)
    extension = tiny_extension(tmp_path, "mindie_test_held_build")
    holder = hold_flock(build_root() / extension.name)
    try:
        with caplog.at_level(logging.WARNING, "mindie_host.backends"):
            assert get_within(extension, 60) is None
    finally:
        holder.kill()
        holder.wait()
    assert any("could not be built" in r.getMessage() and "held the build" in r.getMessage() for r in caplog.records)


def test_kernels_built_side_by_side_all_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))  # what load_cpu_kernels does on a cold cache
    extensions = [tiny_extension(tmp_path, f"mindie_test_side_by_side_{i}") for i in range(3)]
    results: dict[int, object] = {}
    workers = [threading.Thread(target=lambda i=i, e=e: results.__setitem__(i, e.get()), daemon=True)
               for i, e in enumerate(extensions)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(300)
    assert sorted(results) == [0, 1, 2]
    assert all(module is not None and module.answer() == 42 for module in results.values())  # type: ignore[attr-defined]


def test_a_changed_header_changes_the_build_flags(tmp_path: Path) -> None:
    (tmp_path / "vector_math.h").write_text("inline int f() { return 1; }\n")
    before = headers_digest(tmp_path)
    assert headers_digest(tmp_path) == before
    (tmp_path / "vector_math.h").write_text("inline int f() { return 2; }\n")
    assert headers_digest(tmp_path) != before


def test_the_shipped_kernels_headers_are_part_of_the_digest() -> None:
    kernels = Path(cpu_extensions.__file__).parent
    assert sorted(p.name for p in kernels.glob("*.h")), "the kernels' headers ship beside them"
    assert len(headers_digest(kernels)) == 16


def test_each_variant_has_its_own_flags_and_none_is_native() -> None:
    assert cpu_extensions.variant_flags("portable", "x86_64")[0] == "-march=x86-64"
    assert cpu_extensions.variant_flags("avx2", "x86_64")[0] == "-march=x86-64-v3"
    assert cpu_extensions.variant_flags("avx512", "x86_64")[:2] == ("-march=x86-64-v4", "-mavx512bf16")
    assert cpu_extensions.variant_flags("portable", "aarch64") == ("-march=armv8-a",)
    assert cpu_extensions.variant_flags("portable", "riscv64") == ()
    assert cpu_extensions.variant_flags("neon", "arm64") == ("-march=armv8-a", "-DMINDIE_HOST_NEON=1")
    with pytest.raises(RuntimeError, match="for x86-64, not aarch64"):
        cpu_extensions.variant_flags("avx2", "aarch64")
    with pytest.raises(RuntimeError, match="for aarch64, not x86_64"):
        cpu_extensions.variant_flags("neon", "x86_64")
    flags = [f for isa in ("portable", "avx2", "avx512") for f in cpu_extensions.variant_flags(isa, "x86_64")]
    assert not any("native" in f for f in flags + list(cpu_extensions.COMMON_FLAGS))


def test_a_variant_library_is_built_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    path = cpu_extensions.build_variant("portable")
    assert path.name.startswith("mindie_host_kernels_portable-") and path.parent == build_root() / "kernels"
    built = path.stat().st_mtime_ns
    assert cpu_extensions.build_variant("portable") == path and path.stat().st_mtime_ns == built  # from the cache
    assert [p.name for p in path.parent.iterdir() if p.suffix != ".flock"] == [path.name]  # no work files left
    assert cpu_extensions.variant_library("avx2") != cpu_extensions.variant_library("portable")


#: Debian's cross compiler for aarch64 (apt-get install g++-aarch64-linux-gnu)
AARCH64_CXX = "aarch64-linux-gnu-g++"

#: flags a compile for an x86 instruction set would carry; none may reach an aarch64 build
X86_FLAGS = ("-march=x86", "-mtune=generic", "-mavx", "-mfma", "-mf16c", "-mbmi", "-msse", "-mmovbe", "-mlzcnt")


def binding_syntax_check(shims: Path) -> subprocess.Popen[str]:
    """binding.cpp, the one source that includes torch's headers, syntax-checked for aarch64 as torch's loader would
    compile it (C++20, torch's and Python's include folders: the x86 wheel's headers, architecture-neutral).

    Debian's own Python (CI's) has a multiarch ``pyconfig.h`` that includes ``<aarch64-linux-gnu/python3.X/
    pyconfig.h>`` for an aarch64 target, which only Debian's arm64 Python package installs: a shim in ``shims``
    stands in with this machine's (both LP64 Linux; a syntax check, nothing is linked or run)."""
    from torch.utils.cpp_extension import include_paths

    python_include = Path(sysconfig.get_paths()["include"])
    version = python_include.name  # python3.X
    native = Path("/usr/include/x86_64-linux-gnu") / version / "pyconfig.h"
    if native.exists():
        shim = shims / "aarch64-linux-gnu" / version / "pyconfig.h"
        shim.parent.mkdir(parents=True, exist_ok=True)
        shim.write_text(f'#include "{native}"\n')
    includes = [*include_paths(), str(python_include), str(shims)]
    return subprocess.Popen([AARCH64_CXX, "-std=c++20", "-fsyntax-only", "-march=armv8-a",
                             "-DTORCH_EXTENSION_NAME=mindie_host_cpu_binding", "-DTORCH_API_INCLUDE_EXTENSION_H",
                             "-DMINDIE_HOST_HEADERS=0", *(f for d in includes for f in ("-isystem", d)),
                             str(Path(cpu_extensions.__file__).with_name(cpu_extensions.BINDING))],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.skipif(shutil.which(AARCH64_CXX) is None,
                    reason=f"no aarch64 cross compiler ({AARCH64_CXX}: apt-get install g++-aarch64-linux-gnu)")
def test_an_aarch64_host_builds_only_the_portable_kernels_for_armv8_and_they_answer_right(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An aarch64 host, its machine and /proc/cpuinfo features mocked and Debian's cross compiler as its ``CXX``:
    the profile is portable with one log line saying why, and the one library the selection builds is the portable
    variant for armv8-a (one compiler call per kernel source, no x86 flag, an aarch64 ELF). binding.cpp is
    syntax-checked for aarch64 against torch's headers meanwhile; tests/cpu_kernels_check.cpp, linked to the library,
    runs under qemu-aarch64 where it is installed (each kernel against a double-precision loop, and a low-bit row's
    bits alone and among others)."""
    binding = binding_syntax_check(tmp_path / "shims")
    monkeypatch.setattr(cpu_profile, "features", lambda: CpuFeatures("aarch64", frozenset({"fp", "asimd", "bf16"})))
    monkeypatch.delenv(cpu_profile.ENV, raising=False)
    monkeypatch.setenv("CXX", AARCH64_CXX)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    commands: list[list[str]] = []
    run = subprocess.run

    def recorded(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        return run(command, **kwargs)

    monkeypatch.setattr(subprocess, "run", recorded)
    cpu_profile._profile.cache_clear()
    try:
        with caplog.at_level(logging.INFO, "mindie_host.backends"):
            chosen = cpu_profile.log_profile()
            library = cpu_extensions.build_variant(chosen.isa)
    finally:
        cpu_profile._profile.cache_clear()
    monkeypatch.setattr(subprocess, "run", run)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU profile")]
    assert lines == ["CPU profile portable (detected on aarch64: the avx2 and avx512 kernels are x86-64 only, neon "
                     "is opt-in (MINDIE_HOST_CPU_ISA=neon)): portable kernels, float32 prompt rows and low-bit "
                     "activations (no native bf16), int8 products in floating point"]
    assert (chosen.isa, chosen.native_bf16, chosen.int8_products) == ("portable", False, None)
    assert [isa for isa in cpu_profile.ISAS if cpu_profile.features().runs(isa)] == ["portable", "neon"]  # no x86 one
    builds = [c for c in commands if Path(c[0]).name == AARCH64_CXX and "--version" not in c]
    assert sorted(Path(c[c.index("-c") + 1]).name for c in builds if "-c" in c) == sorted(cpu_extensions.SOURCES)
    assert all("-march=armv8-a" in c for c in builds if "-c" in c) and len(builds) == len(cpu_extensions.SOURCES) + 1
    assert not [f for c in builds for f in c if f.startswith(X86_FLAGS)]
    header = library.read_bytes()[:20]
    assert library.name.startswith("mindie_host_kernels_portable-")
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64
    check = tmp_path / "check"
    flags = cpu_extensions.variant_flags("portable", "aarch64")
    subprocess.run([AARCH64_CXX, *cpu_extensions.COMMON_FLAGS, *flags, str(Path(__file__).with_name(
        "cpu_kernels_check.cpp")), str(library), "-o", str(check)], check=True)
    out, _ = binding.communicate(timeout=300)
    assert binding.returncode == 0, out[-3000:]
    if shutil.which("qemu-aarch64") is None:
        pytest.skip("built for aarch64; no qemu-aarch64 to run the check (apt-get install qemu-user)")
    run_check(["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", str(check)], "portable")


def run_check(command: list[str], variant: str) -> list[str]:
    """Run a build of tests/cpu_kernels_check.cpp: every kernel passed; returns its lines of output bits."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and f"variant {variant}" in result.stdout and "FAIL" not in result.stdout, (
        result.stdout + result.stderr)
    return [line for line in result.stdout.splitlines() if line.startswith("bits ")]


@pytest.mark.skipif(shutil.which(AARCH64_CXX) is None or shutil.which("qemu-aarch64") is None,
                    reason=f"needs {AARCH64_CXX} and qemu-aarch64 (apt-get install g++-aarch64-linux-gnu qemu-user)")
@pytest.mark.skipif(not cpu_profile.read_features().runs("avx2"), reason="this CPU does not run the avx2 kernels")
def test_the_opt_in_neon_variant_answers_right_under_qemu_with_the_avx2_variants_bits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``MINDIE_HOST_CPU_ISA=neon`` on an aarch64 host (mocked) builds the neon variant; under qemu-aarch64 each
    kernel agrees with a double-precision loop, and the low-bit product (hand-written NEON: fused multiply-adds in
    the avx2 variant's order) gives, on the same inputs, the bits the avx2 variant gives natively here."""
    avx2_library = cpu_extensions.build_variant("avx2")  # this machine's own (cached once any kernel test built it)
    monkeypatch.setattr(cpu_profile, "features", lambda: CpuFeatures("aarch64", frozenset({"fp", "asimd"})))
    monkeypatch.setenv(cpu_profile.ENV, "neon")
    monkeypatch.setenv("CXX", AARCH64_CXX)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    cpu_profile._profile.cache_clear()
    try:
        chosen = cpu_profile.profile()
        assert (chosen.isa, chosen.forced, chosen.native_bf16, chosen.int8_products) == ("neon", True, False, None)
        library = cpu_extensions.build_variant(chosen.isa)
    finally:
        cpu_profile._profile.cache_clear()
    check = tmp_path / "check_neon"
    source = str(Path(__file__).with_name("cpu_kernels_check.cpp"))
    subprocess.run([AARCH64_CXX, *cpu_extensions.COMMON_FLAGS, *cpu_extensions.variant_flags("neon", "aarch64"),
                    source, str(library), "-o", str(check)], check=True)
    neon = run_check(["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", str(check)], "neon")
    native = tmp_path / "check_avx2"
    subprocess.run(["c++", *cpu_extensions.COMMON_FLAGS, *cpu_extensions.variant_flags("avx2", "x86_64"), source,
                    str(avx2_library), "-o", str(native)], check=True)
    avx2 = run_check([str(native)], "avx2")
    assert len(neon) == 3 and neon == avx2, (neon, avx2)


def test_the_kernels_parallel_loops_use_every_torch_thread() -> None:
    """The binding runs the kernels' parallel loops through at::parallel_for, whose parallel region is an OpenMP
    pragma: built without ``-fopenmp`` every loop ran on the calling thread, and decode steps lost the second core
    (40-60% slower on 2 cores, found by bench/peers.py)."""
    import torch

    binding = cpu_extensions._BINDING.get()
    if binding is None:
        pytest.skip("the kernels' binding could not be built here")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert binding.threads_used(64) == 2
        torch.set_num_threads(1)
        assert binding.threads_used(64) == 1
    finally:
        torch.set_num_threads(threads)
