"""The ``torch`` backend for multimodal checkpoints: the host's LM plus transformers' vision modules.

The language model runs in the host's :class:`~mindie_host.backend_api.DecoderModel` over the paged
KV cache, as for any text model. Each step, the rows of image placeholder tokens are
replaced by image features (``DecoderModel.forward(embeds=...)``): every image of the step
whose features are not yet known is encoded in one vision forward (images of many
requests together), its features are kept on the request's payload, and a prompt chunk
(splitfuse) takes exactly the feature rows of the placeholder tokens it holds. For M-RoPE
models every token of such a step gets its 3-D rotary from the payload's positions; decode
steps only shift the positions by the request's delta and keep the fast decode path.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from mindie_host.api import ModelInfo, ModelInput
from mindie_host.backend_api import DecoderModel, TorchBackend

from .inputs import ImageItem, MultimodalPayload, mrope_tables
from .models import ModelSpec, VisionEncoder, read_spec, read_weights, text_arch

log = logging.getLogger("mindie_plugin_multimodal")


class MultimodalTorchBackend(TorchBackend):
    """:class:`~mindie_host.api.TorchBackend` for LLaVA- and Qwen2-VL-style directories."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spec: ModelSpec | None = None
        self.vision: VisionEncoder | None = None
        self.counters = {"images_encoded": 0, "vision_batches": 0, "vision_seconds": 0.0}

    def load(self) -> ModelInfo:
        spec = read_spec(self.source.path)
        arch = text_arch(spec)
        lm, vision = read_weights(self.source.path)
        self.spec, self.arch = spec, arch
        self.model = DecoderModel(arch, lm, self.platform, self.dtype, {})
        self.vision = VisionEncoder(spec, vision, self.platform.device(), self.dtype)
        log.info("loaded %s (%s): LM %d layers, hidden %d; vision tower %s", self.name, spec.family,
                 arch.num_layers, arch.hidden_size, type(self.vision.tower).__name__)
        info = ModelInfo.from_arch(self.name, arch, dtype=str(self.dtype).removeprefix("torch."),
                                   device=self.platform.name, multimodal=spec.family)
        return info

    # -- one step ------------------------------------------------------------------------
    def execute(self, batch: ModelInput) -> torch.Tensor:
        if not batch.payloads:
            return super().execute(batch)
        assert self.model is not None and self.spec is not None
        prefill = [s for s in batch.payloads if s.start < s.payload.prompt_len]
        if not prefill:
            if self.spec.mrope_section is None:
                return super().execute(batch)
            return super().execute(self._shift_positions(batch))
        embeds = self._embeds(prefill)
        rope = self._mrope(batch) if self.spec.mrope_section is not None else None
        meta = self.platform.prepare_step(self.model.build_metadata(batch, self.block_size), batch, self.block_size)
        return self.model.forward(batch, meta, self.kv_caches, self.step_deltas(batch), embeds=embeds, rope=rope)

    def _shift_positions(self, batch: ModelInput) -> ModelInput:
        """Decode of M-RoPE sequences: every axis of a generated token sits at ``position + delta``."""
        positions = list(batch.positions)
        for s in batch.payloads or []:
            delta = s.payload.delta
            for r in range(s.flat_start, s.flat_start + s.length):
                positions[r] += delta
        return dataclasses.replace(batch, positions=positions)

    def _embeds(self, slices: list[Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Flat rows of this step's placeholder tokens and their feature rows (encoding what is missing)."""
        wanted: list[tuple[Any, ImageItem]] = []
        for s in slices:
            payload: MultimodalPayload = s.payload
            for item in payload.images:
                if item.start < s.start + s.length and item.start + item.num_tokens > s.start:
                    wanted.append((s, item))
        todo = [item for _, item in wanted if item.embeds is None]
        if todo:
            assert self.vision is not None
            t0 = time.perf_counter()
            feats = self.vision.encode([i.pixels for i in todo], [i.grid for i in todo])
            for item, f in zip(todo, feats):
                if f.shape[0] != item.num_tokens:
                    raise RuntimeError(f"the vision tower gave {f.shape[0]} rows for an image of {item.num_tokens} "
                                       "placeholder tokens")
                item.embeds = f
            self.counters["images_encoded"] += len(todo)
            self.counters["vision_batches"] += 1
            self.counters["vision_seconds"] += time.perf_counter() - t0
        if not wanted:
            return None
        rows: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for s, item in wanted:
            lo = max(item.start, s.start)
            hi = min(item.start + item.num_tokens, s.start + s.length)
            rows.append(torch.arange(s.flat_start + lo - s.start, s.flat_start + hi - s.start))
            assert item.embeds is not None
            values.append(item.embeds[lo - item.start : hi - item.start])
        device = self.platform.device()
        return torch.cat(rows).to(device), torch.cat(values).to(device)

    def _mrope(self, batch: ModelInput) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of every token of the step: 3-D positions for multimodal sequences, ``[p, p, p]`` otherwise."""
        assert self.model is not None and self.spec is not None and self.spec.mrope_section is not None
        pos = torch.tensor(batch.positions, dtype=torch.long).expand(3, -1).clone()
        for s in batch.payloads or []:
            payload: MultimodalPayload = s.payload
            end = s.start + s.length
            in_prompt = min(end, payload.prompt_len) - s.start
            if in_prompt > 0 and payload.positions is not None:
                pos[:, s.flat_start : s.flat_start + in_prompt] = payload.positions[:, s.start : s.start + in_prompt]
            if end > payload.prompt_len:
                first = s.flat_start + max(in_prompt, 0)
                pos[:, first : s.flat_start + s.length] += payload.delta
        return mrope_tables(self.model.cos, self.model.sin, pos.to(self.model.cos.device), self.spec.mrope_section)
