"""Expert parallelism (``ModelConfig.expertParallel``): two ranks that each hold half the routed experts whole
serve the tiny Qwen3-MoE and DeepSeek-V2 models as one rank does, rank 0 built only its own experts, and what cannot
be served that way is refused at startup."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from family_cases import served_with_logprobs

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


def test_rank_one_reads_only_its_experts_and_one_rank_is_told_it_has_no_effect(
    tiny_family: Callable[[str], Path],
) -> None:
    """The loader hands rank 1 of 2 experts 4..7 of each DeepSeek-V2 sparse layer, each whole, and none of the others
    (their tensors are never read); with worldSize 1 the key is reported as having no effect."""
    from mindie_plugin_models.deepseek import DEEPSEEK_V2 as family

    from mindie_host.api import resolve_model
    from mindie_host.backend_api import Architectures, TensorParallel, iter_weights, load_arch
    from mindie_host.testing import no_effect_notes

    source = resolve_model(tiny_family("deepseek_v2"))
    arch = load_arch(source, Architectures.of(family))
    tp = TensorParallel(1, 2, expert_parallel=True)
    read = dict(iter_weights(source, arch, lambda name: family.shard(name, arch, tp), family))
    experts = {int(name.split(".mlp.experts.")[1].split(".")[0]) for name in read if ".mlp.experts." in name}
    assert experts == {4, 5, 6, 7}
    assert read["model.layers.1.mlp.experts.4.down_proj.weight"].shape == (128, 64)  # [hidden, every channel]
    assert read["model.layers.1.mlp.shared_experts.down_proj.weight"].shape == (128, 64)  # 2 x 64 channels, halved
    notes = no_effect_notes(_config(tiny_family("deepseek_v2"), expertParallel=True))
    assert any("ModelConfig[0].expertParallel is True: no effect here (worldSize 1" in n for n in notes), notes
