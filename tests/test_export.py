"""Artifacts from the shipped recipes (export/*.toml): exported through the CLI, loaded with no
model code, token for token equal to the eager backend; the cache mutated in place; manifests
and hashes enforced; an interrupted export leaves nothing behind."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

import staticrt
from staticrt.artifacts.manifest import seal
from staticrt.caches import CacheSpec
from staticrt.cli.main import main
from staticrt.errors import ArtifactError
from staticrt.exporters import export_artifact
from staticrt.exporters.recipe import read_recipe
from staticrt.generation.generator import load_artifact

RECIPES = Path(__file__).parent.parent / "export"
NAMES = ("tiny-llama", "tiny-mistral", "tiny-gemma2")  # static, sliding, hybrid
# With 64 new tokens the longest row reaches position 103, past the window of 64 and the 80 slots
# of a rotating layer.
LENGTHS = (40, 5, 23)
NEW_TOKENS = 64
VIEWS = {
    "view",
    "_unsafe_view",
    "reshape",
    "transpose",
    "permute",
    "expand",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "alias",
    "t",
    "as_strided",
}


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, 512, (n,), generator=gen).tolist() for n in LENGTHS]


# tiny-llama is exported in every format its recipe lists; the rotating recipes only as pt2 (a
# --format override of the recipe): AOTInductor compiles the same programs, and compiling four
# more of them would cost the suite minutes on a cold 2-core machine. tests/test_onnx.py covers
# the onnx format for every family and cache kind.
FORMATS = {"tiny-llama": None, "tiny-mistral": "pt2", "tiny-gemma2": "pt2"}


@pytest.fixture(scope="module")
def compile_commands() -> list[tuple[list[str], str | None]]:
    """Each g++ command the exports run (argv, and the text of the C++ file it compiles)."""
    return []


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, compile_commands) -> dict[str, Path]:
    import torch._inductor.cpp_builder as builder

    def recorded(cmd_line: str, cwd: str) -> None:
        argv = shlex.split(cmd_line)
        sources = [arg for arg in argv if arg.endswith(".cpp")]
        compile_commands.append((argv, Path(sources[0]).read_text() if sources else None))
        run(cmd_line, cwd)

    root = tmp_path_factory.mktemp("artifacts")
    run, builder.run_compile_cmd = builder.run_compile_cmd, recorded
    try:
        for name, formats in FORMATS.items():
            override = ["--format", formats] if formats else []
            assert main(["export", str(RECIPES / f"{name}.toml"), "--out", str(root / name), *override]) == 0
    finally:
        builder.run_compile_cmd = run
    return {name: root / name for name in NAMES}


def eager_tokens(name: str) -> list[list[int]]:
    recipe = read_recipe(RECIPES / f"{name}.toml")
    model = staticrt.load_model(recipe.model, dtype=recipe.dtype)
    gen = staticrt.Generator(
        model,
        cache=recipe.cache,
        max_batch_size=recipe.batch_size,
        max_cache_len=recipe.max_cache_len,
        window=recipe.window,
        prefill_buckets=recipe.prefill_buckets,
    )
    return gen.generate(prompts(), max_new_tokens=NEW_TOKENS)


@pytest.mark.parametrize(
    "name,fmt", [("tiny-llama", "aoti"), ("tiny-llama", "pt2"), ("tiny-mistral", "pt2"), ("tiny-gemma2", "pt2")]
)
def test_artifact_tokens_equal_the_eager_backend(artifacts, name, fmt):
    gen = load_artifact(artifacts[name], backend=fmt)
    manifest = gen.backend.manifest
    formats = ["aoti", "pt2", "onnx"] if name == "tiny-llama" else ["pt2"]
    assert (manifest["cache"]["kind"], manifest["formats"], manifest["prefill_buckets"]) == (
        {"tiny-llama": "static", "tiny-mistral": "sliding", "tiny-gemma2": "hybrid"}[name],
        formats,
        [64],
    )
    key = gen.backend.constants["cache.key_0"]
    address = key.data_ptr()
    assert gen.generate(prompts(), max_new_tokens=NEW_TOKENS) == eager_tokens(name)
    # Every program wrote the one cache tensor the loader handed out, in place.
    assert key.data_ptr() == address and key.abs().sum() > 0


def test_aotinductors_runtime_is_compiled_once_and_linked_into_each_program(artifacts, compile_commands):
    """cpp_builds/aoti_runtime.py: no program's wrapper compiles the runtime's interface again;
    each program's library links the one object that holds it (tiny-llama's prefill and decode),
    compiled here at most once (none where an earlier test's export left it in inductor's cache)."""
    interface = "AOTInductorModelContainerCreateWithDevice("
    runtime = [(argv, text) for argv, text in compile_commands if text is not None and interface in text]
    assert all("staticrt_aoti_runtime" in argv[1] for argv, _ in runtime) and len(runtime) <= 1
    links = [argv for argv, _ in compile_commands if "-c" not in argv and any(a.endswith(".wrapper.o") for a in argv)]
    linked = [[a for a in argv if "/staticrt_aoti_runtime/" in a] for argv in links]
    assert len(links) == 2 and all(len(objects) == 1 and Path(objects[0]).is_file() for objects in linked)


def test_programs_carry_no_weight_bytes_the_weights_file_holds_each_once(artifacts):
    from safetensors import safe_open

    folder = artifacts["tiny-llama"]
    constants = json.loads((folder / "manifest.json").read_text())["constants"]
    with safe_open(str(folder / "weights.safetensors"), "pt") as weights:
        assert sorted(weights.keys()) == sorted(name for name in constants if name.startswith("model."))
    for program in (folder / "pt2").glob("*.pt2"):
        with zipfile.ZipFile(program) as archive:
            payloads = [i for i in archive.infolist() if "/data/weights/weight_" in i.filename]
            # every weight and cache buffer: one element (4 or 8 bytes), stretched to its shape at save
            assert payloads and max(i.file_size for i in payloads) <= 8, program
    # Deflated: a program's graph JSON and an AOTInductor package's library are a tenth of a
    # 30-layer model's bytes if stored as torch writes them.
    for program in [*(folder / "pt2").glob("*.pt2"), *(folder / "aoti").glob("*.pt2")]:
        with zipfile.ZipFile(program) as archive:
            assert {i.compress_type for i in archive.infolist()} == {zipfile.ZIP_DEFLATED}, program
    assert len(list((folder / "aoti").glob("*.pt2"))) == 2  # decode and the prefill bucket


@pytest.mark.parametrize("name", NAMES)
def test_decode_program_mutates_each_cache_buffer_in_place_and_copies_none(artifacts, name):
    """Walk the decode program after functionalisation (what AOTInductor compiles). The export
    records each cache K/V buffer as a buffer mutation, produced by one scatter (`index_put`) of
    the step's entries; any other op whose result is as large as a cache buffer and is not a view
    (a clone, a copy, a cat, a where over the buffer) would be a per-step copy of it, and fails."""
    from staticrt.backends.exported import load_constants, with_constants

    manifest = json.loads((artifacts[name] / "manifest.json").read_text())
    saved = torch.export.load(str(artifacts[name] / "pt2" / "decode.pt2"))
    program = with_constants(saved, load_constants(artifacts[name], manifest)).run_decompositions({})
    cache_buffers = {n: c for n, c in manifest["constants"].items() if re.fullmatch(r"cache\.(key|value)_\d+", n)}
    mutated = program.graph_signature.buffers_to_mutate  # output node name -> buffer
    assert sorted(v for v in mutated.values() if v in cache_buffers) == sorted(cache_buffers)
    sizes = {torch.Size(c["shape"]).numel() for c in cache_buffers.values()}
    scatters, copies = [], []
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.op != "call_function" or not isinstance(value, torch.Tensor) or value.numel() not in sizes:
            continue
        op = node.target._opname if hasattr(node.target, "_opname") else str(node.target)
        if op in VIEWS:
            continue
        (scatters if op == "index_put" and node.name in mutated else copies).append(f"{node.name} ({op})")
    assert copies == []
    assert len(scatters) == len(cache_buffers)


def copy_artifact(artifacts, tmp_path) -> Path:
    return Path(shutil.copytree(artifacts["tiny-llama"], tmp_path / "copy"))


def test_a_corrupted_program_file_is_refused_by_name(artifacts, tmp_path):
    folder = copy_artifact(artifacts, tmp_path)
    program = folder / "aoti" / "decode.pt2"
    data = bytearray(program.read_bytes())
    data[len(data) // 2] ^= 0xFF
    program.write_bytes(bytes(data))
    with pytest.raises(ArtifactError) as err:
        load_artifact(folder)
    assert str(err.value) == (
        f"{program} does not match the sha256 in manifest.json (changed or corrupted since "
        "export); re-export the artifact"
    )


def test_another_schema_version_is_refused_by_field(artifacts, tmp_path):
    folder = copy_artifact(artifacts, tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError) as err:
        load_artifact(folder)
    assert str(err.value) == (
        f"{folder / 'manifest.json'}: field schema_version is 99, this staticrt reads "
        "schema_version 3; re-export the artifact with this staticrt"
    )


def test_cli_runs_an_artifact_with_any_of_its_formats(artifacts, capsys):
    ids = ",".join(map(str, prompts()[0]))
    assert main(["run", str(artifacts["tiny-llama"]), "--prompt-ids", ids, "--max-new-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "exported-aoti" and out["cache"] == "static"  # the default: the first format held
    reference = load_artifact(artifacts["tiny-llama"], "pt2").generate([prompts()[0]], 8)[0]
    assert out["tokens"] == [reference]
    assert (
        main(
            [
                "run",
                str(artifacts["tiny-llama"]),
                "--backend",
                "onnx",
                "--prompt-ids",
                ids,
                "--max-new-tokens",
                "8",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "onnx" and out["tokens"] == [reference]  # the recipe's onnx graph agrees


def test_exported_programs_sample_the_tokens_every_backend_samples(artifacts):
    """The programs end at the logits and the host chooses, so a seed gives the eager backend's tokens."""
    folder = artifacts["tiny-llama"]
    kwargs = dict(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=50, top_p=0.95, seed=7)
    eager = staticrt.Generator(
        staticrt.load_model("tiny-llama"), max_batch_size=3, max_cache_len=128, prefill_buckets=[64]
    )
    expected = eager.generate(prompts(), **kwargs)
    assert expected != eager.generate(prompts(), max_new_tokens=12)  # sampling, not the greedy answer
    for backend in ("aoti", "pt2", "onnx"):
        assert load_artifact(folder, backend).generate(prompts(), **kwargs) == expected, backend


def test_an_export_interrupted_in_its_last_stage_leaves_no_folder(tmp_path, monkeypatch):
    import safetensors.torch

    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    model = staticrt.load_model("tiny-llama")
    with pytest.raises(RuntimeError, match="disk full"):
        export_artifact(model, CacheSpec("static", 1, 32), [16], tmp_path / "tiny", formats=["pt2"])
    assert list(tmp_path.iterdir()) == []  # neither the artifact nor a temporary folder


def test_cold_start_bench_starts_every_program_cold_and_warm_with_the_same_first_token(artifacts, tmp_path):
    """Every way to run the artifact's model, and transformers on the same weights, each from a
    fresh process twice: all give the artifact's greedy tokens. An ONNX program's process
    imports no torch (its peak is below the torch-free floor every torch process is above)."""
    out = tmp_path / "cold.json"
    assert main(["bench", "--cold-start", str(artifacts["tiny-llama"]), "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["programs"]) == ["eager", "compiled", "aoti", "pt2", "onnx", "transformers"]
    assert (report["cache"], report["model"], report["not_run"]) == ("static", "tiny-llama", {})
    tokens = load_artifact(artifacts["tiny-llama"], "pt2").generate([[1, 2, 3]], 8)[0]
    for label, result in report["programs"].items():
        assert list(result) == ["cold", "warm"], label
        for phase in result.values():
            assert phase["tokens"] == tokens, label
            assert 0 < phase["s"] < phase["all_tokens_s"]
            torch_free = label == "onnx"
            assert (phase["peak_rss_mb"] < 150) == torch_free, (label, phase["peak_rss_mb"])
    assert report["tokens_agree"] is True


def test_an_artifact_for_another_cpu_is_refused_for_aoti(artifacts, tmp_path):
    folder = copy_artifact(artifacts, tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["cpu_capability"] = "AVX1024"  # as if exported on another CPU: sealed as the exporter would
    (folder / "manifest.json").write_text(json.dumps(seal(manifest)))
    with pytest.raises(
        ArtifactError,
        match=r"field cpu_capability is 'AVX1024', this CPU offers '\w+'; the compiled "
        r"code may not run here: use --backend pt2 or re-export here$",
    ):
        load_artifact(folder)
    assert load_artifact(folder, backend="pt2").generate([[1, 2, 3]], max_new_tokens=4) == load_artifact(
        artifacts["tiny-llama"]
    ).generate([[1, 2, 3]], max_new_tokens=4)
