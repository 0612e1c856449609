"""The default model (SmolLM2-135M-Instruct GGUF): served with no arguments, and identical to HF transformers."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from mindie_host.api import EngineRequest, SamplingParams
from mindie_host.models.default import default_model_path
from mindie_host.testing import free_port, loaded_host, run_engine, server_config

pytestmark = pytest.mark.slow


def test_serve_with_no_arguments_answers_paris(tmp_path) -> None:
    """`mindie-host serve` (only ports changed, so tests can run side by side) answers with Paris."""
    port, mport, xport = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mindie_host.cli", "serve", "--port", str(port), "--management-port", str(mport),
         "--metrics-port", str(xport)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path, env={**os.environ},
    )
    try:
        deadline = time.time() + 240
        ready = False
        while time.time() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(f"http://127.0.0.2:{mport}/v2/health/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                ready = False
            if ready:
                break
            time.sleep(0.5)
        assert ready, "server did not become ready"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 30, "temperature": 0,
        })
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
    assert b"loading weights" in out  # model loading shows progress


def test_greedy_matches_transformers_on_default_model() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32).eval()
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors."]
    expected: list[tuple[list[int], list[int]]] = []  # (prompt, transformers' greedy tokens) per question
    for q in questions:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                 eos_token_id=None, min_new_tokens=16, pad_token_id=0)[0, len(ids):].tolist()
        expected.append((ids, ref))
    del model
    gc.collect()  # transformers' model is gone before the host loads (3.4 GB in float32 with its packed copies)
    host = loaded_host(server_config(None, model={"quantization": "none"}))  # the reference numerics
    for i, (q, (ids, ref)) in enumerate(zip(questions, expected)):
        out = run_engine(host, [EngineRequest(f"q{i}", ids, SamplingParams(max_tokens=16, ignore_eos=True))])[f"q{i}"]
        assert out.token_ids == ref, q


def _teacher_forced_logits(host, seqs: list[list[int]], batched: bool) -> list[torch.Tensor]:
    """Feed each sequence one token per decode step (all together when ``batched``); next-token logits per step."""
    from mindie_host.backends.base import ModelInput

    backend, block = host.backend, host.config.schedule.cacheBlockSize
    blocks = -(-max(len(s) for s in seqs) // block)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(seqs))]
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    for group in ([list(range(len(seqs)))] if batched else [[i] for i in range(len(seqs))]):
        for t in range(max(len(seqs[i]) for i in group) - 1):
            live = [i for i in group if t < len(seqs[i]) - 1]
            logits = backend.execute(ModelInput(
                input_ids=[seqs[i][t] for i in live], positions=[t] * len(live), query_lens=[1] * len(live),
                context_lens=[t + 1] * len(live), block_tables=[tables[i] for i in live],
                logits_indices=list(range(len(live))), row_variants=[-1] * len(live),
            ))
            for j, i in enumerate(live):
                out[i].append(logits[j])
    return [torch.stack(o) for o in out]


def test_low_bit_weights_keep_the_default_models_next_tokens() -> None:
    """quantization "auto" (the file's 4-bit groups, bf16 activations, int8 head) against the fp32 reference."""
    ref = loaded_host(server_config(None, model={"quantization": "none"}))
    tok = ref.tokenizer
    questions = ["Explain why the sky is blue.", "Give me a recipe for pancakes.", "How do plants make food from sunlight?"]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for q in questions]
    outs = run_engine(ref, [EngineRequest(f"q{i}", p, SamplingParams(max_tokens=24, ignore_eos=True))
                            for i, p in enumerate(prompts)])
    seqs = [p + outs[f"q{i}"].token_ids for i, p in enumerate(prompts)]
    want = _teacher_forced_logits(ref, seqs, batched=True)  # fp32 torch operators: batch-invariant
    del ref
    gc.collect()  # the reference host (3.4 GB with its packed copies) is gone before the other loads
    auto = loaded_host(server_config(None))
    assert type(auto.backend.model.layers[0].attn.qkv).__name__ == "FourBitWeight"
    for batched in (False, True):
        got = _teacher_forced_logits(auto, seqs, batched)
        agree = sum(int((g.argmax(-1) == w.argmax(-1)).sum()) for g, w in zip(got, want)) / sum(len(w) for w in want)
        kl = sum(float(torch.nn.functional.kl_div(g.log_softmax(-1), w.log_softmax(-1), log_target=True,
                                                   reduction="batchmean")) for g, w in zip(got, want)) / len(want)
        assert agree >= 0.95, (batched, agree)
        assert kl < 0.01, (batched, kl)
