"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache, in plain torch.

Weights are held as flat tensors (Q/K/V and gate/up fused into one matmul each),
and the forward pass works on the flattened tokens of a whole batch, so a step
costs a fixed number of operator calls per layer whatever the batch holds.
Operators that a platform may fuse go through :class:`~mindie_host.backends.platform.Platform`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo
import torch.nn.functional as F

from ...distributed.tensor_parallel import TensorParallel
from ...models.rope import rope_of
from ...models.weights import FourBitGroups, LlamaArch
from ..base import LinearDeltas, ModelInput
from ..int8 import Int8Matrix
from ..linear import PromptRows
from ..platform import AttentionMetadata, Platform, ragged
from .graphs import DecodeGraphs


@dataclass
class LayerWeights:
    """One decoder layer's tensors."""

    input_norm: torch.Tensor
    qkv: Any  # weights as made by Platform.prepare_linear
    qkv_bias: torch.Tensor | None
    o_proj: Any
    post_norm: torch.Tensor
    gate_up: Any
    down: Any


def _add_deltas(deltas: LinearDeltas, layer: int, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``deltas.apply`` at ``layer``, as :meth:`Platform.gated_mlp <mindie_host.backends.platform.Platform.gated_mlp>`
    calls its ``add``."""
    return deltas.apply(name, layer, x, y)


def rope_inv_freq(arch: LlamaArch, seq_len: int | None = None) -> torch.Tensor:
    """Rotary inverse frequencies of ``arch``'s RoPE kind (:mod:`mindie_host.models.rope`), as float32."""
    return torch.from_numpy(rope_of(arch).inv_freq(arch.head_dim, seq_len)).float()


class TorchLlama:
    """The forward pass. Construct with HF-named float tensors; call :meth:`forward` per step.

    ``stored`` says, by HF name, how the model file holds its low-bit matrices (see
    :func:`~mindie_host.models.weights.low_bit_matrices`); the platform may read those
    forms for products of few rows. :class:`~mindie_host.backends.int8.Int8Matrix` entries (the
    ``w8a16`` / ``w8a8`` schemes) are served in int8 only.
    """

    def __init__(
        self,
        arch: LlamaArch,
        weights: dict[str, torch.Tensor],
        platform: Platform,
        dtype: torch.dtype,
        stored: dict[str, FourBitGroups | Int8Matrix | str] | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        #: this rank's place in a tensor-parallel world (``weights`` then hold its slices), or None
        self.tp = tp
        self.vocab_size = arch.vocab_size
        if tp is not None:
            arch = tp.local_arch(arch)
        self.arch = arch
        self.platform = platform
        self.dtype = dtype
        self.device = platform.device()
        self.scale = 1.0 / math.sqrt(arch.head_dim)

        stored = stored or {}

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=self.device, dtype=dtype).contiguous()

        def linear(*names: str) -> Any:
            """One prepared product for these matrices stacked by rows (fused QKV, gate+up)."""
            int8 = [stored.get(n) for n in names]
            if all(isinstance(m, Int8Matrix) for m in int8):  # the w8a16 / w8a8 schemes
                return platform.prepare_int8(Int8Matrix.concat(int8) if len(int8) > 1 else int8[0], dtype)  # type: ignore[arg-type]
            dense = torch.cat([take(n) for n in names]) if len(names) > 1 else take(names[0])
            forms = [stored.get(n) for n in names]
            form: FourBitGroups | str | None = None
            if all(isinstance(f, FourBitGroups) for f in forms):
                form = FourBitGroups.concat(forms)  # type: ignore[arg-type]
            elif all(f == "int8" for f in forms):
                form = "int8"
            return platform.prepare_linear(dense.contiguous(), form)

        self.embed = self._vocab_rows(take("model.embed_tokens.weight"))
        self.final_norm = take("model.norm.weight")
        self.lm_head = self.embed if arch.tie_word_embeddings or "lm_head.weight" not in weights else (
            self._vocab_rows(take("lm_head.weight"))
        )
        self.layers: list[LayerWeights] = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            bias = None
            if p + "self_attn.q_proj.bias" in weights:
                bias = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"], dim=0)
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=linear(*(p + f"self_attn.{x}_proj.weight" for x in "qkv")),
                    qkv_bias=bias,
                    o_proj=linear(p + "self_attn.o_proj.weight"),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=linear(p + "mlp.down_proj.weight"),
                )
            )
        head_name = "model.embed_tokens.weight" if self.lm_head is self.embed else "lm_head.weight"
        self.lm_head_linear = platform.prepare_linear(self.lm_head, stored.get(head_name))
        self.rope = rope_of(arch)
        self.cos, self.sin = self._rope_tables(torch.arange(arch.max_position_embeddings), rope_inv_freq(arch))
        self.compiled_decode: Any = None
        self.compiled_max_seqs = 0
        self.compiled_steps = 0  # decode steps that ran compiled (for stats and tests)
        self.graphs: DecodeGraphs | None = None
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim

    def _vocab_rows(self, table: torch.Tensor) -> torch.Tensor:
        """A rank's rows of the embedding or LM head, padded with zeros to the same count on every rank."""
        if self.tp is None:
            return table
        rows = self.tp.vocab_rows(self.vocab_size)
        if table.shape[0] == rows:
            return table
        return torch.cat([table, table.new_zeros(rows - table.shape[0], table.shape[1])]).contiguous()

    def extend_rope(self, positions: int) -> None:
        """Make the cos/sin tables cover ``positions`` positions (past ``max_position_embeddings``, the same
        frequencies continue, as transformers computes them for any position)."""
        if positions > self.cos.shape[0]:
            self.cos, self.sin = self._rope_tables(torch.arange(positions), rope_inv_freq(self.arch))

    def _rope_tables(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[len(positions), head_dim]`` (scaled by yarn's attention factor)."""
        freqs = torch.outer(positions.to(torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.rope.attention_scaling
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos.to(self.device, self.dtype), sin.to(self.device, self.dtype)

    def dynamic_rope(self, batch: ModelInput) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-token cos and sin when dynamic NTK RoPE rescales a sequence; None when the tables serve.

        A sequence whose length (its context after this step) passes ``max_position_embeddings``
        rotates this step's tokens with frequencies recomputed for that length, as transformers does
        for the tokens of each forward pass; the keys already cached keep the rotation they got.
        """
        limit = self.arch.max_position_embeddings
        if not self.rope.dynamic or max(batch.context_lens) <= limit:
            return None
        cos, sin, start = [], [], 0
        for q, ctx in zip(batch.query_lens, batch.context_lens):
            positions = torch.tensor(batch.positions[start : start + q])
            start += q
            if ctx <= limit:
                cos.append(self.cos[positions.to(self.device)])
                sin.append(self.sin[positions.to(self.device)])
            else:
                c, s = self._rope_tables(positions, rope_inv_freq(self.arch, ctx))
                cos.append(c)
                sin.append(s)
        return torch.cat(cos), torch.cat(sin)

    def mrope_tables(self, positions: torch.Tensor, section: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[n, head_dim]`` for multimodal RoPE (Qwen2-VL's ``mrope_section``).

        ``positions`` is ``[3, n]`` (temporal, height, width position of each token); the
        rotary frequencies are split into ``section`` (summing to ``head_dim // 2``) and
        part ``i`` rotates by axis ``i % 3``. Equal axes give the 1-D tables.
        """
        parts_cos, parts_sin, lo = [], [], 0
        half = self.arch.head_dim // 2
        pos = positions.to(self.device)
        for i, width in enumerate(section):
            axis = pos[i % 3]
            parts_cos.append(self.cos[axis, lo : lo + width])
            parts_sin.append(self.sin[axis, lo : lo + width])
            lo += width
        if lo != half:
            raise ValueError(f"mrope_section {section} must sum to head_dim // 2 = {half}")
        cos, sin = torch.cat(parts_cos, dim=-1), torch.cat(parts_sin, dim=-1)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    # -- per-step metadata ---------------------------------------------------------------
    def build_metadata(self, batch: ModelInput, block_size: int) -> AttentionMetadata:
        """Slot mapping, gather indices and causal mask for one step (shared by all layers)."""
        device = self.device
        num_seqs = batch.num_seqs
        max_q = max(batch.query_lens)
        max_ctx = max(batch.context_lens)
        max_blocks = -(-max_ctx // block_size)
        tables = torch.tensor(
            [t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in batch.block_tables], dtype=torch.long
        )  # [B, max_blocks], padded with block 0
        q_lens = torch.tensor(batch.query_lens)
        ctx_lens = torch.tensor(batch.context_lens)
        offsets = torch.arange(max_ctx)
        valid = offsets.unsqueeze(0) < ctx_lens.unsqueeze(1)  # [B, max_ctx]
        # cache slot of every context position of every sequence; padding points at slot 0
        gather = (tables[:, offsets // block_size] * block_size + offsets % block_size) * valid
        is_new = valid & (offsets.unsqueeze(0) >= (ctx_lens - q_lens).unsqueeze(1))
        slot_mapping = gather[is_new]  # the new tokens' slots, sequence by sequence, in position order
        if max_q == 1:
            mask = valid.view(num_seqs, 1, 1, max_ctx)
            pad_index = None
        else:
            qi = torch.arange(max_q)
            pad_index = (torch.arange(num_seqs).repeat_interleave(q_lens) * max_q) + torch.cat(
                [torch.arange(int(q)) for q in batch.query_lens]
            )
            if bool((q_lens == max_q).all()):
                pad_index = None
            mask = None  # ragged (a chunk beside decodes): attention runs per sequence and builds its own
            if pad_index is None or not ragged(num_seqs, max_q, len(batch.input_ids)):
                # absolute position of query row r of sequence i: ctx_i - q_i + r
                qpos = (ctx_lens - q_lens).unsqueeze(1) + qi.unsqueeze(0)  # [B, max_q]
                mask = offsets.view(1, 1, max_ctx) <= qpos.unsqueeze(2)
                valid_row = qi.unsqueeze(0) < q_lens.unsqueeze(1)  # [B, max_q]
                mask = mask & valid_row.unsqueeze(2)
                mask[..., 0] |= ~valid_row  # padded rows attend to slot 0 so softmax stays finite
                mask = mask.unsqueeze(1)
        return AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            gather_index=gather.to(device),
            attn_mask=None if mask is None else mask.to(device),
            pad_index=None if pad_index is None else pad_index.to(device),
            num_seqs=num_seqs,
            max_query_len=max_q,
            max_context_len=max_ctx,
            query_lens=batch.query_lens,
            context_lens=batch.context_lens,
        )

    # -- forward -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        batch: ModelInput,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        deltas: LinearDeltas | None = None,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run the decoder over the flattened new tokens; return float32 logits at ``logits_indices``.

        ``embeds`` = ``(rows, values)`` replaces the token embeddings of flat rows ``rows`` by
        ``values`` (``[len(rows), hidden]``; e.g. image features at placeholder tokens); ``rope``
        gives every token's cos and sin ``[n, head_dim]`` (e.g. from :meth:`mrope_tables`) instead
        of the tables at ``batch.positions``. Both are for backends that extend this model; a
        text-only step passes neither. ``deltas`` adds per-row deltas after the named projections
        (:class:`~mindie_host.backends.base.LinearDeltas`) when a row runs a model variant.
        """
        ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
        if rope is None:
            rope = self.dynamic_rope(batch)
        # every sequence brings one token on the base model: the steps graphs and torch.compile serve
        plain_decode = (deltas is None and rope is None and embeds is None and meta.max_query_len == 1
                        and meta.pad_index is None and meta.attn_mask is not None)
        if (
            plain_decode
            and self.graphs is not None
            and len(batch.logits_indices) == meta.num_seqs  # every row's logits, in order
            and self.graphs.covers(meta.num_seqs, meta.max_context_len)
        ):
            logits = self.graphs.run(ids, pos, meta.slot_mapping, meta.gather_index, meta.attn_mask)
            if logits is not None:
                return logits
        idx = torch.tensor(batch.logits_indices, dtype=torch.long, device=self.device)
        compiled = self.compiled_decode
        if plain_decode and compiled is not None and meta.num_seqs <= self.compiled_max_seqs:
            self.compiled_steps += 1
            hidden = self._call_compiled(compiled, ids, pos, idx, meta, kv_caches)
        else:
            prompt_rows = PromptRows.of(pos, batch.query_lens, batch.prompt_lens) if meta.max_query_len > 1 else None
            hidden = self.run(ids, pos, idx, meta, kv_caches, deltas, rope, embeds, prompt_rows)
        # the LM head stays eager: its best kernel depends on the row count (bench/PERF.md)
        return self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the whole vocabulary for final-normed ``hidden`` rows."""
        logits = self.platform.linear(hidden, self.lm_head_linear)
        if self.tp is not None:  # vocab-parallel: each rank computed its rows of the vocabulary
            logits = self.tp.gather_logits(logits, self.vocab_size)
        return logits.float()

    def compile_decode(self, max_seqs: int, warm: list[tuple[ModelInput, AttentionMetadata]],
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Compile the decode step, then serve decode steps of up to ``max_seqs`` sequences (base model only)
        through it.

        Inductor fuses the small operators between the matrix products (norms, rotary,
        residual adds, SiLU) into a few generated kernels, which removes most of the
        per-operator cost that dominates a small decode step on CPU (bench/PERF.md).
        The graph is compiled with dynamic batch and context sizes by running the ``warm``
        steps (decode steps whose K/V go to cache slots no sequence owns); only then does
        :meth:`forward` start using it, so this may run on another thread while eager steps
        are served (the backend does that).
        """
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
        # a C++ wrapper around the generated kernels saves ~0.5 ms of Python per step
        compiled = torch.compile(self._decode, options={"cpp_wrapper": True})
        with torch.inference_mode():  # as forward() runs it: the guards include the grad mode
            for batch, meta in warm:
                ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)
                pos = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
                idx = torch.tensor(batch.logits_indices, dtype=torch.long, device=self.device)
                self._call_compiled(compiled, ids, pos, idx, meta, kv_caches)
        self.compiled_max_seqs = max_seqs
        self.compiled_decode = compiled

    def _call_compiled(self, compiled: Any, ids: torch.Tensor, pos: torch.Tensor, idx: torch.Tensor,
                       meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One decode step through the compiled :meth:`_decode`."""
        kv_flat = [t for pair in kv_caches for t in pair]
        args = (ids, pos, idx, meta.slot_mapping, meta.gather_index, meta.attn_mask)
        for t in args:  # batch and context sizes vary; the caches and the model do not
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(meta.gather_index, 1)
        torch._dynamo.maybe_mark_dynamic(meta.attn_mask, 3)
        return compiled(*args, kv_flat)

    def enable_graphs(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scratch_slot: int, max_seqs: int, max_context: int
    ) -> DecodeGraphs:
        """Serve decode steps (base model only) from padded buckets, replayed as CUDA graphs on CUDA devices.

        ``kv_caches`` must stay where they are from now on (graphs hold their addresses);
        ``scratch_slot`` is a cache slot no sequence owns, where padded rows write.
        """
        kv_flat = [t for pair in kv_caches for t in pair]

        def step(*inputs: torch.Tensor) -> torch.Tensor:  # ids, positions, rows, slots, gather index, mask
            hidden = self._decode(*inputs, kv_flat)  # type: ignore[call-arg]
            return self.logits(hidden)

        max_context = min(max_context, self.arch.max_position_embeddings)
        use_graphs = self.device.type == "cuda"
        self.graphs = DecodeGraphs(step, self.device, scratch_slot, max_seqs, max_context, use_graphs)
        return self.graphs

    def _decode(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        idx: torch.Tensor,
        slot_mapping: torch.Tensor,
        gather_index: torch.Tensor,
        attn_mask: torch.Tensor,
        kv_flat: list[torch.Tensor],
    ) -> torch.Tensor:
        """:meth:`run` for a step whose sequences each bring one token, from tensors only (what gets compiled)."""
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            gather_index=gather_index,
            attn_mask=attn_mask,
            pad_index=None,
            num_seqs=gather_index.shape[0],
            max_query_len=1,
            max_context_len=gather_index.shape[1],
            query_lens=[],
            context_lens=[],
        )
        kv_caches = [(kv_flat[i], kv_flat[i + 1]) for i in range(0, len(kv_flat), 2)]
        return self.run(ids, pos, idx, meta, kv_caches, None)

    def run(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        idx: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        deltas: LinearDeltas | None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        prompt_rows: PromptRows | None = None,
    ) -> torch.Tensor:
        """The decoder over token ids ``ids`` at positions ``pos``: final-normed hidden states of the rows ``idx``.

        ``rope`` gives each token's cos and sin where they do not come from the tables (dynamic NTK,
        multimodal RoPE); ``embeds`` replaces the embeddings of some rows (see :meth:`forward`);
        ``prompt_rows`` marks the prompt tokens, which the layers' products may multiply differently.
        """
        arch, plat = self.arch, self.platform
        cos = (rope[0] if rope is not None else self.cos[pos]).unsqueeze(1)
        sin = (rope[1] if rope is not None else self.sin[pos]).unsqueeze(1)
        x = F.embedding(ids, self.embed) if self.tp is None else self.tp.embed(ids, self.embed, self.vocab_size)
        if embeds is not None:  # e.g. image features at their placeholder tokens
            x[embeds[0]] = embeds[1].to(x.dtype)
        n = ids.shape[0]
        mlp_out: torch.Tensor | None = None  # the last layer's MLP output, added to x by the next norm
        for li, layer in enumerate(self.layers):
            x, h = plat.add_rms_norm(x, mlp_out, layer.input_norm, arch.rms_norm_eps)
            qkv = plat.linear(h, layer.qkv, layer.qkv_bias, prompt_rows)
            if deltas is not None:
                qkv = deltas.apply("qkv", li, h, qkv)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(n, arch.num_heads, arch.head_dim)
            k = k.view(n, arch.num_kv_heads, arch.head_dim)
            v = v.view(n, arch.num_kv_heads, arch.head_dim)
            q, k = plat.rotary(q, k, cos, sin)
            k_cache, v_cache = kv_caches[li]
            plat.write_kv(k_cache, v_cache, k, v, meta)
            attn = plat.paged_attention(q, k_cache, v_cache, meta, self.scale).reshape(n, self.q_size)
            o = plat.linear(attn, layer.o_proj, prompt_rows=prompt_rows)
            if deltas is not None:
                o = deltas.apply("o", li, attn, o)
            if self.tp is not None:  # row-parallel: each rank holds a partial sum
                o = self.tp.all_reduce(o)
            x, h = plat.add_rms_norm(x, o, layer.post_norm, arch.rms_norm_eps)
            add = None if deltas is None else functools.partial(_add_deltas, deltas, li)
            d = plat.gated_mlp(h, layer.gate_up, layer.down, prompt_rows, add)
            if self.tp is not None:
                d = self.tp.all_reduce(d)
            mlp_out = d
        x = x.index_select(0, idx)
        if mlp_out is not None:  # the residual add of the rows asked for only
            x = x + mlp_out.index_select(0, idx)
        return plat.rms_norm(x, self.final_norm, arch.rms_norm_eps)
