"""The StandardMock backend (``modelInstanceType: "StandardMock"``): a server that loads no model.

MindIE's fake model: the server runs, and no model is loaded. Every request gets the same deterministic
answer, :data:`PLACEHOLDER` followed by the tokenizer's end-of-sequence token (with ``ignore_eos`` the
text repeats), whatever the protocol, so an operator can try routing, probes, TLS and the MS
coordinator without a model. The tokenizer is the one at ``modelWeightPath`` when there is one there,
else a built-in byte-level tokenizer (:func:`~mindie_host.tokenizer.byte_level_tokenizer`).

The logits of every row put the next placeholder token :data:`GAP` nats above all others, so sampling
at any temperature, top-k or top-p picks it; logprobs are those of these logits. No KV is stored: the
answer does not depend on the context. Under PD disaggregation a block exports as one zero, so P and D
instances, the controller's roles and the coordinator's PD routing work as with a model.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import ModelBackend, ModelInfo, ModelInput

#: what every StandardMock answer says
PLACEHOLDER = "This is a placeholder answer from a StandardMock instance, which loads no model."
#: the logit of the next placeholder token over every other token's
GAP = 60.0


class MockBackend(ModelBackend):
    """Placeholder tokens in place of a forward pass (see the module)."""

    backend_type = "mock"

    def __init__(self, tokenizer: Any, name: str, max_positions: int) -> None:
        self.name = name
        self.vocab_size = len(tokenizer)
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.cycle = tokenizer.encode(PLACEHOLDER, add_special_tokens=False)
        if self.eos_token_id is not None:
            self.cycle.append(self.eos_token_id)
        self.max_positions = max_positions

    def load(self) -> ModelInfo:
        return ModelInfo(
            name=self.name,
            architecture="StandardMock",
            vocab_size=self.vocab_size,
            num_layers=0,
            num_kv_heads=0,
            head_dim=0,
            max_position_embeddings=self.max_positions,
            eos_token_ids=[self.eos_token_id] if self.eos_token_id is not None else [],
            model_type="mock",
        )

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return 1  # nothing is stored; one nominal byte keeps the pool's arithmetic

    def available_kv_memory(self, requested_gb: int) -> int:
        return 1 << 40

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Nothing to allocate."""

    def set_max_positions(self, max_positions: int) -> None:
        self.max_positions = max(self.max_positions, max_positions)

    # PD disaggregation: a block holds nothing; one float per block keeps the transfer's framing
    def kv_block_shapes(self) -> tuple[str, list[list[int]]] | None:
        return "float32", [[1]]

    def export_blocks(self, blocks: list[int]) -> list[torch.Tensor]:
        return [torch.zeros(len(blocks), 1)]

    def import_blocks(self, blocks: list[int], tensors: list[torch.Tensor]) -> None:
        """Nothing to write."""

    def next_token(self, output_index: int) -> int:
        """The placeholder token at ``output_index`` of the answer (0: the first generated token)."""
        return self.cycle[output_index % len(self.cycle)]

    def execute(self, batch: ModelInput) -> torch.Tensor:
        starts, flat = [], 0
        for q in batch.query_lens:
            starts.append(flat)
            flat += q
        logits = torch.zeros(len(batch.logits_indices), self.vocab_size)
        seq = 0
        for row, idx in enumerate(batch.logits_indices):
            while seq + 1 < len(starts) and starts[seq + 1] <= idx:
                seq += 1
            prompt_len = batch.prompt_lens[seq] if batch.prompt_lens else 0
            logits[row, self.next_token(batch.positions[idx] + 1 - prompt_len)] = GAP
        return logits
