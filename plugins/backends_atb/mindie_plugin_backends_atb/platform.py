"""``NpuPlatform``: the host's :class:`~mindie_host.api.Platform` on Ascend NPUs through torch_npu.

The host's torch model (:class:`~mindie_host.backend_api.DecoderModel`) calls only the
platform for the operators that matter on an accelerator; this subclass routes
each one to a torch_npu fused inference operator:

==================  ==============================================================
platform operator   torch_npu function
==================  ==============================================================
``rms_norm``        ``torch_npu.npu_rms_norm(x, gamma, epsilon=eps)[0]``
``rotary``          ``torch_npu.npu_apply_rotary_pos_emb(q, k, cos, sin, layout="BSH")``
                    (in place, 4-D ``[1, T, N, D]`` inputs, rotate-half convention)
``write_kv``        ``torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache,
                    slot_indices)`` (ATB ReshapeAndCache; caches ``[blocks, block_size, KV, D]``)
``paged_attention`` decode steps (every query length 1):
                    ``torch_npu._npu_paged_attention(query, key_cache, value_cache,
                    num_kv_heads, num_heads, scale_value, block_table, context_lens, out)``;
                    steps with prefill or chunked prefill:
                    ``torch_npu.npu_fused_infer_attention_score(query, key, value,
                    atten_mask, block_table, input_layout="TND", block_size,
                    actual_seq_lengths=<cumulative query lengths>,
                    actual_seq_lengths_kv=<context lengths>, num_heads,
                    num_key_value_heads, scale, sparse_mode=3)``
==================  ==============================================================

Documentation followed: the *Ascend Extension for PyTorch 7.0.0* API reference
(torch_npu for PyTorch 2.1/2.5) for ``npu_rms_norm``,
``npu_apply_rotary_pos_emb`` and ``npu_fused_infer_attention_score``; the ATB
bindings ``_npu_reshape_and_cache`` and ``_npu_paged_attention`` are not in that
reference, their signatures are those of Ascend/op-plugin 7.3.0
(``op_plugin/ops/atb``) as called by vllm-ascend. None of this has run on Ascend
hardware (see the README).

The module object that provides the operators is injected (``ops``), as are the
device-memory source and the device type, so everything above the operator calls
can be exercised on a machine without an NPU.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from mindie_host.api import ModelInput
from mindie_host.backend_api import AttentionMetadata, Platform

#: side of the compressed causal mask that ``sparse_mode=3`` (right-down causal) expects
CAUSAL_MASK_SIZE = 2048

INSTALL_HINT = (
    "pip install mindie-plugin-backends-atb[npu] (torch-npu matching your torch), plus the Ascend CANN "
    "toolkit and NPU driver; then `source <CANN install dir>/set_env.sh`"
)


class NpuUnavailable(RuntimeError):
    """torch_npu or an Ascend NPU is missing; the message says which and how to install it."""


def load_torch_npu(importer: Callable[[str], ModuleType] = importlib.import_module) -> ModuleType:
    """Import torch_npu and check that an NPU is visible.

    :param importer: the import function (injected by tests).
    :raises NpuUnavailable: naming what is missing and the install command.
    """
    try:
        module = importer("torch_npu")
    except ImportError as exc:
        raise NpuUnavailable(
            f"backendType 'atb' needs torch_npu (Ascend Extension for PyTorch), which cannot be imported ({exc}); "
            f"install it with: {INSTALL_HINT}"
        ) from exc
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        raise NpuUnavailable(
            "backendType 'atb' found torch_npu but no Ascend NPU is visible (torch.npu.is_available() is False); "
            "check the NPU driver (npu-smi info), the CANN environment (source set_env.sh) and "
            f"ASCEND_RT_VISIBLE_DEVICES. Install: {INSTALL_HINT}"
        )
    return module


class NpuPlatform(Platform):
    """Ascend NPU: device ``npu``, HCCL for tensor parallelism, torch_npu fused inference operators."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"

    def __init__(
        self,
        ops: Any | None = None,
        *,
        mem_get_info: Callable[[], tuple[int, int]] | None = None,
        device_type: str | None = None,
    ) -> None:
        """
        :param ops: the module providing the torch_npu functions (default: ``import torch_npu``).
        :param mem_get_info: ``() -> (free, total)`` bytes of device memory (default: ``torch.npu.mem_get_info``).
        :param device_type: torch device type of the tensors (default ``"npu"``).
        """
        self._ops = ops
        self._mem_get_info = mem_get_info
        if device_type is not None:
            self.device_type = device_type
        self._causal_mask: torch.Tensor | None = None

    @classmethod
    def is_available(cls) -> bool:
        try:
            load_torch_npu()
        except NpuUnavailable:
            return False
        return True

    @property
    def ops(self) -> Any:
        """The torch_npu module (or the injected stand-in)."""
        if self._ops is None:
            self._ops = load_torch_npu()
        return self._ops

    # -- device facts ---------------------------------------------------------------------------
    def bind_device(self, index: int) -> None:
        """Use NPU ``index`` in this process (a tensor-parallel rank's ``npuDeviceIds`` entry), as
        ``torch.npu.set_device`` does; HCCL then binds the rank to it. Unverified here: no NPU."""
        if self.device_type == "npu":
            import torch

            self.ops  # noqa: B018 - importing torch_npu registers torch.npu
            torch.npu.set_device(index)  # type: ignore[attr-defined]

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of NPU memory, from ``torch.npu.mem_get_info``."""
        source = self._mem_get_info
        if source is None:
            self.ops  # noqa: B018 - importing torch_npu installs torch.npu
            source = torch.npu.mem_get_info  # type: ignore[attr-defined]
        free, total = source()
        return int(free), int(total)

    def synchronize(self) -> None:
        if self.device_type == "npu":
            torch.npu.synchronize()  # type: ignore[attr-defined]

    def default_dtype(self) -> torch.dtype:
        """float16: what every Atlas inference product supports (bfloat16 only on A2/A3)."""
        return torch.float16

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The paged layout ReshapeAndCache and PagedAttention use: ``[num_blocks, block_size, KV, D]``."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def prepare_step(self, meta: AttentionMetadata, batch: ModelInput, block_size: int) -> AttentionMetadata:
        """Block table (int32, padded with 0), int32 slots, and the length lists the fused kernels take."""
        device = self.device()
        width = max(len(t) for t in batch.block_tables)
        table = torch.zeros(batch.num_seqs, width, dtype=torch.int32)
        for i, row in enumerate(batch.block_tables):
            table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        cumulative: list[int] = []
        total = 0
        for q in batch.query_lens:
            total += q
            cumulative.append(total)
        meta.extra.update(
            block_table=table.to(device),
            block_size=block_size,
            slot_indices=meta.slot_mapping.to(torch.int32),
            context_lens=torch.tensor(batch.context_lens, dtype=torch.int32),  # host tensor, as ATB expects
            context_lens_list=list(batch.context_lens),
            query_cumulative=cumulative,
        )
        return meta

    # -- operators --------------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ops.npu_rms_norm(x, weight, epsilon=eps)[0]

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, N, D] -> [1, T, N, D]; cos/sin [T, 1, D] -> [1, T, 1, D]; the operator rotates in place
        q4 = q.contiguous().unsqueeze(0)
        k4 = k.contiguous().unsqueeze(0)
        self.ops.npu_apply_rotary_pos_emb(q4, k4, cos.unsqueeze(0), sin.unsqueeze(0), layout="BSH")
        return q4.squeeze(0), k4.squeeze(0)

    def write_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        self.ops._npu_reshape_and_cache(
            key=k.to(k_cache.dtype).contiguous(),
            value=v.to(v_cache.dtype).contiguous(),
            key_cache=k_cache,
            value_cache=v_cache,
            slot_indices=meta.extra["slot_indices"],
        )

    def causal_mask(self, device: torch.device) -> torch.Tensor:
        """The compressed ``[2048, 2048]`` mask of ``sparse_mode=3``: True above the diagonal (hidden)."""
        if self._causal_mask is None or self._causal_mask.device != device:
            ones = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool)
            self._causal_mask = torch.triu(ones, diagonal=1).to(device)
        return self._causal_mask

    def paged_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        extra = meta.extra
        num_heads = q.shape[1]
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        q = q.to(k_cache.dtype).contiguous()
        if meta.max_query_len == 1:
            out = torch.empty_like(q)
            self.ops._npu_paged_attention(
                query=q,
                key_cache=k_cache,
                value_cache=v_cache,
                num_kv_heads=num_kv_heads,
                num_heads=num_heads,
                scale_value=scale,
                block_table=extra["block_table"],
                context_lens=extra["context_lens"],
                out=out,
            )
            return out
        out, _ = self.ops.npu_fused_infer_attention_score(
            q,
            k_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            v_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            atten_mask=self.causal_mask(q.device),
            block_table=extra["block_table"],
            input_layout="TND",
            block_size=block_size,
            actual_seq_lengths=extra["query_cumulative"],
            actual_seq_lengths_kv=extra["context_lens_list"],
            num_key_value_heads=num_kv_heads,
            num_heads=num_heads,
            scale=scale,
            sparse_mode=3,
        )
        return out
