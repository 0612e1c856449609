"""The runtime: assembles and launches, above the host.

It builds what serves a host (the backend and its tensor-parallel ranks, the KV pool, the swap
space, the PD connector, the engine), starts the engine processes and supervises them, and holds
the entry points of the processes it starts (the engine core, the ranks, a rank-only node) and
their exit codes. Only the launch commands import it (the CLI, MindIE MS, the benchmark tool,
``mindie_host.testing``); everything below types against the host's protocol.

* :func:`load_host` (:mod:`.load`): make a :class:`~mindie_host.host.Host` ready to serve.
* :mod:`.assemble`, :mod:`.engine_build`, :mod:`.backend`, :mod:`.parallel`: the engine in this process.
* :mod:`.front_end`, :mod:`.engine_client`, :mod:`.instances`: engine processes, from the front end.
* :mod:`.engine_main`, :mod:`.rank_main`, :mod:`.rank_node`: the entry points of the processes started.
* :mod:`.exits`, :mod:`.plugin_transport`: exit codes; plugins sent to those processes.
"""

from __future__ import annotations

from .load import load_host

__all__ = ["load_host"]
