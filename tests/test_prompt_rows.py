"""Prompt tokens multiply in bfloat16 or int8, generated tokens through the low-bit kernel, per token (issues 24, 35).

On the default model (GGUF, ``quantization: auto``, batch-invariant) a step that says which rows are
prompt tokens (``ModelInput.prompt_lens``) multiplies those with each matrix's bfloat16 copy and the
generated rows with the file's low-bit form. The choice follows the token, never the batch: a
prompt's logits carry the same bits alone, beside other prompts, or beside decodes in a mixed step;
and a decode row beside a prompt chunk gets the bits it gets alone. ``MINDIE_HOST_PROMPT_BF16=0``
keeps the low-bit kernel for prompt rows; both stay close to the fp32 reference (``quantization:
none``), which does not change. Every test runs in both prompt modes: bfloat16 copies (``MINDIE_HOST_PROMPT_INT8=0``)
and int8 groups of 32 against the file's codes (``MINDIE_HOST_PROMPT_INT8=1``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from mindie_host.backends import cpu_profile
from mindie_host.backends.base import ModelInput
from mindie_host.backends.linear import LowBitWeight, PromptRows
from mindie_host.backends.platform import Platform
from mindie_host.backends.torch.backend import TorchBackend
from mindie_host.models.default import default_model_path
from mindie_host.models.weights import resolve_model

LENGTHS = [37, 5, 64, 23]


def load(quantization: str) -> TorchBackend:
    backend = TorchBackend(resolve_model(default_model_path()), name="default", dtype="float32",
                           quantization=quantization, platform=Platform())
    backend.load()
    backend.allocate_kv_cache(64, 16)
    return backend


#: the two kinds of prompt products: a bfloat16 copy of each low-bit matrix, or int8 groups against its codes
PROMPT_MODES = {"bf16": "0", "int8": "1"}


@pytest.fixture(scope="module", params=sorted(PROMPT_MODES))
def auto(request: pytest.FixtureRequest) -> Iterator[TorchBackend]:
    mode = request.param
    if mode == "bf16" and not cpu_profile.profile().native_bf16:
        pytest.skip("bfloat16 prompt copies need a CPU with native bfloat16")
    if mode == "int8" and cpu_profile.profile().int8_products is None:
        pytest.skip("int8 prompt rows need a CPU with native int8 products")
    before = os.environ.get("MINDIE_HOST_PROMPT_INT8")
    os.environ["MINDIE_HOST_PROMPT_INT8"] = PROMPT_MODES[mode]
    try:
        backend = load("auto")
    finally:
        if before is None:
            del os.environ["MINDIE_HOST_PROMPT_INT8"]
        else:
            os.environ["MINDIE_HOST_PROMPT_INT8"] = before
    backend.prompt_mode = mode  # type: ignore[attr-defined]
    yield backend


def prompts() -> list[list[int]]:
    return [[(31 * s + 7 * t + 3) % 40000 for t in range(n)] for s, n in enumerate(LENGTHS)]


def tables(k: int) -> list[int]:
    return [5 * k + i for i in range(5)]


def prefill(backend: TorchBackend, which: list[int], with_prompt_lens: bool = True) -> torch.Tensor:
    """One step prefilling the prompts ``which`` together; the last row's logits of each."""
    ps = prompts()
    rows, ends = [], []
    for s in which:
        rows.extend(ps[s])
        ends.append(len(rows) - 1)
    return backend.execute(ModelInput(
        input_ids=rows, positions=[t for s in which for t in range(LENGTHS[s])],
        query_lens=[LENGTHS[s] for s in which], context_lens=[LENGTHS[s] for s in which],
        block_tables=[tables(s) for s in which], logits_indices=ends, row_variants=[-1] * len(which),
        prompt_lens=[LENGTHS[s] for s in which] if with_prompt_lens else []))


def test_prompt_rows_are_found_by_position() -> None:
    rows = PromptRows.of(torch.tensor([0, 1, 2, 7, 8, 3]), [3, 2, 1], [3, 8, 10])
    assert rows is not None and not rows.all
    assert rows.prompt is not None and rows.prompt.tolist() == [0, 1, 2, 3, 5]
    assert rows.generated is not None and rows.generated.tolist() == [4]
    assert PromptRows.of(torch.tensor([5, 6]), [1, 1], [3, 4]) is None  # decodes only
    assert PromptRows.of(torch.tensor([0, 1]), [2], []) is None  # prompt lengths not known


def test_low_bit_layers_multiply_prompts_by_their_mode(auto: TorchBackend) -> None:
    """bf16: each low-bit matrix keeps a bfloat16 copy for prompt rows; int8: none, its codes serve prompt rows."""
    assert auto.model is not None
    qkv = auto.model.layers[0].attn.qkv
    assert isinstance(qkv, LowBitWeight) and qkv.dense is None
    if auto.prompt_mode == "bf16":  # type: ignore[attr-defined]
        assert qkv.prompt_weight is not None and qkv.prompt_weight.dtype == torch.bfloat16 and not qkv.prompt_int8
    else:
        assert qkv.prompt_weight is None and qkv.prompt_int8


def test_a_prompts_logits_do_not_depend_on_what_shares_its_step(auto: TorchBackend) -> None:
    together = prefill(auto, [0, 1, 2, 3])
    for i, s in enumerate([0, 1, 2, 3]):
        assert torch.equal(prefill(auto, [s])[0], together[i]), s


def test_mixed_step_gives_each_kind_of_row_its_own_bits(auto: TorchBackend) -> None:
    prefill(auto, [0])  # prompt 0's KV, then one decode token for it
    alone = auto.execute(ModelInput(
        input_ids=[11], positions=[LENGTHS[0]], query_lens=[1], context_lens=[LENGTHS[0] + 1],
        block_tables=[tables(0)], logits_indices=[0], row_variants=[-1], prompt_lens=[LENGTHS[0]]))
    mixed = auto.execute(ModelInput(
        input_ids=[11, *prompts()[2]], positions=[LENGTHS[0], *range(LENGTHS[2])], query_lens=[1, LENGTHS[2]],
        context_lens=[LENGTHS[0] + 1, LENGTHS[2]], block_tables=[tables(0), tables(2)],
        logits_indices=[0, LENGTHS[2]], row_variants=[-1, -1], prompt_lens=[LENGTHS[0], LENGTHS[2]]))
    assert torch.equal(mixed[0], alone[0])
    assert torch.equal(mixed[1], prefill(auto, [2])[0])


def test_a_step_whose_prompt_rows_are_not_one_run_serves_each_row_its_own_bits(auto: TorchBackend) -> None:
    """Prompt rows on both sides of a generated one (a prompt chunk, a decode, a prompt chunk; a sequence recomputed
    after preemption also brings prompt and generated tokens in one chunk): the rows are picked by index, not by a
    slice, and each row still gets the bits it gets alone. Under load this step failed (index_put of bfloat16
    prompt products into a float32 output) and the scheduling-policy benchmark lost requests to it."""
    prefill(auto, [0])
    alone = auto.execute(ModelInput(
        input_ids=[11], positions=[LENGTHS[0]], query_lens=[1], context_lens=[LENGTHS[0] + 1],
        block_tables=[tables(0)], logits_indices=[0], row_variants=[-1], prompt_lens=[LENGTHS[0]]))
    n2, n3 = LENGTHS[2], LENGTHS[3]
    mixed = auto.execute(ModelInput(
        input_ids=[*prompts()[2], 11, *prompts()[3]], positions=[*range(n2), LENGTHS[0], *range(n3)],
        query_lens=[n2, 1, n3], context_lens=[n2, LENGTHS[0] + 1, n3], block_tables=[tables(2), tables(0), tables(3)],
        logits_indices=[n2 - 1, n2, n2 + n3], row_variants=[-1, -1, -1], prompt_lens=[n2, LENGTHS[0], n3]))
    assert torch.equal(mixed[1], alone[0])
    assert torch.equal(mixed[0], prefill(auto, [2])[0])
    assert torch.equal(mixed[2], prefill(auto, [3])[0])


def step(backend: TorchBackend, seqs: list[tuple[int, int, int]], logits: list[int]) -> torch.Tensor:
    """One step of queries ``(prompt s, first position, tokens)`` over prompt ``s``'s blocks (positions past the
    prompt bring token 11 + position: generated tokens); the logits of flat rows ``logits``."""
    ids: list[int] = []
    for s, start, n in seqs:
        ids.extend(prompts()[s][p] if p < LENGTHS[s] else 11 + p for p in range(start, start + n))
    return backend.execute(ModelInput(
        input_ids=ids, positions=[p for _, start, n in seqs for p in range(start, start + n)],
        query_lens=[n for *_, n in seqs], context_lens=[start + n for _, start, n in seqs],
        block_tables=[tables(s) for s, *_ in seqs], logits_indices=logits, row_variants=[-1] * len(seqs),
        prompt_lens=[LENGTHS[s] for s, *_ in seqs]))


def test_a_prompts_last_token_alone_gets_the_bits_it_gets_in_the_whole_prompt(auto: TorchBackend) -> None:
    """A prefix cache that holds all of a prompt but its last token leaves that token alone in its step (query of
    one, maybe beside decode rows): it is still a prompt token (the prompt products, prompt attention), so its
    logits, and the KV it writes for the next token, carry the bits a whole-prompt step gives. It went through the
    decode products and decode attention, and a served greedy answer changed with the prefix cache's state."""
    n = LENGTHS[0]
    whole = prefill(auto, [0])[0]
    next_whole = step(auto, [(0, n, 1)], [0])[0]
    step(auto, [(0, 0, n - 1)], [n - 2])  # all but the last prompt token: what the prefix cache held
    assert torch.equal(step(auto, [(0, n - 1, 1)], [0])[0], whole)
    assert torch.equal(step(auto, [(0, n, 1)], [0])[0], next_whole)
    n1 = LENGTHS[1]
    prefill(auto, [1])
    decode1 = step(auto, [(1, n1, 1)], [0])[0]
    beside = step(auto, [(0, n - 1, 1), (1, n1, 1)], [0, 1])  # beside another sequence's decode row
    assert torch.equal(beside[0], whole) and torch.equal(beside[1], decode1)
    assert torch.equal(step(auto, [(0, n - 17, 17)], [16])[0], whole)  # a chunk of 17: the same bits


def test_generated_tokens_computed_again_as_decode_rows_get_their_first_bits(auto: TorchBackend) -> None:
    """A sequence preempted by recompute comes back with its prompt and its generated tokens; the engine lays the
    generated ones out as one-token decode rows after the prompt's query (engine/step_input.py), and each gets the
    logits it got when it was decoded."""
    n = LENGTHS[3]
    prefill(auto, [3])
    first = [step(auto, [(3, n + j, 1)], [0])[0] for j in range(3)]
    again = step(auto, [(3, 0, n), (3, n, 1), (3, n + 1, 1), (3, n + 2, 1)], [n, n + 1, n + 2])
    for j in range(3):
        assert torch.equal(again[j], first[j])


def test_prompt_products_stay_close_to_the_fp32_reference(auto: TorchBackend) -> None:
    reference = load("none")
    want = prefill(reference, [0, 2, 3])
    bf16 = prefill(auto, [0, 2, 3])
    low_bit = prefill(auto, [0, 2, 3], with_prompt_lens=False)  # no prompt rows known: the low-bit kernel
    assert not torch.equal(bf16, low_bit)
    # prompt 2's best tokens are 0.15 apart in fp32 and bf16 products or the 4-bit weights may swap them: the token
    # each path picks must be one the reference scores within 0.25 of its best (the others' picks are the same)
    for got in (bf16, low_bit):
        picked = want.gather(-1, got.argmax(-1, keepdim=True)).squeeze(-1)
        assert bool((want.max(-1).values - picked < 0.25).all())
    assert torch.equal(bf16.argmax(-1)[[0, 2]], want.argmax(-1)[[0, 2]])
    for got in (bf16, low_bit):
        probs, ref = torch.softmax(got, -1), torch.softmax(want, -1)
        assert (probs - ref).abs().sum(-1).max() < 0.25  # total variation, both within the 4-bit file's error


def test_int8_prompt_rows_are_opt_in_and_need_native_int8(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off unless ``MINDIE_HOST_PROMPT_INT8=1``; 1 on a profile without native int8 products, or a value other than
    0 and 1, is an error that names the variable (at load: a start-up error, never a silent fallback)."""
    from mindie_host.backends.linear import prompt_int8_enabled

    monkeypatch.delenv("MINDIE_HOST_PROMPT_INT8", raising=False)
    assert not prompt_int8_enabled()
    monkeypatch.setenv("MINDIE_HOST_PROMPT_INT8", "yes")
    with pytest.raises(ValueError, match="MINDIE_HOST_PROMPT_INT8 must be 0 or 1"):
        prompt_int8_enabled()
    monkeypatch.setenv("MINDIE_HOST_PROMPT_INT8", "1")
    monkeypatch.setenv(cpu_profile.ENV, "portable")
    with pytest.raises(RuntimeError, match="no native int8 products"):
        prompt_int8_enabled()
    if cpu_profile.features().runs("avx2"):
        monkeypatch.setenv(cpu_profile.ENV, "avx2")
        assert prompt_int8_enabled()


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0", "int8_per_channel"])
def test_the_int8_reference_is_the_product_of_the_quantized_rows(kind: str) -> None:
    """``q8_rows_reference`` (what the kernels' ``lowbit_q8_rows`` must equal bit for bit) is the product of the
    int8-rounded activations with the file's exact weights, to float32 rounding; the rounding itself stays within
    half a step of each group's scale."""
    from mindie_host.backends.cpu_matmul import LowBitTiles, q8_rows_reference, quantize_rows

    gen = torch.Generator().manual_seed(7)
    n, k = 70, 576
    x = torch.randn(5, k, generator=gen)
    x[:, 3] = 40.0  # an outlier channel, as RMSNorm outputs have
    x[1, 64:96] = 0.0  # an all-zero group: scale 0, codes 0
    scale = torch.rand(n, k // 32, generator=gen).half().float()
    if kind in ("q4_0", "q4_1"):
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        offset = -8 * scale if kind == "q4_0" else torch.randn(n, k // 32, generator=gen).half().float()
        tiles = LowBitTiles.four_bit(codes, scale, offset, 32)
    elif kind == "q8_0":
        tiles = LowBitTiles(torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), scale,
                            torch.zeros_like(scale), 32)
    else:
        tiles = LowBitTiles.per_channel(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
                                        torch.rand(n, generator=gen))
    assert tiles.stored_offsets == (kind == "q4_1")
    rows = quantize_rows(x)
    groups = x.view(5, -1, 32)
    assert rows.q.abs().max() <= 127 and torch.equal(rows.scale[1, 2], torch.tensor(0.0))
    assert bool(((rows.q.view(5, -1, 32).float() * rows.scale[..., None] - groups).abs()
                 <= rows.scale[..., None] / 2 * (1 + 1e-5)).all())
    assert torch.equal(rows.qsum, rows.q.view(5, -1, 32).sum(-1, dtype=torch.int32))
    exact = (rows.q.double().view(5, -1, 32) * rows.scale.double()[..., None]).view(5, k) @ tiles.dequantize().double().T
    got = q8_rows_reference(rows, tiles).double()
    assert ((got - exact).abs().max() / exact.abs().max()) < 1e-6
    alone = q8_rows_reference(quantize_rows(x[2:3]), tiles)
    assert torch.equal(alone[0], got[2].float())  # a row's bits do not depend on the other rows


def test_int8_prompt_rows_carry_the_kernels_bits_without_them(auto: TorchBackend,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Int8 mode: the whole model's prompt logits are the same bits with the int8 kernels (``lowbit_q8_rows``,
    ``quantize_rows``) as with them off (torch's quantize_rows and q8_rows_reference), so turning a kernel off never
    changes an answer."""
    from mindie_host.backends import cpu_extensions

    if auto.prompt_mode != "int8":  # type: ignore[attr-defined]
        pytest.skip("int8 mode only")
    from mindie_host.backends import cpu_matmul

    if not cpu_matmul.q8_rows_loaded():
        pytest.skip("the int8 kernels are not built here")
    with_kernels = prefill(auto, [0, 2])
    active = cpu_extensions.active
    monkeypatch.setattr(cpu_extensions, "active", lambda name: None if name == "lowbit_q8_rows" else active(name))
    assert not cpu_matmul.q8_rows_loaded()
    try:
        assert torch.equal(prefill(auto, [0, 2]), with_kernels)
    finally:
        assert auto.model is not None
        for layer in auto.model.layers:  # drop the reference's float32 integer weights
            for weight in (*vars(layer.attn).values(), *vars(layer.mlp).values()):
                if isinstance(weight, LowBitWeight):
                    weight._int_values = None
