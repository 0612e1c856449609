"""Image-request throughput: mindie-host with the multimodal plugin against transformers' generate.

Builds a small random-weight LLaVA (CLIP tower at ``--image-size`` px, patch 14; Llama LM of
``--hidden`` width and ``--layers`` layers) with transformers, then

* serves it with the real server (plugin ``multimodal``) and sends ``--requests`` OpenAI chat
  requests, each with its own image (base64 data URL), ``--concurrency`` at a time, each
  generating exactly ``--max-tokens`` tokens (``ignore_eos``);
* runs transformers' ``generate`` on the same directory, one request at a time (batch 1), and
  in batches of ``--concurrency`` (the prompts have equal length, so no padding).

Prints one JSON object: requests/s and output tokens/s of each, and the server's vision
batching counters (images encoded / vision-tower calls).

    python bench/multimodal_bench.py --requests 32 --concurrency 8 --max-tokens 32
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from mindie_plugin_multimodal.testing import data_url, image_png, make_tiny_llava

from mindie_host.testing import RunningServer, server_config

QUESTION = "What is written on the sign in this picture?"


def serve(model: Path, pngs: list[bytes], args: argparse.Namespace) -> dict[str, float]:
    sched = {"maxBatchSize": args.concurrency, "maxPrefillBatchSize": args.concurrency, "maxIterTimes": 512}
    cfg = server_config(model, model={"plugin_params": json.dumps({"plugin_type": "multimodal"})}, schedule=sched,
                        deploy={"maxSeqLen": 1024, "maxInputTokenLen": 900})
    with RunningServer(cfg) as server:
        def one(png: bytes) -> int:
            r = httpx.post(server.url + "/v1/chat/completions", timeout=600, json={
                "model": "tiny", "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_url(png)}}, {"type": "text", "text": QUESTION}]}]})
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        def counters() -> dict[str, float]:
            text = httpx.get(server.metrics_url + "/metrics", timeout=30).text
            return {ln.split("{")[0].split()[0]: float(ln.split()[-1]) for ln in text.splitlines()
                    if ln.startswith("multimodal_")}

        one(pngs[0])  # warm-up
        before = counters()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            tokens = sum(pool.map(one, pngs))
        wall = time.perf_counter() - t0
        after = counters()
    delta = {k.removeprefix("multimodal_"): after[k] - before.get(k, 0.0) for k in after}
    return {"seconds": wall, "requests_per_s": len(pngs) / wall, "output_tokens_per_s": tokens / wall, **delta}


def transformers_generate(model_dir: Path, pngs: list[bytes], args: argparse.Namespace, batch: int) -> dict[str, float]:
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    proc = AutoImageProcessor.from_pretrained(str(model_dir))
    model = LlavaForConditionalGeneration.from_pretrained(str(model_dir)).eval()
    cfg = model.config
    n_img = (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2
    messages = [{"role": "user", "content": "<image>" + QUESTION}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids: list[int] = []
    for t in tok.encode(prompt, add_special_tokens=False):
        ids.extend([t] * n_img if t == cfg.image_token_index else [t])

    def run(chunk: list[bytes]) -> int:
        images = [Image.open(io.BytesIO(p)).convert("RGB") for p in chunk]
        pixel_values = proc(images=images, return_tensors="pt")["pixel_values"]
        input_ids = torch.tensor([ids] * len(chunk))
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 pixel_values=pixel_values, max_new_tokens=args.max_tokens,
                                 min_new_tokens=args.max_tokens, do_sample=False)
        return (out.shape[1] - input_ids.shape[1]) * len(chunk)

    run(pngs[:1])  # warm-up
    t0 = time.perf_counter()
    tokens = sum(run(pngs[i : i + batch]) for i in range(0, len(pngs), batch))
    wall = time.perf_counter() - t0
    return {"seconds": wall, "requests_per_s": len(pngs) / wall, "output_tokens_per_s": tokens / wall}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=112)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llava(Path(tmp) / "llava", image_size=args.image_size, hidden_size=args.hidden,
                                num_layers=args.layers, vision_hidden=64, vision_layers=2)
        pngs = [image_png(args.image_size, args.image_size, 1000 + i) for i in range(args.requests)]
        result = {
            "model": {"image_size": args.image_size, "image_tokens": (args.image_size // 14) ** 2,
                      "hidden": args.hidden, "layers": args.layers},
            "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "mindie_host": serve(model, pngs, args),
            "transformers_batch1": transformers_generate(model, pngs, args, 1),
            f"transformers_batch{args.concurrency}": transformers_generate(model, pngs, args, args.concurrency),
        }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
