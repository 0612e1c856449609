"""Mixtures of experts: Qwen3-MoE (``qwen3_moe``) and Mixtral (``mixtral``).

Each sparse layer's MLP is a router (``mlp.gate``: one logit per expert) and ``E`` gated experts. A token's router
logits go through a softmax (in float32), its ``num_experts_per_tok`` best experts are kept, and their weights are
renormalized to sum to one (Mixtral always; Qwen3-MoE when ``norm_topk_prob``); the layer's output is the weighted
sum of those experts' outputs. Dispatch is batched: the step's (token, expert) pairs are sorted by expert, and each
expert that some token chose runs once over all of its tokens (a loop over experts, never over tokens), adding its
rows in expert order as transformers does, so float32 results are the same.

Qwen3-MoE is Qwen3's attention (per-head q/k norms); its ``mlp_only_layers`` (and the layers ``decoder_sparse_step``
skips) keep a dense MLP. Mixtral is Mistral's attention; its ``block_sparse_moe.experts.N.w1/w3/w2`` are read under
the canonical ``mlp.experts.N.gate_proj/up_proj/down_proj`` names.

Under tensor parallelism every rank holds every expert's share of the intermediate channels (like the dense MLP's
split), and the output is reduced over the ranks. With expert parallelism (``ModelConfig.expertParallel``) a rank holds
``E / worldSize`` whole experts instead (and reads no other expert's tensors); every rank has every token of the
step, so it runs its own experts' rows and the same all-reduce sums the ranks' partial outputs (what an all-to-all
dispatch and combine would give for this layout, without moving the tokens). The int8 weight schemes quantize the attention's products and the
dense layers' MLPs; the experts stay in the model's dtype (the log line says so).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from mindie_host.backend_api import (
    Architecture,
    DecoderLayer,
    GGUFInfo,
    ModelArch,
    ModelLoadError,
    Piece,
    Step,
    base_config,
    dense_attention,
    dense_mlp,
)

log = logging.getLogger(__name__)


class SoftmaxRouter:
    """Softmax over the router's logits (in float32), the ``top_k`` best kept, renormalized when ``renormalize``."""

    def __init__(self, weight: torch.Tensor, *, top_k: int, renormalize: bool, float_weights: bool) -> None:
        #: ``[E, H]``
        self.weight = weight
        self.top_k, self.renormalize = top_k, renormalize
        #: whether the weights multiply the experts' outputs in float32 (Mixtral) or in the model's dtype
        self.float_weights = float_weights

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``(weights, experts)``, ``[T, top_k]`` each."""
        probs = torch.softmax(F.linear(h, self.weight).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float_weights else weights.to(h.dtype)), experts


class SparseMoE:
    """Routed gated experts over a step's tokens (``h [T, H] -> [T, H]``): ``router(h)`` gives each token's experts
    and weights; each chosen expert runs once over all its tokens."""

    def __init__(self, *, router: Any, gate_up: torch.Tensor, down: torch.Tensor, first: int = 0) -> None:
        #: ``[E, 2I, H]`` (gate rows, then up rows) and ``[E, H, I]``: the experts ``first ..`` this rank holds
        self.router, self.gate_up, self.down = router, gate_up, down
        self.first, self.held = first, gate_up.shape[0]

    def __call__(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        weights, experts = self.router(h)
        top_k = experts.shape[-1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.first + self.held)
        start = int(counts[: self.first].sum())  # the (token, expert) pairs of the experts before this rank's
        mine = counts[self.first : self.first + self.held].tolist()
        order = order[start : start + sum(mine)]
        tokens = order // top_k
        slot_weights = weights.reshape(-1)[order]
        x = h.index_select(0, tokens)
        out = torch.zeros_like(h)
        start = 0
        for e, count in enumerate(mine):
            if not count:
                continue
            rows = slice(start, start + count)
            gate, up = F.linear(x[rows], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e]) * slot_weights[rows, None]
            out.index_add_(0, tokens[rows], y.to(out.dtype))
            start += count
        return out if step.tp is None else step.tp.all_reduce(out)


def stacked_experts(weights: Any, prefix: str, count: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The experts ``{prefix}{i}.{gate,up,down}_proj.weight`` the loader read (all ``count``, or under expert
    parallelism this rank's consecutive share) as ``(first, [E, 2I, H] gate/up, [E, H, I] down)``."""
    held = [i for i in range(count) if weights.has(f"{prefix}{i}.down_proj.weight")]
    if not held or held != list(range(held[0], held[0] + len(held))):
        raise ModelLoadError(f"the checkpoint's experts {prefix}N: expected consecutive ones of {count}, got {held}")
    gate_up = torch.stack(
        [torch.cat([weights.tensor(f"{prefix}{i}.gate_proj.weight"), weights.tensor(f"{prefix}{i}.up_proj.weight")])
         for i in held]
    )
    return held[0], gate_up, torch.stack([weights.tensor(f"{prefix}{i}.down_proj.weight") for i in held])


def expert_shard(name: str, experts: int, size: int, tp: Any) -> tuple[int, int, int] | None:
    """The slice rank ``tp`` reads of routed-expert tensor ``name`` (``...experts.N.{gate,up,down}_proj.weight``):
    expert ``N`` whole or not at all under expert parallelism, else its share of the ``size`` channels."""
    if tp.expert_parallel:
        return tp.expert_span(experts, int(name.split(".mlp.experts.", 1)[1].split(".", 1)[0]))
    lo, hi = tp.span(size)
    return (1, lo, hi) if name.endswith("down_proj.weight") else (0, lo, hi)


def expert_errors(family: str, experts: int, world_size: int, key: str) -> list[str]:
    """Why ``world_size`` ranks cannot hold ``experts`` routed experts in equal whole shares."""
    if experts % world_size == 0:
        return []
    allowed = [d for d in range(1, experts + 1) if experts % d == 0]
    return [f"{key}: got true with {world_size} ranks, which do not divide the {family} model's {experts} routed "
            f"experts evenly; allowed world sizes: {', '.join(map(str, allowed))} (or expertParallel false)"]


class MoEFamily(Architecture):
    """A decoder whose sparse layers route each token to ``num_experts_per_tok`` of ``E`` experts."""

    #: whether the kept experts' weights are renormalized when the config does not say (``norm_topk_prob``)
    renormalize_default: bool = True
    #: whether the routing weights stay float32 when they multiply the experts' outputs
    float_weights: bool = False

    def read_config(self, cfg: dict[str, Any], directory: Any = None) -> ModelArch:
        """The base reading plus the experts' counts and sizes and which layers are sparse."""
        arch = super().read_config(cfg, directory)
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")
        if not experts:
            raise ModelLoadError(f"config.json: a {self.name} checkpoint needs num_experts (or num_local_experts)")
        top_k = int(cfg.get("num_experts_per_tok", 2))
        if not 1 <= top_k <= int(experts):
            raise ModelLoadError(f"config.json: num_experts_per_tok {top_k} must be between 1 and {experts}")
        arch.options.update(
            num_experts=int(experts),
            top_k=top_k,
            renormalize=bool(cfg.get("norm_topk_prob", self.renormalize_default)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or arch.intermediate_size),
            sparse_layers=self.sparse_layers(cfg, arch.num_layers),
        )
        return arch

    def sparse_layers(self, cfg: dict[str, Any], layers: int) -> list[int]:
        """The layers whose MLP is a mixture of experts (all of them)."""
        return list(range(layers))

    def shard(self, name: str, arch: ModelArch, tp: Any) -> tuple[int, int, int] | None:
        """Each expert's intermediate channels split as the dense MLP's are; the router whole on every rank."""
        if ".mlp.experts." in name:
            return expert_shard(name, arch.options["num_experts"], arch.options["moe_intermediate_size"], tp)
        return tp.slice_of(name, arch)

    def parallel_errors(self, arch: ModelArch, world_size: int, key: str) -> list[str]:
        """The experts' intermediate channels must divide too."""
        size = arch.options["moe_intermediate_size"]
        if size % world_size:
            return [f"{key}: got {world_size}; it must divide the experts' {size} intermediate channels"]
        return []

    def expert_parallel_errors(self, arch: ModelArch, world_size: int, key: str) -> list[str]:
        """The experts must divide evenly over the ranks (each expert's channels stay whole)."""
        return expert_errors(self.name, arch.options["num_experts"], world_size, key)

    def delta_gaps(self, arch: ModelArch) -> dict[str, dict[int, str]]:
        """The sparse layers' MLP projections: a per-row delta would need each routed expert's own."""
        why = (f"the {self.name} family's MLP on this layer is a mixture of {arch.options['num_experts']} routed "
               "experts, which per-row deltas to gate/up/down projections do not reach")
        layers = {i: why for i in arch.options["sparse_layers"]}
        return {"gate_up": layers, "down": dict(layers)}

    def build_layer(self, index: int, arch: ModelArch, weights: Any) -> DecoderLayer:
        """The shared attention with :class:`SparseMoE` (or the dense MLP on a dense layer)."""
        p = f"model.layers.{index}."
        if index in arch.options["sparse_layers"]:
            first, gate_up, down = stacked_experts(weights, p + "mlp.experts.", arch.options["num_experts"])
            router = SoftmaxRouter(weights.tensor(p + "mlp.gate.weight"), top_k=arch.options["top_k"],
                                   renormalize=arch.options["renormalize"], float_weights=self.float_weights)
            mlp: Any = SparseMoE(router=router, gate_up=gate_up, down=down, first=first)
        else:
            mlp = dense_mlp(arch, index, weights)
        if index == 0 and weights.stored:
            log.info("the %s family's experts stay in the model's dtype (the int8 forms serve attention and dense "
                     "MLPs)", self.name)
        return DecoderLayer(
            attn=dense_attention(arch, index, weights),
            mlp=mlp,
            attn_in=weights.tensor(p + "input_layernorm.weight"),
            mlp_in=weights.tensor(p + "post_attention_layernorm.weight"),
            eps=arch.rms_norm_eps,
        )


class Qwen3MoeFamily(MoEFamily):
    """Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention, softmax routing renormalized when
    ``norm_topk_prob``, dense MLPs on ``mlp_only_layers`` and the layers ``decoder_sparse_step`` skips."""

    name = "qwen3_moe"
    model_types = ("qwen3_moe",)
    renormalize_default = False
    gguf_architectures = ("qwen3moe",)

    def gguf_config(self, info: GGUFInfo) -> dict[str, Any] | None:
        """llama.cpp's ``qwen3moe`` files: its runtime renormalizes the kept experts' weights (``norm_topk_prob``)
        and the layers without a router are dense."""
        cfg = base_config(info, "qwen3_moe")
        layers = cfg["num_hidden_layers"]
        cfg.update(norm_topk_prob=True,
                   mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in info.tensors])
        return cfg

    def sparse_layers(self, cfg: dict[str, Any], layers: int) -> list[int]:
        """transformers' rule: not in ``mlp_only_layers``, and ``(i + 1) % decoder_sparse_step == 0``."""
        dense = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step") or 1)
        return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]


#: Mixtral's names -> the canonical ones
MIXTRAL_NAMES = (
    (".block_sparse_moe.gate.", ".mlp.gate."),
    (".block_sparse_moe.experts.", ".mlp.experts."),
)
MIXTRAL_EXPERT = {".w1.weight": ".gate_proj.weight", ".w3.weight": ".up_proj.weight", ".w2.weight": ".down_proj.weight"}


class MixtralFamily(MoEFamily):
    """Mixtral (``MixtralForCausalLM``): Mistral's attention, every layer sparse, softmax routing always
    renormalized, the weights multiplied in float32."""

    name = "mixtral"
    model_types = ("mixtral",)
    float_weights = True
    gguf_architectures = ("llama",)
    gguf_rotary_permuted = True

    def gguf_config(self, info: GGUFInfo) -> dict[str, Any] | None:
        """A ``llama`` file with expert tensors (how llama.cpp's converter writes Mixtral); every layer sparse."""
        if not info.key("expert_count") or "blk.0.ffn_gate_inp.weight" not in info.tensors:
            return None
        return base_config(info, "mixtral")

    def tensor_pieces(self, name: str, arch: ModelArch) -> list[Piece]:
        """``block_sparse_moe`` read as ``mlp``, each expert's ``w1`` / ``w3`` / ``w2`` as gate / up / down."""
        for old, new in MIXTRAL_NAMES:
            if old in name:
                stem, rest = name.split(old, 1)
                renamed = stem + new + rest
                for suffix, canonical in MIXTRAL_EXPERT.items():
                    if renamed.endswith(suffix):
                        renamed = renamed[: -len(suffix)] + canonical
                return [Piece(renamed)]
        return [Piece(name)]


QWEN3_MOE = Qwen3MoeFamily()
MIXTRAL = MixtralFamily()
