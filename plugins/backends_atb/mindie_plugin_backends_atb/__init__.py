"""mindie-host plugin ``atb``: the host's torch Llama model on Ascend NPUs (``backendType: "atb"``).

:mod:`~mindie_plugin_backends_atb.platform` holds :class:`NpuPlatform` (device
``npu``, HCCL, memory through ``torch.npu``, torch_npu fused operators);
:mod:`~mindie_plugin_backends_atb.backend` the ``ModelBackend``;
:mod:`~mindie_plugin_backends_atb.plugin` the hooks.
"""

from __future__ import annotations

__all__ = ["BACKEND_TYPE"]

BACKEND_TYPE = "atb"
