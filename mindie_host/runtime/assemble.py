"""Assemble the engine in this process: tokenizer, backend (and its tensor-parallel ranks), engine.

:func:`check_and_enable` is what every process that serves does first (the config's refusals and
no-effect notes, the plugins it enables, their validation). :func:`assemble` then fills the host
with what the model needs: the backend of ``backendType`` from the ``mindie_host_model_backend``
hook, wrapped for tensor parallelism when the world has several ranks, loaded; the per-row linear
deltas a plugin provides; and the :class:`~mindie_host.engine.core.LLMEngine` over the KV pool
(:mod:`.engine_build`). It runs in the server's process (``engineProcess`` false) and in each
engine process (:mod:`.engine_main`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..backends.base import ModelBackend, ModelInfo
from ..backends.mock import MockBackend
from ..config import ModelConfig
from ..config.support import no_effect, unsupported
from ..host import Host
from ..models.default import default_model_path
from ..models.weights import resolve_model
from ..plugins import PluginError, PluginHost
from ..tokenizer import byte_level_tokenizer, load_tokenizer
from .backend import create_backend
from .engine_build import build_engine
from .parallel import parallel_backend

log = logging.getLogger("mindie_host")
STANDARD_MOCK = "StandardMock"


def check_and_enable(host: Host) -> None:
    """Refuse what the config asks that this server cannot do, note what has no effect, enable and validate
    the plugins it names (a :class:`~mindie_host.plugins.PluginError` lists every problem)."""
    cfg = host.config
    refused = unsupported(cfg)
    if refused:
        raise PluginError("config.json asks for what this server cannot do:\n  " + "\n  ".join(refused))
    for note in no_effect(cfg):
        log.warning("%s", note)
    host.plugins.enable_from_config(cfg)
    errors = host.plugins.validate(cfg)
    if errors:
        raise PluginError("plugin configuration rejected:\n  " + "\n  ".join(errors))


def model_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer of the served model (``modelWeightPath``, or the default model). StandardMock: the one at
    ``modelWeightPath`` when there is one there, else the built-in byte-level tokenizer (no model is read)."""
    if model.modelInstanceType == STANDARD_MOCK:
        return mock_tokenizer(model)
    source = resolve_model(model.modelWeightPath or str(default_model_path()))
    return load_tokenizer(source, trust_remote_code=model.trustRemoteCode)


def mock_tokenizer(model: ModelConfig) -> Any:
    """StandardMock's tokenizer: ``modelWeightPath``'s, or the built-in byte-level one."""
    if model.modelWeightPath:
        try:
            return load_tokenizer(resolve_model(model.modelWeightPath), trust_remote_code=model.trustRemoteCode)
        except Exception as exc:  # no tokenizer there: the placeholder answers need none of the model's
            log.warning("StandardMock: no tokenizer read from modelWeightPath %s (%s); using the built-in "
                        "byte-level tokenizer", model.modelWeightPath, exc)
    else:
        log.info("StandardMock: no modelWeightPath; using the built-in byte-level tokenizer")
    return byte_level_tokenizer()


def assemble(
    host: Host,
    progress: Callable[[int, int, str], None] | None = None,
    *,
    on_rank_lost: Callable[[], None] | None = None,
) -> None:
    """Load the tokenizer and the model, and build the engine, into ``host`` (``backend``, ``info``,
    ``tokenizer``, ``llm``; what must be released at shutdown goes to ``host.teardown``).

    ``progress``: the loading bar. ``on_rank_lost``: what a tensor-parallel instance does when a rank
    dies (the engine process exits, so its supervisor restarts every rank; by default later steps fail).
    """
    cfg, mc = host.config, host.model_config
    if mc.modelInstanceType == STANDARD_MOCK:
        host.tokenizer = model_tokenizer(mc)
        backend: ModelBackend = MockBackend(host.tokenizer, mc.modelName, cfg.deploy.maxSeqLen)
        log.info("modelInstanceType StandardMock: no model is loaded; every answer is the placeholder text")
    else:
        backend = create_backend(host.plugins, cfg)
    if progress is not None and hasattr(backend, "progress"):
        backend.progress = progress
    if mc.worldSize > 1 or cfg.BackendConfig.multiNodesInferEnabled:
        backend = parallel_backend(backend, cfg, host.plugins, on_rank_lost)
    host.backend = backend
    host.teardown.append(backend.shutdown)
    if mc.modelInstanceType != STANDARD_MOCK:  # (StandardMock's was read above: the backend needs it)
        host.tokenizer = model_tokenizer(mc)
    info = host.info = backend.load()
    if not info.eos_token_ids and host.tokenizer.eos_token_id is not None:
        info.eos_token_ids = [host.tokenizer.eos_token_id]
    attach_linear_deltas(host.plugins, backend, info, mc)
    host.llm = build_engine(host.plugins, cfg, backend, info, host.tokenizer)
    if host.llm.handoff is not None:
        host.teardown.insert(0, host.llm.handoff.connector.close)


def attach_linear_deltas(plugins: PluginHost, backend: ModelBackend, info: ModelInfo, model: ModelConfig) -> None:
    """Give the backend the per-row linear deltas a plugin provides (``mindie_host_linear_deltas``)."""
    impls = plugins.hook.mindie_host_linear_deltas.get_hookimpls()
    deltas = plugins.hook.mindie_host_linear_deltas(info=info)
    if deltas is not None and not backend.set_linear_deltas(deltas):
        owners = ", ".join(i.plugin_name for i in impls) or "a plugin"
        raise PluginError(
            f"{owners} provides per-row linear deltas (mindie_host_linear_deltas) but backendType "
            f"{model.backendType!r} cannot apply them (ModelBackend.set_linear_deltas returned False)"
        )
