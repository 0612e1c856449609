"""Expert parallelism (``ModelConfig.expertParallel``): two ranks that each hold half the routed experts whole
serve the tiny Qwen3-MoE and DeepSeek-V2 models as one rank does, rank 0 built only its own experts, and what cannot
be served that way is refused at startup."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import served_with_logprobs
from mindie_host.testing import load_host, server_config

PROMPTS = [[300 + 7 * i for i in range(n)] for n in (9, 23, 17)]


def _config(path: Path, world: int = 1, **model: Any) -> dict[str, Any]:
    cfg = server_config(path, model={"dtype": "float32", "quantization": "none", "worldSize": world, **model})
    cfg["BackendConfig"]["npuDeviceIds"] = [list(range(world))]
    return cfg


@pytest.mark.parametrize(("name", "experts"), [("qwen3_moe", 4), ("deepseek_v2", 8)])
def test_two_expert_parallel_ranks_equal_one(name: str, experts: int, tiny_family: Callable[[str], Path]) -> None:
    path = tiny_family(name)

    def own_experts_only(backend: Any) -> None:
        model = backend.inner.model
        routed_layers = [getattr(layer.mlp, "routed", layer.mlp) for layer in model.layers]
        sparse = [mlp for mlp in routed_layers if hasattr(mlp, "held")]
        assert sparse
        for routed in sparse:
            assert (routed.first, routed.held) == (0, experts // 2)  # rank 0: experts 0 .. E/2-1, each whole
            assert routed.gate_up.shape[0] == routed.down.shape[0] == experts // 2
            assert routed.down.shape[2] == routed.gate_up.shape[1] // 2  # every channel of each expert

    want = served_with_logprobs(_config(path), PROMPTS, new=8)
    got = served_with_logprobs(_config(path, 2, expertParallel=True), PROMPTS, own_experts_only, new=8)
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
        assert tokens == want_tokens
        assert lps == pytest.approx(want_lps, abs=1e-4)


@pytest.mark.parametrize(
    ("name", "model", "error"),
    [
        ("qwen3", {"worldSize": 2}, "the qwen3 family has no routed experts"),
        ("qwen3_moe", {"worldSize": 3}, "do not divide the qwen3_moe model's 4 routed experts evenly; allowed world "
                                        "sizes: 1, 2, 4"),
        ("qwen3_moe", {"backendType": "ms"}, "expert parallelism is served by backendType 'torch' only"),
    ],
)
def test_expert_parallel_refused_where_it_cannot_serve(
    name: str, model: dict[str, Any], error: str, tiny_family: Callable[[str], Path]
) -> None:
    world = model.pop("worldSize", 1)
    with pytest.raises(Exception, match="expertParallel") as info:
        load_host(_config(tiny_family(name), world, expertParallel=True, **model))
    assert error in str(info.value)
