"""Modes of the files an operator hands the server and MS, and writing files with safe modes."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_file"]


def write_file(path: str | os.PathLike[str], data: str | bytes, mode: int = 0o640, *, replace: bool = True) -> Path:
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
