"""The built-in ``torch`` backend: loads a model of any registered family and runs it on a :class:`Platform`."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...distributed.tensor_parallel import ShardedDeltas, TensorParallel, parallel_errors
from ...models.architecture import Architecture, Architectures, ModelArch, ModelLoadError
from ...models.weights import (
    ModelSource,
    checkpoint_model_type,
    family_of,
    load_arch,
    low_bit_readers,
    weight_readers,
)
from ...quant.loader import checkpoint_format, int8_matrices, smoothed_checkpoint
from ...quant.schemes import KV_INT8, check_scheme
from .. import cpu_extensions, cpu_profile, cpu_selfcheck
from ..base import LinearDeltas, ModelBackend, ModelInfo, ModelInput
from ..kv_int8 import Int8KVCache
from ..lazy_memory import lazy_zeros
from ..platform import Platform, select_platform
from .layers import KVSpec
from .model import DecoderModel
from .precompile import PrecompileSpec

log = logging.getLogger("mindie_host.backends.torch")

#: the config key that turns expert parallelism on
EXPERT_PARALLEL_KEY = "BackendConfig.ModelDeployConfig.ModelConfig[0].expertParallel"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, platform: Platform) -> torch.dtype:
    """Map a config ``dtype`` (auto, float32, bfloat16, float16) to a torch dtype."""
    if name in ("auto", "", None):
        return platform.default_dtype()
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} not supported; allowed: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


class TorchBackend(ModelBackend):
    """Models of the registered families in plain torch over a paged KV cache, on CPU or CUDA.

    ``architectures`` are the families the enabled plugins provide (``ctx.architectures`` of the backend hook;
    default: the host's builtin Llama family); the checkpoint's ``model_type`` picks one
    (:mod:`mindie_host.models.architecture`), which reads its config, names its tensors and builds its layers.

    ``quantization="auto"`` hands the platform how the model file stores its low-bit
    matrices (GGUF Q4_0/Q4_1 groups, Q8_0 blocks) next to their dequantized values, so
    CPU decode of few sequences reads them at 4 or 8 bits; ``"none"`` uses only the
    dequantized values (the reference numerics). ``"w8a16"`` / ``"w8a8"`` serve the decoder's
    linear layers in int8 (:mod:`mindie_host.quant`): an int8 checkpoint's own layers, or a
    floating-point model's quantized per output channel at load.

    ``kv_cache_dtype`` stores K and V in another precision than the weights (``auto``:
    the same): bfloat16 halves the cache and the bytes each decode step's attention reads,
    which makes a 16-sequence CPU step of the default model about 7% faster (bench/PERF.md);
    ``int8`` stores int8 codes with a scale per token and KV head (:mod:`~mindie_host.backends.kv_int8`).

    ``compile_decode`` makes decode steps cheap to launch: on CPU through
    ``torch.compile`` (inductor), on CUDA as replays of CUDA graphs captured per
    batch/context bucket (:mod:`~mindie_host.backends.torch.graphs`). On CPU the step
    compiles on a background thread after :meth:`warmup` returns, so the server is ready
    (and serves eager steps) while it compiles; :meth:`wait_compiled` waits for it.
    ``decode_graphs`` forces the bucketed graph path on or off (on CPU it then runs
    the padded step eagerly, which tests use).
    """

    backend_type = "torch"

    def __init__(
        self,
        source: ModelSource,
        *,
        name: str,
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        quantization: str = "auto",
        compile_decode: bool = False,
        decode_graphs: bool | None = None,
        platform: Platform | None = None,
        progress: Any = None,
        architectures: Architectures | None = None,
        expert_parallel: bool = False,
    ) -> None:
        self.source = source
        #: each rank holds its share of a mixture's routed experts whole (``ModelConfig.expertParallel``)
        self.expert_parallel = expert_parallel
        self.name = name
        self.architectures = architectures
        #: what a compile process needs to build the same backend (platform and progress aside)
        self._init_kwargs: dict[str, Any] = dict(
            source=source, name=name, dtype=dtype, kv_cache_dtype=kv_cache_dtype, quantization=quantization,
            compile_decode=compile_decode, decode_graphs=decode_graphs, expert_parallel=expert_parallel,
        )
        self._compile_child: subprocess.Popen[bytes] | None = None
        self.platform = platform or select_platform("auto")
        #: on CPU: the kernels' variant and compute dtypes (logged once; a bad MINDIE_HOST_CPU_ISA fails here)
        self.cpu = cpu_profile.log_profile() if self.platform.device_type == "cpu" else None
        self.dtype = resolve_dtype(dtype, self.platform)
        self.kv_int8 = kv_cache_dtype == KV_INT8
        if self.kv_int8 and self.platform.name not in ("cpu", "cuda"):
            raise ValueError(f"kvCacheDtype 'int8' is served on cpu and cuda only, not on {self.platform.name!r}")
        self.kv_dtype = (
            self.dtype if kv_cache_dtype in ("auto", "", None) or self.kv_int8
            else resolve_dtype(kv_cache_dtype, self.platform)
        )
        if self.cpu is not None:
            self._warn_slow_dtypes(dtype, kv_cache_dtype)
        self._kernel_build: threading.Thread | None = None
        self._kernels_checked = False
        self.quantization = check_scheme(quantization)
        if self.kv_int8 and (compile_decode or decode_graphs):
            log.warning("kvCacheDtype int8: decode steps run eagerly (compile and decode graphs take tensor caches)")
            compile_decode, decode_graphs = False, False
        self.compile_decode = compile_decode
        self.decode_graphs = (
            compile_decode and self.platform.device_type == "cuda" if decode_graphs is None else decode_graphs
        )
        self.progress = progress
        self.arch: ModelArch | None = None
        self.family: Architecture | None = None
        self.model: DecoderModel | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        self.linear_deltas: LinearDeltas | None = None
        self.swap_space: list[torch.Tensor] = []
        self.tp: TensorParallel | None = None
        self.full_arch: ModelArch | None = None  # the whole model's shape (self.arch is this rank's under TP)
        self.num_blocks = 0
        self.spare_block: int | None = None  # a cache block no sequence owns (decode graphs, compile warm-up)
        self._compile_thread: threading.Thread | None = None
        #: set when the decode step compiled in the background by :meth:`warmup` is in use (or failed)
        self.compile_finished = threading.Event()

    # -- tensor parallelism ------------------------------------------------------------------
    #: the families this backend serves, by name (None: every family the plugins provide)
    served_families: frozenset[str] | None = None

    def _family(self) -> Architecture:
        """The checkpoint's family; refused when this backend does not serve it."""
        family = family_of(self.source, self.architectures)
        if self.served_families is not None and family.name not in self.served_families:
            raise ModelLoadError(
                f"backendType {self.backend_type!r} does not serve the {family.name} family (model_type "
                f"{checkpoint_model_type(self.source)!r}); it serves: {', '.join(sorted(self.served_families))}. "
                "backendType 'torch' serves every installed family"
            )
        return family

    def parallel_errors(self, world_size: int, key: str) -> list[str]:
        family = self._family()
        arch = load_arch(self.source, self.architectures)
        errors = parallel_errors(arch, world_size, key)
        if self.expert_parallel:
            errors += family.expert_parallel_errors(arch, world_size, EXPERT_PARALLEL_KEY)
        else:
            errors += family.parallel_errors(arch, world_size, key)
        if self.quantization not in ("auto", "none"):
            errors.append(f"BackendConfig.ModelDeployConfig.ModelConfig[0].quantization: got {self.quantization!r} "
                          f"with {key} {world_size}; allowed with tensor parallelism: auto, none")
        return errors

    @property
    def dist_backend(self) -> str:
        """Its platform's (gloo on CPU, nccl on CUDA, the platform plugin's otherwise)."""
        return self.platform.dist_backend

    def bind_parallel(self, tp: TensorParallel) -> None:
        tp = self.tp = dataclasses.replace(tp, expert_parallel=self.expert_parallel)
        self.platform.bind_device(tp.device_index)
        if self.compile_decode or self.decode_graphs:
            if tp.rank == 0:
                log.warning("ModelConfig.compile is true with worldSize %d: decode steps run eagerly under tensor "
                            "parallelism in this version (their collectives are not compiled or captured)",
                            tp.world_size)
            self.compile_decode = self.decode_graphs = False
        if self.quantization == "auto" and tp.rank == 0:
            log.info("worldSize %d: each rank serves its slices dequantized (the file's 4/8-bit forms are kept only "
                     "with worldSize 1)", tp.world_size)

    def _warn_slow_dtypes(self, dtype: str, kv_cache_dtype: str) -> None:
        """Honour a 16-bit dtype the config sets explicitly, with a warning when this CPU has no native bfloat16."""
        assert self.cpu is not None
        for key, name, value in (("dtype", dtype, self.dtype), ("kvCacheDtype", kv_cache_dtype, self.kv_dtype)):
            if name not in ("auto", "", None, KV_INT8) and self.cpu.slow_dtype(value):
                log.warning("ModelConfig.%s %r is honoured, but this CPU (profile %s) has no native bfloat16 "
                            "arithmetic: torch runs 16-bit products on a reference path, at a fraction of float32's "
                            "rate; \"auto\" picks float32 here", key, name, self.cpu.isa)

    # -- loading -----------------------------------------------------------------------
    def load(self) -> ModelInfo:
        family = self.family = self._family()
        arch = load_arch(self.source, self.architectures)
        self.arch = self.full_arch = arch
        if self.expert_parallel:
            errors = family.expert_parallel_errors(arch, 1 if self.tp is None else self.tp.world_size,
                                                   EXPERT_PARALLEL_KEY)
            if errors:
                raise ModelLoadError("; ".join(errors))
        if self.platform.device_type == "cpu" and cpu_extensions.enabled():  # built while the weights load
            self._kernel_build = threading.Thread(target=cpu_extensions.kernels, name="mindie-host-kernels",
                                                  daemon=True)
            self._kernel_build.start()
        tp = self.tp
        shard = None if tp is None else (lambda name: family.shard(name, arch, tp))
        readers = weight_readers(self.source, arch, shard, family)
        weights: dict[str, Any] = {}
        for i, (name, read) in enumerate(readers.items(), start=1):
            weights[name] = partial(self._read_weight, read, i, len(readers), name)
        stored: dict[str, Any] = {}
        if tp is None:
            stored = dict(low_bit_readers(self.source, arch, family)) if self.quantization == "auto" else {}
            if self.quantization in ("w8a16", "w8a8") or checkpoint_format(self.source) is not None:
                weights = {name: read() for name, read in weights.items()}  # the int8 schemes take from all of them
                stored.update(int8_matrices(self.source, arch.num_layers, weights, self.quantization))
        self.load_cpu_kernels(self._model_shapes(arch, stored))  # before the weights take their form
        kept_low_bit = len(stored)  # (the model takes them out of ``stored``)
        self.model = DecoderModel(arch, weights, self.platform, self.dtype, stored, tp, family)
        if tp is not None:
            self.arch = self.model.arch  # this rank's heads: the KV cache holds its KV heads only
        log.info(
            "loaded %s (%s family): %d layers, hidden %d, %s on %s%s",
            self.name, family.name, arch.num_layers, arch.hidden_size, str(self.dtype).removeprefix("torch."),
            self.platform.name,
            f", {kept_low_bit} matrices served in the file's low-bit form" if kept_low_bit else "",
        )
        return ModelInfo.from_arch(
            self.name, arch, dtype=str(self.dtype).removeprefix("torch."), device=self.platform.name,
            delta_gaps=family.delta_gaps(arch),
        )

    # -- KV cache --------------------------------------------------------------------------
    def kv_specs(self) -> list[KVSpec]:
        """Each layer's cache shape on this rank (the model's; before it is loaded, the architecture's)."""
        if self.model is not None:
            return self.model.kv_specs
        assert self.arch is not None
        return [KVSpec(self.arch.num_kv_heads, self.arch.head_dim, self.arch.head_dim)] * self.arch.num_layers

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        specs = self.kv_specs()
        if self.kv_int8:
            return block_size * sum(Int8KVCache.bytes_per_slot(s.heads, s.k_dim) + Int8KVCache.bytes_per_slot(
                s.heads, s.v_dim) for s in specs)
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return block_size * elem * sum(s.heads * (s.k_dim + s.v_dim) for s in specs)

    def available_kv_memory(self, requested_gb: int) -> int:
        if requested_gb > 0:
            return requested_gb * (1 << 30)
        free, total = self.platform.memory_info()
        return int(free * 0.8)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        assert self.arch is not None
        # decode graphs pad batches with rows that write to a spare block no sequence owns; the decode step
        # compiled while requests are served warms up there too
        spare = 1 if self.decode_graphs or self.compile_decode else 0
        device = self.platform.device()

        def shape(heads: int, dim: int) -> tuple[int, ...]:
            return self.platform.kv_cache_shape(num_blocks + spare, block_size, heads, dim)

        specs = self.kv_specs()
        if self.kv_int8:
            self.kv_caches = [
                (Int8KVCache(shape(s.heads, s.k_dim), self.dtype, device),  # type: ignore[misc]
                 Int8KVCache(shape(s.heads, s.v_dim), self.dtype, device))
                for s in specs
            ]
            self.block_size = block_size
            return
        self.kv_caches = [  # CPU: committed as used
            (lazy_zeros(shape(s.heads, s.k_dim), self.kv_dtype, device),
             lazy_zeros(shape(s.heads, s.v_dim), self.kv_dtype, device))
            for s in specs
        ]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.spare_block = num_blocks if spare else None
        if self.decode_graphs and self.model is not None:
            self.model.enable_graphs(
                self.kv_caches, num_blocks * block_size, self.GRAPH_MAX_SEQS, self.GRAPH_MAX_CONTEXT
            )

    def set_max_positions(self, max_positions: int) -> None:
        if self.model is not None:
            self.model.extend_rope(max_positions)

    # -- swap space ---------------------------------------------------------------------------
    def _block_views(self) -> list[torch.Tensor]:
        """Every layer's K and V cache viewed as ``[blocks, block_size, KV, D]``."""
        return [t.view(-1, self.block_size, *t.shape[-2:]) for pair in self.kv_caches for t in pair]

    def swap_block_bytes(self) -> int:
        if self.kv_int8 or not self.kv_caches:
            return 0  # the int8 cache keeps per-slot scales beside its codes: not swapped in this version
        return sum(v[0].numel() * v.element_size() for v in self._block_views())

    def allocate_swap_space(self, num_blocks: int) -> bool:
        if self.swap_block_bytes() == 0:
            return False
        # pinned for a CUDA cache's fast copies; elsewhere committed only as blocks are swapped out (cpuMemSize is a
        # ceiling: torch.zeros would make all of it resident at startup, 1 GiB per rank at cpuMemSize 1)
        if self.platform.device_type == "cuda":
            self.swap_space = [torch.zeros((num_blocks, *v.shape[1:]), dtype=v.dtype, pin_memory=True)
                               for v in self._block_views()]
        else:
            self.swap_space = [lazy_zeros((num_blocks, *v.shape[1:]), v.dtype) for v in self._block_views()]
        return True

    def swap_out(self, blocks: list[int], swap_blocks: list[int]) -> None:
        src = torch.tensor(blocks, dtype=torch.long, device=self.platform.device())
        dst = torch.tensor(swap_blocks, dtype=torch.long)
        for cache, swap in zip(self._block_views(), self.swap_space):
            swap[dst] = cache.index_select(0, src).to("cpu")

    def swap_in(self, swap_blocks: list[int], blocks: list[int]) -> None:
        src = torch.tensor(swap_blocks, dtype=torch.long)
        dst = torch.tensor(blocks, dtype=torch.long, device=self.platform.device())
        for cache, swap in zip(self._block_views(), self.swap_space):
            cache[dst] = swap.index_select(0, src).to(cache.device, non_blocking=True)

    # -- KV transfer (PD disaggregation) ---------------------------------------------------------
    def kv_block_shapes(self) -> tuple[str, list[list[int]]] | None:
        if self.kv_int8 or not self.kv_caches:
            return None  # the int8 cache keeps per-slot scales beside its codes: not transferred in this version
        return str(self.kv_dtype).removeprefix("torch."), [list(v.shape[1:]) for v in self._block_views()]

    def export_blocks(self, blocks: list[int]) -> list[torch.Tensor]:
        index = torch.tensor(blocks, dtype=torch.long, device=self.platform.device())
        return [cache.index_select(0, index).to("cpu") for cache in self._block_views()]

    def import_blocks(self, blocks: list[int], tensors: list[torch.Tensor]) -> None:
        index = torch.tensor(blocks, dtype=torch.long, device=self.platform.device())
        for cache, data in zip(self._block_views(), tensors, strict=True):
            cache[index] = data.to(cache.device, non_blocking=True)

    # -- forward -----------------------------------------------------------------------------
    def execute(self, batch: ModelInput) -> torch.Tensor:
        assert self.model is not None
        meta = self.platform.prepare_step(self.model.build_metadata(batch, self.block_size), batch, self.block_size)
        return self.model.forward(batch, meta, self.kv_caches, self.step_deltas(batch))

    def step_deltas(self, batch: ModelInput) -> LinearDeltas | None:
        """The linear-delta provider, prepared for ``batch``, when a row of it runs a variant; else None."""
        deltas = self.linear_deltas
        if deltas is None or not any(i >= 0 for i in batch.row_variants):
            return None
        deltas.prepare(batch)
        return deltas

    def set_linear_deltas(self, provider: LinearDeltas | None) -> bool:
        """Apply ``provider`` in every step that has a row on a variant (see :meth:`ModelBackend.set_linear_deltas`).

        Refused on a smoothed int8 checkpoint: its norms and projections were rescaled per
        channel, so deltas made for the original weights would read rescaled inputs.
        """
        if provider is not None and smoothed_checkpoint(self.source):
            raise RuntimeError(
                f"per-row linear deltas cannot run on {self.name!r}: it is a smoothed (anti-outlier) int8 checkpoint "
                "whose norms and projections were rescaled per channel; serve the floating-point model with "
                "quantization 'w8a8', or write the checkpoint with `mindie-host quantize --no-smooth`"
            )
        if provider is not None and self.tp is not None:  # each rank applies its slice of the deltas
            assert self.full_arch is not None
            provider = ShardedDeltas(provider, self.tp, self.full_arch)
        self.linear_deltas = provider
        return True

    #: decode steps of up to this many sequences run compiled when ``compile_decode`` is on (CPU)
    COMPILED_MAX_SEQS = 16
    #: seconds the first (cold) compile of the decode step may take on CPU before it is stopped and decode steps
    #: stay eager: ``MINDIE_HOST_COMPILE_BUDGET_S`` (0: no limit)
    COMPILE_BUDGET_S = 180.0
    #: decode graphs serve steps of up to this many sequences and context tokens (CUDA)
    GRAPH_MAX_SEQS = 256
    GRAPH_MAX_CONTEXT = 8192
    #: buckets captured at warm-up (the others on first use)
    GRAPH_WARM_SEQS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    GRAPH_WARM_CONTEXTS = (128, 256)

    def warmup(self) -> None:
        if not self.kv_caches:
            return
        self.load_cpu_kernels()  # built (or loaded from torch's extension cache) before the first request
        batch = ModelInput(
            input_ids=[0, 1], positions=[0, 1], query_lens=[2], context_lens=[2],
            block_tables=[[0]], logits_indices=[1], row_variants=[-1],
        )
        self.execute(batch)
        graphs = self.model.graphs if self.model is not None else None
        if graphs is not None:
            log.info("capturing decode graphs for %d batch sizes", len(self.GRAPH_WARM_SEQS))
            for ctx in self.GRAPH_WARM_CONTEXTS:
                for seqs in self.GRAPH_WARM_SEQS:
                    if graphs.covers(seqs, ctx):
                        graphs.capture(seqs, ctx)
        elif self.compile_decode and self.platform.device_type not in ("cpu", "cuda"):
            log.warning("compile is only supported on cpu and cuda; %s runs eager", self.platform.name)
        elif self.compile_decode and self.model is not None:
            log.info("compiling the decode step in the background (torch.compile; cached on disk after the first "
                     "time); decode steps run eagerly until it is ready")
            self._compile_thread = threading.Thread(
                target=self._compile_decode, args=(self.model,), name="mindie-host-compile", daemon=True
            )
            self._compile_thread.start()
        self.platform.synchronize()

    def load_cpu_kernels(self, shapes: cpu_selfcheck.ModelShapes | None = None) -> None:
        """Build or load this package's C++ kernels on CPU (:mod:`~mindie_host.backends.cpu_extensions`), the
        variant of this CPU's profile, and self-check them once against torch on the model's ``shapes``
        (:mod:`~mindie_host.backends.cpu_selfcheck`): a kernel that disagrees is turned off.

        :meth:`load` starts the build as it starts reading weights (the library's sources and the binding to
        torch compile side by side, one compiler process each) and checks before the weights take their form.
        """
        if self.platform.device_type != "cpu":
            return
        if self._kernel_build is not None:
            self._kernel_build.join()
            self._kernel_build = None
        kernels = cpu_extensions.kernels()
        if kernels is not None and shapes is not None and not self._kernels_checked:
            cpu_selfcheck.check_and_turn_off(kernels, shapes)
            self._kernels_checked = True

    def _read_weight(self, read: Any, index: int, total: int, name: str) -> torch.Tensor:
        """Read one tensor (when the model's layers take it), reporting progress."""
        tensor = torch.from_numpy(np.require(read(), requirements="W"))  # GGUF floats are read-only maps
        if self.progress is not None:
            self.progress(index, total, name)
        return tensor

    def _model_shapes(self, arch: ModelArch, stored: dict[str, Any]) -> cpu_selfcheck.ModelShapes:
        """What the kernels' paths depend on in this model (this rank's heads under tensor parallelism)."""
        from ...models.weights import EightBitGroups, FourBitGroups, LowBitReader

        ranks = 1 if self.tp is None else self.tp.world_size
        low_bit = set()
        for form in stored.values():
            if isinstance(form, LowBitReader):
                low_bit.add((form.kind, form.cols, form.group_size))
            elif isinstance(form, FourBitGroups | EightBitGroups):
                kind = "int4" if isinstance(form, FourBitGroups) else "int8"
                low_bit.add((kind, form.codes.shape[1], form.group_size))
        return cpu_selfcheck.ModelShapes(
            hidden=arch.hidden_size, heads=arch.num_heads // ranks, kv_heads=max(1, arch.num_kv_heads // ranks),
            head_dim=arch.head_dim, intermediate=arch.intermediate_size,
            kv_dtype=torch.float32 if self.kv_int8 else self.kv_dtype, low_bit=tuple(sorted(low_bit)))

    def _compile_decode(self, model: DecoderModel) -> None:
        """Compile the decode step on a thread of its own, while the engine serves eager steps.

        Dynamo's tracing and inductor's lowering are Python and hold the GIL, which would slow the
        eager steps served meanwhile many times over for the minutes a cold compile takes. So a
        child process (:mod:`~mindie_host.backends.torch.precompile`) compiles first, filling
        torch.compile's on-disk caches; this thread then compiles from them in seconds. Its warm-up
        steps write only to the spare cache block, which no sequence owns, and the model switches
        to the compiled step once they have run, so no request ever waits on a compile. A failed
        compile leaves decode steps eager (logged). A first compile that runs past :attr:`COMPILE_BUDGET_S` (a
        machine with few cores: 400 s on two Zen 3 cores) is stopped: decode steps stay eager, the log says so,
        and later starts of the same model on the same machine do not try again.
        """
        start = time.monotonic()
        budget = float(os.environ.get("MINDIE_HOST_COMPILE_BUDGET_S", self.COMPILE_BUDGET_S))
        try:
            if self.platform.device_type == "cpu":
                marker = self._slow_compile_marker()
                if budget and marker.exists():
                    log.warning("compile: true is not tried: the decode step's compile took more than %.0f s on this "
                                "machine before (%s); decode steps stay eager (delete that file, or set "
                                "MINDIE_HOST_COMPILE_BUDGET_S=0, to compile anyway)", budget, marker)
                    return
                try:
                    self._precompile_in_child(budget or None)
                except subprocess.TimeoutExpired:
                    marker.parent.mkdir(parents=True, exist_ok=True)
                    marker.write_text(json.dumps({"budget_s": budget, "threads": torch.get_num_threads(),
                                                  "when": time.strftime("%Y-%m-%dT%H:%M:%S")}))
                    log.warning("compiling the decode step takes more than %.0f s on this machine (%d threads): it is "
                                "stopped and decode steps stay eager, now and at later starts (%s records it; delete "
                                "it, or set MINDIE_HOST_COMPILE_BUDGET_S=0, to compile anyway)", budget,
                                torch.get_num_threads(), marker)
                    return
            child_s = time.monotonic() - start
            self.compile_now(model)
            log.info("decode steps of up to %d sequences now run compiled (%.1f s after warm-up; %.1f s of it in "
                     "the compile process)", self.COMPILED_MAX_SEQS, time.monotonic() - start, child_s)
        except Exception:
            log.exception("compiling the decode step failed; decode steps stay eager")
        finally:
            self.compile_finished.set()

    def compile_now(self, model: DecoderModel) -> None:
        """Compile the decode step here and now (warm-up steps on the spare block), then serve through it."""
        assert self.spare_block is not None
        self.load_cpu_kernels()  # the compiled step calls them (as the eager one does): loaded before tracing
        warm = []
        for seqs in (1, 2):  # one sequence is its own graph (size-1 dims are specialized)
            batch = ModelInput(
                input_ids=[0] * seqs, positions=[4 + seqs] * seqs, query_lens=[1] * seqs,
                context_lens=[5 + seqs] * seqs, block_tables=[[self.spare_block]] * seqs,
                logits_indices=list(range(seqs)), row_variants=[-1] * seqs,
            )
            meta = model.build_metadata(batch, self.block_size)
            warm.append((batch, self.platform.prepare_step(meta, batch, self.block_size)))
        model.compile_decode(self.COMPILED_MAX_SEQS, warm, self.kv_caches)

    def _slow_compile_marker(self) -> Path:
        """The file that records that this model's decode step took too long to compile with this many threads."""
        arch = self.arch
        key = (f"{arch.num_layers}x{arch.hidden_size}-{torch.get_num_threads()}threads-"
               f"{self.cpu.isa if self.cpu else 'cpu'}" if arch is not None else "unknown")
        return cpu_extensions.build_root() / "compile" / f"{key}.too-slow.json"

    def _precompile_in_child(self, timeout: float | None = None) -> None:
        """Run the same compile in a child process, to fill the on-disk caches without holding this one's GIL; a
        child still compiling after ``timeout`` seconds is killed (subprocess.TimeoutExpired)."""
        spec = PrecompileSpec(
            backend=f"{type(self).__module__}:{type(self).__qualname__}",
            kwargs={**self._init_kwargs, "compile_decode": True},
            platform=self.platform.name,
            threads=torch.get_num_threads(),
            max_positions=self.model.cos.shape[0] if self.model is not None else 0,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
        )
        child = subprocess.Popen(
            [sys.executable, "-m", "mindie_host.backends.torch.precompile"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        self._compile_child = child
        try:
            _, err = child.communicate(pickle.dumps(spec), timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
        if child.returncode != 0:  # the in-process compile then starts cold; slower, still correct
            tail = err.decode(errors="replace").strip().splitlines()[-3:]
            log.warning("the compile process exited with %s: %s", child.returncode, " | ".join(tail))

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for a background compile started by :meth:`warmup` (True at once when none was started);
        whether it has finished (successfully or not)."""
        if self._compile_thread is None:
            return True
        return self.compile_finished.wait(timeout)

    def shutdown(self) -> None:
        if self._compile_child is not None and self._compile_child.poll() is None:
            self._compile_child.kill()
        self.kv_caches = []
        self.swap_space = []
        self.model = None
