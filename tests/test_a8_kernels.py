"""quantize "int8-a8" and "int4-a8": staticrt's int8-activation kernels (models/a8_kernels.py), built
for AVX512-VNNI or AVX2. Their tokens, with the build this CPU takes and with the AVX2 one, against
a float model that rounds the same weights and activations to the same grids (the oracle is plain
torch: int8 weights per output channel, int4 ones a scale and minimum a block of 32, activations
int8 per block of 32 along each row); eager and compiled; what cannot run them refused by name; on
SmolLM2 the perplexity within 1% (int8) and 5% (int4) of fp32."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import staticrt
from staticrt.artifacts.manifest import seal
from staticrt.bench.perplexity import perplexity
from staticrt.caches import CacheSpec
from staticrt.cli.main import main
from staticrt.errors import ArtifactError, ConfigError
from staticrt.exporters import export_artifact
from staticrt.models import a8_kernels
from staticrt.models.a8_linear import int4_blocks, int4_groups, int4_ungrouped, int4_weight, int8_codes, int8_groups
from staticrt.models.quant_spec import parse_quantize

FAMILIES = ("llama", "qwen2", "gemma2", "llama-linear-tied")  # qwen2: q/k/v biases; the last: a tied head
PROMPT = [200, 1, 64, 64, 9, 31, 7, 120, 88, 14, 2, 77]
kernel = pytest.mark.skipif(
    a8_kernels.unavailable() is not None,
    reason=f"{a8_kernels.unavailable()}: int8-a8 is refused there (test_a_cpu_without_the_kernel_is_refused_by_name)",
)
SPECS = ("int8-a8", "int4-a8")


def on_the_grids(folder, quantize: str = "int8-a8") -> staticrt.Generator:
    """The float model with the head's weight rounded to its int8 grid (absmax / 127 a row), each
    projection's to int8's or (int4-a8) to its int4 blocks' (Int4Linear's own rounding, read back
    as d * q + m), and each input rounded to the int8 grid of its block of 32 values."""
    model = staticrt.load_model(folder)
    if model.lm_head is None:  # the head as a module of its own, so that its input is rounded too
        model.lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
        model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.detach().clone(), requires_grad=False)

    def rounded(x: torch.Tensor, block: int) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1] // block, block)
        scale = rows.abs().amax(-1, keepdim=True) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return (torch.round(rows / scale) * scale).reshape(x.shape)

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            int4 = quantize == "int4-a8" and name != "lm_head"
            weight = module.weight.data
            module.weight.data = int4_weight(*int4_blocks(weight)) if int4 else rounded(weight, module.in_features)
            module.register_forward_pre_hook(lambda _module, args: (rounded(args[0], 32),))
    return staticrt.Generator(model, max_cache_len=64)


@kernel
@pytest.mark.parametrize("quantize", SPECS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a8_tokens_equal_the_float_model_on_its_grids_eager_and_compiled(hf_checkpoints, family, quantize):
    folder = hf_checkpoints[family][0]
    model = staticrt.load_model(folder, quantize=quantize)
    assert type(model.lm_head).__name__ == "Int8Linear" and model.quantization.name == quantize
    projection = model.layers[0].self_attn.qkv_proj
    assert type(projection).__name__ == ("Int8Linear" if quantize == "int8-a8" else "Int4Linear")
    assert projection.codes.dtype == (torch.int8 if quantize == "int8-a8" else torch.uint8)
    want = on_the_grids(folder, quantize).generate([PROMPT], 24)[0]
    assert staticrt.Generator(model, max_cache_len=64).generate([PROMPT], 24)[0] == want
    compiled = staticrt.Generator(model, max_cache_len=64, backend="compiled", prefill_buckets=(16,))
    assert compiled.generate([PROMPT], 24)[0] == want


@kernel
@pytest.mark.parametrize("quantize", SPECS)
def test_the_avx2_build_gives_the_float_models_tokens_on_its_grids(hf_checkpoints, quantize):
    """Where the CPU has AVX512-VNNI the AVX2 build is tested too, in a process of its own (a
    process holds one build of the ops)."""
    if a8_kernels.isa() == "avx2":
        pytest.skip("this CPU has no AVX512-VNNI: every a8 test here runs the AVX2 build already")
    folder = hf_checkpoints["qwen2"][0]
    code = (
        "import json, sys, staticrt; from staticrt.models import a8_kernels; a8_kernels.isa = lambda: 'avx2'; "
        "m = staticrt.load_model(sys.argv[1], quantize=sys.argv[3]); "
        "print(json.dumps(staticrt.Generator(m, max_cache_len=64).generate([json.loads(sys.argv[2])], 24)[0]))"
    )
    argv = [sys.executable, "-c", code, str(folder), json.dumps(PROMPT), quantize]
    run = subprocess.run(argv, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.splitlines()[-1]) == on_the_grids(folder, quantize).generate([PROMPT], 24)[0]


@kernel
def test_int8_and_int4_choose_these_kernels_on_this_cpu(capsys):
    """What `--quantize int8` and `int4` run on a CPU with the kernels: these, in float32 (and
    `inspect` sizes the cache for float32), a tied head an int8 copy of its own."""
    for name, projection in (("int8", "Int8Linear"), ("int4", "Int4Linear")):
        model = staticrt.load_model("tiny-llama", quantize=name)
        assert model.quantization.name == f"{name}-a8" and model.embed_tokens.weight.dtype == torch.float32
        assert type(model.layers[0].mlp.down_proj).__name__ == projection
        assert type(model.lm_head).__name__ == "Int8Linear"
    assert main(["inspect", "--model", "tiny-llama", "--quantize", "int4", "--format", "csv"]) == 0
    assert '0,full_attention,static,device,1x2x1024x16,"262,144"' in capsys.readouterr().out


@pytest.mark.parametrize("quantize", SPECS)
def test_a_cpu_without_the_kernel_is_refused_by_name(monkeypatch, quantize):
    monkeypatch.setattr(a8_kernels, "isa", lambda: None)
    monkeypatch.setattr(a8_kernels, "_loaded", False)
    with pytest.raises(ConfigError) as raised:
        staticrt.load_model("tiny-llama", quantize=quantize)
    assert str(raised.value) == (
        f"quantize '{quantize}' runs staticrt's int8-activation kernels, and this CPU has neither AVX512-VNNI nor "
        f"AVX2 (or no /proc/cpuinfo says so); use --quantize {quantize[:4]}"
    )


@kernel
def test_a_failed_build_names_the_folder_and_the_compiler_and_each_asker_its_own_way_out(monkeypatch, caplog):
    """Where the library does not build, int8-a8 is refused with the weight-only spec as the way
    out, and float32 decode says it keeps oneDNN's linear (no --quantize advice: it asked for none)."""
    import logging

    from torch.utils import cpp_extension

    from staticrt.models import packed_gemv

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'staticrt_a8'\ng++: not found")

    monkeypatch.setattr(a8_kernels, "_loaded", False)
    monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
    flags = " ".join(a8_kernels.FLAGS[a8_kernels.isa()])
    built = (
        r"staticrt's CPU kernels, which could not be built in \S+/kernels/a8-[0-9a-f]{16}: Error building "
        rf"extension 'staticrt_a8'; install a C\+\+ compiler that takes {flags} \(g\+\+ 10 or newer does\)"
    )
    with pytest.raises(ConfigError, match=rf"^quantize 'int8-a8' needs {built}, or use --quantize int8$"):
        a8_kernels.load("int8-a8")
    packed_gemv.usable.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="staticrt"):
            assert packed_gemv.usable() is False
        said = [r.getMessage() for r in caplog.records if r.name == "staticrt"]
        assert len(said) == 1
        assert re.fullmatch(rf"float32 decode keeps oneDNN's linear for every step: it needs {built}", said[0])
    finally:
        packed_gemv.usable.cache_clear()  # the next test's build is the real one


@kernel
def test_caches_linked_to_one_kernels_folder_build_in_one_place(monkeypatch, tmp_path):
    """torch's builder rebuilds a library whose recorded command names another folder: two caches
    whose kernels folders are links to one (as the tests' are) hand it the same, resolved, path."""
    from torch.utils import cpp_extension

    shared = tmp_path / "kernels"
    shared.mkdir()
    asked = []

    def builder(*args, build_directory, **kwargs):  # what the build is handed, then no library
        asked.append(build_directory)
        raise RuntimeError("not built here")

    monkeypatch.setattr(cpp_extension, "load_inline", builder)
    monkeypatch.setattr(a8_kernels, "_loaded", False)
    for cache in ("one", "two"):
        (tmp_path / cache).mkdir()
        (tmp_path / cache / "kernels").symlink_to(shared, target_is_directory=True)
        monkeypatch.setenv("STATICRT_CACHE", str(tmp_path / cache))
        with pytest.raises(ConfigError, match="could not be built"):
            a8_kernels.build()
    assert len(asked) == 2 and asked[0] == asked[1] and Path(asked[0]).parent == shared.resolve()


@pytest.mark.parametrize("quantize", SPECS)
def test_a8_refuses_another_dtype_and_the_onnx_format(tmp_path, quantize):
    with pytest.raises(ConfigError) as raised:
        staticrt.load_model("tiny-llama", quantize=quantize, dtype="bfloat16")
    assert str(raised.value) == (
        f"quantize '{quantize}' with dtype bfloat16: its kernel takes float32 activations; leave --dtype out (or "
        f"pass float32), or use --quantize {quantize[:4]} for bfloat16"
    )
    refusal = (
        f"quantize '{quantize}' runs in staticrt's own CPU kernels, which an ONNX graph cannot call; export it to "
        f"the torch formats (--format aoti,pt2), or to onnx with --quantize {quantize[:4]} (ONNX Runtime's int8/int4 "
        "weights)"
    )
    model = staticrt.load_model("tiny-llama")
    with pytest.raises(ArtifactError) as raised:
        export_artifact(
            model, CacheSpec("static", 1, 32), [16], tmp_path / "a", ["onnx"], quantize=parse_quantize(quantize)
        )
    assert str(raised.value) == refusal


@kernel
def test_a8_exports_to_aoti_and_pt2_and_a_new_process_runs_it_on_the_kernels(hf_checkpoints, tmp_path):
    """The torch programs call the kernels by name (AOTInductor through its proxy executor, which
    reads the calls from the .json beside the library); a process that loads the artifact builds or
    loads the kernel library first. Tokens: the loaded model's, eager. int4-a8 here; int8-a8 takes
    the same path (test_bench.py runs it in aoti and pt2)."""
    quantize = "int4-a8"
    model = staticrt.load_model(hf_checkpoints["qwen2"][0], quantize=quantize)
    want = staticrt.Generator(model, max_cache_len=64).generate([PROMPT], 24)[0]
    folder = export_artifact(model, CacheSpec("static", 1, 64), [16], tmp_path / "a", ["aoti", "pt2"])
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (manifest["quantize"], manifest["a8_layout"]) == (quantize, 2)
    for backend in ("aoti", "pt2"):
        assert staticrt.load_artifact(folder, backend=backend).generate([PROMPT], 24)[0] == want
    command = ["staticrt", "run", str(folder), "--backend", "aoti", "--prompt-ids", ",".join(map(str, PROMPT))]
    run = subprocess.run([*command, "--max-new-tokens", "24", "--json"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["tokens"][0] == want
    # an artifact of the int4 layout before 16-channel groups (no a8_layout field) is refused, not misread
    del manifest["a8_layout"]
    (folder / "manifest.json").write_text(json.dumps(seal(manifest)))
    with pytest.raises(ArtifactError, match=r"field a8_layout is 1: its int4 codes are laid out for an earlier"):
        staticrt.load_artifact(folder, backend="pt2")


@kernel
def test_a8_keeps_the_real_models_perplexity(smollm2, english_text):
    """SmolLM2-135M over the first 512 tokens of the text test_quantize.py reads: int8-a8 within 1%
    of fp32 (by hand: +0.2% simulated on these 512 tokens), int4-a8 within 5% (docs/measurements.md)."""
    fp32 = staticrt.load_model(smollm2)
    ids = fp32.tokenizer.encode(english_text)[:512]
    base = perplexity(fp32, ids)
    for quantize, limit in (("int8-a8", 1.01), ("int4-a8", 1.05)):
        model = staticrt.load_model(smollm2, quantize=quantize)
        assert perplexity(model, ids) / base < limit, quantize


def test_int4_blocks_pack_what_int4_weight_reads_back_to_within_half_a_step():
    """Every weight is within half its block's step d of d * q + m, the codes pack two a byte as
    the kernel reads them, int4_groups lays them out in 16-channel groups and back, and a constant
    block (d 0) comes back exact."""
    weight = torch.randn(18, 128, generator=torch.Generator().manual_seed(0))
    weight[2, 32:64] = 0.25
    codes, dm = int4_blocks(weight)
    assert (codes.shape, codes.dtype, dm.shape, dm.dtype) == ((18, 64), torch.uint8, (18, 4, 2), torch.float16)
    back = int4_weight(codes, dm)
    step = dm[..., 0].float().repeat_interleave(32, dim=1)
    assert ((back - weight).abs() <= step / 2 + 1e-3).all()
    assert torch.equal(back[2, 32:64], torch.full((32,), 0.25))
    # byte 4 * 5 + 3 of channel 1 holds q_43 (block 1) low and q_47 high: codes 8 * 5 + 3 and + 4
    low, high = int(codes[1, 23]) & 15, int(codes[1, 23]) >> 4
    d, m = dm[1, 1].float()
    assert torch.equal(back[1, [43, 47]], torch.stack([d * low + m, d * high + m]))
    grouped, scales = int4_groups(codes, dm)  # 18 channels: a group of 16, then 2 and 14 of zeros
    assert (grouped.shape, scales.shape) == ((2, 16, 16, 4), (2, 4, 2, 16))
    assert grouped[1, 5, 1, 3] == codes[17, 23] and torch.equal(scales[1, 1, :, 1], dm[17, 1])  # channel 16 + 1
    assert not grouped[1, :, 2:].any() and not scales[1, :, :, 2:].any()
    assert all(map(torch.equal, int4_ungrouped(grouped, scales, 18), (codes, dm)))


@kernel
def test_int8_linear_is_the_integer_dot_product_of_each_block_on_a_ragged_last_group():
    """`int8_linear` over int8_groups' layout: 37 channels (a last group of 5 with 11 zero channels
    past N) and five rows (a step of rows sharing each load, then the rest one at a time), against
    each block's exact integer dot product scaled in float64; the codes' extremes (-127, 127) and
    a zero activation block included."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 128, generator=generator)
    weight[4, :64] = torch.tensor([-1.0, 1.0]).repeat(32)  # codes -127 and 127 side by side
    x = torch.randn(5, 128, generator=generator)
    x[1, 32:64] = 0
    codes, scales = int8_codes(weight)
    assert int8_groups(codes).shape == (3, 32, 16, 4) and not int8_groups(codes)[2, :, 5:].any()
    a8_kernels.load()
    y = torch.ops.staticrt.int8_linear(x, int8_groups(codes), scales)
    blocks = x.double().reshape(5, 4, 32)
    s = blocks.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    xq = torch.round(blocks / s).long()  # [5, 4, 32]
    dots = torch.einsum("mbi,nbi->mnb", xq, codes.long().reshape(37, 4, 32))  # exact, [5, 37, 4]
    want = (dots.double() * s[:, None, :, 0]).sum(-1) * scales.double()
    assert y.shape == (5, 37) and torch.allclose(y.double(), want, rtol=1e-5, atol=1e-6)
    one_by_one = [torch.ops.staticrt.int8_linear(x[m : m + 1], int8_groups(codes), scales) for m in range(5)]
    assert torch.equal(y, torch.cat(one_by_one))  # a row's sums, in its order, whatever the rows beside it


@kernel
def test_int4_linear_is_each_blocks_integer_dot_product_and_a_rows_sums_whatever_rows_beside_it():
    """`int4_linear` over int4_groups' layout: 21 channels (a last group of 5 with 11 zero channels
    past N) and six rows (a step of rows sharing each load, then the rest one at a time), against
    sum_b s_b (d_b sum q xq + m_b sum xq) with each block's integer dot product exact, in float64;
    each row's numbers are the ones it gets alone, to the bit (prefill and decode agree)."""
    generator = torch.Generator().manual_seed(4)
    weight, x = torch.randn(21, 128, generator=generator), torch.randn(6, 128, generator=generator)
    x[2, 64:96] = 0
    codes, dm = int4_blocks(weight)
    a8_kernels.load("int4-a8")
    y = torch.ops.staticrt.int4_linear(x, *int4_groups(codes, dm), 21)
    blocks = x.double().reshape(6, 4, 32)
    s = blocks.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    xq = torch.round(blocks / s).long()  # [6, 4, 32]
    # [N, 4 blocks, 32]: each 4 bytes hold 8 codes, the first 4 in their low nibbles, the next 4 in the high
    fours = codes.reshape(21, 16, 1, 4)
    q = torch.cat([fours & 15, fours >> 4], dim=2).long().reshape(21, 4, 32)
    d, m = dm.double().unbind(-1)  # each [N, 4 blocks]
    dots = torch.einsum("mbi,nbi->mnb", xq, q).double()  # exact, [6, 21, 4]
    want = (s[:, None, :, 0] * (d[None] * dots + m[None] * xq.sum(-1)[:, None, :])).sum(-1)
    assert y.shape == (6, 21) and torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5)
    one_by_one = [torch.ops.staticrt.int4_linear(x[r : r + 1], *int4_groups(codes, dm), 21) for r in range(6)]
    assert torch.equal(y, torch.cat(one_by_one))  # a row's sums, in its order, whatever the rows beside it
