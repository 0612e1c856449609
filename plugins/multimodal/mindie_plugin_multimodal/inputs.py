"""From a request's media parts to placeholder tokens, 3-D positions and the per-request payload.

The protocol parsers put the model's image text (``<image>``, or Qwen2-VL's
``<|vision_start|><|image_pad|><|vision_end|>``) where each image part was; the
tokenizer turns it into one image token. :func:`expand` widens each image token into
as many placeholder tokens as the image has feature rows, exactly as transformers'
processors do, and records the spans. For M-RoPE models :func:`mrope_positions` gives
every prompt token its (temporal, height, width) position, as transformers'
``get_rope_index`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mindie_host.api import RequestError

from .models import ModelSpec


@dataclass
class ImageItem:
    """One preprocessed image of a request."""

    pixels: torch.Tensor  # LLaVA: [1, 3, H, W]; Qwen2-VL: [patches, C*T*P*P]
    grid: torch.Tensor | None  # Qwen2-VL: [[t, h, w]]
    num_tokens: int
    digest: bytes  # SHA-256 of the image bytes (the prefix-cache key of its tokens)
    start: int = 0  # index of its first placeholder token in the prompt
    embeds: torch.Tensor | None = None  # computed on the first step that needs them, kept for later chunks


@dataclass
class MultimodalPayload:
    """The plugin's ``EngineRequest.payload``: the request's images and, for M-RoPE, its positions."""

    images: list[ImageItem]
    prompt_len: int
    positions: torch.Tensor | None = None  # [3, prompt_len] (M-RoPE)
    delta: int = 0  # M-RoPE: position of generated token i is prompt_len + i + delta on every axis
    stats: dict[str, Any] = field(default_factory=dict)


class ImagePreprocessor:
    """transformers' image processor of the model (resize, normalize, patchify)."""

    def __init__(self, spec: ModelSpec) -> None:
        from transformers import AutoImageProcessor

        self.spec = spec
        self.processor = AutoImageProcessor.from_pretrained(str(spec.path))
        vision = spec.config.get("vision_config") or {}
        self.patch_size = int(vision.get("patch_size", 14))
        has_cls = str(vision.get("model_type", "clip_vision_model")).startswith("clip")
        select = spec.config.get("vision_feature_select_strategy", "default")
        self.extra_tokens = (1 if has_cls else 0) - (1 if select == "default" else 0)

    def __call__(self, image: Any, digest: bytes) -> ImageItem:
        out = self.processor(images=[image], return_tensors="pt")
        pixels = out["pixel_values"]
        if self.spec.family == "llava":
            h, w = pixels.shape[-2:]
            n = (h // self.patch_size) * (w // self.patch_size) + self.extra_tokens
            return ImageItem(pixels, None, int(n), digest)
        grid = out["image_grid_thw"]
        n = int(grid.prod()) // self.spec.spatial_merge_size**2
        return ImageItem(pixels, grid, n, digest)


def expand(ids: list[int], images: list[ImageItem], image_token_id: int, field: str) -> list[int]:
    """Replace the i-th image token of ``ids`` by ``images[i].num_tokens`` copies; sets each ``start``."""
    found = sum(1 for t in ids if t == image_token_id)
    if found != len(images):
        raise RequestError(
            f"{field} has {len(images)} image part(s) but its text holds {found} image placeholder(s); "
            "the image placeholder text may not appear in text parts",
            field=field,
        )
    out: list[int] = []
    it = iter(images)
    for t in ids:
        if t == image_token_id:
            item = next(it)
            item.start = len(out)
            out.extend([image_token_id] * item.num_tokens)
        else:
            out.append(t)
    return out


def mrope_positions(num_tokens: int, images: list[ImageItem], merge: int) -> tuple[torch.Tensor, int]:
    """``[3, num_tokens]`` M-RoPE positions of a prompt and its delta (next position - length)."""
    parts: list[torch.Tensor] = []
    cur = 0
    at = 0
    for item in images:
        if item.start > at:
            n = item.start - at
            parts.append(torch.arange(cur, cur + n).expand(3, -1))
            cur += n
        assert item.grid is not None
        t, h, w = (int(v) for v in item.grid[0])
        h, w = h // merge, w // merge
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + cur)
        cur += max(t, h, w)
        at = item.start + item.num_tokens
    if num_tokens > at:
        parts.append(torch.arange(cur, cur + num_tokens - at).expand(3, -1))
    pos = torch.cat(parts, dim=1)
    return pos, int(pos.max()) + 1 - num_tokens


def mrope_tables(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 section: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[n, rotary_dim]`` for multimodal RoPE (Qwen2-VL's ``mrope_section``), from the language
    model's own 1-D tables ``cos``, ``sin`` (``[positions, rotary_dim]``, each frequency twice).

    ``positions`` is ``[3, n]`` (temporal, height, width position of each token, on the tables' device); the
    rotary frequencies are split into ``section`` (summing to ``rotary_dim // 2``) and part ``i`` rotates by axis
    ``i % 3``. Equal axes give the 1-D tables.
    """
    parts_cos, parts_sin, lo = [], [], 0
    half = cos.shape[-1] // 2
    for i, width in enumerate(section):
        axis = positions[i % 3]
        parts_cos.append(cos[axis, lo : lo + width])
        parts_sin.append(sin[axis, lo : lo + width])
        lo += width
    if lo != half:
        raise ValueError(f"mrope_section {section} must sum to rotary_dim // 2 = {half}")
    c, s = torch.cat(parts_cos, dim=-1), torch.cat(parts_sin, dim=-1)
    return torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
