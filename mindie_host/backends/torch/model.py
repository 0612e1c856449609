"""A decoder over a paged KV cache, in plain torch: the layers of its family, the embedding, the LM head.

Weights are held as flat tensors (Q/K/V and gate/up fused into one matmul each),
and the forward pass works on the flattened tokens of a whole batch, so a step
costs a fixed number of operator calls per layer whatever the batch holds.
Operators that a platform may fuse go through :class:`~mindie_host.backends.platform.Platform`.
The layers come from the model's family (:mod:`mindie_host.models.architecture`): its own
(:meth:`~mindie_host.models.architecture.Architecture.build_layer`) or the dense layer of
:mod:`~mindie_host.backends.torch.layers`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ...distributed.tensor_parallel import TensorParallel
from ...models.architecture import Architecture, ModelArch, ModelLoadError
from ...models.llama import LLAMA
from ...models.rope import Rope, rope_of
from ...models.weights import EightBitGroups, FourBitGroups
from ..base import LinearDeltas, ModelInput
from ..cpu_matmul import LowBitTiles
from ..int8 import Int8Matrix
from ..lazy_memory import trim_heap
from ..linear import PromptRows, low_bit_kernels_available
from ..platform import AttentionMetadata, Platform, ragged
from .graphs import DecodeGraphs
from .layers import KVSpec, ModelWeights, Step, dense_layer

#: checkpoint tensors a model may carry that change nothing (old checkpoints saved RoPE's frequencies)
IGNORED_TENSORS = ("rotary_emb.inv_freq",)
#: positions the RoPE tables cover at first; :meth:`DecoderModel.extend_rope` (the backend's ``set_max_positions``,
#: told ``maxSeqLen``) grows them: a 128k-position model serving 4k tokens keeps 4k rows of each table, not 128k
ROPE_TABLE_POSITIONS = 8192


def rope_inv_freq(rope: Rope | ModelArch, head_dim: int | None = None, seq_len: int | None = None) -> torch.Tensor:
    """Rotary inverse frequencies of a :class:`~mindie_host.models.rope.Rope` (or of a model's own RoPE) as
    float32 (:mod:`mindie_host.models.rope`)."""
    if isinstance(rope, ModelArch):
        rope, head_dim = rope_of(rope), rope.head_dim
    assert head_dim is not None
    return torch.from_numpy(rope.inv_freq(head_dim, seq_len)).float()


class DecoderModel:
    """The forward pass. Construct with canonical float tensors; call :meth:`forward` per step.

    ``family`` builds the layers (default: the builtin Llama family). ``stored`` says, by canonical name, how the
    model file holds its low-bit matrices (see :func:`~mindie_host.models.weights.low_bit_matrices`); the platform
    may read those forms for products of few rows. :class:`~mindie_host.backends.int8.Int8Matrix` entries (the
    ``w8a16`` / ``w8a8`` schemes) are served in int8 only. A tensor no layer takes is an error: a checkpoint part
    the family does not serve is refused, not ignored.
    """

    def __init__(
        self,
        arch: ModelArch,
        weights: dict[str, torch.Tensor],
        platform: Platform,
        dtype: torch.dtype,
        stored: dict[str, FourBitGroups | EightBitGroups | Int8Matrix] | None = None,
        tp: TensorParallel | None = None,
        family: Architecture | None = None,
    ) -> None:
        #: this rank's place in a tensor-parallel world (``weights`` then hold its slices), or None
        self.tp = tp
        self.vocab_size = arch.vocab_size
        if tp is not None:
            arch = tp.local_arch(arch)
        self.arch = arch
        self.family = family or LLAMA
        self.platform = platform
        self.dtype = dtype
        self.device = platform.device()
        self.scale = arch.attention_scale if arch.attention_scale is not None else 1.0 / math.sqrt(arch.head_dim)

        w = ModelWeights(weights, platform, dtype, stored)
        platform.plan_prompt_copies(w.low_bit_bytes())
        #: the embedding table (``[vocab, hidden]`` in the model's dtype), or the low-bit tiles its rows are
        #: gathered from (:meth:`~mindie_host.backends.cpu_matmul.LowBitTiles.rows`) when the file holds it low-bit
        self.embed: torch.Tensor | LowBitTiles
        self.lm_head_linear, self.embed = self._embedding_and_head(arch, w)
        self.final_norm = w.tensor("model.norm.weight")
        self.layers: list[Any] = []
        trim_heap()
        for i in range(arch.num_layers):
            layer = self.family.build_layer(i, arch, w)
            self.layers.append(layer if layer is not None else dense_layer(self.family, arch, i, w))
            trim_heap()  # each layer's freed temporaries back to the OS before the next layer's are made
        left = [n for n in w.left() if not n.endswith(IGNORED_TENSORS)]
        if left:
            shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
            raise ModelLoadError(f"the {self.family.name} family does not serve the checkpoint's tensors {shown}")
        #: each RoPE the layers use, by key ("" is the model's own; a layer kind may have its own)
        self.ropes: dict[str, Rope] = {"": rope_of(arch)}
        for layer in self.layers:
            key = getattr(getattr(layer, "attn", None), "rope_key", "")
            if key not in self.ropes:
                self.ropes[key] = rope_of(arch, key)
        self.rope = self.ropes[""]
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.extend_rope(min(arch.max_position_embeddings, ROPE_TABLE_POSITIONS))
        self.embedding_multiplier = (None if arch.embedding_multiplier == 1.0
                                     else torch.tensor(arch.embedding_multiplier, dtype=dtype, device=self.device))
        self.compiled_decode: Any = None
        self.compiled_max_seqs = 0
        self.compiled_steps = 0  # decode steps that ran compiled (for stats and tests)
        self.graphs: DecodeGraphs | None = None

    def _embedding_and_head(self, arch: ModelArch, w: ModelWeights) -> tuple[Any, torch.Tensor | LowBitTiles]:
        """The prepared LM head and the embedding table (a tied checkpoint's one tensor serves both). On CPU, a
        table the file holds low-bit is looked up from its low-bit tiles (the tied head's own), never read dense
        unless the head's product keeps it dense."""
        embed = "model.embed_tokens.weight"
        tied = arch.tie_word_embeddings or not w.has("lm_head.weight")
        if tied:
            w.drop("lm_head.weight")  # a tied checkpoint may hold the head too: the embedding serves
        if self.tp is not None:  # each rank's rows, padded: dense
            table = self._vocab_rows(w.tensor(embed))
            head = table if tied else self._vocab_rows(w.tensor("lm_head.weight"))
            return self.platform.prepare_linear(head, None), table
        lookup = self.device.type == "cpu" and low_bit_kernels_available()
        if tied:
            head_linear = w.linear(embed, keep=True)
            tiles = getattr(head_linear, "tiles", None)
            if lookup and isinstance(tiles, LowBitTiles):
                w.drop(embed)
                return head_linear, tiles
            return head_linear, w.tensor(embed)
        form = w.low_bit(embed) if lookup else None
        if form is not None:
            w.drop(embed)
            table: torch.Tensor | LowBitTiles = (
                LowBitTiles.four_bit(torch.from_numpy(form.codes), torch.from_numpy(form.scale),
                                     torch.from_numpy(form.offset), form.group_size)
                if isinstance(form, FourBitGroups) else
                LowBitTiles(torch.from_numpy(form.codes), torch.from_numpy(form.scale),
                            torch.zeros_like(torch.from_numpy(form.scale)), form.group_size))
        else:
            table = w.tensor(embed)
        return w.linear("lm_head.weight"), table

    @property
    def kv_specs(self) -> list[KVSpec]:
        """Each layer's cache shape (this rank's KV heads)."""
        return [layer.kv_spec for layer in self.layers]

    @property
    def cos(self) -> torch.Tensor:
        """The model's own RoPE cos table ``[positions, rotary_dim]``."""
        return self.tables[""][0]

    @property
    def sin(self) -> torch.Tensor:
        """The model's own RoPE sin table ``[positions, rotary_dim]``."""
        return self.tables[""][1]

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
        for key, rope in self.ropes.items():
            if key not in self.tables or positions > self.tables[key][0].shape[0]:
                self.tables[key] = self._rope_tables(torch.arange(positions), rope)

    def _rope_tables(self, positions: torch.Tensor, rope: Rope,
                     seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[len(positions), rotary_dim]`` of ``rope`` (scaled by yarn's or longrope's attention
        factor); ``seq_len`` is the sequence's length, for the kinds whose frequencies depend on it."""
        freqs = torch.outer(positions.to(torch.float32), rope_inv_freq(rope, self.arch.head_dim, seq_len))
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = rope.attention_scaling
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos.to(self.device, self.dtype), sin.to(self.device, self.dtype)

    def dynamic_rope(self, batch: ModelInput) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """Per-token cos and sin of every RoPE when one whose frequencies depend on the sequence's length (dynamic
        NTK, longrope) changes them for a sequence of the step; None when the tables serve.

        A sequence whose length passes the RoPE's threshold (``max_position_embeddings``; longrope:
        ``original_max_position_embeddings``) rotates this step's tokens with frequencies computed for that length,
        as transformers does for the tokens of each forward pass; the keys already cached keep the rotation they
        got. Its length is its context after this step, and at least its prompt's, so a prompt computed in chunks
        rotates as one computed at once.
        """
        lengths = [max(ctx, prompt) for ctx, prompt in zip(batch.context_lens, batch.prompt_lens)] or batch.context_lens
        longest = max(lengths)
        if not any(r.dynamic and longest > r.length_threshold for r in self.ropes.values()):
            return None
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, rope in self.ropes.items():
            table_cos, table_sin = self.tables[key]
            cos, sin, start = [], [], 0
            for q, length in zip(batch.query_lens, lengths):
                positions = torch.tensor(batch.positions[start : start + q])
                start += q
                if not rope.dynamic or length <= rope.length_threshold:
                    cos.append(table_cos[positions.to(self.device)])
                    sin.append(table_sin[positions.to(self.device)])
                else:
                    c, s = self._rope_tables(positions, rope, length)
                    cos.append(c)
                    sin.append(s)
            out[key] = (torch.cat(cos), torch.cat(sin))
        return out

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
            prompt_queries=batch.prompt_queries(),
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
        gives every token's cos and sin ``[n, rotary_dim]`` (e.g. multimodal RoPE's, made from :attr:`cos` and :attr:`sin`) instead
        of the tables at ``batch.positions``, for every layer. Both are for backends that extend this model; a
        text-only step passes neither. ``deltas`` adds per-row deltas after the named projections
        (:class:`~mindie_host.backends.base.LinearDeltas`) when a row runs a model variant.
        """
        ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
        tables = self.dynamic_rope(batch) if rope is None else {key: rope for key in self.ropes}
        # every sequence brings one generated token on the base model: the steps graphs and torch.compile serve
        plain_decode = (deltas is None and tables is None and embeds is None and meta.max_query_len == 1
                        and meta.pad_index is None and meta.attn_mask is not None and not any(meta.prompt_queries))
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
            # a prompt token takes the prompt rows' arithmetic even alone (the last token of a cached prefix)
            prompt_rows = PromptRows.of(pos, batch.query_lens, batch.prompt_lens) if any(meta.prompt_queries) else None
            hidden = self.run(ids, pos, idx, meta, kv_caches, deltas, tables, embeds, prompt_rows)
        # the LM head stays eager: its best kernel depends on the row count (bench/PERF.md)
        return self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the whole vocabulary for final-normed ``hidden`` rows."""
        logits = self.platform.linear(hidden, self.lm_head_linear)
        if self.tp is not None:  # vocab-parallel: each rank computed its rows of the vocabulary
            logits = self.tp.gather_logits(logits, self.vocab_size)
        logits = logits.float()
        if self.arch.logit_scale != 1.0:
            logits = logits * self.arch.logit_scale
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

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
        import torch._dynamo  # here, not at the top: importing it costs ~1.3 s of CPU in every engine process

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
        import torch._dynamo

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
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        prompt_rows: PromptRows | None = None,
    ) -> torch.Tensor:
        """The decoder over token ids ``ids`` at positions ``pos``: final-normed hidden states of the rows ``idx``.

        ``rope`` gives each token's cos and sin, by RoPE key, where they do not come from the tables (dynamic NTK,
        longrope, multimodal RoPE); ``embeds`` replaces the embeddings of some rows (see :meth:`forward`);
        ``prompt_rows`` marks the prompt tokens, which the layers' products may multiply differently.
        """
        plat = self.platform
        if rope is None:
            rope = {key: (cos[pos], sin[pos]) for key, (cos, sin) in self.tables.items()}
        step = Step(platform=plat, meta=meta, kv_caches=kv_caches, deltas=deltas, prompt_rows=prompt_rows, tp=self.tp,
                    rope={key: (cos.unsqueeze(1), sin.unsqueeze(1)) for key, (cos, sin) in rope.items()})
        if isinstance(self.embed, LowBitTiles):
            x = self.embed.rows(ids).to(self.dtype)
        else:
            x = F.embedding(ids, self.embed) if self.tp is None else self.tp.embed(ids, self.embed, self.vocab_size)
        if self.embedding_multiplier is not None:
            x = x * self.embedding_multiplier
        if embeds is not None:  # e.g. image features at their placeholder tokens
            x[embeds[0]] = embeds[1].to(x.dtype)
        pending: torch.Tensor | None = None  # the last layer's branch output, added to x by the next norm
        for layer in self.layers:
            x, pending = layer(x, pending, step)
        x = x.index_select(0, idx)
        if pending is not None:  # the residual add of the rows asked for only
            x = x + pending.index_select(0, idx)
        return plat.rms_norm(x, self.final_norm, self.arch.rms_norm_eps)


#: The old name, kept for the backends and plugins that import it.
TorchLlama = DecoderModel
