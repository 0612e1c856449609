"""The entry point of an engine-core process: assemble the engine from the config and plugins, then serve steps.

The front end's :class:`~mindie_host.runtime.engine_client.EngineProcessClient` starts it with
multiprocessing's ``spawn`` context. It assembles the engine directly (:func:`~.assemble.assemble`:
backend, KV pool, scheduler, the tensor-parallel ranks when ``worldSize`` > 1), reports ``READY``
with the model's facts (or ``FAILED`` with the error, and exits with
:data:`~.exits.ENGINE_LOAD_FAILED`), and hands over to the engine's loop
(:func:`~mindie_host.engine.process_loop.serve_steps`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal

import zmq

from ..config import Config
from ..engine import ipc
from ..engine.process_loop import serve_steps
from ..host import Host
from .assemble import assemble, check_and_enable
from .exits import ENGINE_LOAD_FAILED, exit_for_lost_rank
from .plugin_transport import PluginSpecs, register_specs

log = logging.getLogger("mindie_host.engine.process")


def engine_core_main(
    config: Config,
    specs: PluginSpecs,
    in_addr: str,
    out_addr: str,
    parent_pid: int,
    threads: int | None = None,
    show_progress: bool = False,
) -> None:
    """Entry point of the engine process: load the model as the server would, then serve steps."""
    from ..config.hot_update import watch_config
    from ..logs import LoadProgress, setup_logging

    # Ctrl-C, and a SIGTERM sent to the whole process group (`kill -TERM -- -PGID`, a terminal's hang-up), reach
    # this process too: it keeps serving while the front end drains, and stops when the front end says so (or dies)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # this process starts the tensor-parallel ranks (worldSize > 1); it stops them itself, and they exit
    # when it disappears (runtime/rank_main.py), so multiprocessing's rule against children of daemons is lifted
    multiprocessing.current_process().daemon = False
    setup_logging(config.LogConfig, to_stderr=True)
    watch_config(config)  # LogConfig.logLevel's hot update, in this process too
    if threads:  # one of several instances: its share of the cores
        import torch

        torch.set_num_threads(threads)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    pull.connect(in_addr)
    push.connect(out_addr)
    try:
        host = Host(config)  # what the plugins' lifecycle hooks see here: the backend, the model's facts
        register_specs(host.plugins, specs)
        check_and_enable(host)
        # a dead tensor-parallel rank ends this process at once: the supervisor restarts every rank together
        assemble(host, LoadProgress() if show_progress else None, on_rank_lost=exit_for_lost_rank)
        host.plugins.hook.mindie_host_startup()
    except BaseException as exc:
        log.exception("engine process failed to load")
        try:  # the error itself, so startup fails with the same exception as with the engine in-process
            blob = pickle.dumps(exc)
        except Exception:  # the front end falls back to the message (as it does when unpickling fails)
            blob = b""
        push.send_multipart([*ipc.encode(ipc.FAILED, f"{type(exc).__name__}: {exc}"), blob])
        push.close(linger=2000)
        ctx.term()
        raise SystemExit(ENGINE_LOAD_FAILED) from None
    push.send_multipart([ipc.READY.encode(), pickle.dumps((host.info, host.stats()))])
    assert host.llm is not None
    try:
        serve_steps(host.llm, host.plugins, host.plugin_metrics, pull, push, parent_pid)
    finally:
        host.shutdown()
        push.close(linger=1000)
        pull.close(linger=0)
        ctx.term()
        log.info("engine process stopped")
        logging.shutdown()
        os._exit(0)  # no waiting on helper threads that libraries leave running: the work is done
