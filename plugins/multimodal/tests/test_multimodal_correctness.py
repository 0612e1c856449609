"""Greedy outputs through a real server with the multimodal plugin are token-identical to transformers' generate.

Tiny random-weight LLaVA (CLIP tower, MLP projector, Llama LM) and Qwen2-VL (M-RoPE) models
are built with transformers; the server serves the LM in the host's torch model over the paged
KV cache and the vision tower through the plugin. Covered: one image per request, two
different images in one batch (concurrent requests), two images in one prompt, prefix_cache on
(the same image reuses its blocks, a different one never does), and splitfuse chunks that cut
through an image's placeholder span.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from mm_helpers import data_url, image_png, make_tiny_llava, make_tiny_qwen2_vl, mm_config

from mindie_host.testing import RunningServer

N = 10
TEXT = "What is in this picture?"


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))


class Reference:
    """transformers' own model, processor and generate on the same directory."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        self.path = path
        self.cfg = AutoConfig.from_pretrained(str(path))
        self.tok = AutoTokenizer.from_pretrained(str(path))
        self.proc = AutoImageProcessor.from_pretrained(str(path))
        if self.cfg.model_type == "llava":
            from transformers import LlavaForConditionalGeneration

            self.model = LlavaForConditionalGeneration.from_pretrained(str(path)).eval()
            self.image_text = "<image>"
            self.image_id = self.cfg.image_token_index
        else:
            from transformers import Qwen2VLForConditionalGeneration

            self.model = Qwen2VLForConditionalGeneration.from_pretrained(str(path)).eval()
            self.image_text = "<|vision_start|><|image_pad|><|vision_end|>"
            self.image_id = self.cfg.image_token_id

    def generate(self, texts: list[str], pngs: list[bytes], n: int = N) -> list[int]:
        """Greedy ids for the prompt ``texts[0] <img0> texts[1] <img1> ...`` (tokenized without specials)."""
        import io

        from PIL import Image

        prompt = texts[0] + "".join(self.image_text + t for t in texts[1:])
        ids = self.tok.encode(prompt, add_special_tokens=False)
        images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs]
        out = self.proc(images=images, return_tensors="pt")
        kwargs: dict[str, Any] = {"pixel_values": out["pixel_values"]}
        if self.cfg.model_type == "llava":
            per = [(self.cfg.vision_config.image_size // self.cfg.vision_config.patch_size) ** 2] * len(images)
        else:
            kwargs["image_grid_thw"] = out["image_grid_thw"]
            per = (out["image_grid_thw"].prod(-1) // 4).tolist()
        expanded: list[int] = []
        it = iter(per)
        for t in ids:
            expanded.extend([t] * next(it) if t == self.image_id else [t])
        input_ids = torch.tensor([expanded])
        self.last_prompt_len = len(expanded)
        self.last_image_start = expanded.index(self.image_id)
        if self.cfg.model_type != "llava":
            kwargs["mm_token_type_ids"] = (input_ids == self.image_id).int()
        with torch.no_grad():
            gen = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                      max_new_tokens=n, do_sample=False, **kwargs)
        return gen[0, input_ids.shape[1]:].tolist()


def tgi_ids(url: str, texts: list[str], pngs: list[bytes], n: int = N) -> tuple[list[int], dict[str, Any]]:
    """Generated ids through TGI ``/generate`` with an ``inputs`` list of typed items."""
    items: list[dict[str, Any]] = [{"type": "text", "text": texts[0]}] if texts[0] else []
    for png, t in zip(pngs, texts[1:]):
        items.append({"type": "image_url", "image_url": data_url(png)})
        if t:
            items.append({"type": "text", "text": t})
    r = httpx.post(url + "/generate", json={"inputs": items, "parameters": {
        "max_new_tokens": n, "details": True, "do_sample": False}}, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    return [t["id"] for t in body["details"]["tokens"]], body


def assert_prefix_equal(got: list[int], ref: list[int]) -> None:
    """Identical, except the server may go on (ignore nothing) where transformers stopped at EOS."""
    assert got[: len(ref)] == ref, (got, ref)
    assert len(got) == len(ref) or len(ref) < N


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_single_image_matches_transformers(family: str, llava: Path, qwen: Path) -> None:
    path = llava if family == "llava" else qwen
    ref = Reference(path)
    png = image_png(56, 56, 1) if family == "llava" else image_png(112, 56, 1)  # Qwen: a 8x4 patch grid
    want = ref.generate(["", TEXT], [png])
    with RunningServer(mm_config(path)) as server:
        got, _ = tgi_ids(server.url, ["", TEXT], [png])
        # the OpenAI chat form of the same image: its text is the decoded reference (chat template prompt)
        import openai

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
        r = client.chat.completions.create(model="tiny", temperature=0, max_tokens=N, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(png)}}, {"type": "text", "text": TEXT}]}])
        host = server.host
        prompt = host.apply_chat_template([{"role": "user", "content": ref.image_text + TEXT}])
        chat_ids = host.tokenize(prompt, add_special_tokens=False)
        texts = prompt.split(ref.image_text)
        chat_ref = ref.generate(texts, [png])
        stats = server.wait_idle()
    assert_prefix_equal(got, want)
    assert r.choices[0].message.content == ref.tok.decode(chat_ref, skip_special_tokens=True)
    assert ref.image_id in chat_ids
    assert stats.get("requests_received", 2) >= 2


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_two_images_in_one_batch_and_in_one_prompt(family: str, llava: Path, qwen: Path) -> None:
    path = llava if family == "llava" else qwen
    ref = Reference(path)
    size = (56, 56) if family == "llava" else (56, 112)
    a, b = image_png(*size, 2), image_png(*size, 3)
    jobs = [(["Describe: ", " please"], [a]), (["Describe: ", " please"], [b]),
            (["First ", " then ", " compare."], [a, b])]
    wants = [ref.generate(t, p) for t, p in jobs]
    assert wants[0] != wants[1]  # the two images do lead to different outputs
    with RunningServer(mm_config(path)) as server:
        with ThreadPoolExecutor(3) as pool:
            gots = list(pool.map(lambda job: tgi_ids(server.url, *job)[0], jobs))
        metrics = httpx.get(server.metrics_url + "/metrics", timeout=30).text
    for got, want in zip(gots, wants):
        assert_prefix_equal(got, want)
    encoded = [ln for ln in metrics.splitlines() if ln.startswith("multimodal_images_encoded")]
    assert encoded and float(encoded[0].split()[-1]) == 4.0, encoded


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_prefix_cache_keys_blocks_by_image(family: str, llava: Path, qwen: Path) -> None:
    """The same image reuses its cached blocks; a different image with the same text never does."""
    path = llava if family == "llava" else qwen
    ref = Reference(path)
    size = (56, 56) if family == "llava" else (112, 112)  # 16 placeholder tokens each
    a, b = image_png(*size, 4), image_png(*size, 5)
    long_text = ["A long shared instruction for the model, written twice over. " * 3, " What is shown here?"]
    want_b = ref.generate(long_text, [b])
    want_a = ref.generate(long_text, [a])
    prompt_len, image_start = ref.last_prompt_len, ref.last_image_start
    with RunningServer(mm_config(path, prefix_cache=True)) as server:
        got1, _ = tgi_ids(server.url, long_text, [a])
        hit0 = server.wait_idle()["prefix_cache_hit_tokens"]
        got2, _ = tgi_ids(server.url, long_text, [a])
        hit1 = server.wait_idle()["prefix_cache_hit_tokens"]
        got3, _ = tgi_ids(server.url, long_text, [b])
        hit2 = server.wait_idle()["prefix_cache_hit_tokens"]
    assert_prefix_equal(got1, want_a)
    assert_prefix_equal(got2, want_a)
    assert_prefix_equal(got3, want_b)
    assert hit0 == 0
    assert (prompt_len - 1) // 16 > image_start // 16  # a cached whole block holds image tokens
    assert hit1 - hit0 == (prompt_len - 1) // 16 * 16  # every whole block, image blocks included
    assert hit2 - hit1 == image_start // 16 * 16  # only the blocks before the image


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_splitfuse_chunks_through_an_image(family: str, llava: Path, qwen: Path) -> None:
    path = llava if family == "llava" else qwen
    ref = Reference(path)
    png = image_png(56, 56, 6) if family == "llava" else image_png(112, 112, 6)  # 16 placeholder tokens each
    texts = ["Short text before ", " and after the image."]
    want = ref.generate(texts, [png])
    cfg = mm_config(path, templateType="Mix", enableSplit=True, splitChunkTokens=8, splitStartBatchSize=0)
    cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["plugin_params"] = json.dumps(
        {"plugin_type": "multimodal,splitfuse"})
    with RunningServer(cfg) as server:
        got, _ = tgi_ids(server.url, texts, [png])
        steps = server.host.stats()
    assert_prefix_equal(got, want)
    assert steps["steps"] >= 4 + N - 1, steps  # the prompt ran in chunks of 8 tokens


def test_vision_encoding_is_batched_across_requests(llava: Path) -> None:
    """Three requests admitted in one prefill step: their four images go through the tower in one call."""
    from mindie_host.api import SamplingParams
    from mindie_host.testing import loaded_host, run_engine

    ref = Reference(llava)
    host = loaded_host(mm_config(llava))
    pngs = [image_png(56, 56, 20 + i) for i in range(4)]
    jobs = [(["Look: ", " now"], [pngs[0]]), (["Look: ", " now"], [pngs[1]]),
            (["Both ", " and ", " here"], [pngs[2], pngs[3]])]
    reqs = []
    for i, (texts, images) in enumerate(jobs):
        items: list[dict[str, Any]] = [{"type": "text", "text": texts[0]}]
        for png, t in zip(images, texts[1:]):
            items += [{"type": "image_url", "image_url": data_url(png)}, {"type": "text", "text": t}]
        prompt = texts[0] + "".join(ref.image_text + t for t in texts[1:])
        reqs.append(host.new_request(protocol="tgi", body={"inputs": items}, prompt=prompt, request_id=f"r{i}",
                                     sampling=SamplingParams(max_tokens=N, temperature=0)))
    assert [len(r.prompt_token_ids) for r in reqs][:2] == [len(reqs[0].prompt_token_ids)] * 2
    outs = run_engine(host, reqs)
    counters = host.backend.counters
    assert counters["images_encoded"] == 4 and counters["vision_batches"] == 1, counters
    for i, (texts, images) in enumerate(jobs):
        assert_prefix_equal(outs[f"r{i}"].token_ids, ref.generate(texts, images))
    assert all(item.embeds is None for r in reqs for item in r.payload.images)  # freed when each finished


def test_engine_in_its_own_process(qwen: Path) -> None:
    """``ServerConfig.engineProcess``: images are parsed in the front end and travel to the engine process."""
    ref = Reference(qwen)
    png = image_png(112, 56, 30)
    want = ref.generate(["", TEXT], [png])
    cfg = mm_config(qwen)
    cfg["ServerConfig"]["engineProcess"] = True
    with RunningServer(cfg) as server:
        got, _ = tgi_ids(server.url, ["", TEXT], [png])
    assert_prefix_equal(got, want)
