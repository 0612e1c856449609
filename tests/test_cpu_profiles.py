"""The CPU profile (kernel variant and compute dtypes from the CPU's features), the self-check, and equal answers.

A new user on an AVX2 server got a wrong answer from the default config while CI, on AVX-512, passed: no
test ran the kernels' other paths, and the bf16 paths ran on a CPU without native bf16. Here: the profile
is chosen from mocked CPU features for each kind of CPU (and ``MINDIE_HOST_CPU_ISA`` forces it, or fails
clearly); a kernel whose answer is corrupted is caught by the self-check at load, turned off with one
warning, and the server's answers are torch's; and for every variant this CPU executes, the default
model's greedy answers equal the answers with every kernel off.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from test_low_bit_weights import decode_logits, loaded, write_tiny_gguf

from mindie_host.api import EngineRequest, SamplingParams
from mindie_host.backends import cpu_extensions, cpu_profile, cpu_selfcheck
from mindie_host.backends.base import ModelInput
from mindie_host.backends.cpu_profile import CpuFeatures
from mindie_host.testing import loaded_host, run_engine, server_config

V3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

#: (machine, flags) of kinds of CPU -> (variant, native bf16, int8 products)
CPUS = {
    "Zen 3 / Haswell (AVX2)": ("x86_64", V3, ("avx2", False, "avx2")),
    "Alder Lake (AVX2 + AVX-VNNI)": ("x86_64", V3 | {"avx_vnni"}, ("avx2", False, "vnni")),
    "Skylake-X / Ice Lake (AVX-512, no BF16)": ("x86_64", V4 | {"avx512_vnni"}, ("avx2", False, "vnni")),
    "Zen 4 / Sapphire Rapids (AVX-512 BF16)": ("x86_64", V4 | {"avx512_bf16", "avx512_vnni"},
                                               ("avx512", True, "vnni")),
    "an x86-64 without AVX2": ("x86_64", {"sse2", "avx"}, ("portable", False, None)),
    "Graviton (aarch64)": ("aarch64", {"fp", "asimd", "bf16"}, ("portable", False, None)),
}


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set the CPU features the profile sees (and clear the cached profiles)."""

    def set_cpu(machine: str, flags: set[str]) -> None:
        monkeypatch.setattr(cpu_profile, "features", lambda: CpuFeatures(machine, frozenset(flags)))
        cpu_profile._profile.cache_clear()

    yield set_cpu
    cpu_profile._profile.cache_clear()


@pytest.mark.parametrize("kind", CPUS)
def test_each_kind_of_cpu_gets_its_variant_and_dtypes(cpu: Any, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    machine, flags, (isa, bf16, int8) = CPUS[kind]
    cpu(machine, flags)
    monkeypatch.delenv(cpu_profile.ENV, raising=False)
    chosen = cpu_profile.profile()
    assert (chosen.isa, chosen.native_bf16, chosen.int8_products, chosen.forced) == (isa, bf16, int8, False)
    assert chosen.compute_dtype == (torch.bfloat16 if bf16 else torch.float32)
    line = chosen.describe()
    assert line.startswith(f"CPU profile {isa} (detected on {machine}") and ("(native bf16)" in line) == bf16


def test_the_forced_profile_is_the_one_that_cpu_would_get(cpu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu("x86_64", V4 | {"avx512_bf16", "avx512_vnni"})
    for isa, bf16, int8 in (("portable", False, None), ("avx2", False, "avx2"), ("avx512", True, "vnni")):
        monkeypatch.setenv(cpu_profile.ENV, isa)
        chosen = cpu_profile.profile()
        assert (chosen.isa, chosen.native_bf16, chosen.int8_products, chosen.forced) == (isa, bf16, int8, True)
        assert f"{cpu_profile.ENV}={isa}" in chosen.describe()


def test_an_unknown_or_unexecutable_variant_is_a_startup_error(cpu: Any, monkeypatch: pytest.MonkeyPatch,
                                                                tiny_model: Path) -> None:
    cpu("x86_64", V3)
    monkeypatch.setenv(cpu_profile.ENV, "avx1024")
    with pytest.raises(ValueError, match=r"MINDIE_HOST_CPU_ISA='avx1024' .* allowed: portable, avx2, avx512"):
        cpu_profile.profile()
    monkeypatch.setenv(cpu_profile.ENV, "avx512")
    with pytest.raises(RuntimeError, match=r"cannot execute the avx512 kernels .*avx512_bf16.*allowed here: "
                                           r"portable, avx2"):
        cpu_profile.profile()
    with pytest.raises(RuntimeError, match="cannot execute the avx512 kernels"):  # a server does not start
        loaded_host(server_config(tiny_model))
    monkeypatch.setenv(cpu_profile.ENV, "neon")
    with pytest.raises(RuntimeError, match="lacks an aarch64 CPU, not x86_64"):
        cpu_profile.profile()
    cpu("aarch64", {"asimd"})
    monkeypatch.setenv(cpu_profile.ENV, "avx2")
    with pytest.raises(RuntimeError, match="an x86-64 CPU, not aarch64.*allowed here: portable, neon"):
        cpu_profile.profile()
    monkeypatch.setenv(cpu_profile.ENV, "neon")  # opt-in on Arm: only when asked for
    assert (cpu_profile.profile().isa, cpu_profile.profile().forced) == ("neon", True)


def test_features_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_profile.read_features(str(info)).flags == {"fpu", "sse2", "avx", "avx2", "fma"}
    info.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm bf16\n")
    assert "asimd" in cpu_profile.read_features(str(info)).flags
    assert cpu_profile.read_features(str(tmp_path / "missing")).flags == frozenset()


def test_a_16_bit_dtype_set_explicitly_is_honoured_with_a_warning_without_native_bf16(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(cpu_profile.ENV, "avx2")
    monkeypatch.setattr(cpu_profile, "_logged", set())  # the profile line is logged once a process: an earlier test's
    with caplog.at_level(logging.INFO, "mindie_host.backends"):
        host = loaded_host(server_config(tiny_model, model={"dtype": "bfloat16"}))
    assert host.backend.dtype == torch.bfloat16
    messages = [r.getMessage() for r in caplog.records]
    assert any("ModelConfig.dtype 'bfloat16' is honoured" in m and "profile avx2" in m for m in messages)
    assert any(m.startswith("CPU profile avx2 (MINDIE_HOST_CPU_ISA=avx2)") for m in messages)


class Corrupted:
    """A variant's kernels with one kernel's answers made wrong (the test's seam): everything else delegates."""

    def __init__(self, kernels: Any, method: str) -> None:
        self._kernels, self._method = kernels, method

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._kernels, name)
        if name != self._method:
            return real

        def wrong(*args: Any) -> Any:
            out = real(*args)
            first = out[0] if isinstance(out, list) else out
            first.view(-1)[3] += 0.25  # one element off
            return out

        return wrong


@pytest.mark.parametrize("method,kernel", [("add_rms_norm", "layer_ops"), ("lowbit_matmul", "lowbit_matmul"),
                                           ("decode_attention", "decode_attention"),
                                           ("lowbit_q8_rows", "lowbit_q8_rows")])
def test_a_kernel_that_answers_wrong_is_turned_off_at_load_and_torch_serves(
        cpu_variants: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        tmp_path: Path, method: str, kernel: str) -> None:
    """A tiny GGUF model (4-bit matrices, a Q8_0 embedding) loaded on kernels one of which answers wrong: the
    self-check turns that one off with one warning, and the logits are those with that kernel off on purpose."""
    native = cpu_profile.profile().isa
    if cpu_variants.get(native) is None:
        pytest.skip("no compiler")
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    bad = Corrupted(cpu_variants[native], method)
    with cpu_extensions.using(bad), monkeypatch.context() as patch:
        patch.setattr(cpu_extensions, "kernels", lambda: bad)
        with caplog.at_level(logging.WARNING, "mindie_host.backends"):
            backend = loaded(path, "auto")
        warnings = [r.getMessage() for r in caplog.records if "disagreed with torch" in r.getMessage()]
        assert len(warnings) == 1 and f"CPU kernel {kernel} disagreed" in warnings[0], warnings
        assert cpu_extensions.turned_off() == {kernel}
        got = decode_logits(backend, 3)
    with cpu_extensions.using(cpu_variants[native], off=frozenset({kernel})):
        want = decode_logits(loaded(path, "auto"), 3)
    assert torch.equal(got, want)  # the corrupted kernel's place is torch's, exactly


def test_the_self_check_passes_every_variant_on_shapes_whose_paths_differ(cpu_variant: Any) -> None:
    for shapes in (cpu_selfcheck.ModelShapes(576, 9, 3, 64, 1536, torch.bfloat16, (("int4", 576, 32),
                                                                                    ("int8", 1536, 1536))),
                   cpu_selfcheck.ModelShapes(1000, 8, 2, 128, 300, torch.float32, (("int4", 96, 32),)),
                   cpu_selfcheck.ModelShapes(160, 6, 1, 80, 100, torch.float32, ())):
        assert cpu_selfcheck.check(cpu_variant, shapes) == []


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
           "Explain why the sky is blue.", "Give me a recipe for pancakes.", "Compare cats and dogs as pets.",
           "How do plants make food from sunlight?", "Translate 'good morning' into Spanish."]


def prompts(host: Any) -> list[list[int]]:
    """:data:`PROMPTS` through the chat template, as token ids."""
    tok = host.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False) for p in PROMPTS]


def answers(host: Any, tokens: int = 24) -> list[list[int]]:
    """The host's greedy answers to :data:`PROMPTS` (chat template), all in one batch."""
    requests = [EngineRequest(f"q{i}", p, SamplingParams(max_tokens=tokens, ignore_eos=True))
                for i, p in enumerate(prompts(host))]
    out = run_engine(host, requests)
    return [out[f"q{i}"].token_ids for i in range(len(PROMPTS))]


def tokens_logits(host: Any, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """The logits after ``prompt`` and ``generated`` as the engine computed them: the prompt in one step, then one
    decode step per generated token (the kernels are batch-invariant, so the batch it ran in does not matter)."""
    backend, block = host.backend, host.config.schedule.cacheBlockSize
    ids = prompt + generated
    table = list(range(-(-len(ids) // block)))
    n = len(prompt)
    logits = backend.execute(ModelInput(input_ids=prompt, positions=list(range(n)), query_lens=[n], context_lens=[n],
                                        block_tables=[table], logits_indices=[n - 1], row_variants=[-1],
                                        prompt_lens=[n]))[0]
    for t in range(n, len(ids)):
        logits = backend.execute(ModelInput(input_ids=[ids[t]], positions=[t], query_lens=[1], context_lens=[t + 1],
                                            block_tables=[table], logits_indices=[0], row_variants=[-1],
                                            prompt_lens=[n]))[0]
    return logits


#: the avx512 profile's bf16 roundings (prompt rows, low-bit activations) turn a last-bit difference of a float32
#: sum into a bf16 step: a greedy choice between two tokens this close in both runs' logits may go either way
BF16_TIE = 0.02


#: the kernels-off answers of the float32 profiles, computed once for the module
_KERNELS_OFF: dict[str, list[list[int]]] = {}


@pytest.mark.slow
def test_every_variant_answers_as_torchs_operators_do(cpu_variant: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default config, forced to each variant's profile, against the same config with every kernel off
    (``MINDIE_HOST_CPU_KERNELS=0``: torch's operators, with the profile's dtypes). The float32 profiles (portable,
    avx2) give the same answers. The avx512 profile rounds to bf16 along the way: its answers may part only where
    both runs' two candidate tokens are within :data:`BF16_TIE` of each other."""

    def load(kernels: bool) -> Any:
        monkeypatch.setenv("MINDIE_HOST_CPU_KERNELS", "1" if kernels else "0")
        return loaded_host(server_config(None))

    host = load(kernels=True)
    assert cpu_extensions.active("layer_ops") is cpu_variant and cpu_extensions.turned_off() == frozenset()
    with_kernels, asked = answers(host), prompts(host)
    assert "Paris" in host.tokenizer.decode(with_kernels[0])
    if cpu_variant.variant != "avx512":
        del host
        gc.collect()
        # the float32 profiles (portable, avx2) run torch's operators alike with the kernels off: one run serves both
        without = _KERNELS_OFF.get("float32")
        if without is None:
            without = _KERNELS_OFF["float32"] = answers(load(kernels=False))
            gc.collect()
        assert with_kernels == without
        return
    # avx512: both models stay loaded (bf16, ~0.3 GB each) so a parted answer is examined in both
    hosts = {True: host, False: load(kernels=False)}
    without = answers(hosts[False])
    parted = [(prompt, a, b) for prompt, a, b in zip(asked, with_kernels, without) if a != b]
    for kernels, h in hosts.items():
        for prompt, a, b in parted:
            j = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            logits = tokens_logits(h, prompt, a[:j])
            gap = abs(float(logits[a[j]] - logits[b[j]]))
            assert gap < BF16_TIE, ("kernels on" if kernels else "kernels off", j, a[j], b[j], gap)
    del host, hosts
    gc.collect()
