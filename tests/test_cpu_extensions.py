"""How the C++ CPU kernels are built (mindie_host/backends/cpu_extensions.py), with a real compiler.

A kernel build that was killed (a server stopped with SIGKILL while it compiled) leaves torch's
``lock`` file behind, and torch's loader waits on that file forever: every later server hung
"not ready". The build now runs under an ``flock`` that dies with its holder, clears such a file,
and gives up (torch's operators serve) rather than wait forever on a live build. The kernel here is
a tiny C-API module, so each build takes about a second.
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
