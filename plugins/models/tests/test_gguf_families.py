"""GGUF files of each family as llama.cpp's own converter writes them, served like the HF directory they came from.

Each family's tiny random model (conftest's config, made expressible in GGUF where the format cannot say what the
HF config does, see :data:`GGUF_KEYS`) has its weights rounded to float16 and is saved with ``save_pretrained``;
``convert_hf_to_gguf.py`` from llama-cpp-python's sdist (``scripts/fetch-llama-cpp.sh``; every conversion in one
process) writes it at F16 (and Q8_0 for :data:`Q8_FAMILIES`). The F16 file, whose weights are the directory's, gives the directory's greedy
tokens and prompt logprobs (within 1e-4); the Q8_0 file (served in its stored 8-bit blocks where the family allows)
scores the F16 file's own continuations within :data:`PPL_DELTA` of the F16 file's perplexity. The family is
recognised from the file alone: Mixtral is written as ``llama`` with expert tensors, ``GlmForCausalLM`` as
``chatglm``. The builtin family's Qwen2 (biased Q/K/V) is checked here too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from family_cases import SPECS, prompts, randomize_zero_biases

from mindie_host.api import EngineRequest, SamplingParams
from mindie_host.testing import (
    convert_to_gguf,
    llama_cpp_converter,
    loaded_host,
    make_tiny_model,
    run_engine,
    server_config,
    tiny_tokenizer,
)

pytestmark = pytest.mark.skipif(
    llama_cpp_converter() is None,
    reason="llama.cpp's convert_hf_to_gguf.py is not unpacked (scripts/fetch-llama-cpp.sh, run by install-dev.sh)",
)

#: what each family's GGUF model changes in conftest's config: what llama.cpp's format cannot carry
GGUF_KEYS: dict[str, dict[str, Any]] = {
    # no sliding window in llama.cpp's qwen3
    "qwen3": {"use_sliding_window": False, "sliding_window": None},
    # llama.cpp's qwen3moe has no dense layers
    "qwen3_moe": {"mlp_only_layers": []},
    "mixtral": {},
    # llama.cpp's chatglm takes a head as hidden / heads wide and the norms' epsilon as 1e-5 (the converter reads
    # ChatGLM's layernorm_epsilon, not rms_norm_eps)
    "glm": {"num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-5},
    "glm4": {},
    # llama.cpp's gemma3 reads every 6th layer as global and scales queries by the head size
    "gemma3_text": {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                    "query_pre_attn_scalar": 64},
    "phi3": {},
    "deepseek_v3": {},
    "deepseek_v2": {},
    "qwen2": {},
}
#: the family each file is served by
FAMILY = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "glm": "glm", "glm4": "glm4",
          "gemma3_text": "gemma3", "phi3": "phi3", "deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v2",
          "qwen2": "llama"}
#: the special tokens llama.cpp's GLM converters (``chatglm`` and ``glm4``) look up
GLM_TOKENS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
#: the Q8_0 file's perplexity on the F16 file's continuations may differ from the F16 file's by this share
PPL_DELTA = 0.02
#: the families whose Q8_0 file is checked: one of each kind of layer the 8-bit blocks are served in as stored
#: (dense attention and MLP, routed experts, sliding windows, latent attention); the others' Q8_0 tensors take
#: the same loader path (measured once: every family within 1.4%), and each conversion costs CI time
Q8_FAMILIES = frozenset({"qwen3", "mixtral", "gemma3_text", "deepseek_v3"})
NEW = 16


def round_to_f16(directory: Path) -> None:
    """The directory's weights rounded to float16 (kept float32, so both sides compute alike), its all-zero biases
    made random first (:func:`conftest.randomize_zero_biases`)."""
    from safetensors.torch import load_file, save_file

    randomize_zero_biases(directory)
    for f in directory.glob("*.safetensors"):
        tensors = {k: v.half().float() for k, v in load_file(str(f)).items()}
        save_file(tensors, str(f), metadata={"format": "pt"})


def sentencepiece_model() -> bytes:
    """A 100-piece sentencepiece model trained on made-up words (deterministic, a few milliseconds)."""
    import io

    import sentencepiece

    words = [f"w{i % 97}x{i % 13}" for i in range(3000)]
    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(" ".join(words[i:i + 12]) for i in range(0, len(words), 12)), model_writer=out,
        vocab_size=100, model_type="bpe", num_threads=1, minloglevel=2)
    return out.getvalue()


def tiny_gguf_model(name: str, directory: Path) -> Path:
    """Family ``name``'s tiny model as :data:`GGUF_KEYS` changes it, with a tokenizer the converter accepts: GLM's
    special tokens added; Phi-3's declared a GPT-2 tokenizer (the converter's other road needs sentencepiece);
    Qwen2's given a sentencepiece ``tokenizer.model``, the road its converter tries first (transformers reads a
    ``qwen2`` directory's tokenizer.json as Qwen2Tokenizer whatever it declares, with a pre-tokenizer the
    converter knows only on Qwen's own vocabulary). The tokenizers serve no test here: prompts are token ids."""
    keys = {**SPECS[name].keys, **GGUF_KEYS[name]}
    config_class, model_class = SPECS[name].classes()
    tokenizer_dir = None
    if name in ("glm", "glm4"):
        tokenizer = tiny_tokenizer()
        tokenizer.add_special_tokens({"additional_special_tokens": GLM_TOKENS})
        tokenizer_dir = directory.with_name(f"{directory.name}-tokenizer")
        tokenizer.save_pretrained(str(tokenizer_dir))
    path = make_tiny_model(directory, config_class, model_class, tokenizer_dir=tokenizer_dir, **keys)
    if name == "phi3":
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    if name == "qwen2":
        (path / "tokenizer.model").write_bytes(sentencepiece_model())
    round_to_f16(path)
    return path


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, Path]]:
    """name -> (f16-rounded HF directory, its F16 GGUF, its Q8_0 GGUF), converted in one converter process."""
    root = tmp_path_factory.mktemp("gguf")
    out: dict[str, tuple[Path, Path, Path]] = {}
    for name in GGUF_KEYS:
        hf = tiny_gguf_model(name, root / name)
        out[name] = (hf, root / f"{name}-f16.gguf", root / f"{name}-q8_0.gguf")
    convert_to_gguf([(hf, f16, "f16") for hf, f16, _ in out.values()]
                    + [(hf, q8, "q8_0") for name, (hf, _, q8) in out.items() if name in Q8_FAMILIES])
    return out


@contextmanager
def hosted(path: Path) -> Iterator[Any]:
    # the models plugin is enabled by the file alone (a Mixtral file through the ``llama`` entry point, once the
    # builtin family has said no to its expert tensors)
    host = loaded_host(server_config(path, model={"dtype": "float32"}))
    try:
        yield host
    finally:
        host.shutdown()


def greedy(host: Any, batch: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    reqs = [EngineRequest(f"g{i}", p, SamplingParams(max_tokens=NEW, ignore_eos=True, prompt_logprobs=0))
            for i, p in enumerate(batch)]
    out = run_engine(host, reqs)
    return ([out[f"g{i}"].token_ids for i in range(len(batch))],
            [[lp.logprob for lp in out[f"g{i}"].prompt_logprobs[1:]] for i in range(len(batch))])


def continuation_ppl(host: Any, batch: list[list[int]], continuations: list[list[int]]) -> float:
    """The perplexity of ``continuations`` after their prompts, scored as prompt tokens."""
    reqs = [EngineRequest(f"s{i}", p + c, SamplingParams(max_tokens=1, prompt_logprobs=0))
            for i, (p, c) in enumerate(zip(batch, continuations))]
    out = run_engine(host, reqs)
    lps = [lp.logprob for i, p in enumerate(batch) for lp in out[f"s{i}"].prompt_logprobs[len(p):]]
    return math.exp(-sum(lps) / len(lps))


@pytest.mark.parametrize("name", list(GGUF_KEYS))
def test_gguf_file_serves_as_its_hf_directory(name: str, gguf_models: dict[str, tuple[Path, Path, Path]]) -> None:
    hf, f16, q8 = gguf_models[name]
    vocab = json.loads((hf / "config.json").read_text()).get("vocab_size") or 49152
    batch = [prompts(vocab)[0], prompts(vocab)[3]]  # 17 and 47 tokens: past the sliding windows
    with hosted(hf) as host:
        want_tokens, want_lps = greedy(host, batch)
    with hosted(f16) as host:
        assert host.backend.family.name == FAMILY[name]
        tokens, lps = greedy(host, batch)
        ppl16 = continuation_ppl(host, batch, tokens)
    assert tokens == want_tokens
    for got, want in zip(lps, want_lps):
        assert got == pytest.approx(want, abs=1e-4)
    if name not in Q8_FAMILIES:
        return
    with hosted(q8) as host:
        ppl8 = continuation_ppl(host, batch, tokens)
    assert abs(ppl8 / ppl16 - 1) < PPL_DELTA, (ppl16, ppl8)


def chatglm_file(path: Path, *, fused: bool) -> Path:
    """A one-layer ``chatglm`` GGUF file (zero weights, a 64-token BPE vocabulary) that the ``glm`` family does not
    serve: Q, K and V fused in ``attn_qkv`` (as from THUDM's remote-code ChatGLM checkpoints), or apart with heads
    of 128 where the metadata says hidden / heads = 64 (a ``GlmForCausalLM`` whose ``head_dim`` is not hidden / heads,
    which the converter writes without a head size)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "chatglm")
    writer.add_block_count(1)
    writer.add_embedding_length(128)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_feed_forward_length(256)
    writer.add_context_length(128)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([chr(97 + i % 26) * (1 + i // 26) for i in range(64)])
    writer.add_token_types([1] * 64)
    writer.add_token_merges(["a a"])
    writer.add_eos_token_id(0)
    zeros = {"token_embd.weight": (64, 128), "output_norm.weight": (128,), "blk.0.attn_norm.weight": (128,)}
    zeros.update({"blk.0.attn_qkv.weight": (256, 128)} if fused else
                 {"blk.0.attn_q.weight": (256, 128), "blk.0.attn_k.weight": (128, 128), "blk.0.attn_v.weight": (128, 128)})
    for name, shape in zeros.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("fused", "says"), [(True, "fused attn_qkv"), (False, "attn_q has 256 rows")])
def test_chatglm_files_the_glm_family_cannot_read_are_refused_by_what_they_hold(
    fused: bool, says: str, tmp_path: Path
) -> None:
    from mindie_host.backend_api import ModelLoadError

    with pytest.raises(ModelLoadError, match=says):
        loaded_host(server_config(chatglm_file(tmp_path / "chatglm.gguf", fused=fused), model={"dtype": "float32"}))


def test_a_windowed_tokens_bits_do_not_depend_on_its_step(gguf_models: dict[str, tuple[Path, Path, Path]]) -> None:
    """Gemma 3's Q8_0 file (sliding layers with a window of 16, and a global one) in batch-invariant mode: a token's
    logits carry the same bits however its prompt was chunked, how much of it a prefix cache held, and whatever
    shares its step, past the window as before it; so do the decode steps after it. (Steps whose window hides keys
    run torch's banded attention; one-token steps, the windowed decode path: both must agree with the whole
    prompt's rows.)"""
    hf, _, q8 = gguf_models["gemma3_text"]
    with hosted(q8) as host:  # the models plugin registers the family; its backend is then stepped by hand
        backend = host.backend
        assert backend.family.name == "gemma3"
        backend.allocate_kv_cache(64, 16)  # a pool of its own: 16-token blocks, 8 a sequence
        check_windowed_steps(backend, hf)


def check_windowed_steps(backend: Any, hf: Path) -> None:
    """The steps of :func:`test_a_windowed_tokens_bits_do_not_depend_on_its_step` on a loaded ``backend``."""
    import torch

    from mindie_host.api import ModelInput

    vocab = json.loads((hf / "config.json").read_text()).get("vocab_size") or 49152
    ps = prompts(vocab)
    lengths = [len(p) for p in ps]

    def step(seqs: list[tuple[int, int, int]], logits: list[int]) -> torch.Tensor:
        """Queries ``(prompt s, first position, tokens)``; positions past the prompt bring generated tokens."""
        return backend.execute(ModelInput(
            input_ids=[ps[s][p] if p < lengths[s] else 11 + p for s, start, n in seqs for p in range(start, start + n)],
            positions=[p for _, start, n in seqs for p in range(start, start + n)],
            query_lens=[n for *_, n in seqs], context_lens=[start + n for _, start, n in seqs],
            block_tables=[[8 * s + i for i in range(8)] for s, *_ in seqs], logits_indices=logits,
            row_variants=[-1] * len(seqs), prompt_lens=[lengths[s] for s, *_ in seqs]))

    n, m = lengths[3], lengths[2]  # 47 and 33 tokens: past the window
    whole = step([(3, 0, n)], [n - 1])[0]
    gen = [step([(3, n + j, 1)], [0])[0] for j in range(2)]  # two decode steps after the whole prompt
    for size in (5, 20):  # chunks of 5, then of 20
        for start in range(0, n, size):
            got = step([(3, start, min(size, n - start))], [min(size, n - start) - 1])[0]
        assert torch.equal(got, whole), size
        assert torch.equal(step([(3, n, 1)], [0])[0], gen[0]), size
    alone = step([(2, 0, m)], [m - 1])[0]
    step([(3, 0, n - 1)], [n - 2])  # all but the last token held, as a prefix cache would
    assert torch.equal(step([(3, n - 1, 1)], [0])[0], whole)  # the last alone in its step
    beside = step([(2, 0, m), (3, n - 1, 1)], [m - 1, m])  # the last alone, beside another prompt
    assert torch.equal(beside[1], whole) and torch.equal(beside[0], alone)
    step([(3, n, 1)], [0])
    mixed = step([(3, n + 1, 1), (2, 0, m)], [0, m])  # a decode row beside a prompt
    assert torch.equal(mixed[0], gen[1]) and torch.equal(mixed[1], alone)
