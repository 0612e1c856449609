"""DeepSeek-V3 (and R1, which is V3's shape) and DeepSeek-V2 (V2-Lite): multi-head latent attention over a latent KV cache, and a mixture of
shared plus routed experts with sigmoid, group-limited routing.

Attention (MLA): each token's keys and values are compressed into one latent of ``kv_lora_rank`` values (normed),
plus one rotary key part of ``qk_rope_head_dim`` values shared by the heads. The cache holds exactly these two per
token and layer (:attr:`LatentAttention.kv_spec`: one "head" of the latent beside one of the rotary key), not the
expanded per-head keys and values. Each step expands the cached latents of its sequences through ``kv_b_proj``
into per-head keys (``qk_nope_head_dim``, then the shared rotary part) and values (``v_head_dim``), as transformers
does, and attends with torch's attention. Queries come from ``q_proj``, or through the ``q_a_proj`` /
``q_a_layernorm`` / ``q_b_proj`` low-rank path when ``q_lora_rank`` is set. The rotary parts use interleaved pairs
when ``rope_interleave`` (V3's default); yarn scaling multiplies the softmax scale by ``mscale(factor,
mscale_all_dim) ** 2``.

Experts: the first ``first_k_dense_replace`` layers keep a dense MLP; the others route each token through the sigmoid
of the router's logits, choose among the ``topk_group`` best of ``n_group`` expert groups (a group scored by its two
best experts, with ``e_score_correction_bias`` added for the choice only), weight the chosen experts by their sigmoid
scores (renormalized when ``norm_topk_prob``) times ``routed_scaling_factor``, and add ``n_shared_experts`` always-on
experts (one gated MLP of ``moe_intermediate_size * n_shared_experts`` channels).

A checkpoint's multi-token-prediction layers (``num_nextn_predict_layers``, stored as layers past
``num_hidden_layers``) are skipped with a log line. FP8 block-scaled checkpoints (V3's and R1's own) are dequantized
as they are read (:func:`mindie_host.models.weights.fp8_block_size`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F

from mindie_host.backend_api import (
    Architecture,
    DecoderLayer,
    GatedMLP,
    GGUFInfo,
    KVSpec,
    ModelArch,
    ModelLoadError,
    Piece,
    Step,
    base_config,
    dense_mlp,
)

from .moe import SparseMoE, expert_errors, expert_shard, stacked_experts

log = logging.getLogger(__name__)


def halves_from_interleaved(x: torch.Tensor) -> torch.Tensor:
    """The last dimension's interleaved pairs ``(0, 1), (2, 3) ...`` reordered as halves (even values, then odd)."""
    *lead, d = x.shape
    return x.reshape(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)


class LatentAttention:
    """Multi-head latent attention of one layer over a cache of latents (see the module's docstring)."""

    def __init__(
        self,
        *,
        layer: int,
        q_proj: Any,
        q_a: Any,
        q_a_norm: torch.Tensor | None,
        kv_a: Any,
        kv_a_norm: torch.Tensor,
        kv_b: torch.Tensor,
        o_proj: Any,
        num_heads: int,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        rank: int,
        scale: float,
        eps: float,
        interleave: bool,
    ) -> None:
        self.layer = layer
        self.q_proj, self.q_a, self.q_a_norm = q_proj, q_a, q_a_norm
        self.kv_a, self.kv_a_norm, self.kv_b, self.o_proj = kv_a, kv_a_norm, kv_b, o_proj
        self.num_heads, self.nope_dim, self.rope_dim, self.v_dim, self.rank = num_heads, nope_dim, rope_dim, v_dim, rank
        self.scale, self.eps, self.interleave = scale, eps, interleave
        #: the model's own RoPE tables
        self.rope_key = ""

    @property
    def kv_spec(self) -> KVSpec:
        """One latent (``kv_lora_rank`` values) beside one shared rotary key (``qk_rope_head_dim``) per token."""
        return KVSpec(1, self.rank, self.rope_dim)

    def __call__(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        plat, n, heads = step.platform, h.shape[0], self.num_heads
        if self.q_a is None:
            q = plat.linear(h, self.q_proj)
        else:
            q = plat.linear(plat.rms_norm(plat.linear(h, self.q_a), self.q_a_norm, self.eps), self.q_proj)
        q_pass, q_rot = q.view(n, heads, self.nope_dim + self.rope_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = plat.linear(h, self.kv_a).split([self.rank, self.rope_dim], dim=-1)
        latent = plat.rms_norm(latent.contiguous(), self.kv_a_norm, self.eps)
        k_rot = k_rot.reshape(n, 1, self.rope_dim)
        if self.interleave:
            q_rot, k_rot = halves_from_interleaved(q_rot), halves_from_interleaved(k_rot)
        cos, sin = step.rope[self.rope_key]
        q_rot, k_rot = plat.rotary(q_rot.contiguous(), k_rot.contiguous(), cos, sin)
        k_cache, v_cache = step.kv_caches[self.layer]
        plat.write_kv(k_cache, v_cache, latent.view(n, 1, self.rank), k_rot, step.meta)
        q = torch.cat([q_pass, q_rot], dim=-1)
        out = self._attend(plat, q, k_cache, v_cache, step)
        o = plat.linear(out.reshape(n, heads * self.v_dim), self.o_proj)
        return o if step.tp is None else step.tp.all_reduce(o)

    def _attend(self, plat: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                step: Step) -> torch.Tensor:
        """Each sequence's new queries over its expanded cached context (causal), sequence by sequence."""
        from mindie_host.backend_api import gather_slots

        meta = step.meta
        if not meta.query_lens:
            raise ModelLoadError("latent attention needs eager step metadata (set ModelConfig.compile false)")
        heads, dt = self.num_heads, plat.attention_dtype(k_cache.dtype)
        out = q.new_empty(q.shape[0], heads, self.v_dim)
        start = 0
        for i, (nq, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            slots = meta.gather_index[i, :ctx]
            latent = gather_slots(k_cache, slots)[:, 0].to(q.dtype)  # [ctx, rank]
            k_rot = gather_slots(v_cache, slots).to(q.dtype)  # [ctx, 1, rope]
            kv = F.linear(latent, self.kv_b).view(ctx, heads, self.nope_dim + self.v_dim)
            k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
            k = torch.cat([k_nope, k_rot.expand(ctx, heads, self.rope_dim)], dim=-1)
            qpos = torch.arange(ctx - nq, ctx, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos
            o = plat.attention(
                q[start : start + nq].transpose(0, 1).unsqueeze(0).to(dt),
                k.transpose(0, 1).unsqueeze(0).to(dt),
                v.transpose(0, 1).unsqueeze(0).to(dt),
                mask.view(1, 1, nq, ctx),
                self.scale,
            )
            out[start : start + nq] = o[0].transpose(0, 1).to(q.dtype)
            start += nq
        return out


class GroupLimitedRouter:
    """DeepSeek-V3's routing: sigmoid scores, the best ``topk_group`` of ``n_group`` groups, the ``top_k`` best
    experts in them (by score plus ``bias``), weighted by their scores (renormalized) times ``scaling``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, *, top_k: int, groups: int, top_groups: int,
                 renormalize: bool, scaling: float) -> None:
        self.weight, self.bias = weight.float(), bias.float()
        self.top_k, self.groups, self.top_groups = top_k, groups, top_groups
        self.renormalize, self.scaling = renormalize, scaling

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``(weights [T, top_k] float32, experts [T, top_k])``."""
        scores = F.linear(h.float(), self.weight).sigmoid()
        choice = scores + self.bias
        n, experts = choice.shape
        group_scores = choice.view(n, self.groups, experts // self.groups).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.top_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(n, self.groups, experts // self.groups).reshape(n, experts)
        chosen = torch.topk(choice.masked_fill(~keep.bool(), float("-inf")), k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen


class SoftmaxGroupRouter:
    """DeepSeek-V2's routing: softmax scores; ``greedy`` keeps the ``top_k`` best, ``group_limited_greedy`` the
    ``top_k`` best within the ``topk_group`` groups whose best expert scores highest; weights times ``scaling``, not
    renormalized (as transformers' DeepseekV2, whatever ``norm_topk_prob`` says)."""

    def __init__(self, weight: torch.Tensor, *, top_k: int, groups: int, top_groups: int, grouped: bool,
                 scaling: float) -> None:
        self.weight = weight.float()
        self.top_k, self.groups, self.top_groups, self.grouped, self.scaling = top_k, groups, top_groups, grouped, scaling

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``(weights [T, top_k] float32, experts [T, top_k])``."""
        scores = F.linear(h.float(), self.weight).softmax(dim=-1, dtype=torch.float32)
        if self.grouped:
            n, experts = scores.shape
            group_scores = scores.view(n, self.groups, experts // self.groups).max(dim=-1).values
            group_idx = torch.topk(group_scores, k=self.top_groups, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            keep = group_mask.unsqueeze(-1).expand(n, self.groups, experts // self.groups).reshape(n, experts)
            scores = scores.masked_fill(~keep.bool(), 0.0)
        weights, chosen = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return weights * self.scaling, chosen


class SharedAndRouted:
    """The routed experts' output plus the shared experts'."""

    def __init__(self, routed: SparseMoE, shared: GatedMLP) -> None:
        self.routed, self.shared = routed, shared

    def __call__(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        return self.routed(h, step) + self.shared(h, step)


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """``kv_b_proj`` ``[heads * (nope + v), rank]`` from llama.cpp's split of it: each head's key part transposed
    (``k_b`` ``[heads, rank, nope]``) and its value part (``v_b`` ``[heads, v, rank]``)."""
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, v_b.shape[-1]).contiguous()


class DeepseekV3Family(Architecture):
    """``DeepseekV3ForCausalLM`` checkpoints (DeepSeek-V3, R1)."""

    name = "deepseek_v3"
    model_types = ("deepseek_v3",)
    gguf_architectures = ("deepseek2",)
    #: llama.cpp's names for the latent attention's, the router's bias and the shared experts' tensors; it splits
    #: ``kv_b_proj`` into a transposed key part and a value part (``k_b_proj``/``v_b_proj``, joined in build_layer)
    gguf_names = {
        "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
    }
    #: V3's sigmoid routing with the correction bias (llama.cpp's ``expert_gating_func`` 2), V2's softmax (1)
    sigmoid_routing = True

    def gguf_config(self, info: GGUFInfo) -> dict[str, Any] | None:
        """A ``deepseek2`` file of this version: sigmoid routing (``expert_gating_func`` 2, or the routers'
        correction bias when the file does not say) is V3's, softmax V2's; MLA's sizes from the ``*_mla`` keys."""
        gating = info.key("expert_gating_func")
        sigmoid = gating == 2 if gating is not None else "blk.0.exp_probs_b.bias" in info.tensors or any(
            n.endswith("exp_probs_b.bias") for n in info.tensors)
        if sigmoid != self.sigmoid_routing:
            return None
        cfg = base_config(info, self.name)
        cfg.pop("partial_rotary_factor", None)
        rope = int(info.key("rope.dimension_count"))
        groups = int(info.key("expert_group_count") or 1)
        cfg.update(
            num_key_value_heads=cfg["num_attention_heads"],  # the converter writes MLA as one KV head
            q_lora_rank=info.key("attention.q_lora_rank"),
            kv_lora_rank=int(info.key("attention.kv_lora_rank")),
            qk_rope_head_dim=rope,
            qk_nope_head_dim=int(info.key("attention.key_length_mla")) - rope,
            v_head_dim=int(info.key("attention.value_length_mla")),
            n_routed_experts=cfg.get("num_experts"),
            n_group=groups,
            topk_group=int(info.key("expert_group_used_count") or 1),
            routed_scaling_factor=float(info.key("expert_weights_scale") or 1.0),
            norm_topk_prob=bool(info.key("expert_weights_norm") or False),
            n_shared_experts=int(info.key("expert_shared_count") or 0),
            first_k_dense_replace=int(info.key("leading_dense_block_count") or 0),
        )
        if not self.sigmoid_routing:
            cfg["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
        scaling = cfg.get("rope_scaling")
        if scaling is not None and info.key("rope.scaling.yarn_log_multiplier") is not None:
            mscale = float(info.key("rope.scaling.yarn_log_multiplier")) / 0.1  # the converter writes 0.1 * it
            scaling.update(mscale=mscale, mscale_all_dim=mscale)
        return cfg

    def read_config(self, cfg: dict[str, Any], directory: Any = None) -> ModelArch:
        """The base reading plus MLA's ranks and head parts and the experts' routing."""
        arch = super().read_config(cfg, directory)
        nope, rope, v = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
        experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
        groups = int(cfg.get("n_group") or 1)
        if experts % groups:
            raise ModelLoadError(f"config.json: n_routed_experts {experts} must be a multiple of n_group {groups}")
        scaling = arch.rope_scaling or {}
        scale = (nope + rope) ** -0.5
        if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
            factor = float(scaling["factor"])
            m = 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale *= m * m
        arch.head_dim = rope  # the rotary tables' width
        arch.attention_scale = scale
        arch.options.update(
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            nope_dim=nope,
            rope_dim=rope,
            v_dim=v,
            interleave=bool(cfg.get("rope_interleave", True)),
            num_experts=experts,
            top_k=int(cfg.get("num_experts_per_tok", 8)),
            groups=groups,
            top_groups=int(cfg.get("topk_group") or 1),
            renormalize=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)),
            shared_experts=int(cfg.get("n_shared_experts") or 0),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            first_dense=int(cfg.get("first_k_dense_replace") or 0),
            mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        )
        return arch

    def tensor_pieces(self, name: str, arch: ModelArch) -> list[Piece]:
        """The multi-token-prediction layers skipped (logged once)."""
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if index >= arch.num_layers:
                if name.endswith(f"{index}.embed_tokens.weight") or name.endswith("enorm.weight"):
                    log.info("skipping the checkpoint's multi-token-prediction layer %d (not used for decoding)", index)
                return []
        return [Piece(name)]

    def shard(self, name: str, arch: ModelArch, tp: Any) -> tuple[int, int, int] | None:
        """Heads split through MLA's per-head projections; the latent path whole; experts' channels split."""
        o = arch.options
        lo, hi = tp.span(arch.num_heads)
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            width = o["nope_dim"] + o["rope_dim"]
            return 0, lo * width, hi * width
        if name.endswith("self_attn.kv_b_proj.weight"):
            width = o["nope_dim"] + o["v_dim"]
            return 0, lo * width, hi * width
        if name.endswith("self_attn.o_proj.weight"):
            return 1, lo * o["v_dim"], hi * o["v_dim"]
        if name.endswith(("self_attn.k_b_proj.weight", "self_attn.v_b_proj.weight")):  # GGUF's [heads, ...] parts
            return 0, lo, hi
        if ".self_attn." in name or ".mlp.gate." in name:
            return None
        if ".mlp.experts." in name:
            return expert_shard(name, o["num_experts"], o["moe_intermediate_size"], tp)
        if ".mlp.shared_experts." in name:  # channel-split, with or without expert parallelism
            a, b = tp.span(o["moe_intermediate_size"] * o["shared_experts"])
            return (1, a, b) if name.endswith("down_proj.weight") else (0, a, b)
        return tp.slice_of(name, arch)

    def parallel_errors(self, arch: ModelArch, world_size: int, key: str) -> list[str]:
        """The experts' channels must divide too."""
        size = arch.options["moe_intermediate_size"]
        return [] if size % world_size == 0 else [
            f"{key}: got {world_size}; it must divide the experts' {size} intermediate channels"]

    def expert_parallel_errors(self, arch: ModelArch, world_size: int, key: str) -> list[str]:
        """The routed experts must divide evenly over the ranks; the shared experts' channels (still split) too."""
        o = arch.options
        errors = expert_errors(self.name, o["num_experts"], world_size, key)
        shared = o["moe_intermediate_size"] * o["shared_experts"]
        if shared % world_size:
            errors.append(f"{key}: got true with {world_size} ranks, which do not divide the shared experts' {shared} "
                          "intermediate channels (split over the ranks as under tensor parallelism)")
        return errors

    def delta_gaps(self, arch: ModelArch) -> dict[str, dict[int, str]]:
        """Every layer's attention (latent attention has no q/k/v/o projections of the dense form) and the MLP of
        the layers after ``first_k_dense_replace`` (shared plus routed experts)."""
        o = arch.options
        attention = {i: f"the {self.name} family's attention is multi-head latent attention (MLA), which per-row "
                        "deltas to q/k/v/o projections do not reach" for i in range(arch.num_layers)}
        experts = {i: f"the {self.name} family's MLP on this layer is {o['shared_experts']} shared plus "
                      f"{o['num_experts']} routed experts, which per-row deltas to gate/up/down projections do not "
                      f"reach (only the first {o['first_dense']} layers are dense)"
                   for i in range(o["first_dense"], arch.num_layers)}
        return {"qkv": attention, "o": dict(attention), "gate_up": experts, "down": dict(experts)}

    def router(self, prefix: str, arch: ModelArch, weights: Any) -> Any:
        """Layer ``prefix``'s :class:`GroupLimitedRouter`."""
        o = arch.options
        return GroupLimitedRouter(
            weights.tensor(prefix + "mlp.gate.weight"),
            weights.tensor(prefix + "mlp.gate.e_score_correction_bias"),
            top_k=o["top_k"],
            groups=o["groups"],
            top_groups=o["top_groups"],
            renormalize=o["renormalize"],
            scaling=o["routed_scaling"],
        )

    def build_layer(self, index: int, arch: ModelArch, weights: Any) -> DecoderLayer:
        """:class:`LatentAttention` with a dense MLP (the first layers) or shared plus routed experts."""
        o, p = arch.options, f"model.layers.{index}."
        a = p + "self_attn."
        low_rank_q = o["q_lora_rank"] is not None
        attn = LatentAttention(
            layer=index,
            q_proj=weights.linear(a + ("q_b_proj.weight" if low_rank_q else "q_proj.weight")),
            q_a=weights.linear(a + "q_a_proj.weight") if low_rank_q else None,
            q_a_norm=weights.tensor(a + "q_a_layernorm.weight") if low_rank_q else None,
            kv_a=weights.linear(a + "kv_a_proj_with_mqa.weight"),
            kv_a_norm=weights.tensor(a + "kv_a_layernorm.weight"),
            kv_b=weights.tensor(a + "kv_b_proj.weight") if weights.has(a + "kv_b_proj.weight") else join_kv_b(
                weights.tensor(a + "k_b_proj.weight"), weights.tensor(a + "v_b_proj.weight")),
            o_proj=weights.linear(a + "o_proj.weight"),
            num_heads=arch.num_heads,
            nope_dim=o["nope_dim"],
            rope_dim=o["rope_dim"],
            v_dim=o["v_dim"],
            rank=o["kv_lora_rank"],
            scale=float(arch.attention_scale or 1.0),
            eps=arch.rms_norm_eps,
            interleave=o["interleave"],
        )
        if index < o["first_dense"]:
            mlp: Any = dense_mlp(arch, index, weights)
        else:
            router = self.router(p, arch, weights)
            first, gate_up, down = stacked_experts(weights, p + "mlp.experts.", o["num_experts"])
            mlp = SparseMoE(router=router, gate_up=gate_up, down=down, first=first)
            if o["shared_experts"]:
                s = p + "mlp.shared_experts."
                mlp = SharedAndRouted(mlp, GatedMLP(layer=index, gate_up=weights.linear(s + "gate_proj.weight",
                                                   s + "up_proj.weight"), down=weights.linear(s + "down_proj.weight")))
        return DecoderLayer(
            attn=attn,
            mlp=mlp,
            attn_in=weights.tensor(p + "input_layernorm.weight"),
            mlp_in=weights.tensor(p + "post_attention_layernorm.weight"),
            eps=arch.rms_norm_eps,
        )


class DeepseekV2Family(DeepseekV3Family):
    """``DeepseekV2ForCausalLM`` checkpoints (DeepSeek-V2, V2-Lite): V3's latent attention (rotary pairs always
    interleaved) with softmax routing (:class:`SoftmaxGroupRouter`, ``topk_method`` greedy or group-limited)."""

    name = "deepseek_v2"
    model_types = ("deepseek_v2",)
    sigmoid_routing = False

    def read_config(self, cfg: dict[str, Any], directory: Any = None) -> ModelArch:
        """V3's reading; the rotary pairs interleaved; ``topk_method`` ``greedy`` or ``group_limited_greedy``."""
        arch = super().read_config(cfg, directory)
        method = cfg.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ModelLoadError(f"config.json: topk_method {method!r} is not served (allowed: greedy, "
                                 "group_limited_greedy)")
        arch.options.update(interleave=True, grouped=method == "group_limited_greedy")
        return arch

    def router(self, prefix: str, arch: ModelArch, weights: Any) -> Any:
        """Layer ``prefix``'s :class:`SoftmaxGroupRouter`."""
        o = arch.options
        return SoftmaxGroupRouter(weights.tensor(prefix + "mlp.gate.weight"), top_k=o["top_k"], groups=o["groups"],
                                  top_groups=o["top_groups"], grouped=o["grouped"], scaling=o["routed_scaling"])


DEEPSEEK_V3 = DeepseekV3Family()
DEEPSEEK_V2 = DeepseekV2Family()
