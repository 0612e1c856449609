"""mindie-host plugin ``ms``: serve Llama-family models with MindSpore (``backendType: "ms"``).

The hooks live in :mod:`mindie_plugin_backends_ms.plugin`; the model in
:mod:`~mindie_plugin_backends_ms.model`; the ``ModelBackend`` in
:mod:`~mindie_plugin_backends_ms.backend`.
"""

from __future__ import annotations

__all__ = ["BACKEND_TYPE"]

BACKEND_TYPE = "ms"
