"""The two model families: LLaVA-style (CLIP/SigLIP tower + projector) and Qwen2-VL-style.

A :class:`ModelSpec` is read from the model directory's ``config.json`` alone (no weights):
the family, the language model's architecture, the image placeholder token and the text
that stands for an image in a prompt. A :class:`VisionEncoder` holds transformers' own
vision modules with the checkpoint's weights and turns preprocessed images into rows of
the language model's embedding space, many images (of many requests) per call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mindie_host.backend_api import LlamaArch

FAMILIES = {"llava": "llava", "qwen2_vl": "qwen2_vl"}


class MultimodalModelError(RuntimeError):
    """The model directory is not a multimodal model this plugin serves."""


@dataclass
class ModelSpec:
    """What the plugin needs to know about a multimodal checkpoint, from ``config.json``."""

    family: str  # "llava" | "qwen2_vl"
    path: Path
    config: dict[str, Any]
    text: dict[str, Any]
    image_token_id: int
    vision_start_id: int | None = None
    vision_end_id: int | None = None
    mrope_section: list[int] | None = None
    spatial_merge_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def lm_model_type(self) -> str:
        return "qwen2" if self.family == "qwen2_vl" else str(self.text.get("model_type", "llama"))


def _rope(text: dict[str, Any]) -> tuple[float, list[int] | None]:
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = float(text.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = params.get("rope_type") or params.get("type") or "default"
    section = params.get("mrope_section")
    if kind not in ("default", "mrope") and not section:
        raise MultimodalModelError(f"rope type {kind!r} of the language model is not supported (allowed: default, mrope)")
    return theta, [int(s) for s in section] if section else None


def _text_config(path: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config with transformers' defaults filled in.

    Published checkpoints often write only the keys that differ from the defaults
    (llava-1.5's ``text_config`` has no ``hidden_size``), and older Qwen2-VL configs keep the
    LM keys at the top level; transformers' config classes know both.
    """
    from transformers import AutoConfig

    try:
        text = AutoConfig.from_pretrained(str(path)).get_text_config().to_dict()
    except Exception as exc:  # a config transformers cannot read
        raise MultimodalModelError(f"{path / 'config.json'}: transformers cannot read it: {exc}") from exc
    for key, value in (cfg.get("text_config") or {}).items():
        text.setdefault(key, value)
    return text


def read_spec(path: Path) -> ModelSpec:
    """The :class:`ModelSpec` of the transformers-format model at ``path``."""
    cfg = json.loads((path / "config.json").read_text())
    family = FAMILIES.get(str(cfg.get("model_type")))
    if family is None:
        raise MultimodalModelError(
            f"{path / 'config.json'}: model_type {cfg.get('model_type')!r} is not a multimodal model this plugin "
            f"serves (allowed: {sorted(FAMILIES)})"
        )
    text = _text_config(path, cfg)
    _, section = _rope(text if ("rope_parameters" in text or "rope_scaling" in text) else cfg)
    if family == "llava":
        token = cfg.get("image_token_index", cfg.get("image_token_id"))
        return ModelSpec(family, path, cfg, text, int(token))
    vision = cfg.get("vision_config") or {}
    return ModelSpec(
        family, path, cfg, text, int(cfg["image_token_id"]),
        vision_start_id=int(cfg["vision_start_token_id"]), vision_end_id=int(cfg["vision_end_token_id"]),
        mrope_section=section or [16, 24, 24], spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
    )


def text_arch(spec: ModelSpec) -> LlamaArch:
    """The language model's :class:`~mindie_host.api.LlamaArch` (served by the host's torch model)."""
    t, cfg = spec.text, spec.config
    heads = int(t["num_attention_heads"])
    hidden = int(t["hidden_size"])
    theta, _ = _rope(t if ("rope_parameters" in t or "rope_scaling" in t) else cfg)
    eos = t.get("eos_token_id", cfg.get("eos_token_id"))
    gen = spec.path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])] if eos is not None else []
    return LlamaArch(
        model_type=spec.lm_model_type,
        hidden_size=hidden,
        num_layers=int(t["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(t.get("num_key_value_heads") or heads),
        head_dim=int(t.get("head_dim") or hidden // heads),
        intermediate_size=int(t["intermediate_size"]),
        vocab_size=int(t["vocab_size"]),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(t.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
        attention_bias=spec.family == "qwen2_vl" or bool(t.get("attention_bias", False)),
        bos_token_id=t.get("bos_token_id", cfg.get("bos_token_id")),
        eos_token_ids=[e for e in eos_ids if 0 <= e < int(t["vocab_size"])],
    )


#: checkpoint prefixes of the language model (legacy and transformers-5 layouts) -> the host's names
LM_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
#: checkpoint prefixes of the vision part -> ``tower.`` (the vision model) / ``projector.``
VISION_PREFIXES = (
    ("model.vision_tower.", "tower."),
    ("vision_tower.", "tower."),
    ("model.multi_modal_projector.", "projector."),
    ("multi_modal_projector.", "projector."),
    ("model.visual.", "tower."),
    ("visual.", "tower."),
)


def split_name(name: str) -> tuple[str, str]:
    """``("lm" | "vision", host name)`` for a checkpoint tensor name."""
    for old, new in VISION_PREFIXES:
        if name.startswith(old):
            return "vision", new + name[len(old):]
    for old, new in LM_PREFIXES:
        if name.startswith(old):
            return "lm", new + name[len(old):]
    return "lm", name  # Qwen2-VL's legacy layout: model.layers..., lm_head.weight


def read_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The language-model tensors (host names) and the vision tensors of the safetensors files at ``path``."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    files = (sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.exists()
             else sorted(path.glob("*.safetensors")))
    if not files:
        raise MultimodalModelError(f"no .safetensors files in {str(path)!r}")
    lm: dict[str, torch.Tensor] = {}
    vision: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                part, name = split_name(key)
                (vision if part == "vision" else lm)[name] = st.get_tensor(key).float()
    return lm, vision


class VisionEncoder:
    """Image features in the language model's embedding space, through transformers' vision modules."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
        from transformers import AutoConfig

        self.spec = spec
        self.device = device
        self.dtype = dtype
        hf_config = AutoConfig.from_pretrained(str(spec.path))
        self.hf_config = hf_config
        tower_w = {k[len("tower."):]: v for k, v in weights.items() if k.startswith("tower.")}
        if spec.family == "llava":
            from transformers import AutoModel
            from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

            self.tower = AutoModel.from_config(hf_config.vision_config)
            self.projector: Any = LlavaMultiModalProjector(hf_config)
            self.projector.load_state_dict(
                {k[len("projector."):]: v for k, v in weights.items() if k.startswith("projector.")}, strict=True
            )
            self.projector.to(device=device, dtype=dtype).eval()
            self.feature_layer = hf_config.vision_feature_layer
            self.select = hf_config.vision_feature_select_strategy
        else:
            from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

            self.tower = Qwen2VisionTransformerPretrainedModel._from_config(hf_config.vision_config)
            self.projector = None
        missing, unexpected = self.tower.load_state_dict(tower_w, strict=False)
        missing = [m for m in missing if "position_ids" not in m]  # a non-persistent buffer in some versions
        if missing or unexpected:
            raise MultimodalModelError(
                f"vision weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        self.tower.to(device=device, dtype=dtype).eval()

    @torch.inference_mode()
    def encode(self, pixels: list[torch.Tensor], grids: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """One forward of the vision tower over every image given: ``[num_tokens_i, hidden]`` per image."""
        if self.spec.family == "llava":
            batch = torch.cat([p.to(self.device, self.dtype) for p in pixels])  # each [1, 3, H, W]
            out = self.tower(batch, output_hidden_states=True, return_dict=True)
            layers = self.feature_layer if isinstance(self.feature_layer, list) else [self.feature_layer]
            hs = [out.hidden_states[i] for i in layers]
            if self.select == "default":
                hs = [h[:, 1:] for h in hs]
            feats = self.projector(torch.cat(hs, dim=-1))
            return list(feats.unbind(0))
        flat = torch.cat([p.to(self.device, self.dtype) for p in pixels])
        grid = torch.cat([g for g in grids if g is not None]).to(self.device)
        out = self.tower(flat, grid_thw=grid)
        merged = out.pooler_output if hasattr(out, "pooler_output") else out
        sizes = (grid.prod(-1) // self.spec.spatial_merge_size**2).tolist()
        return list(merged.split(sizes))
