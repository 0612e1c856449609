"""Engine correctness against HF transformers, on real (tiny, random) Llama-family weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config

from mindie_host.api import EngineRequest, SamplingParams
from mindie_host.testing import loaded_host, run_engine, server_config

PROMPTS = [
    [1, 504, 3458, 314, 260, 1831, 30],
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411],
    [1, 18, 19],
    list(range(100, 160)),
]


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny_host(tiny_model: Path):
    return loaded_host(server_config(tiny_model))


def test_greedy_matches_hf_alone_and_batched(tiny_model: Path, tiny_host) -> None:
    n = 24
    expected = [hf_greedy(tiny_model, p, n) for p in PROMPTS]
    for i, prompt in enumerate(PROMPTS):  # one at a time
        out = run_engine(tiny_host, [EngineRequest(f"alone{i}", prompt, greedy(n))])[f"alone{i}"]
        assert out.token_ids == expected[i]
    outs = run_engine(tiny_host, [EngineRequest(f"b{i}", p, greedy(n)) for i, p in enumerate(PROMPTS)])
    assert [outs[f"b{i}"].token_ids for i in range(len(PROMPTS))] == expected
    assert tiny_host.llm.kv.num_used_blocks() == 0


def _save(model: torch.nn.Module, tokenizer_dir: Path, out: Path, **save_kw: object) -> Path:
    from transformers import AutoTokenizer

    model.save_pretrained(str(out), **save_kw)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out))
    return out


@pytest.mark.parametrize(
    "arch",
    ["llama-sharded", "qwen2-bias", "mistral", "llama-tied"],
)
def test_architectures_match_hf(arch: str, tiny_model: Path, tmp_path: Path) -> None:
    torch.manual_seed(1)
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if arch.startswith("qwen2"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**common))
    elif arch == "mistral":
        model = AutoModelForCausalLM.from_config(MistralConfig(**common, sliding_window=None))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=arch == "llama-tied"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # make biases and norms non-trivial
    kw = {"max_shard_size": "2MB"} if arch == "llama-sharded" else {}
    path = _save(model.eval(), tiny_model, tmp_path / arch, **kw)
    if arch == "llama-sharded":
        assert len(list(path.glob("*.safetensors"))) > 1
    host = loaded_host(server_config(path))
    prompt = PROMPTS[1]
    out = run_engine(host, [EngineRequest("r", prompt, greedy(12))])["r"]
    assert out.token_ids == hf_greedy(path, prompt, 12)


def test_logprobs_match_hf(tiny_model: Path, tiny_host) -> None:
    prompt = PROMPTS[0]
    out = run_engine(tiny_host, [EngineRequest("lp", prompt, greedy(4, logprobs=3))])["lp"]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    ids = prompt + out.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    ref = torch.log_softmax(logits, -1)
    assert len(out.logprobs) == 4
    for j, lp in enumerate(out.logprobs):
        pos = len(prompt) - 1 + j
        assert lp.token_id == ids[pos + 1]
        assert lp.logprob == pytest.approx(float(ref[pos, lp.token_id]), abs=1e-4)
        assert [t for t, _ in lp.top] == torch.topk(ref[pos], 3).indices.tolist()


def test_prompt_logprobs(tiny_model: Path, tiny_host) -> None:
    prompt = PROMPTS[0]
    out = run_engine(tiny_host, [EngineRequest("pl", prompt, greedy(2, prompt_logprobs=0))])["pl"]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert out.prompt_logprobs[i].logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)


def test_seed_gives_same_text_alone_and_batched(tiny_host) -> None:
    params = dict(max_tokens=20, ignore_eos=True, do_sample=True, temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    alone = run_engine(tiny_host, [EngineRequest("s", PROMPTS[1], SamplingParams(**params))])["s"].token_ids
    others = [EngineRequest(f"o{i}", p, SamplingParams(max_tokens=20, do_sample=True, temperature=1.0))
              for i, p in enumerate(PROMPTS)]
    batched = run_engine(tiny_host, [*others, EngineRequest("s2", PROMPTS[1], SamplingParams(**params))])
    assert batched["s2"].token_ids == alone
    other_seed = run_engine(tiny_host, [EngineRequest("s3", PROMPTS[1], SamplingParams(**{**params, "seed": 99}))])
    assert other_seed["s3"].token_ids != alone


def test_sampling_filters(tiny_host) -> None:
    base = run_engine(tiny_host, [EngineRequest("g", PROMPTS[1], greedy(10))])["g"].token_ids
    # top_k=1 sampling is greedy whatever the temperature
    k1 = run_engine(tiny_host, [EngineRequest("k1", PROMPTS[1], SamplingParams(
        max_tokens=10, ignore_eos=True, do_sample=True, temperature=1.5, top_k=1, seed=3))])["k1"].token_ids
    assert k1 == base
    # a tiny top_p keeps only the most likely token
    p = run_engine(tiny_host, [EngineRequest("p", PROMPTS[1], SamplingParams(
        max_tokens=10, ignore_eos=True, do_sample=True, temperature=1.0, top_p=1e-5, seed=3))])["p"].token_ids
    assert p == base
    # min_p close to 1 keeps only the argmax too
    mp = run_engine(tiny_host, [EngineRequest("mp", PROMPTS[1], SamplingParams(
        max_tokens=10, ignore_eos=True, do_sample=True, min_p=0.999, seed=3))])["mp"].token_ids
    assert mp == base
    typ = run_engine(tiny_host, [EngineRequest("ty", PROMPTS[1], SamplingParams(
        max_tokens=10, ignore_eos=True, do_sample=True, typical_p=0.5, seed=3))])["ty"]
    assert len(typ.token_ids) == 10


def test_repetition_penalty_matches_hf(tiny_model: Path, tiny_host) -> None:
    prompt = PROMPTS[1]
    out = run_engine(tiny_host, [EngineRequest("rp", prompt, greedy(16, repetition_penalty=1.8))])["rp"].token_ids
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                             repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out == ref


def test_presence_and_frequency_penalties() -> None:
    from mindie_host.engine.sampling import apply_penalties

    logits = torch.zeros(10)
    apply_penalties(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [1, 2], [3, 3, 3, 4])
    assert logits[3].item() == pytest.approx(-(0.5 + 3 * 0.25))
    assert logits[4].item() == pytest.approx(-(0.5 + 0.25))
    assert logits[1].item() == 0.0  # prompt tokens are not penalised by presence/frequency


def test_stop_conditions(tiny_host) -> None:
    base = run_engine(tiny_host, [EngineRequest("a", PROMPTS[0], greedy(16))])["a"]
    # stop token id: output ends before it (excluded by default)
    stop_tok = base.token_ids[5]
    first = base.token_ids.index(stop_tok)
    out = run_engine(tiny_host, [EngineRequest("b", PROMPTS[0], greedy(16, stop_token_ids=[stop_tok]))])["b"]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == base.token_ids[:first]
    inc = run_engine(tiny_host, [EngineRequest("c", PROMPTS[0], greedy(
        16, stop_token_ids=[stop_tok], include_stop_str_in_output=True))])["c"]
    assert inc.token_ids == base.token_ids[: first + 1]
    # stop string: text is cut before it
    text = base.text
    needle = text[len(text) // 2: len(text) // 2 + 3]
    if needle.strip():
        s = run_engine(tiny_host, [EngineRequest("d", PROMPTS[0], greedy(16, stop=[needle]))])["d"]
        assert s.finish_reason == "stop" and s.stop_reason == needle
        assert s.text == text[: text.index(needle)]
    # max tokens
    m = run_engine(tiny_host, [EngineRequest("e", PROMPTS[0], greedy(3))])["e"]
    assert m.finish_reason == "length" and len(m.token_ids) == 3


def test_eos_stops_unless_ignored(tiny_host) -> None:
    eos = tiny_host.info.eos_token_ids[0]
    base = run_engine(tiny_host, [EngineRequest("a", PROMPTS[0], greedy(8))])["a"].token_ids
    # force the model's first token to be EOS through a constraint, then see it stop
    req = EngineRequest("b", PROMPTS[0], SamplingParams(max_tokens=8))
    req.logits_constraint = lambda out: [eos]
    out = run_engine(tiny_host, [req])["b"]
    assert out.finish_reason == "stop" and out.token_ids == []
    req2 = EngineRequest("c", PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True))
    req2.logits_constraint = lambda out: [eos]
    assert run_engine(tiny_host, [req2])["c"].token_ids == [eos] * 3
    assert len(base) == 8


def test_incremental_detokenization_never_splits_utf8(tiny_host) -> None:
    tok = tiny_host.tokenizer
    text = "naïve café 北京欢迎你 🙂👍 end"
    ids = tok.encode(text, add_special_tokens=False)
    req = EngineRequest("u", PROMPTS[0], SamplingParams(max_tokens=len(ids), ignore_eos=True))
    req.logits_constraint = lambda out: [ids[len(out)]]
    pieces = []
    llm = tiny_host.llm
    llm.add_request(req)
    final = None
    while llm.has_work():
        for o in llm.step():
            pieces.append(o.new_text)
            final = o
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == final.text


@pytest.mark.parametrize("policy", [{}, {"policyType": 6, "maxBatchSize": 2, "maxPrefillBatchSize": 2}],
                         ids=["fcfs", "skip-join-mlfq"])
def test_preemption_recomputes_without_dropping(tiny_model: Path, tiny_host, policy: dict[str, int]) -> None:
    """A pool too small for the batch preempts; each policy (Skip-Join MLFQ also pausing the running jobs beyond
    maxBatchSize 2) gives every request the tokens it gets alone."""
    schedule = {"cacheBlockSize": 16, "maxBatchSize": 8, "maxPrefillBatchSize": 8, "maxIterTimes": 100,
                "maxPrefillTokens": 4096, **policy}
    cfg = server_config(tiny_model, model={"maxKvBlocks": 8}, deploy={"maxSeqLen": 128, "maxInputTokenLen": 64},
                        schedule=schedule)
    host = loaded_host(cfg)
    prompts = [list(range(200 + 7 * i, 240 + 7 * i - 9 * (i % 2))) for i in range(4)]
    reqs = [EngineRequest(f"p{i}", p, greedy(32)) for i, p in enumerate(prompts)]
    outs = run_engine(host, reqs)
    assert host.llm.counters["preemptions"] > 0
    assert host.llm.kv.num_used_blocks() == 0
    alone = run_engine(tiny_host, [EngineRequest(f"a{i}", p, greedy(32)) for i, p in enumerate(prompts)])
    for i in range(len(prompts)):  # the tokens of an unpreempted run
        assert outs[f"p{i}"].token_ids == alone[f"a{i}"].token_ids
        assert outs[f"p{i}"].finish_reason == "length"


def test_batch_limits_and_abort(tiny_model: Path) -> None:
    cfg = server_config(tiny_model, schedule={"maxBatchSize": 2, "maxPrefillBatchSize": 1})
    host = loaded_host(cfg)
    llm = host.llm
    for i in range(5):
        llm.add_request(EngineRequest(f"r{i}", PROMPTS[0], greedy(30)))
    peak = 0
    for _ in range(8):
        llm.step()
        peak = max(peak, len(llm.scheduler.running))
    assert peak == 2
    out = llm.abort("r0")
    assert out is not None and out.finish_reason == "abort"
    for i in range(1, 5):
        llm.abort(f"r{i}")
    assert llm.kv.num_used_blocks() == 0 and not llm.has_work()


def test_timeout_frees_blocks(tiny_model: Path) -> None:
    host = loaded_host(server_config(tiny_model))
    req = EngineRequest("t", PROMPTS[0], greedy(400))
    req.timeout = 0.05
    outs = run_engine(host, [req])
    assert outs["t"].finish_reason == "timeout"
    assert host.llm.kv.num_used_blocks() == 0


def test_priority_policy_orders_admission(tiny_model: Path) -> None:
    cfg = server_config(tiny_model, schedule={"maxBatchSize": 1, "maxPrefillBatchSize": 1, "prefillPolicyType": 2,
                                              "decodePolicyType": 2})
    host = loaded_host(cfg)
    order = []
    reqs = [EngineRequest(f"r{i}", PROMPTS[0], greedy(2), priority=p) for i, p in enumerate([5, 3, 1])]
    llm = host.llm
    for r in reqs:
        llm.add_request(r)
    while llm.has_work():
        for o in llm.step():
            if o.finished:
                order.append(o.request_id)
    assert order == ["r2", "r1", "r0"]


def test_backend_error_fails_only_that_batch(tiny_model: Path) -> None:
    host = loaded_host(server_config(tiny_model))
    real = host.backend.execute
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real(batch)

    host.backend.execute = flaky
    outs = run_engine(host, [EngineRequest("x", PROMPTS[0], greedy(4))])
    # The client learns which request failed and where, never the exception's text (the log has it).
    assert outs["x"].finish_reason == "error" and "backend error" in outs["x"].error
    assert "injected fault" not in outs["x"].error
    outs = run_engine(host, [EngineRequest("y", PROMPTS[0], greedy(4))])
    assert outs["y"].finish_reason == "length"
    assert host.llm.kv.num_used_blocks() == 0


def test_min_tokens_bans_eos_until_reached(tiny_host) -> None:
    eos = tiny_host.info.eos_token_ids[0]
    req = EngineRequest("m", PROMPTS[0], SamplingParams(max_tokens=12, min_tokens=5))
    req.logits_constraint = lambda out: [eos, 1000]
    out = run_engine(tiny_host, [req])["m"]
    assert out.token_ids[:5] == [1000] * 5
    assert eos not in out.token_ids


def test_a_recomputed_sequence_brings_its_generated_tokens_as_decode_rows() -> None:
    """After a preemption by recompute a sequence comes back with its prompt and its generated tokens: the step lays
    the prompt out as one query and each generated token as a one-token row over the same blocks (the layout a
    decode step gave it, so it gets the same bits: tests/test_prompt_rows.py), and samples from the last row."""
    from mindie_host.engine.kv_cache import KVCacheManager
    from mindie_host.engine.policy import StepPlan
    from mindie_host.engine.sequence import Sequence
    from mindie_host.engine.step_input import build_step_input

    seq = Sequence(0, EngineRequest("r", [5, 6, 7, 8, 9], greedy(8)), 8)
    seq.token_ids += [21, 22, 23]  # three generated tokens, their KV freed by the preemption
    kv = KVCacheManager(8, 4)
    kv.allocate(seq, 8)
    step = build_step_input(StepPlan([(seq, 8)]), {}, kv)
    assert step.batch.query_lens == [5, 1, 1, 1]
    assert step.batch.context_lens == [5, 6, 7, 8]
    assert step.batch.positions == list(range(8)) and step.batch.input_ids == seq.token_ids
    assert step.batch.prompt_queries() == [True, False, False, False]
    assert step.batch.logits_indices == [7] and step.samplers == [(seq, 0, 1)]
    chunk = build_step_input(StepPlan([(seq, 3)]), {}, kv)  # a prompt chunk: one query, as before
    assert chunk.batch.query_lens == [3] and chunk.batch.logits_indices == [2]
