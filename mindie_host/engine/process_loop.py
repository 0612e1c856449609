"""The engine process's loop: drain the input socket, run one engine step, send that step's outputs.

The runtime starts the process and assembles the engine (:mod:`mindie_host.runtime.engine_main`);
this module is what the process then does until the front end says stop, or is gone. Messages
are those of :mod:`.ipc`. An exception inside a step ends only the requests that step was
serving (:meth:`~mindie_host.engine.core.LLMEngine.fail_active`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import zmq

from . import ipc
from .commands import run_command
from .core import LLMEngine
from .hook_relay import HookRelay
from .request import RequestOutput, failed_output

log = logging.getLogger("mindie_host.engine.process")


def serve_steps(
    llm: LLMEngine,
    plugins: HookRelay,
    plugin_metrics: Callable[[], dict[str, float]],
    pull: zmq.Socket[bytes],
    push: zmq.Socket[bytes],
    parent_pid: int,
) -> None:
    """Serve the front end until it sends ``SHUTDOWN`` or its process is gone (our parent pid changes).

    ``plugin_metrics()``: the metrics of the plugins that live in this process, sent with each step.
    """
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    while True:
        outputs: list[RequestOutput] = []
        if poller.poll(0 if llm.has_work() else 500):
            while True:
                try:
                    frames = pull.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                kind = frames[0].decode()
                if kind == ipc.ADD:
                    try:
                        request = ipc.decode_request(frames)
                    except Exception:  # its opaque fields did not unpickle here: that request fails, alone
                        log.exception("a request could not be decoded in the engine process")
                        outputs.append(
                            failed_output(
                                ipc.decode_plain_request(frames), "the request could not be handed to the engine"
                            )
                        )
                        continue
                    try:
                        llm.add_request(request)
                    except Exception as exc:
                        outputs.append(failed_output(request, exc))
                elif kind == ipc.ABORT:
                    out = llm.abort(ipc.decode(frames[1]))
                    if out is not None:
                        outputs.append(out)
                elif kind == ipc.COMMAND:
                    ident, (target, command, args) = ipc.decode_blob(frames)
                    result = run_command(plugins, target, command, args)
                    push.send_multipart(ipc.encode_blob(ipc.RESULT, ident, result))
                elif kind == ipc.SHUTDOWN:
                    return
        if os.getppid() != parent_pid:  # checked every step: an orphan must not go on computing for nobody
            log.error("the front end is gone; the engine process exits")
            return
        if llm.has_work():
            try:
                outputs.extend(llm.step())
            except Exception:
                log.exception("engine step failed; ending the requests it was serving")
                outputs.extend(llm.fail_active("generation failed in an engine step; the server log has the details"))
        if outputs or llm.stats_dirty:
            llm.stats_dirty = False
            # engine statistics, and apart the metrics of plugins that live here (a KV manager's hit rate)
            push.send_multipart(ipc.encode(ipc.OUTPUTS, outputs, llm.stats(), plugin_metrics()), copy=False)
