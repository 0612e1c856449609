"""Qwen3 (dense) served by the engine in its own process (the models plugin enabled there too, from the checkpoint's
model_type alone) with multi_lora: a PEFT adapter over every projection, served beside the base model in one batch,
gives transformers' greedy tokens with the adapter merged (the per-row deltas land before the per-head q/k norms,
as PEFT's do); a json_schema response is valid JSON of the schema. One server start."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from family_cases import one_thread

from mindie_host.testing import RunningServer, server_config

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[300 + 7 * i for i in range(n)] for n in (9, 14, 20)]
NEW = 10


@pytest.fixture(scope="module")
def adapter(tiny_family: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random PEFT LoRA adapter on the tiny Qwen3 (B randomized: peft starts it at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(5)
    base = Qwen3ForCausalLM.from_pretrained(str(tiny_family("qwen3")), dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=MODULES, lora_dropout=0.0, task_type="CAUSAL_LM")
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.4)
    out = tmp_path_factory.mktemp("qwen3-lora")
    model.save_pretrained(str(out))
    return out


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def hf_greedy(base: Path, adapter_dir: Path | None) -> list[list[int]]:
    """transformers' greedy tokens of every prompt, with the adapter merged when given."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    model.eval()
    with torch.no_grad(), one_thread():
        outs = [
            model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
            for p in PROMPTS
        ]
    return [out[0, len(p) :].tolist() for out, p in zip(outs, PROMPTS)]


def test_engine_process_adapter_and_base_in_one_batch_and_structured_output(
    tiny_family: Callable[[str], Path], adapter: Path
) -> None:
    base = tiny_family("qwen3")
    cfg = server_config(
        base,
        model={"dtype": "float32", "quantization": "none", "plugin_params": json.dumps({"plugin_type": "multi_lora"})},
        plugins={"multi_lora": {"maxLoras": 2, "maxLoraRank": 8, "adapters": {"ad": str(adapter)}}},
        server={"engineProcess": True},
    )
    jobs = [(model, i) for i in range(len(PROMPTS)) for model in ("ad", "tiny")]
    with RunningServer(cfg) as server:

        def complete(job: tuple[str, int]) -> str:
            r = httpx.post(
                server.url + "/v1/completions",
                timeout=120,
                json={
                    "model": job[0],
                    "prompt": PROMPTS[job[1]],
                    "max_tokens": NEW,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        with ThreadPoolExecutor(len(jobs)) as pool:
            texts = list(pool.map(complete, jobs))
        tokenizer = server.host.tokenizer
        mixed = server.host.stats()["lora_max_kinds_per_step"]
        rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        r = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=120,
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "Describe a person."}],
                "max_tokens": 60,
                "response_format": rf,
                "temperature": 1.0,
                "seed": 3,
            },
        )
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), PERSON)
    hf = {"ad": hf_greedy(base, adapter), "tiny": hf_greedy(base, None)}
    want = {(m, i): hf[m][i] for m, i in jobs}
    assert want[("ad", 0)] != want[("tiny", 0)]  # the adapter changes the answer: the comparison is not vacuous
    for job, text in zip(jobs, texts):
        assert text == tokenizer.decode(want[job], skip_special_tokens=True), job
    assert mixed >= 2  # a step really ran the adapter and the base model side by side
