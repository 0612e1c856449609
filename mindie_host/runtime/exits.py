"""The exit codes of the processes the runtime starts, in one place, and what the supervisor says of them."""

from __future__ import annotations

import logging
import os
from typing import NoReturn

from ..logs import describe_exit

#: an engine process that could not load the model (it sent the reason before exiting)
ENGINE_LOAD_FAILED = 3
#: an engine process one of whose tensor-parallel ranks died: the supervisor restarts every rank together
RANK_FAILED = 70
#: a rank process whose rank 0 is gone, or whose control channel broke
RANK_ORPHANED = 1


def exit_reason(exitcode: int | None) -> str:
    """``exit code 70: one of its tensor-parallel ranks died``, ``killed by SIGKILL``, ... for an engine process."""
    if exitcode == RANK_FAILED:
        return f"{describe_exit(exitcode)}: one of its tensor-parallel ranks died"
    return describe_exit(exitcode)


def exit_for_lost_rank() -> NoReturn:
    """End this engine process at once with :data:`RANK_FAILED` (its ranks are already stopped)."""
    logging.shutdown()
    os._exit(RANK_FAILED)
