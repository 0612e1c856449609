"""Test and benchmark helpers: tiny random-weight LLaVA and Qwen2-VL checkpoints (transformers format), images.

The checkpoints use the default model's tokenizer with the image tokens added, are built with
transformers' own classes and saved with ``save_pretrained`` (weights, tokenizer, image processor),
so the plugin loads them exactly as it loads a downloaded model.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import torch


def _tokenizer(extra: list[str]) -> Any:
    from tokenizers import AddedToken

    from mindie_host.api import default_model_path, load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(default_model_path()))
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in extra], special_tokens=True)
    return tok


def _spread(lm_head: torch.nn.Module) -> None:
    with torch.no_grad():  # larger logits spread so greedy ties are vanishingly rare
        lm_head.weight.mul_(8.0)


def make_tiny_llava(directory: Path, image_size: int = 56, seed: int = 0, *, hidden_size: int = 64,
                    num_layers: int = 2, vision_hidden: int = 32, vision_layers: int = 2) -> Path:
    """A small LLaVA: CLIP tower (patch 14, ``image_size`` px), 2-layer MLP projector, Llama LM (2 layers, 64 wide)."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    if (directory / "config.json").exists():
        return directory
    tok = _tokenizer(["<image>"])
    image_id = tok.convert_tokens_to_ids("<image>")
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                              num_hidden_layers=vision_layers, num_attention_heads=2,
                              image_size=image_size, patch_size=14, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                       num_hidden_layers=num_layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                      image_seq_length=(image_size // 14) ** 2)
    model = LlavaForConditionalGeneration(cfg).eval()
    _spread(model.lm_head)
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
                       ).save_pretrained(str(directory))
    return directory


def make_tiny_qwen2_vl(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen2-VL (M-RoPE sections [2, 3, 3]) with a 2-block vision tower, merge 2, patch 14."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if (directory / "config.json").exists():
        return directory
    tok = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                      "<|video_pad|>")}
    torch.manual_seed(seed)
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, rope_theta=10000.0,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_chans=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    _spread(model.lm_head)
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(str(directory))
    return directory


def image_png(width: int, height: int, seed: int) -> bytes:
    """A random RGB PNG."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


