#!/usr/bin/env python3
"""How int8 prompt rows change the default model's answer to the README's question (bench/PERF.md, "Int8 prompt rows:
accuracy").

Loads the default model (``quantization: auto``) in-process with ``MINDIE_HOST_PROMPT_INT8=1`` and prefills the chat
prompt "What is the capital of France?" once per setting, printing the first answer token's top three log-probabilities:

* ``int8``: every low-bit matrix's prompt rows in int8 groups of 32 (the opt-in mode);
* ``int8 but <matrix>``: the same with one kind of matrix (qkv, o_proj, gate_up, down) back on the float path;
* ``float``: no matrix in int8 (prompt rows through the low-bit kernel in the profile's dtype);
* ``rounded, groups of G``: the activations rounded to int8 in groups of G (32, 16, 8) then multiplied in float32 by
  the file's exact weights: what smaller groups would buy.

The greedy answer "The capital of France is Paris." starts with "The"; the other reply starts with "L'Étoile".

    python bench/int8_answers.py
"""

from __future__ import annotations

import os

os.environ["MINDIE_HOST_PROMPT_INT8"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mindie_host.backends.base import ModelInput  # noqa: E402
from mindie_host.backends.linear import LowBitWeight  # noqa: E402
from mindie_host.backends.platform import Platform  # noqa: E402
from mindie_host.backends.torch.backend import TorchBackend  # noqa: E402
from mindie_host.models.default import default_model_path  # noqa: E402
from mindie_host.models.weights import resolve_model  # noqa: E402
from mindie_host.tokenizer import load_tokenizer  # noqa: E402

KINDS = ("qkv", "o_proj", "gate_up", "down")


def matrices(layer: object) -> dict[str, LowBitWeight]:
    """A layer's low-bit matrices by kind (``attn.qkv`` -> ``qkv``)."""
    found = {}
    for part in vars(layer).values():
        for name, w in getattr(part, "__dict__", {}).items():
            if isinstance(w, LowBitWeight):
                found[name] = w
    return found


def rounded_product(group: int):  # noqa: ANN201 - a method to patch in
    """``int8_product`` replaced by: activations rounded to int8 in groups of ``group``, then a float32 product."""
    def product(self: LowBitWeight, x: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        g = x.float().reshape(m, k // group, group)
        s = g.abs().amax(-1, keepdim=True) / 127
        q = torch.round(g / torch.where(s > 0, s, torch.ones_like(s))).clamp(-127, 127) * s
        if self._dequantized is None:
            assert self.tiles is not None
            self._dequantized = self.tiles.dequantize()
        return F.linear(q.reshape(m, k), self._dequantized)
    return product


def main() -> None:
    source = resolve_model(default_model_path())
    tokenizer = load_tokenizer(source)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text)["input_ids"]
    backend = TorchBackend(source, name="default", dtype="float32", quantization="auto", platform=Platform())
    backend.load()
    backend.allocate_kv_cache(64, 16)
    assert backend.model is not None
    layers = [matrices(layer) for layer in backend.model.layers]
    n = len(ids)

    def top3(label: str) -> None:
        logits = backend.execute(ModelInput(input_ids=ids, positions=list(range(n)), query_lens=[n], context_lens=[n],
                                            block_tables=[list(range(8))], logits_indices=[n - 1], row_variants=[-1],
                                            prompt_lens=[n]))[0]
        lp = torch.log_softmax(logits.float(), -1).topk(3)
        tops = ", ".join(f"{tokenizer.decode([int(i)])!r} {float(v):.3f}" for v, i in zip(lp.values, lp.indices))
        print(f"| {label} | {tops} |")

    def int8(kinds: tuple[str, ...]) -> None:
        for layer in layers:
            for kind, w in layer.items():
                w.prompt_int8 = kind in kinds

    print("| prompt rows | first token: top three log-probabilities |\n| --- | --- |")
    int8(KINDS)
    top3("int8")
    for kind in KINDS:
        int8(tuple(k for k in KINDS if k != kind))
        top3(f"int8 but {kind}")
    int8(())
    top3("float (no int8)")
    int8(KINDS)
    for group in (32, 16, 8):
        LowBitWeight.int8_product = rounded_product(group)  # type: ignore[method-assign]
        top3(f"rounded, groups of {group}")


if __name__ == "__main__":
    main()
