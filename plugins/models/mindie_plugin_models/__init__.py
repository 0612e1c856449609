"""mindie-plugin-models: the model families beyond Llama, one module each, for the host's torch backend.

Each family is an :class:`~mindie_host.backend_api.Architecture`: how its ``config.json`` reads, how its tensors
are named, what its layers are made of. The host's shared layers (paged-KV attention, RMSNorm, rotary embeddings,
the gated MLP) serve them all; a family states only what makes it different.

The plugin is enabled without a config entry when the served checkpoint's ``model_type`` is one of its families'
(the ``mindie_host.architectures`` entry points in ``pyproject.toml``); listing ``models`` in ``plugin_params``
also works.
"""

from __future__ import annotations

from mindie_host.api import BackendContext, hookimpl
from mindie_host.backend_api import Architecture

from .deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from .gemma3 import GEMMA3
from .glm import GLM, GLM4
from .moe import MIXTRAL, QWEN3_MOE
from .phi3 import PHI3
from .qwen3 import QWEN3

#: every family of this plugin
FAMILIES: tuple[Architecture, ...] = (QWEN3, GLM, GLM4, GEMMA3, PHI3, QWEN3_MOE, MIXTRAL, DEEPSEEK_V3, DEEPSEEK_V2)


@hookimpl
def mindie_host_model_architectures(ctx: BackendContext) -> list[Architecture]:
    """Qwen3, GLM (``glm`` and ``glm4``), Gemma 3 (text), Phi-3, Qwen3-MoE, Mixtral and DeepSeek-V3 / V2."""
    return list(FAMILIES)
