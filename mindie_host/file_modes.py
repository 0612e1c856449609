"""Modes of the files an operator hands the server and MS, and writing files with safe modes.

``MINDIE_CHECK_INPUTFILES_PERMISSION`` (spec §6.3, §8.3, §10.1): unset, empty or anything but ``0``
checks the files a process reads at startup, and ``0`` skips the check. A file that fails it stops
startup with its path, its mode (or owner) and the fix:

* config files (``config.json``, ``ms_coordinator.json``, ``ms_controller.json``, the global rank
  table, ``http_client_ctl.json``): at most 0640 (no execute, no group write, nothing for others;
  the spec's "no more than 640");
* certificates, CA files, CRLs, private keys, key-password files and the master-key files: at most
  0600 (the spec's import modes: CA, certificate and CRL 600, private key 400);
* either kind: a regular file owned by the user running the process, or by root.

Symbolic links are followed, so a Kubernetes ConfigMap or Secret mount (whose files are links into a
``..data`` directory) is judged by the file it points to; set the volume's ``defaultMode`` (0440 for
configs, 0400 for secrets) to pass. Directories are not checked.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

__all__ = ["CONFIG_MODE", "ENV_CHECK", "SECRET_MODE", "FileModeError", "check_mode", "checks_enabled", "write_file"]

ENV_CHECK = "MINDIE_CHECK_INPUTFILES_PERMISSION"
CONFIG_MODE = 0o640
SECRET_MODE = 0o600
_MEANING = {
    CONFIG_MODE: "no execute, no group write, nothing for others",
    SECRET_MODE: "read and write for the owner only",
}


class FileModeError(ValueError):
    """A file's mode or owner fails the check; ``path``, ``got`` and ``allowed`` name it all."""

    def __init__(self, path: str | os.PathLike[str], got: str, allowed: str) -> None:
        self.path = os.fspath(path)
        self.got = got
        self.allowed = allowed
        super().__init__(f"{self.path}: got {got!r}; allowed {allowed}")  # as ConfigError says it

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.path, self.got, self.allowed))


def checks_enabled(env: Mapping[str, str] | None = None) -> bool:
    """False only when ``MINDIE_CHECK_INPUTFILES_PERMISSION`` is ``0``."""
    return (os.environ if env is None else env).get(ENV_CHECK, "").strip() != "0"


def check_mode(path: str | os.PathLike[str], max_mode: int, what: str, *, env: Mapping[str, str] | None = None) -> None:
    """Refuse ``path`` (a ``what``, e.g. "a config file") if its mode has a bit outside ``max_mode`` or a stranger owns it.

    A missing file passes: whether it must exist is its reader's rule, with its own message.
    """
    if not checks_enabled(env):
        return
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    skip = f"or set {ENV_CHECK}=0 to skip the check"
    if not stat.S_ISREG(st.st_mode):
        raise FileModeError(path, "not a regular file", f"{what} that is a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & ~max_mode:
        meaning = _MEANING.get(max_mode, "")
        raise FileModeError(
            path,
            f"mode {mode:04o}",
            f"{what} with mode at most {max_mode:04o}{f' ({meaning})' if meaning else ''}: run chmod {max_mode:o} "
            f"{os.fspath(path)}, {skip}",
        )
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        raise FileModeError(
            path,
            f"owner uid {st.st_uid}",
            f"{what} owned by the user running this process (uid {uid}) or by root: another user could change it; "
            f"chown it, {skip}",
        )


def write_file(
    path: str | os.PathLike[str], data: str | bytes, mode: int = CONFIG_MODE, *, replace: bool = True
) -> Path:
    """Write ``data`` to ``path`` with ``mode`` (whatever the umask), atomically: readers see the old or the new file.

    With ``replace`` False an existing file is an error (:class:`FileExistsError`).
    """
    target = Path(path)
    if not replace and target.exists():
        raise FileExistsError(f"{target} exists")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target
