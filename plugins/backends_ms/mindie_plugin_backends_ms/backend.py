"""``MsBackend``: the host's :class:`~mindie_host.api.ModelBackend` contract on MindSpore (CPU, PyNative)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from mindie_host.api import ModelBackend, ModelInfo, ModelInput, ModelSource
from mindie_host.backend_api import LlamaArch, ModelLoadError, Platform, count_tensors, iter_weights, load_arch

from .model import MsLlama, build_step
from .runtime import mindspore_module

log = logging.getLogger("mindie_host.backends.ms")

#: bytes per KV element: the MindSpore backend keeps weights and cache in float32
KV_ELEMENT_BYTES = 4


#: what to say when a checkpoint is not of the family this backend implements
OTHER_FAMILIES = ("backendType 'ms' implements the Llama family only (model_type llama, mistral, qwen2, smollm); "
                  "backendType 'torch' serves every installed family")


class MsBackend(ModelBackend):
    """Llama-family models in MindSpore over the host's paged KV cache (float32, CPU).

    Other families, and sliding-window attention, are refused at startup (:data:`OTHER_FAMILIES`).
    """

    backend_type = "ms"

    def __init__(self, source: ModelSource, *, name: str, num_threads: int | None = None,
                 progress: Any = None) -> None:
        self.source = source
        self.name = name
        self.num_threads = num_threads
        self.progress = progress
        self.arch: LlamaArch | None = None
        self.model: MsLlama | None = None
        self.block_size = 0

    def load(self) -> ModelInfo:
        try:
            arch = load_arch(self.source)  # the host's builtin family: the one MsLlama implements
        except ModelLoadError as exc:
            raise ModelLoadError(f"{exc}: {OTHER_FAMILIES}") from exc
        ms = mindspore_module(self.num_threads)
        self.arch = arch
        total = count_tensors(self.source)
        weights: dict[str, np.ndarray] = {}
        for i, (name, array) in enumerate(iter_weights(self.source, arch), start=1):
            weights[name] = array
            if self.progress is not None:
                self.progress(i, total, name)
        self.model = MsLlama(arch, weights, ms)
        log.info("loaded %s in MindSpore %s: %d layers, hidden %d, float32 on CPU",
                 self.name, ms.__version__, arch.num_layers, arch.hidden_size)
        return ModelInfo.from_arch(
            self.name, arch, dtype="float32", device="cpu", framework=f"mindspore {ms.__version__}"
        )

    def set_max_positions(self, max_positions: int) -> None:
        """Refuse a model whose sliding window would hide part of a sequence of ``max_positions`` tokens: this
        backend's attention sees every cached position."""
        assert self.arch is not None
        window = self.arch.sliding_window
        if window is not None and window < max_positions:
            raise ModelLoadError(f"the model's sliding_window is {window} but backendType 'ms' has no sliding-window "
                                 f"attention; lower ModelDeployConfig.maxSeqLen to {window} or less, or use "
                                 "backendType 'torch'")

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        assert self.arch is not None
        a = self.arch
        return 2 * a.num_layers * block_size * a.num_kv_heads * a.head_dim * KV_ELEMENT_BYTES

    def available_kv_memory(self, requested_gb: int) -> int:
        if requested_gb > 0:
            return requested_gb * (1 << 30)
        free, _total = Platform().memory_info()
        return int(free * 0.8)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        assert self.model is not None
        self.model.allocate(num_blocks * block_size)
        self.block_size = block_size

    def execute(self, batch: ModelInput) -> torch.Tensor:
        assert self.model is not None and self.arch is not None
        if any(i >= 0 for i in batch.row_variants):
            raise RuntimeError("backendType 'ms' does not apply LoRA adapters; use backendType 'torch' for multi_lora")
        step = build_step(batch, self.block_size, self.model.num_slots, self.arch.num_kv_heads)
        return torch.from_numpy(self.model.forward(step))

    def warmup(self) -> None:
        if self.model is None or not self.model.kv_caches:
            return
        self.execute(ModelInput(input_ids=[0, 1], positions=[0, 1], query_lens=[2], context_lens=[2],
                                block_tables=[[0]], logits_indices=[1], row_variants=[-1]))

    def shutdown(self) -> None:
        if self.model is not None:
            self.model.kv_caches = []
        self.model = None
