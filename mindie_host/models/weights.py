"""Reading models: architecture facts and weights, from an HF directory or a GGUF file.

The checkpoint's family (:mod:`mindie_host.models.architecture`) reads its ``config.json`` and names its tensors:
weights come out under the canonical (Llama's Hugging Face) names (``model.layers.0.self_attn.q_proj.weight``)
as float32 numpy arrays, whatever the source, so every backend (torch, MindSpore, Ascend) shares one loader.
GGUF tensors are dequantized with the ``gguf`` package, named as the family's checkpoint names them
(:mod:`mindie_host.models.gguf_files`) and put back in the checkpoint's form where llama.cpp's converter changed
it (the Q/K row permutation of its Llama converter; a family's own, :meth:`Architecture.from_gguf`), so a GGUF
reader hands the family the tensors an HF checkpoint would hold.

GGUF files whose matrices are stored as 4-bit groups (Q4_0, Q4_1) or 8-bit blocks
(Q8_0) also say so (:func:`low_bit_matrices`), handing 4-bit groups over as they are,
so a backend with low-bit kernels reads 8x fewer bytes per weight than fp32 without
re-quantizing anything.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from .architecture import Architecture, Architectures, ModelArch, Piece, unpermute_rows
from .architecture import LlamaArch as LlamaArch  # re-exported: the old import path
from .architecture import ModelLoadError as ModelLoadError
from .gguf_files import BLOCK_NAMES, checkpoint_names, read_info
from .gguf_header import gguf_tensors, read_gguf_header
from .llama import LLAMA
from .low_bit import EightBitGroups as EightBitGroups  # re-exported: the forms' old import path
from .low_bit import FourBitGroups as FourBitGroups
from .low_bit import eight_bit_from_gguf, four_bit_from_gguf, six_bit_from_gguf

#: the model types the host serves without a plugin (the builtin Llama family)
SUPPORTED_ARCHITECTURES = set(LLAMA.model_types)
#: the families :func:`load_arch` knows when it is given none (the host's builtin)
BUILTIN_ARCHITECTURES = Architectures.of(LLAMA)


@dataclass
class ModelSource:
    """Where a model lives: an HF directory, or a GGUF file (with its directory)."""

    kind: str  # "hf" | "gguf"
    path: Path
    directory: Path

    @property
    def name(self) -> str:
        stem = self.path.name if self.kind == "hf" else self.path.stem
        return stem.split(".Q")[0].split(".F")[0] if self.kind == "gguf" else stem


def resolve_model(path: str | os.PathLike[str]) -> ModelSource:
    """Classify ``path``: a ``.gguf`` file, a directory with ``config.json``, or a directory holding one GGUF."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path {str(p)!r} does not exist")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"model file {str(p)!r} is not a .gguf file")
        return ModelSource("gguf", p, p.parent)
    if (p / "config.json").exists():
        return ModelSource("hf", p, p)
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], p)
    raise ModelLoadError(f"{str(p)!r} has no config.json and not exactly one .gguf file")


# -- architecture ------------------------------------------------------------------------
def checkpoint_model_type(source: ModelSource) -> str:
    """The model type the checkpoint declares: ``config.json``'s ``model_type``, or a GGUF file's
    ``general.architecture``."""
    if source.kind == "gguf":
        return str(read_gguf_header(source.path).get("general.architecture"))
    try:
        cfg = json.loads((source.path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{source.path / 'config.json'} cannot be read: {exc}") from exc
    return str(cfg.get("model_type", "llama"))


def family_of(source: ModelSource, architectures: Architectures | None = None) -> Architecture:
    """The family that serves ``source`` among ``architectures`` (default: the host's builtin Llama family).

    A GGUF file's family is the first that reads its ``general.architecture`` and, by the file's tensors and
    metadata, says it is its own (:meth:`~mindie_host.models.architecture.Architecture.gguf_config`)."""
    registry = architectures if architectures is not None else BUILTIN_ARCHITECTURES
    if source.kind == "gguf":
        return _gguf_family(source, registry)[0]
    model_type = checkpoint_model_type(source)
    family = registry.get(model_type)
    if family is None:
        raise ModelLoadError(f"unsupported model_type {model_type!r}; supported: {registry.model_types()}")
    return family


def _gguf_family(source: ModelSource, registry: Architectures) -> tuple[Architecture, dict[str, Any]]:
    """The family of a GGUF file and the ``config.json`` dict it reads the file as."""
    info = read_info(source.path)
    for family in registry.families():
        if info.arch in family.gguf_architectures:
            cfg = family.gguf_config(info)
            if cfg is not None:
                return family, cfg
    experts = " with expert tensors" if info.key("expert_count") else ""
    raise ModelLoadError(f"unsupported GGUF architecture {info.arch!r}{experts}; supported: "
                         f"{registry.gguf_architectures()}")


def load_arch(source: ModelSource, architectures: Architectures | None = None) -> ModelArch:
    """Read the architecture from ``config.json`` (HF) or the GGUF metadata, through the checkpoint's family
    among ``architectures`` (default: the host's builtin Llama family)."""
    if source.kind == "gguf":
        family, cfg = _gguf_family(source, architectures if architectures is not None else BUILTIN_ARCHITECTURES)
        return family.read_config(cfg, None)
    family = family_of(source, architectures)
    return family.read_config(json.loads((source.path / "config.json").read_text()), source.path)


# -- weights -------------------------------------------------------------------------------
#: Which slice of an HF-named tensor to read: ``(dim, start, stop)``, or ``None`` for all of it.
Sharding = Callable[[str], "tuple[int, int, int] | None"]  # ELSEWHERE (dim -1): not read by this rank


#: Reads one canonical tensor when called: the float32 array :func:`iter_weights` yields for it.
Reader = Callable[[], np.ndarray]


def weight_readers(
    source: ModelSource, arch: ModelArch | None = None, shard: Sharding | None = None,
    family: Architecture | None = None,
) -> dict[str, Reader]:
    """``{canonical name: reader}`` for every tensor the model uses, in the file's order; nothing is read yet.

    Each reader reads its tensor (a rank's slice of it with ``shard``) and returns it as float32, adapted by the
    family, so a loader can turn each tensor into the form it is served in before reading the next (the peak is
    one tensor's float32 copy, not the model's). A GGUF tensor the family splits (fused, a stack of experts) is
    dequantized once and held until its last piece is read; its file pages are given back after each read.
    """
    family = family or family_of(source)
    arch = arch or load_arch(source, Architectures.of(family))
    if source.kind == "gguf":
        raw = _gguf_readers(source.path, arch, family, shard)
    else:
        raw = _safetensors_readers(source.path, arch, family, shard)
    return {name: partial(_adapted, family, name, read, arch) for name, read in raw.items()}


def _adapted(family: Architecture, name: str, read: Reader, arch: ModelArch) -> np.ndarray:
    return family.adapt(name, read(), arch)


def iter_weights(
    source: ModelSource, arch: ModelArch | None = None, shard: Sharding | None = None,
    family: Architecture | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(canonical name, float32 array)`` for every tensor the model uses (:func:`weight_readers`, read
    in the file's order).

    ``family`` (default: the builtin one that serves ``source``) names the checkpoint's tensors, splits its
    fused ones and adapts them (:class:`~mindie_host.models.architecture.Architecture`). With ``shard`` (a
    tensor-parallel rank's slicing rule, by canonical name), each tensor is read only as far as its slice:
    safetensors through the file's memory map, GGUF matrices by their rows (or their block-aligned columns)
    before dequantizing, so no rank holds a full copy.
    """
    for name, read in weight_readers(source, arch, shard, family).items():
        yield name, read()


def count_tensors(source: ModelSource, family: Architecture | None = None, arch: ModelArch | None = None) -> int:
    """How many tensors :func:`iter_weights` will yield (for progress bars)."""
    if source.kind == "gguf":
        return len(read_gguf_header(source.path).tensor_names)
    from safetensors import safe_open

    family = family or family_of(source)
    arch = arch or load_arch(source, Architectures.of(family))
    total = 0
    for f in _safetensor_files(source.path):
        with safe_open(str(f), framework="numpy") as st:
            total += sum(len(family.tensor_pieces(key, arch)) for key in st.keys() if not key.endswith(FP8_SCALE))
    return total


def _gguf_pieces(name: str, shape: list[int], arch: ModelArch, family: Architecture) -> list[tuple[str, list[Piece]]]:
    """GGUF tensor ``name``'s checkpoint name(s) (one per expert of a stack), each with the family's pieces."""
    names = checkpoint_names(name, tuple(shape), {**BLOCK_NAMES, **family.gguf_names})
    return [(n, family.tensor_pieces(n, arch)) for n in names or []]


def release_pages(tensor: Any) -> None:
    """Give back the resident pages of a GGUF tensor's bytes (read through the file's memory map) once it has
    been converted: they are the file's, read again from the page cache if touched, and would otherwise stay in
    the process's RSS beside the converted forms."""
    base = tensor.data
    while base is not None and not isinstance(base, np.memmap):
        base = base.base
    mm = getattr(base, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = int(tensor.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
    stop = int(tensor.data_offset) + int(tensor.n_bytes)
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, stop - start)
    except (OSError, ValueError):
        pass  # an advice the kernel refuses changes nothing but the RSS


class _SplitTensor:
    """A GGUF tensor the family splits into pieces: dequantized (and put in the checkpoint's form) on the first
    piece's read, held until the last piece is read."""

    def __init__(self, tensor: Any, shape: list[int], names: list[str], arch: ModelArch, family: Architecture) -> None:
        self.tensor, self.shape, self.names, self.arch, self.family = tensor, shape, names, arch, family
        self.arrays: dict[int, np.ndarray] = {}
        self.whole: np.ndarray | None = None
        self.pending = 0

    def read(self, index: int, piece: Piece, part: tuple[int, int, int] | None) -> np.ndarray:
        if self.whole is None:
            self.whole = _gguf_slice(self.tensor, self.shape, None)
            release_pages(self.tensor)
        if index not in self.arrays:
            self.arrays[index] = self.family.from_gguf(
                self.names[index], self.whole[index] if len(self.names) > 1 else self.whole, self.arch)
        array = self.arrays[index]
        rows = array if piece.rows is None else array[piece.rows[0] : piece.rows[1]]
        if part is not None:
            dim, lo, hi = part
            rows = rows[lo:hi] if dim == 0 else rows[:, lo:hi]
        out = np.ascontiguousarray(rows)
        if out is rows and out.base is not None:
            out = out.copy()  # not a view of the held tensor, which is dropped after its last piece
        self.pending -= 1
        if self.pending == 0:
            self.arrays, self.whole = {}, None
        return out


def _gguf_piece(tensor: Any, shape: list[int], part: tuple[int, int, int] | None, name: str, arch: ModelArch,
                family: Architecture) -> np.ndarray:
    array = family.from_gguf(name, _gguf_slice(tensor, shape, part), arch)
    release_pages(tensor)
    return array


def _gguf_readers(path: Path, arch: ModelArch, family: Architecture,
                  shard: Sharding | None = None) -> dict[str, Reader]:
    """A reader for each GGUF tensor's pieces under its checkpoint name, in the checkpoint's form
    (:meth:`Architecture.from_gguf`); a whole tensor is read only as far as a rank's slice, a split one whole."""
    out: dict[str, Reader] = {}
    for tensor in gguf_tensors(path):
        shape = [int(d) for d in reversed(tensor.shape.tolist())]
        mapped = _gguf_pieces(tensor.name, shape, arch, family)
        if len(mapped) == 1 and len(mapped[0][1]) == 1 and mapped[0][1][0].rows is None:
            (name, (piece,)), = mapped
            part = shard(piece.name) if shard is not None else None
            if part is None or part[0] >= 0:
                out[piece.name] = partial(_gguf_piece, tensor, shape, part, name, arch, family)
            continue
        split = _SplitTensor(tensor, shape, [name for name, _ in mapped], arch, family)
        for index, (_, pieces) in enumerate(mapped):
            for piece in pieces:
                part = shard(piece.name) if shard is not None else None
                if part is not None and part[0] < 0:
                    continue  # another rank's
                split.pending += 1
                out[piece.name] = partial(split.read, index, piece, part)
    return out


def _gguf_slice(tensor: Any, shape: list[int], part: tuple[int, int, int] | None) -> np.ndarray:
    """A GGUF tensor (or its ``part``) as float32, dequantizing only the bytes of the part where it can."""
    import gguf
    from gguf.quants import dequantize

    raw, qtype = tensor.data, tensor.tensor_type
    if part is None:
        return np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(shape)
    dim, lo, hi = part
    if dim == 0:  # rows: the rows' bytes only
        return np.asarray(dequantize(raw[lo:hi], qtype), dtype=np.float32).reshape([hi - lo, *shape[1:]])
    rows = shape[0]
    if raw.dtype != np.uint8:  # F32 / F16: elements, not blocks
        return np.asarray(raw.reshape(shape)[:, lo:hi], dtype=np.float32)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if lo % block == 0 and hi % block == 0:  # whole quantization blocks: their bytes only
        cols = raw[:, lo // block * size : hi // block * size]
        return np.asarray(dequantize(np.ascontiguousarray(cols), qtype), dtype=np.float32).reshape(rows, hi - lo)
    out = np.empty((rows, hi - lo), dtype=np.float32)
    for r in range(0, rows, 256):  # columns across blocks: dequantize a few rows at a time
        chunk = np.asarray(dequantize(raw[r : r + 256], qtype), dtype=np.float32).reshape(-1, shape[1])
        out[r : r + 256] = chunk[:, lo:hi]
    return out


@dataclass
class LowBitReader:
    """A matrix the model file stores below 16 bits, not read yet: its kind (``"int4"``: 4-bit groups, ``"int8"``:
    8-bit groups), shape and group size; calling it reads the :class:`FourBitGroups` / :class:`EightBitGroups`
    (then gives the file's pages back)."""

    kind: str
    rows: int
    cols: int
    group_size: int
    read: Callable[[], FourBitGroups | EightBitGroups]

    def __call__(self) -> FourBitGroups | EightBitGroups:
        return self.read()


def low_bit_readers(source: ModelSource, arch: ModelArch | None = None,
                    family: Architecture | None = None) -> dict[str, LowBitReader]:
    """How the model file stores its matrices that are below 16 bits, under canonical names, as readers.

    A Q4_0/Q4_1 matrix reads as its :class:`FourBitGroups`, a Q8_0 one as its :class:`EightBitGroups` (groups of
    32), a Q6_K one as 8-bit groups of 16 (exactly: :func:`six_bit_from_gguf`; llama-quantize stores a Q4_0 file's
    tied embedding so), Q/K rows un-permuted where the converter permuted them; other types (other K-quants, Q5,
    floats) are left out, and so
    are matrices the family splits (fused, stacks of experts), every matrix of a family whose rows are reordered
    after reading (:attr:`~mindie_host.models.architecture.Architecture.gguf_low_bit`) and everything of an HF
    directory.
    """
    if source.kind != "gguf":
        return {}
    import gguf

    family = family or family_of(source)
    arch = arch or load_arch(source, Architectures.of(family))
    if not family.gguf_low_bit:
        return {}
    out: dict[str, LowBitReader] = {}
    kinds = {gguf.GGMLQuantizationType.Q8_0: ("int8", 32), gguf.GGMLQuantizationType.Q6_K: ("int8", 16),
             gguf.GGMLQuantizationType.Q4_0: ("int4", 32), gguf.GGMLQuantizationType.Q4_1: ("int4", 32)}
    for tensor in gguf_tensors(source.path):
        mapped = _gguf_pieces(tensor.name, [int(d) for d in reversed(tensor.shape.tolist())], arch, family)
        if len(mapped) != 1 or len(mapped[0][1]) != 1 or mapped[0][1][0].rows is not None or len(tensor.shape) != 2:
            continue
        hf = mapped[0][1][0].name
        if not hf.endswith("proj.weight") and hf != "lm_head.weight" and hf != "model.embed_tokens.weight":
            continue
        kind = kinds.get(tensor.tensor_type)
        if kind is None:
            continue
        heads = (arch.num_heads if "q_proj" in hf else arch.num_kv_heads if "k_proj" in hf else 0
                 ) if family.gguf_permuted(arch) else 0
        out[hf] = LowBitReader(kind[0], int(tensor.shape[1]), int(tensor.shape[0]), kind[1],
                               partial(_read_low_bit, tensor, heads))
    return out


def _read_low_bit(tensor: Any, heads: int) -> FourBitGroups | EightBitGroups:
    """A Q8_0 / Q6_K / Q4_0 / Q4_1 tensor's groups, its rows un-permuted over ``heads`` heads (0: as stored)."""
    import gguf

    kind = tensor.tensor_type
    groups: FourBitGroups | EightBitGroups | None = (
        eight_bit_from_gguf(tensor) if kind == gguf.GGMLQuantizationType.Q8_0
        else six_bit_from_gguf(tensor) if kind == gguf.GGMLQuantizationType.Q6_K
        else four_bit_from_gguf(tensor))
    assert groups is not None
    release_pages(tensor)
    if heads and isinstance(groups, FourBitGroups):
        groups = FourBitGroups(*(unpermute_rows(a, heads) for a in (groups.codes, groups.scale, groups.offset)),
                               groups.group_size)
    elif heads:
        groups = EightBitGroups(*(unpermute_rows(a, heads) for a in (groups.codes, groups.scale)),
                                groups.group_size)
    return groups


def low_bit_matrices(source: ModelSource, arch: ModelArch | None = None,
                     family: Architecture | None = None) -> dict[str, FourBitGroups | EightBitGroups]:
    """Every matrix of :func:`low_bit_readers`, read (all at once: a loader takes them one at a time)."""
    return {name: read() for name, read in low_bit_readers(source, arch, family).items()}


def _safetensor_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / s for s in shards]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors files in {str(directory)!r}")
    return files


#: the suffix of an FP8 block-scaled weight's scales (DeepSeek-V3's format: ``weight = fp8 * weight_scale_inv``)
FP8_SCALE = "_scale_inv"


def fp8_block_size(directory: Path) -> tuple[int, int] | None:
    """The ``weight_block_size`` of an FP8 block-scaled checkpoint (``quantization_config.quant_method`` "fp8"),
    or None when it is not one; an FP8 config without block scales is refused."""
    cfg_path = directory / "config.json"
    qc = json.loads(cfg_path.read_text()).get("quantization_config") if cfg_path.exists() else None
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return None
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"{cfg_path}: an fp8 quantization_config is served with weight_block_size [rows, cols] "
                             f"(block scales, as DeepSeek-V3 ships); got {block!r}")
    return int(block[0]), int(block[1])


def _safetensors_readers(directory: Path, arch: ModelArch, family: Architecture,
                         shard: Sharding | None = None) -> dict[str, Reader]:
    """A reader for each piece of each tensor, as float32; an FP8 block-scaled checkpoint's weights dequantized
    with their ``weight_scale_inv`` blocks (read for the slice a rank reads only), the scales themselves not read
    as tensors."""
    from safetensors import safe_open

    block = fp8_block_size(directory)
    keys: dict[str, Path] = {}
    for f in _safetensor_files(directory):
        with safe_open(str(f), framework="pt") as st:
            keys.update({k: f for k in st.keys()})
    scales = {k: f for k, f in keys.items() if block is not None and k.endswith(FP8_SCALE)}
    out: dict[str, Reader] = {}
    for key, f in keys.items():
        if key in scales:
            continue
        for piece in family.tensor_pieces(key, arch):
            part = shard(piece.name) if shard is not None else None
            if part is not None and part[0] < 0:
                continue  # another rank's (never read)
            out[piece.name] = partial(_read_safetensor, f, key, piece, part, scales.get(key + FP8_SCALE), block)
    return out


def _read_safetensor(f: Path, key: str, piece: Piece, part: tuple[int, int, int] | None, scale_file: Path | None,
                     block: tuple[int, int] | None) -> np.ndarray:
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as st:
        tensor = _read_piece(st, key, piece, part).float()
        if scale_file is not None:
            assert block is not None
            tensor = _dequantize_fp8(tensor, scale_file, key + FP8_SCALE, block,
                                     _read_span(st.get_slice(key).get_shape(), piece, part))
    return tensor.numpy()  # type: ignore[no-any-return]


def _read_span(shape: list[int], piece: Piece, part: tuple[int, int, int] | None) -> tuple[int, int]:
    """The first row and column of what :func:`_read_piece` reads of a 2-D tensor of ``shape``."""
    base = piece.rows[0] if piece.rows is not None else 0
    if part is None:
        return base, 0
    dim, lo, _ = part
    return (base + lo, 0) if dim == 0 else (base, lo)


def _dequantize_fp8(tensor: Any, scale_file: Path, scale_key: str, block: tuple[int, int],
                    start: tuple[int, int]) -> Any:
    """``tensor`` (the float values of FP8 codes, read from ``start``) times its blocks' scales."""
    import torch
    from safetensors import safe_open

    with safe_open(str(scale_file), framework="pt") as st:
        scale = st.get_tensor(scale_key).float()
    rows = (torch.arange(tensor.shape[0]) + start[0]) // block[0]
    cols = (torch.arange(tensor.shape[1]) + start[1]) // block[1]
    return tensor * scale[rows][:, cols]


def _read_piece(st: Any, key: str, piece: Piece, part: tuple[int, int, int] | None) -> Any:
    """Rows ``piece.rows`` of tensor ``key`` (all of it when None), sliced by ``part``, read through the memory map:
    only the bytes of the slice."""
    if piece.rows is None and part is None:
        return st.get_tensor(key)
    view = st.get_slice(key)
    base, stop = piece.rows if piece.rows is not None else (0, view.get_shape()[0])
    if part is None:
        return view[base:stop]
    dim, lo, hi = part
    return view[base + lo : base + hi] if dim == 0 else view[base:stop, lo:hi]
