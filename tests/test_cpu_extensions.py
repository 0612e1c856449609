"""How the C++ CPU kernels are built (mindie_host/backends/cpu_extensions.py), with a real compiler.

A kernel build that was killed (a server stopped with SIGKILL while it compiled) leaves torch's
``lock`` file behind, and torch's loader waits on that file forever: every later server hung
"not ready". The build now runs under an ``flock`` that dies with its holder, clears such a file,
and gives up (torch's operators serve) rather than wait forever on a live build. The extension here
is a tiny C-API module, so each build takes about a second. Each instruction-set variant of the
kernels is its own library with its own flags (never ``-march=native``), built once and cached
under a name that changes with its sources; and the kernels compile for aarch64 (the portable
path, no x86 intrinsic outside its ``#if``) where Debian's cross compiler is installed.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mindie_host.backends import cpu_extensions
from mindie_host.backends.cpu_extensions import CppExtension, build_root, exclusive_build, headers_digest

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
    with pytest.raises(RuntimeError, match="for x86-64, not aarch64"):
        cpu_extensions.variant_flags("avx2", "aarch64")
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


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None,
                    reason="no aarch64 cross compiler (apt-get install g++-aarch64-linux-gnu)")
def test_the_kernels_build_and_answer_right_on_aarch64(tmp_path: Path) -> None:
    """The portable variant as the server builds it for aarch64 (a shared library), and tests/cpu_kernels_check.cpp
    built with the same sources and flags; where qemu-aarch64 is installed the check runs (each kernel against a
    double-precision loop, and a low-bit row's bits alone and among others)."""
    cross, flags = "aarch64-linux-gnu-g++", cpu_extensions.variant_flags("portable", "aarch64")
    library = tmp_path / "kernels_aarch64.so"
    cpu_extensions.compile_variant("portable", library, cross, flags)
    header = library.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64
    here = Path(cpu_extensions.__file__).parent
    check = tmp_path / "check"
    sources = [str(here / source) for source in cpu_extensions.SOURCES]
    subprocess.run([cross, *cpu_extensions.COMMON_FLAGS, *flags, "-static", *sources,
                    str(Path(__file__).with_name("cpu_kernels_check.cpp")), "-o", str(check)], check=True)
    if shutil.which("qemu-aarch64") is None:
        pytest.skip("built for aarch64; no qemu-aarch64 to run the check (apt-get install qemu-user)")
    run = subprocess.run(["qemu-aarch64", str(check)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "variant portable" in run.stdout and "FAIL" not in run.stdout, run.stdout
