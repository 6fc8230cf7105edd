"""The float32 decode kernel over oneDNN's packed weights (staticrt/models/packed_gemv.py): its
product equals the matrix's for every block width it takes, and a packed linear layer runs it for
steps of up to four rows and oneDNN's GEMM past them, on the same tensor. The tokens of models whose
graphs read packed weights are test_compile_cache.py's (transformers' greedy tokens)."""

from __future__ import annotations

import pytest
import torch

from staticrt.models import a8_kernels, packed_gemv
from staticrt.models.packed_linear import PackedLinear, address, packing_available

pytestmark = pytest.mark.skipif(
    a8_kernels.unavailable() is not None or not packing_available(torch.float32),
    reason="the kernel needs AVX2 (or AVX-512) and oneDNN's packed linear",
)


@pytest.fixture(autouse=True)
def _kernels():
    assert packed_gemv.usable()  # builds (once) and loads the library that defines the op


def blocks_of(weight: torch.Tensor, width: int, padded: int) -> torch.Tensor:
    """`weight` [N, K] laid out as oneDNN packs it: [B, Kp, width], channel n's weight k at
    [n // width, k, n % width], zeros past N and K."""
    n, k = weight.shape
    count = -(-n // width)
    out = torch.zeros(count * width, padded)
    out[:n, :k] = weight
    return out.view(count, width, padded).transpose(1, 2).contiguous()


@pytest.mark.parametrize("width", [8, 16, 32, 64])
def test_the_kernel_multiplies_each_block_width_as_the_layout_lays_it_out(width):
    lanes = 16 if a8_kernels.isa() == "avx512_vnni" else 8
    weight = torch.randn(100, 40)  # 100 channels: a part block at the end; 40 of Kp 48
    blocks = blocks_of(weight, width, 48)
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, 40)
        if width % lanes:
            with pytest.raises(RuntimeError, match="NB must be 1, 2, 4 or 8 vectors"):
                torch.ops.staticrt.f32_packed_linear(x, blocks)
            continue
        y = torch.ops.staticrt.f32_packed_linear(x, blocks)  # [rows, B * width]
        assert y.shape == (rows, blocks.shape[0] * width)
        torch.testing.assert_close(y[:, :100], x @ weight.T, rtol=1e-5, atol=1e-5)
        assert torch.count_nonzero(y[:, 100:]) == 0  # the padding's channels: zero weights


def test_more_rows_than_a_decode_step_are_refused_by_the_kernel():
    blocks = blocks_of(torch.randn(64, 16), 64, 16)
    with pytest.raises(RuntimeError, match=r"x must be \[M <= 4, K\] float32"):
        torch.ops.staticrt.f32_packed_linear(torch.randn(5, 16), blocks)


def kernel_calls(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = module(x)
    return y, sum(e.count for e in prof.key_averages() if e.key == "staticrt::f32_packed_linear")


def test_a_packed_linear_runs_the_kernel_up_to_four_rows_and_onednn_past_them_on_one_copy():
    weight, bias = torch.randn(300, 256), torch.randn(300)
    layer = PackedLinear(weight, bias, {"a": 100, "b": 200})
    if layer.blocks is None:  # `blocked` found no width whose product is oneDNN's
        pytest.skip("this CPU's oneDNN packs float32 weights in a layout the kernel does not read; oneDNN runs")
    assert layer.blocks.data_ptr() == address(layer.weight)  # its memory, no copy
    for shape, on_kernel in (((1, 256), 1), ((2, 2, 256), 1), ((4, 256), 1), ((5, 256), 0), ((2, 8, 256), 0)):
        x = torch.randn(shape)
        (a, b), calls = kernel_calls(layer, x)
        assert calls == on_kernel, shape
        want = torch.nn.functional.linear(x, weight, bias)
        torch.testing.assert_close(torch.cat([a, b], -1), want, rtol=1e-4, atol=1e-4)
