"""ONNX artifacts: graphs exported from transformers checkpoints, run by staticrt's ONNX Runtime
runner and by onnxruntime-genai; tokens against transformers and the eager backend; the cache
written in place; no torch at deploy; bad inputs refused with the limit or the file named."""

from __future__ import annotations

import json
import mmap
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from genai_runner import genai_greedy
from hf_models import hf_greedy
from onnx_host_values import host_values_read_on_the_device

import staticrt
from staticrt.artifacts.manifest import seal, sha256
from staticrt.backends.mapped_pages import page_entries
from staticrt.backends.onnx_session import has_cuda_device
from staticrt.caches import CacheSpec
from staticrt.errors import ArtifactError, GenerationError
from staticrt.exporters import export_artifact
from staticrt.exporters.onnx_gqa import OP, group_query_attention
from staticrt.generation.generator import load_artifact
from staticrt.models.quant_spec import parse_quantize

# (checkpoint, cache): every family, every exportable cache kind. mistral-sw16 and gemma2 attend
# through a window of 16; their rotating layers get 32 slots (the window plus genai's slack).
CASES = [("llama", "static"), ("qwen2", "static"), ("mistral-sw16", "sliding"), ("gemma2", "hybrid")]
LENGTHS = (40, 5, 23)  # mixed, two longer than the window; 64 new tokens go far past it
NEW_TOKENS = 64
QUANT8 = parse_quantize("int8")


def prompts(vocab: int = 256) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def onnx_artifacts(hf_checkpoints, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("onnx")
    made = {}
    for family, cache in CASES:
        model = staticrt.load_model(hf_checkpoints[family][0])
        made[family, cache] = export_artifact(
            model, CacheSpec(cache, 3, 128), [64], root / f"{family}-{cache}", ["onnx"]
        )
    return made


def eager(hf_checkpoints, family: str, cache: str):
    model = staticrt.load_model(hf_checkpoints[family][0])
    return staticrt.Generator(model, cache=cache, max_batch_size=3, max_cache_len=128)


@pytest.mark.parametrize("family,cache", CASES)
def test_onnx_greedy_tokens_equal_transformers_and_sampling_equals_eager(onnx_artifacts, hf_checkpoints, family, cache):
    gen = load_artifact(onnx_artifacts[family, cache], backend="onnx")
    assert gen.backend.name == "onnx"
    if not has_cuda_device():  # onnxruntime takes a CUDA GPU where there is one
        assert gen.backend.report() == {"device": "cpu", "cuda_graph": False}
    tokens = gen.generate(prompts(), max_new_tokens=NEW_TOKENS)
    hf_model = hf_checkpoints[family][1]
    assert tokens == [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts()]
    assert tokens == eager(hf_checkpoints, family, cache).generate(prompts(), max_new_tokens=NEW_TOKENS)
    options = dict(max_new_tokens=24, do_sample=True, temperature=0.9, top_k=40, top_p=0.95, seed=1234)
    sampled = gen.generate(prompts(), **options)
    assert sampled == eager(hf_checkpoints, family, cache).generate(prompts(), **options)
    assert sampled != tokens  # sampling really sampled
    # log-probabilities: computed on the host from the graph's logits, as eager's in its step graph
    reference = eager(hf_checkpoints, family, cache)
    assert gen.generate(prompts(), 8, logprobs=3) == reference.generate(prompts(), 8, logprobs=3)
    for ours, theirs in zip(gen.last_logprobs, reference.last_logprobs, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


def test_onnx_runner_on_cuda_gives_the_cpu_tokens(onnx_artifacts):
    from staticrt.backends.onnx import OnnxBackend
    from staticrt.backends.onnx_session import OnnxCudaGraphWarning
    from staticrt.generation.generator import Generator

    if not has_cuda_device():
        pytest.skip("no CUDA device: ONNX Runtime's CUDA provider and its CUDA graphs run only on a GPU")
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip(f"onnxruntime {onnxruntime.__version__} lacks the CUDA provider (onnxruntime-gpu has it)")
    folder = onnx_artifacts["gemma2", "hybrid"]
    cpu = Generator(OnnxBackend(folder, device="cpu")).generate(prompts(), max_new_tokens=NEW_TOKENS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen = Generator(OnnxBackend(folder, device="cuda"))
    refused = [str(w.message) for w in caught if issubclass(w.category, OnnxCudaGraphWarning)]
    assert gen.backend.report() == {"device": "cuda", "cuda_graph": True}, refused
    assert gen.generate(prompts(), max_new_tokens=NEW_TOKENS) == cpu, "first generation (captures decode)"
    assert gen.generate(prompts(), max_new_tokens=NEW_TOKENS) == cpu, "second generation (replays it)"


def test_no_value_from_a_shape_is_read_on_the_device_so_onnx_runtime_can_capture_a_cuda_graph(onnx_artifacts):
    """The step's sizes (S, T, the rotating layers' dropped entries) enter device arithmetic as
    device counts: ONNX Runtime's CUDA provider would compute them on the CPU and copy them over,
    and refuse its CUDA graph (three such copies in the Gemma2 graph on an H200)."""
    for (family, cache), folder in onnx_artifacts.items():
        manifest = json.loads((folder / "manifest.json").read_text())
        graph = onnx.load(str(folder / manifest["onnx"]["graph"]), load_external_data=False).graph
        assert host_values_read_on_the_device(graph) == [], f"{family} {cache}"


def test_where_onnx_runtime_will_not_capture_a_cuda_graph_the_session_runs_without_and_says_why(
    onnx_artifacts, monkeypatch
):
    """Seen on an H200 with onnxruntime-gpu 1.31.1: the graph loads on the CUDA provider, but ONNX
    Runtime refuses its CUDA graph. The session is made again without one, with a warning that
    gives ONNX Runtime's reason; any other load failure stays an ArtifactError."""
    import onnxruntime as ort

    from staticrt.backends.onnx_session import OnnxCudaGraphWarning, session

    refusal = (
        "[ONNXRuntimeError] : 1 : FAIL : This session cannot use the graph capture feature as requested by the user "
        " as all compute graph nodes have not been partitioned to the CUDAExecutionProvider"
    )
    real, asked = ort.InferenceSession, []

    def on_a_gpu(path, options, providers):  # the CUDA provider's answers, then a CPU session for the rest
        asked.append(providers[0])
        if providers[0][1]["enable_cuda_graph"] == "1":
            raise RuntimeError(refusal)
        return real(path, options, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(ort, "InferenceSession", on_a_gpu)
    folder = onnx_artifacts["llama", "static"]
    manifest = json.loads((folder / "manifest.json").read_text())
    path = folder / manifest["onnx"]["graph"]
    with pytest.warns(OnnxCudaGraphWarning) as caught:
        _, graphs = session(path, None, "cuda", True, manifest)
    assert graphs is False
    # float32 in float32: ONNX Runtime's CUDA provider would take TF32 (a 10-bit mantissa) by default
    assert asked == [("CUDAExecutionProvider", {"enable_cuda_graph": flag, "use_tf32": "0"}) for flag in ("1", "0")]
    assert [str(w.message) for w in caught] == [
        f"{path}: ONNX Runtime would not capture its decode step in a CUDA graph ({refusal}); decode runs on CUDA "
        "without one, launching each node's kernels every step. Its node placements (the session at log level 0, "
        "or bench/onnx_placement.py) show which node or copy keeps it off"
    ]
    monkeypatch.setattr(ort, "InferenceSession", lambda *args, **kw: (_ for _ in ()).throw(RuntimeError("bad graph")))
    with pytest.raises(ArtifactError, match=r"cannot load this graph .*: bad graph; install an onnxruntime-gpu"):
        session(path, None, "cuda", True, manifest)


def test_graph_is_standard_onnx_with_one_tensor_scatter_per_cache_tensor(onnx_artifacts):
    folder = onnx_artifacts["gemma2", "hybrid"]
    manifest = json.loads((folder / "manifest.json").read_text())
    graph = onnx.load(str(folder / manifest["onnx"]["graph"]), load_external_data=False)
    onnx.checker.check_model(str(folder / manifest["onnx"]["graph"]), full_check=True)
    assert graph.ir_version <= 13 and [(o.domain, o.version) for o in graph.opset_import] == [("", 24)]
    assert {n.domain for n in graph.graph.node} == {""}  # standard ops only, no staticrt domain
    producers = {out: n for n in graph.graph.node for out in n.output}
    modes = {}
    for output in graph.graph.output[2:]:  # every present is a TensorScatter's own output (no copy after it)
        node = producers[output.name]
        assert node.op_type == "TensorScatter"
        modes[output.name] = onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == "mode"))
    # Gemma2 alternates sliding (rotating, circular) and global (linear) layers.
    assert modes == {
        "present.0.key": b"circular",
        "present.0.value": b"circular",
        "present.1.key": b"linear",
        "present.1.value": b"linear",
    }
    assert [i.name for i in graph.graph.input][:4] == ["input_ids", "attention_mask", "position_ids", "logits_index"]
    # logits_index is optional: an initializer of its name, [-1], is its default (the last column)
    assert [
        (t.name, list(onnx.numpy_helper.to_array(t))) for t in graph.graph.initializer if t.name == "logits_index"
    ] == [("logits_index", [-1])]
    assert manifest["onnx"]["outputs"][:2] == [
        {"name": "logits", "shape": ["batch_size", 1, 256], "dtype": "float32"},  # genai: the last column's alone
        {"name": "indexed_logits", "shape": ["batch_size", "logits_length", 256], "dtype": "float32"},
    ]
    assert manifest["onnx"]["inputs"][4] == {
        "name": "past_key_values.0.key",
        "shape": ["batch_size", 2, 32, 16],
        "dtype": "float32",
    }
    assert (folder / "onnx" / "model.onnx.data").stat().st_size > 100_000  # weights live in external data


def _gqa_pair(hf_checkpoints: dict, family: str, tmp_path: Path) -> tuple[Path, Path]:
    """`family`'s one-row static export (128 positions, bucket 64) and a copy of it whose every
    layer's attention is one GroupQueryAttention (exporters/onnx_gqa.py), its manifest sealed again."""
    model = staticrt.load_model(hf_checkpoints[family][0])
    folder = export_artifact(model, CacheSpec("static", 1, 128), [64], tmp_path / family, ["onnx"])
    copy = _copy(folder, tmp_path, f"{family}-gqa")
    graph = copy / "onnx" / "model.onnx"
    assert group_query_attention(graph, 1) == model.config.num_layers
    ops = {node.op_type for node in onnx.load(str(graph), load_external_data=False).graph.node}
    assert OP in ops and not ops & {"Attention", "TensorScatter", "RotaryEmbedding"}
    _graph_rewritten(copy)
    return folder, copy


@pytest.fixture(scope="module")
def llama_gqa(hf_checkpoints, tmp_path_factory) -> tuple[Path, Path]:
    """tiny llama's pair (`_gqa_pair`), for the GroupQueryAttention test and the cache residency test."""
    return _gqa_pair(hf_checkpoints, "llama", tmp_path_factory.mktemp("gqa"))


def test_static_layers_as_group_query_attention_give_the_graphs_tokens_cache_and_continuations(
    onnx_artifacts, hf_checkpoints, llama_gqa, tmp_path
):
    """exporters/onnx_gqa.py (applied to quantized one-row exports) checked on float graphs, where
    nothing rounds the two apart: each static layer's ~15 attention nodes become one
    GroupQueryAttention, and one row gives the graph's tokens and cache contents, also where a
    step feeds several tokens over a held context (a continued conversation, drafts verified).
    Graphs of several rows, rotating layers (sliding, hybrid's local ones) and softcapped ones
    keep their attention."""
    for family in ("llama", "qwen2"):
        folder, copy = llama_gqa if family == "llama" else _gqa_pair(hf_checkpoints, family, tmp_path)
        before, after = (load_artifact(f, backend="onnx") for f in (folder, copy))
        prompt = prompts()[0]
        tokens = before.generate([prompt], max_new_tokens=NEW_TOKENS)
        assert after.generate([prompt], max_new_tokens=NEW_TOKENS) == tokens, family
        for name, value in before.backend.caches.items():  # [1, H_kv, 128, D]
            np.testing.assert_allclose(after.backend.caches[name].numpy(), value.numpy(), rtol=0, atol=1e-4)
        turn = [*prompt, *tokens[0], 7, 8, 9, 10]  # the next turn: the conversation kept, 4 tokens prefilled over it
        continued = before.generate([turn], max_new_tokens=16, reuse_prefix=True)
        assert after.generate([turn], max_new_tokens=16, reuse_prefix=True) == continued, family
        assert after.last_stats.kept == before.last_stats.kept and after.last_stats.kept[0] > 0
        drafted = before.generate([prompt], max_new_tokens=32, speculative="ngram:3")
        assert after.generate([prompt], max_new_tokens=32, speculative="ngram:3") == drafted, family
    assert group_query_attention(onnx_artifacts["llama", "static"] / "onnx" / "model.onnx", 3) == 0  # three rows
    for family, layers in (("llama", 2), ("mistral-sw16", 0)):  # mistral-sw16: a window in every mask, cache static
        model = staticrt.load_model(hf_checkpoints[family][0])
        spec, out = CacheSpec("static", 1, 64), tmp_path / f"{family}-int8"
        int8 = export_artifact(model, spec, [16], out, ["onnx"], quantize=QUANT8)
        assert json.loads((int8 / "manifest.json").read_text())["onnx"]["fused"][OP] == layers, family
    for case in (("mistral-sw16", "sliding"), ("gemma2", "hybrid")):  # circular writes; softcapped scores
        copy = _copy(onnx_artifacts[case], tmp_path)
        assert group_query_attention(copy / "onnx" / "model.onnx", 1) == 0, case


def test_each_norm_and_rotary_embedding_is_one_standard_op(onnx_artifacts):
    """torch writes an RMSNorm out as seven nodes and a rotary embedding as seven; the export makes
    each one opset-23 node (exporters/onnx_fuse.py), in every family: Gemma2's `1 + w` norms and
    sandwich norms, Qwen2's biased projections, sliding and hybrid caches alike."""
    for (family, cache), folder in onnx_artifacts.items():
        manifest = json.loads((folder / "manifest.json").read_text())
        config = manifest["model"]["config"]
        layers, per_layer = config["num_layers"], 4 if config["sandwich_norms"] else 2
        fused = {"RMSNormalization": layers * per_layer + 1, "RotaryEmbedding": 2 * layers, "GroupQueryAttention": 0}
        assert manifest["onnx"]["fused"] == fused
        graph = onnx.load(str(folder / manifest["onnx"]["graph"]), load_external_data=False).graph
        ops = [node.op_type for node in graph.node]
        assert not {"Pow", "Reciprocal", "Neg"} & set(ops), (family, cache)
        assert ops.count("Cos") == ops.count("Sin") == 1, (family, cache)  # the tables, once a step


def test_genai_config_describes_the_graph(onnx_artifacts):
    config = json.loads((onnx_artifacts["gemma2", "hybrid"] / "genai_config.json").read_text())
    model, decoder = config["model"], config["model"]["decoder"]
    assert (model["type"], model["context_length"], model["vocab_size"]) == ("decoder", 128, 256)
    assert (
        decoder["filename"],
        decoder["head_size"],
        decoder["num_hidden_layers"],
        decoder["num_key_value_heads"],
    ) == ("onnx/model.onnx", 16, 2, 2)
    assert decoder["sliding_window"] == {
        "window_size": 16,
        "cache_slack": 16,
        "slide_key_value_cache": False,
        "slide_inputs": False,
        "layers": [0],
    }
    assert config["search"]["past_present_share_buffer"] is True
    assert decoder["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert decoder["outputs"]["present_value_names"] == "present.%d.value"


@pytest.mark.parametrize("family,cache", [("llama", "static"), ("mistral-sw16", "sliding")])
def test_onnxruntime_genai_runs_the_artifact_token_for_token(onnx_artifacts, hf_checkpoints, family, cache):
    og = pytest.importorskip(
        "onnxruntime_genai", reason="install onnxruntime-genai (--no-deps), as the README's test command does"
    )
    model = og.Model(str(onnx_artifacts[family, cache]))
    reference = eager(hf_checkpoints, family, cache)
    for prompt in prompts():
        tokens = genai_greedy(og, model, prompt, NEW_TOKENS)
        assert tokens == reference.generate([prompt], max_new_tokens=NEW_TOKENS)[0]


def test_decode_writes_the_bound_cache_in_place(onnx_artifacts, hf_checkpoints, capfd):
    """16 decode steps: ONNX Runtime never logs that TensorScatter copied the cache, the buffer
    keeps its address, and it holds the eager cache's entries at the graph's columns."""
    gen = load_artifact(onnx_artifacts["llama", "static"], backend="onnx")
    key = gen.backend.caches["past_key_values.1.key"]  # [B, H_kv, 128, D]
    address = key.data_ptr()
    capfd.readouterr()
    gen.generate(prompts(), max_new_tokens=17)  # prefill, then 16 decode steps
    assert "in-place optimization not activated" not in capfd.readouterr().err
    assert key.data_ptr() == address
    written = key.numpy()
    reference = eager(hf_checkpoints, "llama", "static")
    reference.generate(prompts(), max_new_tokens=17)
    expected = reference.backend.cache.key_1.numpy()  # [B, H_kv, 128, D], position p at slot p
    width = max(LENGTHS)  # the prefill's columns; row r starts at column width - LENGTHS[r]
    for r, n in enumerate(LENGTHS):
        held = n + 16  # the prompt and 16 decoded tokens (the last token is chosen, not yet written)
        start = width - n
        np.testing.assert_allclose(written[r, :, start : start + held], expected[r, :, :held], rtol=1e-4, atol=1e-5)
        assert not written[r, :, start + held :].any()  # nothing beyond (the holes before hold masked padding)


def test_the_in_place_detector_sees_a_copy_when_present_is_not_bound_to_past(onnx_artifacts, capfd):
    """The control for the test above: bound to other buffers, TensorScatter copies and says so."""
    import onnxruntime as ort

    folder = onnx_artifacts["llama", "static"]
    session = ort.InferenceSession(str(folder / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    ids = np.ones((3, 4), dtype=np.int64)
    binding.bind_cpu_input("input_ids", ids)
    binding.bind_cpu_input("attention_mask", np.ones((3, 4), dtype=np.int64))
    binding.bind_cpu_input("position_ids", np.tile(np.arange(4), (3, 1)))
    for value in session.get_inputs()[3:]:
        binding.bind_cpu_input(value.name, np.zeros([3, *value.shape[1:]], dtype=np.float32))
    for value in session.get_outputs():
        binding.bind_output(value.name)
    capfd.readouterr()
    session.run_with_iobinding(binding)
    assert "TensorScatter: in-place optimization not activated" in capfd.readouterr().err


def test_running_and_serving_an_onnx_artifact_imports_no_torch(onnx_artifacts):
    folder = onnx_artifacts["mistral-sw16", "sliding"]
    script = (
        "import sys, json\n"
        "from staticrt.cli.main import main\n"
        f"assert main(['run', {str(folder)!r}, '--backend', 'onnx', '--prompt-ids', '1,2,3', '--max-new-tokens', '4',"
        " '--json']) == 0\n"
        "import staticrt\n"
        f"staticrt.load_artifact({str(folder)!r}, backend='onnx').generate([[4, 5]], max_new_tokens=2)\n"
        "from fastapi.testclient import TestClient\n"
        "from staticrt.cli.main import build_parser\n"
        "from staticrt.cli.serve import build_server\n"
        f"app, _ = build_server(build_parser().parse_args(['serve', {str(folder)!r}, '--threads', '2']))\n"
        "with TestClient(app) as http:\n"
        f"    body = dict(model={folder.name!r}, prompt=[4, 5], max_tokens=2, temperature=0)\n"
        "    served = http.post('/v1/completions', json=body).json()\n"
        "    assert len(served['choices'][0]['token_ids']) == 2, served\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'staticrt.models.decoder',"
        " 'staticrt.caches', 'staticrt.exporters')))\n"
        "print(json.dumps(loaded), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert json.loads(done.stderr.strip().splitlines()[-1]) == []
    assert len(json.loads(done.stdout)["tokens"][0]) == 4


def test_requests_beyond_the_artifact_are_refused_before_running(onnx_artifacts):
    gen = load_artifact(onnx_artifacts["llama", "static"], backend="onnx")
    with pytest.raises(
        GenerationError,
        match=r"^4 prompts exceed max_batch_size=3; split the batch or re-export the artifact with a larger "
        r"--batch-size$",
    ):
        gen.generate([[1]] * 4, max_new_tokens=2)
    with pytest.raises(
        GenerationError,
        match=r"^prompt 0 has 100 tokens; with max_new_tokens=29 that is 129, beyond "
        r"max_cache_len=128; shorten the prompt",
    ):
        gen.generate([[1] * 100], max_new_tokens=29)
    # Nothing ran: the next request still matches the reference run.
    assert (
        gen.generate([[1] * 100], max_new_tokens=28)[0]
        == load_artifact(onnx_artifacts["llama", "static"], backend="onnx").generate([[1] * 100], max_new_tokens=28)[0]
    )


def _copy(folder: Path, tmp_path: Path, name: str | None = None) -> Path:
    return Path(shutil.copytree(folder, tmp_path / (name or folder.name)))


def _graph_rewritten(folder: Path, edit: Callable[[dict], None] = lambda manifest: None) -> None:
    """Seal `folder`'s manifest (edited by `edit`) over the graph a test rewrote on purpose, its hash
    taken again, as the exporter would have written it."""
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    manifest["files"]["onnx/model.onnx"] = sha256(folder / "onnx" / "model.onnx")
    (folder / "manifest.json").write_text(json.dumps(seal(manifest)))


def test_a_missing_or_altered_graph_file_is_named(onnx_artifacts, tmp_path):
    folder = _copy(onnx_artifacts["qwen2", "static"], tmp_path)
    data = folder / "onnx" / "model.onnx.data"
    blob = bytearray(data.read_bytes())
    blob[1234] ^= 0xFF
    data.write_bytes(bytes(blob))
    with pytest.raises(
        ArtifactError,
        match=rf"^{data} does not match the sha256 in manifest.json \(changed or corrupted "
        r"since export\); re-export the artifact$",
    ):
        load_artifact(folder, backend="onnx")
    data.unlink()
    with pytest.raises(
        ArtifactError,
        match=rf"^{data} is listed in manifest.json but missing; re-export the artifact with `staticrt export`$",
    ):
        load_artifact(folder, backend="onnx")


def test_an_opset_the_installed_onnxruntime_cannot_run_is_refused_with_the_opset_named(onnx_artifacts, tmp_path):
    import onnxruntime as ort

    folder = _copy(onnx_artifacts["qwen2", "static"], tmp_path)
    path = folder / "onnx" / "model.onnx"
    graph = onnx.load(str(path), load_external_data=False)
    graph.opset_import[0].version = 99  # as if written by an exporter from the future
    onnx.save(graph, str(path))
    _graph_rewritten(folder, lambda manifest: manifest["onnx"].update(opset=99))
    with pytest.raises(
        ArtifactError,
        match=rf"^{path}: onnxruntime {ort.__version__} cannot load this graph \(opset 99, "
        r"IR version \d+, float32\): .*; install an onnxruntime-gpu that runs opset 99 or "
        r"re-export the artifact with this staticrt$",
    ):
        load_artifact(folder, backend="onnx")


def test_a_float16_graph_runs_on_the_cpu_and_a_bfloat16_one_is_refused_with_the_way_out(tmp_path):
    """ONNX Runtime's CPU provider runs a float16 graph (its logits bound as float16, not float32,
    which failed every step): greedy tokens equal eager float16's, and it samples (not compared:
    float16 logits of ORT's and torch's kernels differ in the last bits, and a sampled token with
    them); it has no bfloat16 kernels, which the loader says instead of blaming the opset."""
    prompt, sampled = [[1, 2, 3, 4, 5]], dict(do_sample=True, temperature=0.9, top_k=40, seed=7)
    models = {dtype: staticrt.load_model("tiny-llama", dtype=dtype) for dtype in ("float16", "bfloat16")}
    for dtype, model in models.items():
        export_artifact(model, CacheSpec("static", 1, 64), [16], tmp_path / dtype, ["onnx"])
    gen = load_artifact(tmp_path / "float16", backend="onnx")
    lone = staticrt.Generator(models["float16"], max_cache_len=64)
    assert gen.generate(prompt, 16) == lone.generate(prompt, 16)
    assert len(gen.generate(prompt, 16, **sampled)[0]) == 16
    refused = r"\(opset \d+, IR version \d+, bfloat16\): .*; ONNX Runtime's CPU provider has no bfloat16 kernels"
    with pytest.raises(ArtifactError, match=refused):
        load_artifact(tmp_path / "bfloat16", backend="onnx")


def test_a_backend_the_artifact_lacks_is_named(onnx_artifacts):
    with pytest.raises(
        ArtifactError,
        match=r"holds format\(s\) onnx, not 'aoti'; run it with one of onnx or "
        r"re-export with --format aoti$",
    ):
        load_artifact(onnx_artifacts["llama", "static"], backend="aoti")


def test_cuda_asked_of_an_onnxruntime_without_its_cuda_provider_names_the_package_to_install(
    onnx_artifacts, monkeypatch
):
    """Seen on a GPU image that shipped onnxruntime (CPU only): ONNX Runtime failed deep in its
    first allocation ("Can't allocate memory on the CUDA device using this package")."""
    from staticrt.backends.onnx import OnnxBackend

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(
        ArtifactError,
        match=rf"^device 'cuda' asked, but the installed onnxruntime {onnxruntime.__version__} runs only on "
        r"CPUExecutionProvider: install onnxruntime-gpu in place of onnxruntime \(pip uninstall onnxruntime; "
        r"pip install onnxruntime-gpu\), or run the artifact on the CPU$",
    ):
        OnnxBackend(onnx_artifacts["llama", "static"], device="cuda")


def test_onnx_export_refuses_a_window_genai_would_allocate_differently(hf_checkpoints, tmp_path):
    model = staticrt.load_model(hf_checkpoints["mistral-sw16"][0])
    with pytest.raises(
        ArtifactError,
        match=r"^window is 16, the model's sliding_window; onnxruntime-genai allocates "
        r"sliding layers window_size \+ cache_slack slots with cache_slack >= 1, so "
        r"the onnx format needs window >= 17: set window = 32 \(genai's default "
        r"slack\) or leave it unset$",
    ):
        export_artifact(model, CacheSpec("sliding", 1, 64, window=16), [16], tmp_path / "x", ["onnx"])
    assert list(tmp_path.iterdir()) == []


def test_the_exporters_two_output_rewrite_is_tried_at_its_own_op_alone(monkeypatch):
    """onnxscript's SlicesSplit (two Slices of one input -> Split) lists the whole graph for each
    node it is tried at; inside `multi_output_rules_at_their_op` it is tried at the Slice nodes
    alone, and the graph comes out as without it (SmolLM2's export: the same bytes, 29 -> 22 s)."""
    from collections import Counter

    import onnx_ir as ir
    from onnx import TensorProto
    from onnx import helper as make
    from onnxscript import rewriter
    from onnxscript.rewriter import _matcher

    from staticrt.exporters.onnx_rewrites import multi_output_rules_at_their_op

    constants = {"s0": [0], "e0": [3], "s1": [3], "e1": [6], "axis": [1]}
    nodes = [
        make.make_node("Slice", ["x", "s0", "e0", "axis"], ["a"]),
        make.make_node("Slice", ["x", "s1", "e1", "axis"], ["b"]),
    ]
    nodes += [make.make_node("Relu", [f"r{i - 1}" if i else "a"], [f"r{i}"]) for i in range(20)]
    outputs = [make.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("r19", "b")]
    graph = make.make_graph(
        nodes, "g", [make.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])], outputs,
        [onnx.numpy_helper.from_array(np.array(v, np.int64), n) for n, v in constants.items()],
    )  # fmt: skip
    tried = []
    multi_match = _matcher.SimplePatternMatcher._multi_match
    monkeypatch.setattr(
        _matcher.SimplePatternMatcher,
        "_multi_match",
        lambda self, nodes, **kw: tried.append(nodes[0].op_type) or multi_match(self, nodes, **kw),
    )
    rewritten = {}
    for patched in (False, True):
        model = ir.serde.deserialize_model(make.make_model(graph, opset_imports=[make.make_opsetid("", 18)]))
        tried.clear()
        if patched:
            with multi_output_rules_at_their_op():
                rewriter.rewrite(model)
        else:
            rewriter.rewrite(model)
        rewritten[patched] = ([n.op_type for n in model.graph], Counter(tried))
    plain, guarded = rewritten[False][1], rewritten[True][1]
    assert plain["Relu"] >= 20 and plain["Slice"] >= 2  # every node, each time listing the graph
    assert rewritten[True][0] == rewritten[False][0] and guarded == {"Slice": plain["Slice"]}


def test_a_later_session_maps_the_graph_onnx_runtime_packed_for_this_cpu_and_gives_its_tokens(
    onnx_artifacts, monkeypatch, tmp_path, caplog
):
    """The first session writes ONNX Runtime's optimized graph with its prepacked weights into the
    user cache (backends/onnx_packed.py); later ones load that copy, whose tokens are the
    artifact's own; a copy of the wrong size is written again; STATICRT_COMPILE_CACHE=off stores
    none, and a cache that cannot be written leaves the session as ONNX Runtime makes it from the
    artifact."""
    from staticrt.artifacts.user_cache import entries
    from staticrt.backends.onnx import OnnxBackend

    artifact = onnx_artifacts["gemma2", "hybrid"]  # rotating and full layers, three prompt lengths
    loaded = []
    real = onnxruntime.InferenceSession
    monkeypatch.setattr(
        onnxruntime, "InferenceSession", lambda path, *a, **k: loaded.append(path) or real(path, *a, **k)
    )

    def tokens() -> list[list[int]]:
        return staticrt.Generator(OnnxBackend(artifact, device="cpu")).generate(prompts(), NEW_TOKENS)

    first = tokens()
    (entry,) = entries("onnx")
    copy = entry.path / "model.onnx.data"
    assert loaded == [str(artifact / "onnx" / "model.onnx"), str(entry.path / "model.onnx")]  # wrote, then loaded
    assert copy.stat().st_size > (artifact / "onnx" / "model.onnx.data").stat().st_size  # packed weights beside
    written = (entry.path / "entry.json").stat().st_mtime_ns
    assert tokens() == first
    assert loaded[2:] == [str(entry.path / "model.onnx")] and (entry.path / "entry.json").stat().st_mtime_ns == written
    with open(copy, "r+b") as data:  # a torn copy
        data.truncate(copy.stat().st_size // 2)
    with caplog.at_level("WARNING", logger="staticrt"):
        assert tokens() == first
    assert f"the packed ONNX graph in {entry.path} is unusable (model.onnx.data is not the size" in caplog.text
    assert loaded[3:] == [str(artifact / "onnx" / "model.onnx"), str(entry.path / "model.onnx")]
    monkeypatch.setenv("STATICRT_COMPILE_CACHE", "off")  # the artifact's graph, packed on the heap; nothing stored
    shutil.rmtree(entry.path)
    assert tokens() == first and entries("onnx") == [] and loaded[5:] == [str(artifact / "onnx" / "model.onnx")]
    monkeypatch.delenv("STATICRT_COMPILE_CACHE")
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("STATICRT_CACHE", str(blocked))  # the cache's folder cannot be made
    caplog.clear()
    with caplog.at_level("WARNING", logger="staticrt"):
        assert tokens() == first
    assert f"cannot keep a packed copy of {artifact / 'onnx' / 'model.onnx'} in {blocked / 'onnx'}" in caplog.text


def test_the_files_hashes_are_checked_beside_the_session_and_nothing_is_written_from_a_file_that_fails(
    onnx_artifacts, tmp_path, caplog, monkeypatch
):
    """load_artifact takes the files' hashes while ONNX Runtime makes the session: an altered file
    is refused as before, also when the session fails first; nothing is parsed beside the session
    (`beside`) and no packed copy is written from it, and one written earlier from the whole
    artifact does not let the altered one run."""
    from staticrt.artifacts.user_cache import entries

    folder = _copy(onnx_artifacts["qwen2", "static"], tmp_path)
    data = folder / "onnx" / "model.onnx.data"
    whole = data.read_bytes()
    data.write_bytes(whole[:1234] + bytes([whole[1234] ^ 0xFF]) + whole[1235:])
    refusal = rf"^{data} does not match the sha256 in manifest.json \(changed or corrupted since export\)"
    parsed: list[Path] = []  # what `run` parses beside the session (its tokenizer): only from files that passed
    with pytest.raises(ArtifactError, match=refusal), caplog.at_level("WARNING", logger="staticrt"):
        load_artifact(folder, backend="onnx", beside=lambda: parsed.append(folder))
    assert entries("onnx") == [] and caplog.text == "" and parsed == []  # the artifact's error, not the cache's
    data.write_bytes(whole)
    load_artifact(folder, backend="onnx", beside=lambda: parsed.append(folder))
    assert parsed == [folder]
    on_a_gpu = has_cuda_device() and "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    assert len(entries("onnx")) == (0 if on_a_gpu else 1)  # the copy is the CPU's
    data.write_bytes(whole[:1234] + bytes([whole[1234] ^ 0xFF]) + whole[1235:])
    with pytest.raises(ArtifactError, match=refusal):
        load_artifact(folder, backend="onnx")
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bad")))
    with pytest.raises(ArtifactError, match=refusal):  # not "cannot load this graph"
        load_artifact(folder, backend="onnx")


def _written_pages(address: int, size: int) -> int:
    """Pages of [address, address + size) this process holds as its own (/proc/self/pagemap: present
    and exclusively mapped): a page only read maps the kernel's shared zero page and is not counted,
    and neither are neighbouring mappings the kernel merged with this one."""
    (entries,) = page_entries([(address, address + size)])
    return int(np.count_nonzero((entries >> np.uint64(63)) & (entries >> np.uint64(56)) & np.uint64(1)))


@pytest.mark.skipif(sys.platform != "linux", reason="the pages' residency is read from Linux's /proc/self/pagemap")
def test_the_cache_is_resident_only_where_steps_wrote_and_a_reset_zeroes_it_and_gives_its_pages_back(llama_gqa):
    """The CPU cache's buffers are pages of one anonymous mapping (backends/zeroed_pages.py): on a
    one-row graph whose layers are GroupQueryAttention (what a quantized export runs), 9 positions
    of 128 make part of it resident, not the whole context; a reset reads as zeros again and holds
    no page; the next generation gives the same tokens."""
    gen = load_artifact(llama_gqa[1], backend="onnx")
    host = gen.backend.host
    size, address = len(host.memory), host.arrays[0].ctypes.data  # each layer's K and V: [1, H_kv, 128, D]
    assert _written_pages(address, size) == 0
    first = gen.generate([prompts()[1]], max_new_tokens=4)  # 5 + 4 positions
    written = _written_pages(address, size)
    assert 0 < written <= size // mmap.PAGESIZE // 2 and any(array.any() for array in host.arrays), (written, size)
    gen.backend.reset()
    assert _written_pages(address, size) == 0 and not any(array.any() for array in host.arrays)
    assert gen.generate([prompts()[1]], max_new_tokens=4) == first
