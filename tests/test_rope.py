"""RoPE settings as transformers writes them (issue 18, defect 9).

Each test saves a random tiny ``LlamaForCausalLM`` with ``save_pretrained`` (transformers 5 writes
``rope_parameters``), serves the directory, and checks that greedy tokens and their logprobs are
transformers' own ``generate`` output, for a non-default theta and every RoPE kind of the Llama family.
The older ``rope_theta`` / ``rope_scaling`` form is checked on the same weights, and an unknown kind
is refused at load time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from mindie_host.models.weights import ModelLoadError, load_arch, resolve_model
from mindie_host.testing import RunningServer, server_config

THETA = 50_000.0
MAX_POS = 64
KINDS: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


def save_llama(directory: Path, tokenizer_dir: Path, rope: dict[str, Any], head_dim: int = 32) -> Path:
    """A random tiny Llama with these ``rope_parameters``, saved by transformers itself."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=4 * head_dim, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=MAX_POS, rope_parameters={**rope, "rope_theta": THETA},
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a wide logit spread: greedy ties are vanishingly rare
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def hf_model(directory: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def hf_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs (from the raw logits)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    lps = [float(torch.log_softmax(lg[0].float(), -1)[t]) for lg, t in zip(out.logits, tokens)]
    return tokens, lps


def served_greedy(server: RunningServer, prompt: list[int], n: int) -> tuple[str, list[float]]:
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 0, "ignore_eos": True,
    })
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["completion_tokens"] == n
    return choice["text"], choice["logprobs"]["token_logprobs"]


def prompts(server: RunningServer) -> list[list[int]]:
    texts = ["The quick brown fox jumps over the lazy dog and then", "Once upon a time in a land far away"]
    return [server.host.tokenize(t) for t in texts]


def compare(directory: Path, lengths: list[tuple[int, int]] | None = None) -> None:
    cfg = server_config(directory, model={"quantization": "none"}, deploy={"maxSeqLen": 256, "maxInputTokenLen": 64},
                        schedule={"maxIterTimes": 128})
    with RunningServer(cfg) as server:
        cases = [(p, 16) for p in prompts(server)]
        if lengths:  # (prompt length, new tokens): past max_position_embeddings
            base = server.host.tokenize("one two three four five six seven eight nine ten " * 8)
            cases += [(base[:k], n) for k, n in lengths]
        served = [served_greedy(server, p, n) for p, n in cases]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = hf_model(directory)
    for (p, n), (text, lps) in zip(cases, served):
        if model.config.rope_parameters["rope_type"] == "dynamic":
            model = hf_model(directory)  # its rotary module keeps the longest length seen: start afresh
        want_tokens, want_lps = hf_greedy(model, p, n)
        # the same tokens (as text), and each step's logprob pins the logits that chose it
        assert text == tokenizer.decode(want_tokens, skip_special_tokens=True), (len(p), n)
        assert lps == pytest.approx(want_lps, abs=2e-3), (len(p), n)


@pytest.mark.parametrize("kind", list(KINDS))
def test_rope_kinds_match_transformers(kind: str, tiny_model: Path, tmp_path: Path) -> None:
    directory = save_llama(tmp_path / kind, tiny_model, KINDS[kind])
    written = json.loads((directory / "config.json").read_text())
    assert written["rope_parameters"]["rope_theta"] == THETA and "rope_theta" not in written
    arch = load_arch(resolve_model(directory))
    assert arch.rope_theta == THETA
    # go past max_position_embeddings (maxSeqLen 256, 64 positions): dynamic NTK only differs there, and every
    # other kind must extrapolate its positions as transformers does instead of failing mid-stream
    compare(directory, [(40, 40), (MAX_POS, 20)])


def test_old_rope_keys_match_transformers(tiny_model: Path, tmp_path: Path) -> None:
    directory = save_llama(tmp_path / "old", tiny_model, KINDS["linear"])
    cfg = json.loads((directory / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (directory / "config.json").write_text(json.dumps(cfg))
    arch = load_arch(resolve_model(directory))
    assert arch.rope_theta == THETA and arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    compare(directory)


@pytest.mark.parametrize(("rope", "message"), [
    ({"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0], "long_factor": [1.0]}, "longrope"),
    ({"rope_type": "su", "rope_theta": 1e4}, "'su'"),
    ({"rope_type": "linear", "rope_theta": 1e4}, "factor"),
    ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "bogus": 1}, "bogus"),
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_unknown_rope_is_refused(tiny_model: Path, tmp_path: Path, rope: dict[str, Any], message: str) -> None:
    cfg = json.loads((tiny_model / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = rope
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        load_arch(resolve_model(directory))
