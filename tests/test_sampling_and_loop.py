"""Token choice and the host loop: exact picks, stop tokens, streaming, padding rows."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

import staticrt
from staticrt.generation import host_sampling, sampling
from staticrt.generation.sampling import blocked_running_sum, greedy, sample


def pick(probs, uniform, top_k=0, top_p=1.0, temperature=1.0):
    logits = torch.tensor([[math.log(p) for p in probs]])
    return sample(
        logits, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([uniform])
    ).item()


def test_inverse_cdf_pick_is_exact():
    probs = [0.2, 0.5, 0.3]  # sorted: token 1 (0.5), token 2 (0.3), token 0 (0.2); cdf .5 .8 1.0
    assert pick(probs, 0.49) == 1
    assert pick(probs, 0.51) == 2
    assert pick(probs, 0.81) == 0
    assert pick(probs, 0.99, top_k=2) == 2  # token 0 is cut; renormalised cdf .625 1.0
    assert pick(probs, 0.99, top_p=0.5) == 1  # the nucleus is token 1 alone
    assert pick(probs, 0.7, top_p=0.6) == 2  # nucleus {1, 2}: cdf .625 1.0


def test_top_k_one_is_greedy():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    chosen = sample(logits, torch.ones(4), torch.ones(4, dtype=torch.int64), torch.ones(4), torch.rand(4))
    assert torch.equal(chosen, greedy(logits))


@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.sampled_from([-3.0, -1.5, 0.0, 0.25, 2.0, 7.0]), min_size=12, max_size=12),  # ties
            st.sampled_from([0.5, 1.0, 1.7]),  # temperature
            st.sampled_from([0, 1, 3, 12]),  # top_k; 1 for a greedy or idle row of a server's step
            st.sampled_from([0.3, 0.9, 1.0]),  # top_p
            st.floats(0, 0.999),  # uniform
        ),
        min_size=1,
        max_size=5,
    )
)
def test_the_hosts_numpy_pick_is_the_graphs_torch_pick(rows):
    """ONNX Runtime's runner chooses on the host; every backend must pick the same token for a seed."""
    logits, temperature, top_k, top_p, uniform = (list(column) for column in zip(*rows))
    expected = sample(
        torch.tensor(logits),
        torch.tensor(temperature),
        torch.tensor(top_k),
        torch.tensor(top_p),
        torch.tensor(uniform, dtype=torch.float32),
    )
    got = host_sampling.sample(
        np.array(logits, dtype=np.float32),
        np.array(temperature),
        np.array(top_k),
        np.array(top_p),
        np.array(uniform, dtype=np.float32),
    )
    assert got.tolist() == expected.tolist()


def scans_in(step, *shapes_and_dtypes) -> list[tuple[int, ...]]:
    """The input shape of every cumsum in `step`'s traced graph, torch.cond's branches included."""
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(step)(*[torch.zeros(shape, dtype=dtype) for shape, dtype in shapes_and_dtypes])
    return [
        tuple(node.args[0].meta["val"].shape)
        for module in traced.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.target == torch.ops.aten.cumsum.default
    ]


def test_sampling_on_cuda_scans_at_most_32_elements_which_torch_211s_inductor_compiles(monkeypatch):
    """`bench-serve --backend cudagraph` died on an H200 compiling decode_sample for 8 rows over a
    32000-token vocabulary: torch 2.11's inductor splits a long scan over few rows (SplitScan) and
    its Triton code generation fails on it. Every scan in the sampling steps is short there
    (traced here on the CPU, taken for CUDA: fake CUDA tensors cannot be indexed without CUDA)."""
    rows, vocab, f32, i64 = 8, 32000, torch.float32, torch.int64
    per_row = [((rows,), f32), ((rows,), i64), ((rows,), f32), ((rows,), f32)]
    steps = {
        "pick": [((rows, vocab), f32), *per_row],
        "verify_sample": [((rows, 4, vocab), f32), ((rows, 4), i64), *per_row[:3], ((rows, 4, 2), f32)],
    }
    assert max(shape[-1] for shape in scans_in(sampling.pick, *steps["pick"])) == vocab  # the CPU's one scan
    monkeypatch.setattr(sampling, "SHORT_SCAN_DEVICES", frozenset({"cpu"}))
    for name, inputs in steps.items():
        scans = scans_in(getattr(sampling, name), *inputs)
        assert len(scans) >= 2 and all(shape[-1] <= sampling.SCAN_BLOCK for shape in scans), (name, scans)


@given(
    rows=st.integers(1, 3),
    width=st.integers(1, 40_000),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_blocked_running_sum_is_the_running_sum(rows, width, seed):
    values = torch.randint(-50, 50, (rows, width), generator=torch.Generator().manual_seed(seed)).double()
    assert torch.equal(blocked_running_sum(values), torch.cumsum(values, dim=-1))  # integers: exact


def test_stop_tokens_and_streaming():
    gen = staticrt.Generator(staticrt.load_model("tiny-qwen2"), max_batch_size=3, max_cache_len=64)
    prompts = [[11, 12, 13], [40, 41], [7]]
    full = gen.generate(prompts, max_new_tokens=12)
    stop = full[0][4]
    streamed: list[tuple[int, int]] = []
    cut = gen.generate(prompts, max_new_tokens=12, stop_token_ids=[stop], stream=lambda r, t: streamed.append((r, t)))
    for row, tokens in zip(full, cut):
        expected = row[: row.index(stop) + 1] if stop in row else row
        assert tokens == expected
    assert [t for r, t in streamed if r == 0] == cut[0]
    assert sorted(r for r, _ in streamed) == sorted(r for r, toks in enumerate(cut) for _ in toks)
    assert gen.last_stats.bucket == 16 and len(gen.last_stats.decode_s) == max(map(len, cut)) - 1


def test_a_short_batch_in_a_large_generator_matches_batch_one():
    model = staticrt.load_model("tiny-gemma2")
    one = staticrt.Generator(model, max_batch_size=1, max_cache_len=48).generate([[5, 6, 7]], max_new_tokens=20)
    four = staticrt.Generator(model, max_batch_size=4, max_cache_len=48).generate([[5, 6, 7]], max_new_tokens=20)
    assert one == four
