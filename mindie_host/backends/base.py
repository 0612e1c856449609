"""The model-backend contract: what the engine asks of a ``backendType``.

The interface is deliberately narrow (plain lists in, one logits tensor out) so a
runner can live in another process or on another device. The engine owns
scheduling, block accounting and sampling; a backend owns the weights, the KV
tensors and the forward pass.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class ModelInfo:
    """Shape facts about a loaded model that the engine needs."""

    name: str
    architecture: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    model_type: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_arch(cls, name: str, arch: Any, *, dtype: str, device: str, **extra: Any) -> ModelInfo:
        """The facts of a model read by :func:`mindie_host.backend_api.load_arch` (``arch`` is a ``ModelArch``)."""
        return cls(
            name=name,
            architecture="LlamaForCausalLM",
            vocab_size=arch.vocab_size,
            num_layers=arch.num_layers,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            max_position_embeddings=arch.max_position_embeddings,
            eos_token_ids=list(arch.eos_token_ids),
            bos_token_id=arch.bos_token_id,
            dtype=dtype,
            device=device,
            model_type=arch.model_type,
            extra={"hidden_size": arch.hidden_size, "num_heads": arch.num_heads,
                   "intermediate_size": arch.intermediate_size, "family": getattr(arch, "architecture", "llama"),
                   **extra},
        )


@dataclass
class PayloadSlice:
    """The part of one sequence a step computes, with that request's plugin payload.

    Sequence ``seq_index`` of the batch brings ``length`` tokens at prompt/sequence
    positions ``[start, start + length)``; they are rows ``[flat_start, flat_start +
    length)`` of the flattened step. A backend that understands ``payload`` (e.g. one
    that replaces image placeholder rows by image embeddings) uses these; others ignore it.
    """

    seq_index: int
    flat_start: int
    start: int
    length: int
    payload: Any


class LinearDeltas(Protocol):
    """Per-row deltas to a model's named linear layers: the seam for per-request model variants.

    A plugin returns one from ``mindie_host_linear_deltas``; a backend that supports
    it (:meth:`ModelBackend.set_linear_deltas`) calls :meth:`prepare` once per step
    in which any ``batch.row_variants`` is >= 0, then :meth:`apply` after each named
    projection of each layer. Steps where every row is ``-1`` never touch it, so the
    base model keeps its fast paths (compiled and graph-captured decode).

    Under tensor parallelism (``worldSize`` > 1) the host sends the provider, pickled, to every
    rank, and again whenever its optional integer attribute ``version`` changes (bump it whenever
    the deltas' weights change, e.g. a variant registered at run time); a provider without
    ``version`` cannot run with ``worldSize`` > 1. Each rank calls it with full-width inputs and
    outputs and keeps its own slice (:class:`~mindie_host.distributed.tensor_parallel.ShardedDeltas`),
    so a delta must be linear in ``x`` (a low-rank product ``x A^T B^T`` is).
    """

    def prepare(self, batch: ModelInput) -> None:
        """Gather what this step's rows need (e.g. each token's variant index)."""

    def apply(self, name: str, layer: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base projection ``name`` of input ``x`` at decoder layer ``layer``) plus each row's delta.

        ``name`` is one of ``"qkv"``, ``"o"``, ``"gate_up"`` and ``"down"``.
        """
        ...


@dataclass
class ModelInput:
    """One forward step over a batch of sequences, flattened.

    Sequence ``i`` contributes ``query_lens[i]`` new tokens (``input_ids`` and
    ``positions`` are the concatenation over sequences) and has
    ``context_lens[i]`` tokens of KV once this step has written its new tokens.
    ``block_tables[i]`` maps its token positions to cache blocks
    (slot = block_tables[i][pos // block_size] * block_size + pos % block_size).
    ``logits_indices`` are the flat token indices whose logits are returned, in
    order. ``row_variants[i]`` is the model variant of sequence ``i`` (``EngineRequest.variant``;
    -1 = the base model), read by the linear-delta provider (:class:`LinearDeltas`).
    ``payloads`` lists, for each sequence whose request carries a plugin payload
    (:attr:`EngineRequest.payload`), a :class:`PayloadSlice`; ``None`` (the text-only
    case) when none does. ``prompt_lens[i]`` is sequence ``i``'s prompt length, so a backend
    can tell prompt tokens from generated ones (the CPU backend multiplies them differently).
    """

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]
    row_variants: list[int] = field(default_factory=list)
    payloads: list[PayloadSlice] | None = None
    #: each sequence's prompt length: rows at positions below it are prompt tokens (empty: not known)
    prompt_lens: list[int] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    def prompt_queries(self) -> list[bool]:
        """Whether each sequence's query holds prompt tokens (it starts below its prompt length); empty when the
        prompt lengths are not known. A backend computes a prompt token with the prompt rows' arithmetic even when it
        is its sequence's only new token, so its result does not depend on how much of the prompt was cached."""
        if not self.prompt_lens:
            return []
        return [c - q < p for c, q, p in zip(self.context_lens, self.query_lens, self.prompt_lens)]


class ModelBackend(abc.ABC):
    """A loaded model that can run forward steps over a paged KV cache.

    Lifecycle: the host constructs it (through ``mindie_host_model_backend``),
    calls :meth:`load`, asks :meth:`kv_cache_bytes_per_block` to size the cache
    against the memory budget, calls :meth:`allocate_kv_cache`, then calls
    :meth:`execute` once per engine step from a single worker thread.
    """

    #: Name of the ``backendType`` this backend serves.
    backend_type: str = ""

    @abc.abstractmethod
    def load(self) -> ModelInfo:
        """Read the weights and return the model's shape facts."""

    @abc.abstractmethod
    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one cache block of ``block_size`` tokens takes over all layers (K and V)."""

    @abc.abstractmethod
    def available_kv_memory(self, requested_gb: int) -> int:
        """Bytes to give the KV cache. ``requested_gb`` is the config's budget for the
        device (``npuMemSize`` on accelerators, ``cpuMemSize`` on the CPU); -1 means
        size it automatically from free device memory."""

    @abc.abstractmethod
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Create the KV tensors for ``num_blocks`` blocks."""

    @abc.abstractmethod
    def execute(self, batch: ModelInput) -> torch.Tensor:
        """Run one forward step, write the new tokens' KV, and return float32 logits
        of shape ``[len(batch.logits_indices), vocab_size]`` on the CPU or device."""

    def set_linear_deltas(self, provider: LinearDeltas | None) -> bool:
        """Attach the provider of per-row deltas to named linear layers (``None`` detaches it).

        The host calls this at startup with what ``mindie_host_linear_deltas`` returned.
        :return: True if this backend applies such deltas; the default is False (the
            host then refuses to start, naming the plugin).
        """
        return False

    # -- tensor parallelism (optional): worldSize > 1 ---------------------------------------------
    def parallel_errors(self, world_size: int, key: str) -> list[str]:
        """Why this backend cannot run as one of ``world_size`` tensor-parallel ranks (``key`` names the
        config key in the messages); empty when it can. Called before :meth:`load`, on rank 0 only."""
        return [f"{key}: got {world_size}; backendType {self.backend_type!r} runs on one device only; allowed: 1"]

    @property
    def dist_backend(self) -> str:
        """The ``torch.distributed`` backend its tensor-parallel ranks join for a step's collectives (``gloo`` on
        CPU, ``nccl`` on CUDA, ``hccl`` on Ascend); the host asks only a backend that accepts a world size over 1."""
        return "gloo"

    def bind_parallel(self, tp: Any) -> None:  # noqa: B027 - optional hook
        """Become rank ``tp.rank`` of ``tp.world_size`` (a :class:`~mindie_host.distributed.tensor_parallel.TensorParallel`)
        before :meth:`load`: load only this rank's slices, and run the step's collectives. Every rank
        then gets the same calls in the same order (the host replays rank 0's on the others)."""

    def set_max_positions(self, max_positions: int) -> None:  # noqa: B027 - optional hook
        """The longest sequence the engine will run (``maxSeqLen``), told before the KV cache is allocated.

        A backend whose position tables stop at ``max_position_embeddings`` extends them here, so a
        ``maxSeqLen`` above it extrapolates the positions (as transformers does) instead of failing mid-stream.
        """

    # -- swap space (optional): where preempted sequences' KV waits in CPU memory ---------------
    def swap_block_bytes(self) -> int:
        """Bytes one KV block takes in the swap space (all layers, K and V); 0 when this backend cannot swap."""
        return 0

    def allocate_swap_space(self, num_blocks: int) -> bool:
        """Create a CPU swap space of ``num_blocks`` blocks. :return: False when this backend cannot swap
        (the default): preempted sequences are then recomputed."""
        return False

    def swap_out(self, blocks: list[int], swap_blocks: list[int]) -> None:
        """Copy the KV of cache ``blocks`` into swap-space blocks ``swap_blocks`` (same order)."""
        raise NotImplementedError(f"{type(self).__name__} has no swap space")

    def swap_in(self, swap_blocks: list[int], blocks: list[int]) -> None:
        """Copy swap-space blocks ``swap_blocks`` back into cache ``blocks`` (same order)."""
        raise NotImplementedError(f"{type(self).__name__} has no swap space")

    # -- KV transfer (optional): PD disaggregation moves a prompt's blocks between instances -----------
    def kv_block_shapes(self) -> tuple[str, list[list[int]]] | None:
        """``(dtype, shape of one block in each cache tensor)``, or None when this backend cannot export and
        import KV blocks (the default; ``inferMode: "dmi"`` then refuses to start)."""
        return None

    def export_blocks(self, blocks: list[int]) -> list[torch.Tensor]:
        """The contents of cache ``blocks``, one CPU tensor ``[len(blocks), *block shape]`` per cache tensor.
        Called from the KV connector's thread: it only reads blocks the engine holds untouched. Never called
        on a backend whose :meth:`kv_block_shapes` is None (the default), so the default raises."""
        raise NotImplementedError(f"{type(self).__name__} cannot export KV blocks")

    def import_blocks(self, blocks: list[int], tensors: list[torch.Tensor]) -> None:
        """Write ``tensors`` (as :meth:`export_blocks` returns them) into cache ``blocks`` (same order).
        Never called on a backend whose :meth:`kv_block_shapes` is None (the default), so the default raises."""
        raise NotImplementedError(f"{type(self).__name__} cannot import KV blocks")

    def warmup(self) -> None:  # noqa: B027 - optional hook
        """Run a throwaway step so the first request is not slow.

        Called once, after :meth:`allocate_kv_cache` and before the first request. Longer work
        (compiling a step, say) may go on in the background after it returns, as long as
        :meth:`execute` serves every step meanwhile and no request waits on it."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Free device memory."""
