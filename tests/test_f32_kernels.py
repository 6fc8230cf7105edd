"""staticrt's float32 matrix-vector kernels (models/f32_kernels.py): `f32_linear` for a decode
step's rows against a row-major weight, `f32_experts` for each row through its own expert, both
against float64 products; a float32 model's packed twin runs its linear layers (a tied head too)
and its experts on them over the model's own tensors, no copy, with transformers' tokens."""

from __future__ import annotations

import pytest
import torch
from hf_models import hf_greedy, save_hf_model

import staticrt
from staticrt.models import a8_kernels, f32_kernels
from staticrt.models.a8_linear import F32Linear
from staticrt.models.packed_linear import PACK_MIN_HIDDEN, pack

if a8_kernels.unavailable() is not None:
    pytest.skip(f"the float kernels cannot run here: {a8_kernels.unavailable()}", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    assert f32_kernels.usable(torch.float32) and not f32_kernels.usable(torch.bfloat16)


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [16, 64, 1040])
def test_f32_linear_is_the_product_for_a_decode_steps_rows(rows, k):
    """Channels in blocks of 4 and what is left (N = 37), K any multiple of 16."""
    g = torch.Generator().manual_seed(k + rows)
    x, w = torch.randn(rows, k, generator=g), torch.randn(37, k, generator=g)
    out = torch.ops.staticrt.f32_linear(x, w)
    assert out.shape == (rows, 37)
    torch.testing.assert_close(out, exact(x, w), rtol=1e-5, atol=1e-5 * k**0.5)


@pytest.mark.parametrize("rows,k", [(5, 64), (40, 64), (1, 24)])
def test_f32_linear_hands_more_rows_or_an_odd_width_to_torchs_linear(rows, k):
    x, w = torch.randn(rows, k), torch.randn(9, k)
    assert torch.equal(torch.ops.staticrt.f32_linear(x, w), torch.nn.functional.linear(x, w))


def test_f32_experts_runs_each_row_through_its_own_expert_and_refuses_another_index():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 64, generator=g), torch.randn(5, 19, 64, generator=g)  # 6 rows, 5 experts of [19, 64]
    index = torch.tensor([4, 0, 0, 2, 4, 1])
    out = torch.ops.staticrt.f32_experts(x, w, index)
    expected = torch.stack([exact(x[r : r + 1], w[e])[0] for r, e in enumerate(index.tolist())])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="f32_experts: an expert index outside 0..E-1"):
        torch.ops.staticrt.f32_experts(x, w, torch.tensor([4, 0, 0, 2, 5, 1]))


@pytest.mark.parametrize("tied,store", [(False, "on"), (True, "off")])
def test_a_float32_model_packed_in_place_decodes_on_the_kernel_over_its_own_weights(tmp_path, tied, store, monkeypatch):
    """`load_model(packed=True)` (the CLI's) makes each linear layer, a tied head too, an F32Linear
    over the checkpoint's row-major tensor: the weights held once; compiled graphs, stored
    (AOTInductor) or frozen in the process, and eager give transformers' tokens."""
    pytest.importorskip("transformers", reason="transformers is the oracle; install the test extra")
    monkeypatch.setenv("STATICRT_COMPILE_CACHE", store)
    hf = save_hf_model("llama", tmp_path, hidden_size=PACK_MIN_HIDDEN, intermediate_size=512, tie_word_embeddings=tied)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    model = staticrt.load_model(tmp_path, packed=True)
    linears = [m for m in model.modules() if isinstance(m, F32Linear)]
    assert model.packed and len(linears) == 2 * 4 + 1
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    floats = sum(t.numel() for t in hf.state_dict().values()) - (hf.lm_head.weight.numel() if tied else 0)
    assert sum(p.numel() for p in model.parameters()) == floats  # no tensor held twice
    if tied:
        assert model.lm_head.weight is model.embed_tokens.weight
    gen = staticrt.Generator(model, max_batch_size=2, max_cache_len=64, backend="compiled", prefill_buckets=[16])
    assert gen.generate(prompts, 12) == expected
    assert staticrt.Generator(model, max_batch_size=2, max_cache_len=64).generate(prompts, 12) == expected


def test_a_mixture_of_experts_twin_streams_each_tokens_experts_in_place(hf_checkpoints):
    """The twin's experts run `f32_experts` on the stacks themselves: the decode steps of two rows
    (2 x k 2 < E 8: each token's own experts, moe.py's gathered form) give transformers' tokens."""
    folder, hf = hf_checkpoints["qwen3_moe"]
    model = staticrt.load_model(folder)
    twin = pack(model, twin=True)
    experts = [m for m in twin.modules() if type(m).__name__ == "Experts"]
    assert experts and all(e.streams for e in experts)
    assert not any(e.streams for e in model.modules() if type(e).__name__ == "Experts")
    prompts = [[5, 17, 99, 3, 200, 45, 8], [77, 3, 3, 140, 9]]
    gen = staticrt.Generator(twin, max_batch_size=2, max_cache_len=64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        assert gen.generate(prompts, 20) == [hf_greedy(hf, p, 20) for p in prompts]
    calls = {event.key: event.count for event in profile.key_averages()}
    assert calls["staticrt::f32_experts"] == 19 * 2 * len(experts)  # each decode step's two stacks a MoE layer
