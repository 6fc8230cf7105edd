"""Mixtures of experts in fixed shapes (issue 64: Mixtral, Qwen3-MoE, OLMoE, gpt-oss) on tiny random
checkpoints transformers saved (tests/hf_models.py): greedy tokens equal transformers' at batch 4
and 1, on every backend and on the sliding cache where the family has windows; a decode step reads
k of E experts a token; routing sends a batch's tokens to different experts. `--quantize` stores
the experts as int8 or int4 codes (expert_quant.py): on staticrt's kernels each expert's own matrix
product, elsewhere exactly the float model of the dequantized codes, on eager, compiled, AOTI and ONNX.
"""

from __future__ import annotations

import contextlib
import copy
import unittest.mock

import pytest
import torch
from hf_models import MOE_FAMILIES

import staticrt
from staticrt.backends.cudagraph import HostReplayBackend
from staticrt.caches import CacheSpec, build_cache
from staticrt.errors import ConfigError
from staticrt.exporters import export_artifact
from staticrt.generation.generator import load_artifact
from staticrt.models.a8_linear import int4_ungrouped
from staticrt.models.expert_quant import QuantizedStack
from staticrt.models.moe import SparseMoE
from staticrt.models.quant_spec import QuantSpec

PROMPTS = [[5, 17, 99, 3, 200, 45, 8], list(range(10, 50)), [1, 2, 3], [77, 3, 3, 140, 9]]
NEW_TOKENS = 36  # past position 32, where gpt-oss's yarn and the windows of 16 matter
OPTIONS = dict(max_batch_size=4, max_cache_len=96)
WINDOWED = {"mixtral": "sliding", "gpt_oss": "hybrid"}
CASES = [(f, c) for f in MOE_FAMILIES for c in ("static", *([WINDOWED[f]] if f in WINDOWED else []))]


@pytest.fixture
def expected(transformers_tokens):
    """family -> transformers' greedy tokens for PROMPTS, each prompt alone."""
    return lambda family: transformers_tokens(family, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("family,cache", CASES)
def test_eager_tokens_equal_transformers_at_batch_4_and_1(hf_checkpoints, expected, family, cache):
    model = staticrt.load_model(hf_checkpoints[family][0])
    assert model.config.num_experts in (4, 8)
    gen = staticrt.Generator(model, cache=cache, **OPTIONS)
    assert gen.generate(PROMPTS, NEW_TOKENS) == expected(family)
    assert [gen.generate([p], NEW_TOKENS)[0] for p in PROMPTS[:2]] == expected(family)[:2]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_logits_equal_transformers_in_prefill_and_in_decode_steps(hf_checkpoints, family):
    """The logits of a 24-token prefill (every expert on every token, weighted) and of 16 decode
    steps after it (each token's own experts gathered) against transformers' over the whole."""
    folder, hf = hf_checkpoints[family]
    model = staticrt.load_model(folder)
    ids = torch.tensor([PROMPTS[1]])  # 40 tokens
    cache = build_cache(model.config, CacheSpec(WINDOWED.get(family, "static"), 1, 64), torch.float32)
    with torch.no_grad():
        ours = [model(ids[:, :24], torch.tensor([0]), cache, last_only=False)[0]]
        ours += [model(ids[:, t : t + 1], torch.tensor([t]), cache, last_only=False)[0] for t in range(24, 40)]
        theirs = hf(ids).logits[0]
    torch.testing.assert_close(torch.cat(ours), theirs, rtol=1e-4, atol=1e-4)


def test_a_decode_step_reads_k_experts_a_token_and_a_batch_goes_to_different_experts(
    hf_checkpoints, expected, monkeypatch
):
    """At batch 1 and 2 (N * k < E) a decode step gathers each token's k experts and runs no
    other; a prefill (and a batch whose tokens could touch every expert) runs them all, weighted."""
    model = staticrt.load_model(hf_checkpoints["qwen3_moe"][0])  # E 8, k 2
    seen: list[tuple[int, list[list[int]]]] = []
    route = SparseMoE._route

    def recorded(self, logits):
        weights, chosen = route(self, logits)
        seen.append((logits.shape[0], sorted(chosen.tolist())))
        return weights, chosen

    every = SparseMoE._dense

    def dense(self, x, routing):
        assert x.shape[0] * self.k >= self.num_experts, "a decode step ran every expert"
        return every(self, x, routing)

    monkeypatch.setattr(SparseMoE, "_route", recorded)
    monkeypatch.setattr(SparseMoE, "_dense", dense)
    gen = staticrt.Generator(model, max_batch_size=2, max_cache_len=96)
    assert gen.generate(PROMPTS[:2], NEW_TOKENS) == expected("qwen3_moe")[:2]
    decode = [chosen for tokens, chosen in seen if tokens == 2]
    assert decode and all(len(set(map(tuple, c))) == 2 for c in decode[:5])  # the two rows chose apart
    assert len({e for c in decode for row in c for e in row}) == 8  # and over the steps, every expert


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_compiled_and_replayed_graphs_give_transformers_tokens(hf_checkpoints, expected, family):
    model = staticrt.load_model(hf_checkpoints[family][0])
    cache = WINDOWED.get(family, "static")
    compiled = staticrt.Generator(model, cache=cache, backend="compiled", prefill_buckets=[64], **OPTIONS)
    assert compiled.generate(PROMPTS, NEW_TOKENS) == expected(family)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert compiled.generate(PROMPTS[:1], NEW_TOKENS) == expected(family)[:1]
    replayed = staticrt.Generator(HostReplayBackend(model, cache=cache, prefill_buckets=[64], **OPTIONS))
    assert replayed.generate(PROMPTS, NEW_TOKENS) == expected(family)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_packed_experts_are_read_in_place_and_give_transformers_tokens(hf_checkpoints, expected, family):
    """The packed twin of the CPU graphs (packed_linear.pack) holds each float32 stack in blocks of
    16 channels: a batch-1 decode step runs `f32_experts` on the chosen experts in place, a
    batch of 4 (as many rows times k as experts) multiplies each expert laid back out; both give
    transformers' tokens, and the model keeps its own float stacks."""
    from staticrt.models.packed_experts import PackedStack
    from staticrt.models.packed_linear import pack

    model = staticrt.load_model(hf_checkpoints[family][0])
    twin = pack(model, twin=True)
    experts = twin.layers[0].mlp.experts
    assert isinstance(experts.down_proj, PackedStack) and isinstance(
        model.layers[0].mlp.experts.down_proj, torch.nn.Parameter
    )
    calls = []
    run = torch.ops.staticrt.f32_experts
    with unittest.mock.patch.object(torch.ops.staticrt, "f32_experts", lambda *a: calls.append(1) or run(*a)):
        cache = WINDOWED.get(family, "static")
        assert staticrt.Generator(twin, cache=cache, **OPTIONS).generate(PROMPTS, NEW_TOKENS) == expected(family)
        assert not calls  # 4 rows: every expert, densely
        one = staticrt.Generator(twin, cache=cache, **{**OPTIONS, "max_batch_size": 1})
        assert one.generate(PROMPTS[:1], NEW_TOKENS) == expected(family)[:1]
    layers = sum(isinstance(m, PackedStack) for m in twin.modules()) // 2  # those with experts: two stacks each
    assert len(calls) == 2 * layers * (NEW_TOKENS - 1)  # each decode step (the first token is the prefill's)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_onnx_torch_export_and_aoti_artifacts_give_transformers_tokens(hf_checkpoints, expected, tmp_path, family):
    """The routing as standard ops (TopK, Gather, MatMul), the experts' weights stored once; the
    torch.export programs, and AOTInductor's compile of them (gpt-oss: sinks, biased experts)."""
    model = staticrt.load_model(hf_checkpoints[family][0])
    cache = WINDOWED.get(family, "static")
    folder = export_artifact(model, CacheSpec(cache, 4, 96), [64], tmp_path / family, ["pt2", "aoti", "onnx"])
    for backend in ("onnx", "pt2", "aoti"):
        assert load_artifact(folder, backend).generate(PROMPTS, NEW_TOKENS) == expected(family), backend


def test_moe_variants_not_implemented_are_refused_by_name():
    from staticrt.loading.hf_config import config_from_hf

    with pytest.raises(ConfigError, match="^config.json: model_type 'qwen2_moe' is not supported; staticrt runs"):
        config_from_hf({"model_type": "qwen2_moe"}, "config.json")


def dequantized_twin(model):
    """A copy of a model loaded with `quantize` whose experts hold their codes' dequantized values as
    float stacks: what the quantized experts must compute exactly (its projections are the model's)."""
    twin = copy.deepcopy(model)
    for moe in [m for m in twin.modules() if isinstance(m, SparseMoE)]:
        for name in ("gate_up_proj", "down_proj"):
            stack = getattr(moe.experts, name)
            assert isinstance(stack, QuantizedStack) and stack.codes.dtype in (torch.int8, torch.uint8)
            weights = stack.gather(torch.arange(moe.num_experts), model.embed_tokens.weight.dtype)
            delattr(moe.experts, name)
            setattr(moe.experts, name, torch.nn.Parameter(weights, requires_grad=False))
    return twin


def dequantization_error_within_half_a_step(stack: QuantizedStack, weight: torch.Tensor) -> bool:
    """Whether every dequantized weight of `stack` lies within half its row's (int8) or block's (int4) step."""
    experts, outputs, inputs = weight.shape
    error = (stack.gather(torch.arange(experts), torch.float32) - weight.float()).abs()
    if stack.bits == 8:
        step = stack.scales[..., None]
    else:  # dm: (d, m) a block of 32 inputs, in 16-channel groups on the kernels
        dm = int4_ungrouped(stack.codes, stack.dm, outputs)[1] if stack.kernel else stack.dm
        step = dm[..., 0].float().repeat_interleave(32, dim=-1)
    return bool(torch.all(error <= step * 0.51 + 1e-4))


@pytest.mark.parametrize("family,quantize", [("gpt_oss", "int4-g32"), ("qwen3_moe", "int8")])
def test_quantized_experts_compute_the_float_model_of_their_dequantized_codes(hf_checkpoints, family, quantize):
    """`--quantize` on a mixture of experts: its stacks as codes in the a8 kernels' layouts
    (expert_quant.py), each weight within half a step of the float one; the router stays float.
    Where a step dequantizes what it gathers (beside torchao's kernels, in bfloat16: int4 named,
    and the int8 that Qwen3-MoE's 96-wide attention takes), the model's tokens (eager, batch 4:
    decode gathers, prefill runs every expert) are those of its twin holding the dequantized values
    as floats."""
    model = staticrt.load_model(hf_checkpoints[family][0], quantize=quantize)
    floats = staticrt.load_model(hf_checkpoints[family][0], dtype=model.embed_tokens.weight.dtype)  # as it quantized
    layers = lambda m: [moe for moe in m.modules() if isinstance(moe, SparseMoE)]  # noqa: E731
    for ours, theirs in zip(layers(model), layers(floats), strict=True):
        assert type(ours.gate) is torch.nn.Linear and ours.gate.weight.dtype == model.embed_tokens.weight.dtype
        for name in ("gate_up_proj", "down_proj"):
            stack = getattr(ours.experts, name)
            assert not stack.kernel and dequantization_error_within_half_a_step(stack, getattr(theirs.experts, name))
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    expected = staticrt.Generator(dequantized_twin(model), **OPTIONS).generate(PROMPTS, NEW_TOKENS)
    assert staticrt.Generator(model, **OPTIONS).generate(PROMPTS, NEW_TOKENS) == expected


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_experts_decode_on_the_kernels_as_each_experts_own_linear(hf_checkpoints, quantize):
    """quantize "int8" / "int4" on this CPU (staticrt's kernels): a decode step runs each token
    through its k experts' codes in place (`int8_experts`, `int4_experts`), exactly as `int8_linear`
    / `int4_linear` over each chosen expert's own rows would, and the router stays float; compiled
    gives eager's tokens."""
    model = staticrt.load_model(hf_checkpoints["mixtral"][0], quantize=quantize)
    floats = staticrt.load_model(hf_checkpoints["mixtral"][0])
    moe, theirs = model.layers[0].mlp, floats.layers[0].mlp
    assert type(moe.gate) is torch.nn.Linear and torch.equal(moe.gate.weight, theirs.gate.weight)
    for name in ("gate_up_proj", "down_proj"):
        stack = getattr(moe.experts, name)
        assert stack.kernel and dequantization_error_within_half_a_step(stack, getattr(theirs.experts, name))
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj

    def linear(x: torch.Tensor, stack: QuantizedStack, e: int) -> torch.Tensor:  # one expert's own matrix product
        if stack.bits == 8:
            return torch.ops.staticrt.int8_linear(x, stack.codes[e], stack.scales[e])  # int8_linear's own layout
        return torch.ops.staticrt.int4_linear(x, stack.codes[e], stack.dm[e], stack.shape[0])  # its own layout

    for seed in range(4):  # one token a step: k of E experts, the gathered form
        x = torch.randn(1, 64, generator=torch.Generator().manual_seed(seed))
        weights, chosen = moe._route(moe.gate(x))
        chosen, order = chosen.sort(dim=-1)
        want = torch.zeros_like(x)
        for j, e in enumerate(chosen[0].tolist()):
            want = want + linear(moe._act(linear(x, gate_up, e)), down, e) * weights.gather(1, order)[:, j, None]
        with torch.no_grad():
            assert torch.equal(moe(x), want)
    rows = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))  # three tokens, each its own two experts
    chosen = torch.tensor([[0, 3], [1, 2], [2, 3]])
    want = torch.stack(
        [torch.stack([linear(rows[t : t + 1], gate_up, e)[0] for e in c]) for t, c in enumerate(chosen.tolist())]
    )
    assert torch.equal(moe.experts.project("gate_up_proj", rows, chosen), want)
    expected = staticrt.Generator(model, **OPTIONS).generate(PROMPTS, NEW_TOKENS)
    compiled = staticrt.Generator(model, backend="compiled", prefill_buckets=[64], **OPTIONS)
    assert compiled.generate(PROMPTS, NEW_TOKENS) == expected


def test_aoti_runs_the_experts_kernel(hf_checkpoints, tmp_path):
    """AOTInductor's program calls `int8_experts` on the codes it holds, as eager does."""
    model = staticrt.load_model(hf_checkpoints["mixtral"][0], quantize="int8")
    aoti = export_artifact(model, CacheSpec("static", 4, 96), [64], tmp_path / "aoti", ["aoti"])
    expected = staticrt.Generator(model, **OPTIONS).generate(PROMPTS, NEW_TOKENS)
    assert load_artifact(aoti, "aoti").generate(PROMPTS, NEW_TOKENS) == expected


@pytest.mark.parametrize("quantize,code_type", [("int8", "INT8"), ("int4", "UINT8")])
def test_the_onnx_graph_holds_the_experts_as_their_codes(hf_checkpoints, tmp_path, monkeypatch, quantize, code_type):
    """`export --format onnx --quantize` quantizes the float model's experts as the torch side does
    (Gather, Cast, Mul over int8 codes, or uint8 nibbles unpacked in the graph), beside ONNX
    Runtime's MatMulNBits for the projections; the routers stay float Gemms, the artifact sheds at
    least half the float stacks' bytes, and its tokens are those of the same graph over the
    dequantized values as floats."""
    import onnx

    from staticrt.exporters import onnx_export

    folder, spec = (
        hf_checkpoints["mixtral"][0],
        QuantSpec(8 if quantize == "int8" else 4, None if quantize == "int8" else 32, None),
    )
    floats = staticrt.load_model(folder)
    graph = export_artifact(floats, CacheSpec("static", 4, 96), [64], tmp_path / "onnx", ["onnx"], quantize=spec)
    moes = [m for m in floats.modules() if isinstance(m, SparseMoE)]
    assert all(type(m.experts.gate_up_proj) is torch.nn.Parameter for m in moes)  # put back after the trace
    onnx_graph = onnx.load(str(graph / "onnx" / "model.onnx")).graph
    stacks = {i.name: i.data_type for i in onnx_graph.initializer if "experts" in i.name}
    assert len(stacks) == 4 and set(stacks.values()) == {getattr(onnx.TensorProto, code_type)}  # 2 layers' codes
    assert len([n for n in onnx_graph.node if n.op_type == "Gemm" and n.input[1].endswith("mlp.gate.weight")]) == 2
    twin = dequantized_twin(staticrt.load_model(folder, quantize=quantize))  # the same codes, dequantized
    float_bytes = sum(4 * (m.experts.gate_up_proj.numel() + m.experts.down_proj.numel()) for m in moes)
    for moe, mine in zip(moes, [m for m in twin.modules() if isinstance(m, SparseMoE)], strict=True):
        moe.experts.gate_up_proj.data, moe.experts.down_proj.data = mine.experts.gate_up_proj, mine.experts.down_proj
    monkeypatch.setattr(onnx_export, "experts_quantized", lambda model, spec: contextlib.nullcontext())
    reference = export_artifact(floats, CacheSpec("static", 4, 96), [64], tmp_path / "ref", ["onnx"], quantize=spec)
    size = lambda f: (f / "onnx" / "model.onnx.data").stat().st_size  # noqa: E731
    assert size(reference) - size(graph) >= float_bytes / 2
    ours, theirs = load_artifact(graph, "onnx"), load_artifact(reference, "onnx")
    assert ours.generate(PROMPTS, NEW_TOKENS) == theirs.generate(PROMPTS, NEW_TOKENS)


def test_a_mixtral_gguf_without_its_experts_is_refused_by_name_before_transformers_reads_it(tmp_path):
    """llama.cpp writes Mixtral as a "llama" GGUF with experts (test_families.py converts one); one
    missing a layer's expert tensors is named, not read by transformers as a dense Llama."""
    pytest.importorskip("gguf", reason="GGUF needs the gguf extra: use the README's test command")
    from gguf_files import stub_gguf

    from staticrt.errors import CheckpointError

    with pytest.raises(CheckpointError) as refused:
        staticrt.load_model(stub_gguf(tmp_path / "mixtral.gguf", "llama", experts=8))
    assert str(refused.value) == (
        "mixtral.gguf holds a Mixtral (a 'llama' GGUF with 8 experts) without its tensor blk.0.ffn_gate_inp.weight; "
        "the file is incomplete or not llama.cpp's layout: download it again"
    )
