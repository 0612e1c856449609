"""Server configs for the multimodal tests (the tiny models live in ``mindie_plugin_multimodal.testing``)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from mindie_plugin_multimodal.testing import data_url, image_png, make_tiny_llava, make_tiny_qwen2_vl

from mindie_host.testing import server_config

__all__ = ["data_url", "image_png", "make_tiny_llava", "make_tiny_qwen2_vl", "mm_config"]

# received images go to a throwaway cache, not the user's ~/.cache (a test may point it elsewhere)
os.environ.setdefault("LOCAL_CACHE_DIR", tempfile.mkdtemp(prefix="mindie-mm-cache-"))


def mm_config(model: Path, *, block: int = 16, prefix_cache: bool = False, plugins: dict[str, Any] | None = None,
              **schedule: Any) -> dict[str, Any]:
    """A server config with the multimodal plugin (and optionally prefix_cache) on."""
    types = "multimodal,prefix_cache" if prefix_cache else "multimodal"
    sched = {"cacheBlockSize": block, "maxBatchSize": 8, "maxPrefillBatchSize": 8, "maxIterTimes": 64,
             "enablePrefixCache": prefix_cache, **schedule}
    return server_config(model, model={"plugin_params": json.dumps({"plugin_type": types})}, schedule=sched,
                         deploy={"maxSeqLen": 512, "maxInputTokenLen": 400}, plugins=plugins or {})
