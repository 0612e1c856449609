"""The layers' elementwise steps on CPU (mindie_host/backends/layer_ops.cpp) against torch's operators.

In every kernel variant this CPU executes (portable, avx2, avx512): the rotary embedding must give
torch's bits (the same products and sum, unfused); the residual add must be exact and the RMSNorm
within float32 rounding of torch's (rtol 2e-6: the sum of squares runs in another order); each row
must get the same bits alone and among other rows (batch-invariant decoding). Widths cover whole
vectors and tails (100, 33 rows). On the default model, a prompt's logits through the kernel match
those through torch's operators, and a platform that brings its own RMSNorm keeps it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mindie_host.backends import cpu_extensions, cpu_layer_ops
from mindie_host.backends.base import ModelInput
from mindie_host.backends.platform import Platform, _rope
from mindie_host.backends.torch.backend import TorchBackend
from mindie_host.models.default import default_model_path
from mindie_host.models.weights import resolve_model

pytestmark = pytest.mark.skipif(cpu_extensions.compiler() is None, reason="no C++ compiler")


def tables(t: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(seed)).float()
    freq = pos[:, None] / 10000 ** (torch.arange(0, d, 2).float() / d)[None]
    emb = torch.cat([freq, freq], -1)
    return emb.cos()[:, None], emb.sin()[:, None]  # [T, 1, D], as the model passes them


@pytest.mark.parametrize("t,heads,kv,d", [(517, 9, 3, 64), (3, 32, 8, 128), (40, 4, 2, 48), (1, 2, 1, 8)])
def test_rope_gives_torchs_bits_on_views_of_the_qkv_product(cpu_variant: object, t: int, heads: int, kv: int,
                                                           d: int) -> None:
    qkv = torch.randn(t, (heads + 2 * kv) * d, generator=torch.Generator().manual_seed(t))
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d : (heads + kv) * d].view(t, kv, d)
    cos, sin = tables(t, d)
    got = cpu_layer_ops.rope(q, k, cos, sin)
    assert got is not None
    assert torch.equal(got[0], _rope(q, cos, sin)) and torch.equal(got[1], _rope(k, cos, sin))
    assert got[0].is_contiguous() and got[1].is_contiguous()
    one = cpu_layer_ops.rope(q[t // 2 : t // 2 + 1], k[t // 2 : t // 2 + 1], cos[t // 2 : t // 2 + 1],
                             sin[t // 2 : t // 2 + 1])
    assert one is not None and torch.equal(one[0][0], got[0][t // 2])


@pytest.mark.parametrize("t,n", [(564, 576), (7, 2048), (33, 100), (2, 7)])
def test_add_rms_norm_adds_exactly_and_normalizes_like_torch(cpu_variant: object, t: int, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x, r, w = torch.randn(t, n, generator=g) * 3, torch.randn(t, n, generator=g), torch.randn(n, generator=g)
    total = x + r
    h = cpu_layer_ops.add_rms_norm(x, r, w, 1e-5)  # x becomes the sum
    assert h is not None and torch.equal(x, total)
    torch.testing.assert_close(h, F.rms_norm(total, (n,), w, 1e-5), rtol=2e-6, atol=1e-6)
    alone = cpu_layer_ops.add_rms_norm(total[t - 1 :].clone(), None, w, 1e-5)
    assert alone is not None and torch.equal(alone[0], h[t - 1])  # a row's bits do not depend on the others


def test_tensors_the_kernel_does_not_take_go_to_torch(cpu_variant: object) -> None:
    x = torch.randn(4, 64)
    assert cpu_layer_ops.add_rms_norm(x.t(), None, torch.ones(4), 1e-5) is None  # not contiguous
    assert cpu_layer_ops.add_rms_norm(x.double(), None, torch.ones(64, dtype=torch.double), 1e-5) is None
    q = torch.randn(4, 2, 64).transpose(0, 1)  # heads not contiguous within a row
    cos, sin = tables(2, 64)
    assert cpu_layer_ops.rope(q, q, cos, sin) is None
    platform = Platform()
    y = torch.randn(5, 64)
    torch.testing.assert_close(platform.rms_norm(y.double(), torch.ones(64, dtype=torch.double), 1e-6),
                               F.rms_norm(y.double(), (64,), torch.ones(64, dtype=torch.double), 1e-6))


def test_a_platform_with_its_own_norm_keeps_it() -> None:
    calls = []

    class OwnNorm(Platform):
        def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            calls.append(x.shape)
            return x * weight

    x, r = torch.randn(3, 16), torch.randn(3, 16)
    total, h = OwnNorm().add_rms_norm(x.clone(), r, torch.full((16,), 2.0), 1e-5)
    assert calls == [(3, 16)] and torch.equal(total, x + r) and torch.equal(h, (x + r) * 2)


def test_the_default_models_logits_match_torchs_operators() -> None:
    backend = TorchBackend(resolve_model(default_model_path()), name="default", dtype="float32",
                           quantization="none", platform=Platform())
    backend.load()
    backend.allocate_kv_cache(16, 16)
    prompt = [(37 * t + 11) % 40000 for t in range(70)]
    step = ModelInput(input_ids=prompt, positions=list(range(70)), query_lens=[70], context_lens=[70],
                      block_tables=[[0, 1, 2, 3, 4]], logits_indices=[10, 69], row_variants=[-1], prompt_lens=[70])
    backend.load_cpu_kernels()
    fused = backend.execute(step)
    with cpu_extensions.using(cpu_extensions.kernels(), off=frozenset({"layer_ops"})):  # torch's operators
        plain = backend.execute(step)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))
