"""The model backend of the config's ``backendType``, from the plugins that serve it."""

from __future__ import annotations

from ..backends.base import ModelBackend
from ..config import Config
from ..plugins import PluginError, PluginHost, install_hint


def create_backend(plugins: PluginHost, config: Config) -> ModelBackend:
    """The backend of ``backendType`` from the ``mindie_host_model_backend`` hook (not loaded yet)."""
    mc = config.model
    backend = plugins.hook.mindie_host_model_backend(backend_type=mc.backendType)
    if backend is None:
        known = ", ".join(plugins.backend_types()) or "none"
        raise PluginError(
            f"no installed plugin serves backendType {mc.backendType!r} (served: {known}); "
            f"{install_hint(mc.backendType)}"
        )
    return backend  # type: ignore[no-any-return]
