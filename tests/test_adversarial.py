"""What an adversarial user tried (issue 16), one test per finding: nothing lost, nothing silently
wrong, every bad input refused with the project's own error, naming the input, the limit and the
way out, before any state changes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_models import hf_greedy, save_hf_model

import staticrt
from staticrt.artifacts.manifest import SCHEMA_VERSION, seal
from staticrt.caches import CacheSpec
from staticrt.cli.main import main
from staticrt.errors import ArtifactError, CacheError, CheckpointError, ConfigError, GenerationError
from staticrt.exporters import export_artifact
from staticrt.generation.generator import load_artifact

EXPORT = ["export", "--model", "tiny-llama", "--cache", "static", "--max-cache-len", "64", "--prefill-buckets", "16"]
WAY_OUT = "choose another --out (a new folder, or an artifact folder to replace)"


@pytest.fixture(scope="module")
def model():
    return staticrt.load_model("tiny-llama")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    """tiny-llama as pt2 and onnx, batch 2, 64 positions."""
    out = tmp_path_factory.mktemp("adversarial") / "tiny"
    assert main([*EXPORT, "--batch-size", "2", "--format", "pt2,onnx", "--out", str(out)]) == 0
    return out


def tampered(artifact: Path, tmp_path: Path, edit, reseal: bool = False) -> Path:
    """A copy of the artifact whose manifest `edit` changed (resealed: as a careful forger would)."""
    folder = Path(shutil.copytree(artifact, tmp_path / "copy"))
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    (folder / "manifest.json").write_text(json.dumps(seal(manifest) if reseal else manifest))
    return folder


# 1. export --out never deletes what is not an artifact, and replaces an artifact atomically


def test_export_refuses_a_folder_that_is_not_an_artifact_and_keeps_its_files(tmp_path, capsys):
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "notes.txt").write_text("x")
    assert main([*EXPORT, "--format", "pt2", "--out", str(folder)]) == 2
    assert capsys.readouterr().err.replace("\n", "") == (
        f"staticrt export: --out {folder} exists and is not an artifact folder (it holds ['notes.txt']); "
        f"{WAY_OUT}, or move its contents away first"
    )
    assert (folder / "notes.txt").read_text() == "x" and list(tmp_path.iterdir()) == [folder]


def test_export_refuses_a_file_and_the_current_folder_before_any_work(tmp_path, monkeypatch, model):
    file = tmp_path / "f"
    file.write_text("keep")
    with pytest.raises(ArtifactError, match=re.escape(f"--out {file} is a file, not an artifact folder; {WAY_OUT}")):
        export_artifact(model, CacheSpec("static", 1, 32), [16], file, ["pt2"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArtifactError, match=re.escape("--out '.' is the current or a parent folder, not a new one")):
        export_artifact(model, CacheSpec("static", 1, 32), [16], Path("."), ["pt2"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"] and file.read_text() == "keep"


def test_export_replaces_an_artifact_only_once_the_new_one_is_complete(tmp_path, monkeypatch, model):
    import safetensors.torch

    target = tmp_path / "tiny"
    export_artifact(model, CacheSpec("static", 1, 32), [16], target, ["pt2"])
    before = {p.name: p.read_bytes() for p in target.rglob("*") if p.is_file()}
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        export_artifact(model, CacheSpec("static", 2, 32), [16], target, ["pt2"])
    assert {p.name: p.read_bytes() for p in target.rglob("*") if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]
    monkeypatch.undo()
    export_artifact(model, CacheSpec("static", 2, 32), [16], target, ["pt2"])  # replaced once complete
    assert load_artifact(target, "pt2").backend.batch_size == 2
    (target / "notes.txt").write_text("mine")
    with pytest.raises(
        ArtifactError,
        match=re.escape(f"--out {target} is an artifact folder that also holds file(s) ['notes.txt'] its manifest"),
    ):
        export_artifact(model, CacheSpec("static", 1, 32), [16], target, ["pt2"])
    assert (target / "notes.txt").read_text() == "mine"


# 2. one Generator, two threads; a stream callback that re-enters


def test_concurrent_generate_calls_are_serialised_and_reentry_is_refused(model):
    shared = staticrt.Generator(model, max_batch_size=1, max_cache_len=128)
    prompts = {"a": [1, 2, 3], "b": [7, 8, 9, 10, 11]}
    expected = {k: staticrt.Generator(model, max_cache_len=128).generate([p], 50) for k, p in prompts.items()}
    got: dict[str, list] = {"a": [], "b": []}

    def worker(name: str) -> None:
        for _ in range(4):
            got[name].append(shared.generate([prompts[name]], 50))

    threads = [threading.Thread(target=worker, args=(name,)) for name in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {k: [v] * 4 for k, v in expected.items()}

    def reenter(row: int, token: int) -> None:
        shared.generate([[5]], 2)

    with pytest.raises(
        GenerationError,
        match=r"^generate was called again while this thread's generate is under way \(from its stream "
        r"callback\?\); the Generator's one cache holds one generation at a time",
    ):
        shared.generate([prompts["a"]], 50, stream=reenter)
    assert shared.generate([prompts["a"]], 50) == expected["a"]


# 3. the manifest is sealed; every file listed; limits held against what was loaded


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m["model"]["config"].update(vocab_size=4096),
        lambda m: m["cache"].update(max_sequence_len=4096),
        lambda m: m["cache"].update(max_batch_size=64),
        lambda m: m["files"].pop("weights.safetensors"),
    ],
    ids=["vocab_size", "max_sequence_len", "max_batch_size", "files-entry"],
)
def test_an_edited_manifest_is_refused(artifact, tmp_path, edit):
    folder = tampered(artifact, tmp_path, edit)
    for backend in ("pt2", "onnx"):
        with pytest.raises(ArtifactError) as err:
            load_artifact(folder, backend)
        assert str(err.value) == (
            f"{folder / 'manifest.json'} does not match its own manifest_sha256 (edited or corrupted since "
            "export); the limits it records are what the loader enforces, so an edited manifest is refused: "
            "re-export the artifact with `staticrt export`"
        )


def test_a_resealed_manifest_is_held_against_the_files(artifact, tmp_path):
    folder = tampered(artifact, tmp_path, lambda m: m["model"]["config"].update(vocab_size=4096), reseal=True)
    with pytest.raises(ArtifactError, match=r"records vocab_size 4096, but .*model.onnx holds 512; the files do not"):
        load_artifact(folder, "onnx")
    with pytest.raises(ArtifactError, match=r"records vocab_size 4096, but .*weights.safetensors holds 512; the"):
        load_artifact(folder, "pt2")
    shutil.rmtree(folder)
    folder = tampered(artifact, tmp_path, lambda m: m["files"].pop("weights.safetensors"), reseal=True)
    with pytest.raises(
        ArtifactError,
        match=re.escape(f"{folder} holds file(s) ['weights.safetensors'] that manifest.json does not list"),
    ):
        load_artifact(folder, "pt2")


def test_an_unlisted_file_and_malformed_manifests_are_refused_by_name(artifact, tmp_path):
    folder = Path(shutil.copytree(artifact, tmp_path / "extra"))
    (folder / "onnx" / "notes.txt").write_text("x")
    with pytest.raises(ArtifactError, match=re.escape("holds file(s) ['onnx/notes.txt'] that manifest.json does not")):
        load_artifact(folder, "onnx")
    manifest = folder / "manifest.json"
    cases = {
        "[]": f"{manifest} holds a JSON list, not an object; re-export the artifact with `staticrt export`",
        json.dumps(seal({"schema_version": True})): f"{manifest}: field schema_version is True, this staticrt reads",
        json.dumps(seal({"schema_version": SCHEMA_VERSION})): (
            f"{manifest}: field versions is missing; re-export the artifact"
        ),
    }
    for text, message in cases.items():
        manifest.write_text(text)
        with pytest.raises(ArtifactError, match="^" + re.escape(message)):
            load_artifact(folder)
    original = json.loads((artifact / "manifest.json").read_text())
    del original["cache"]["max_batch_size"]
    manifest.write_text(json.dumps(seal(original)))
    with pytest.raises(ArtifactError, match=re.escape("field cache.max_batch_size is missing")):
        load_artifact(folder, "onnx")


# 4. --prompt-ids is strict


@pytest.mark.parametrize("text", ["1 2 3", "1,,2", "1_000", "１,２", "-1,2", "1,2,"])
def test_prompt_ids_that_are_not_comma_separated_digits_are_refused(text, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--model", "tiny-llama", f"--prompt-ids={text}"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        f"staticrt run: error: argument --prompt-ids: {text!r} is not comma-separated token ids; write them like "
        "1,2,3 (digits 0-9, one comma between ids); see staticrt run --help\n"
    )


# 5. an activation staticrt does not implement


@pytest.fixture()
def checkpoint(hf_checkpoints, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoints["llama"][0], folder)
    return folder


def edit_config(folder: Path, **fields) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(fields)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_an_unimplemented_activation_is_refused(checkpoint):
    edit_config(checkpoint, hidden_act="relu")
    with pytest.raises(ConfigError) as err:
        staticrt.load_model(checkpoint)
    assert str(err.value) == (
        f"{checkpoint / 'config.json'}: hidden_act 'relu' is not implemented; staticrt runs silu, swish, "
        "gelu_pytorch_tanh, gelu_tanh, and running another activation as one of these would give wrong tokens"
    )


# 6. the Python API takes token ids and numbers of the right type only


@pytest.mark.parametrize(
    ("prompts", "kwargs", "message"),
    [
        ([[1.9, 2.5, 3.7]], {}, "prompt 0 token 0 is 1.9 (float); it must be an int"),
        ([["1", "2"]], {}, "prompt 0 token 0 is '1' (str); it must be an int"),
        ([[1, True]], {}, "prompt 0 token 1 is True (bool); it must be an int"),
        ([[1, None, 3]], {}, "prompt 0 token 1 is None (NoneType); it must be an int"),
        ([[1]], {"do_sample": True, "top_k": 2.5}, "top_k is 2.5 (float); it must be an int"),
        ([[1]], {"max_new_tokens": True}, "max_new_tokens is True (bool); it must be an int"),
        ([[1]], {"do_sample": True, "temperature": "0.7"}, "temperature is '0.7' (str); it must be a number"),
        ([[1]], {"do_sample": True, "seed": -1}, "seed is -1; it must be an int >= 0"),
        ([[1]], {"max_new_tokens": -5}, "max_new_tokens is -5; it must be an int >= 1"),
        ([[1]], {"stop_token_ids": [2.0]}, "stop_token_ids token 0 is 2.0 (float); it must be an int"),
        ([[1]], {"do_sample": "yes"}, "do_sample is 'yes'; it must be True or False"),
    ],
)
def test_values_of_the_wrong_type_are_refused_before_state_changes(model, prompts, kwargs, message):
    gen = staticrt.Generator(model, max_batch_size=1, max_cache_len=32)
    gen.generate([[4, 5, 6]], 4)
    before = [b.clone() for b in gen.backend.cache.state_buffers()]
    with pytest.raises(GenerationError, match="^" + re.escape(message) + "$"):
        gen.generate(prompts, **{"max_new_tokens": 4, **kwargs})
    assert all(torch.equal(a, b) for a, b in zip(before, gen.backend.cache.state_buffers()))


def test_numpy_integers_run_as_ints_and_a_huge_top_k_keeps_every_token(model):
    gen = staticrt.Generator(model, max_batch_size=1, max_cache_len=32)
    reference = gen.generate([[1, 2, 3]], 5)
    assert gen.generate([np.array([1, 2, 3])], np.int64(5), stop_token_ids=None) == reference
    sampled = dict(do_sample=True, seed=3)
    assert gen.generate([[1, 2, 3]], 5, top_k=2**63, **sampled) == gen.generate([[1, 2, 3]], 5, top_k=0, **sampled)


# 7. a tied config whose checkpoint holds its own head


def test_a_tied_config_with_its_own_lm_head_keeps_the_head_as_transformers_does(tmp_path):
    import transformers

    folder = tmp_path / "own-head"
    save_hf_model("llama", folder)  # untied: lm_head differs from the embedding
    edit_config(folder, tie_word_embeddings=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with pytest.warns(UserWarning, match="holds an lm_head.weight of its own; it is used untied, as transformers"):
        model = staticrt.load_model(folder)
    prompt = [3, 17, 42, 99]
    assert staticrt.Generator(model, max_cache_len=64).generate([prompt], 16)[0] == hf_greedy(hf, prompt, 16)


# 8. --json stays JSON with one new token


def test_json_output_with_one_new_token_is_valid_json(capsys):
    assert main(["run", "--model", "tiny-llama", "--prompt-ids", "1,2", "--max-new-tokens", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
    assert out["decode_ms_per_token"] is None and len(out["tokens"][0]) == 1


# 9. an export killed by a signal


def partials(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".partial"))


def start_export(out: Path) -> subprocess.Popen:
    """An export slow enough (pt2 and onnx) to be caught while it writes its partial folder."""
    args = [*EXPORT, "--format", "pt2,onnx", "--out", str(out)]
    code = f"import sys; from staticrt.cli.main import main; sys.exit(main({args!r}))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not partials(out.parent) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert partials(out.parent), "the export never wrote its partial folder"
    return proc


def test_sigterm_removes_the_partial_folder_and_sigkill_leftovers_go_with_the_next_export(tmp_path, model):
    out = tmp_path / "tiny"
    proc = start_export(out)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []
    proc = start_export(out)
    proc.kill()
    proc.wait(timeout=60)
    left = partials(tmp_path)
    assert len(left) == 1 and left[0].startswith(f".tiny.{proc.pid}.")
    live = tmp_path / f".tiny.{os.getpid()}.abc.partial"  # a concurrent export's: left alone
    live.mkdir()
    export_artifact(model, CacheSpec("static", 1, 32), [16], out, ["pt2"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "tiny"])


@pytest.mark.parametrize("when", ["inside mkdtemp", "before mkdtemp"])
def test_sigterm_while_the_partial_folder_is_made_still_removes_it(tmp_path, monkeypatch, when):
    """The CI race: SIGTERM sent as soon as the folder appeared, before the handler or `work` held it."""
    from staticrt.artifacts import write

    make = tempfile.mkdtemp

    def mkdtemp_then_signal(**kwargs):
        if when == "before mkdtemp":
            os.kill(os.getpid(), signal.SIGTERM)
        folder = make(**kwargs)
        if when == "inside mkdtemp":
            os.kill(os.getpid(), signal.SIGTERM)
        return folder

    monkeypatch.setattr(write.tempfile, "mkdtemp", mkdtemp_then_signal)
    built = []
    with pytest.raises(SystemExit) as exit_:
        write.write_folder(tmp_path / "out", built.append)
    assert exit_.value.code == 128 + signal.SIGTERM
    assert (built, list(tmp_path.iterdir())) == ([], [])
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# 10. named errors, never a traceback


def test_broken_config_json_is_named(checkpoint, capsys):
    config = checkpoint / "config.json"
    config.write_text("{not json")
    with pytest.raises(ConfigError, match="^" + re.escape(f"{config} is not valid JSON (Expecting property name")):
        staticrt.load_model(checkpoint)
    config.write_text("[]")
    with pytest.raises(ConfigError, match=re.escape(f"{config} holds a JSON list, not an object; restore its")):
        staticrt.load_model(checkpoint)
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 0}))
    with pytest.raises(ConfigError, match=f"^{re.escape(str(config))}: field num_attention_heads is 0; it must be an"):
        staticrt.load_model(checkpoint)
    assert main(["run", "--model", str(checkpoint), "--prompt-ids", "1"]) == 2
    err = capsys.readouterr().err.replace("\n", "")
    assert err.startswith(f"staticrt run: {config}: field num_attention_heads is 0") and "Traceback" not in err


def test_a_loaded_model_keeps_no_page_of_its_checkpoint_mapped(checkpoint):
    """Loading copies every tensor (column-major, fused, cast) and closes the file's map after
    each: a tensor left on the map would keep every page read resident beside the copies."""
    weights = str((checkpoint / "model.safetensors").resolve())
    model = staticrt.load_model(checkpoint)
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(weights)]
    assert model.config.num_layers > 0 and mapped == []


@pytest.mark.parametrize("damage", ["truncated", "empty", "corrupt"])
def test_a_damaged_safetensors_file_is_named(checkpoint, damage):
    weights = checkpoint / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "corrupt": b"\xff" * 8 + data[8:]}[damage])
    with pytest.raises(CheckpointError, match="^" + re.escape(f"{weights} cannot be read as safetensors (")) as err:
        staticrt.load_model(checkpoint)
    assert str(err.value).endswith("); the file is truncated or corrupt: download it again")


def test_a_broken_tokenizer_or_index_is_named(checkpoint):
    tokenizer = checkpoint / "tokenizer.json"
    tokenizer.write_text("{")
    with pytest.raises(CheckpointError, match="^" + re.escape(f"{tokenizer} cannot be read by the tokenizers")):
        staticrt.load_model(checkpoint)
    tokenizer.unlink()
    index = checkpoint / "model.safetensors.index.json"
    index.write_text('{"weight_map": 3}')
    with pytest.raises(CheckpointError, match="^" + re.escape(f"{index} is not a safetensors index")):
        staticrt.load_model(checkpoint)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--threads", "-1"], "argument --threads: '-1' is not an integer >= 1"),
        (["--threads", "0"], "argument --threads: '0' is not an integer >= 1"),
        (["--seed", "-1"], "argument --seed: '-1' is not an integer >= 0"),
        (["--max-new-tokens", "-5"], "argument --max-new-tokens: '-5' is not an integer >= 1"),
    ],
)
def test_bad_cli_numbers_are_refused_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--model", "tiny-llama", "--prompt-ids", "1,2", *flags])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"staticrt run: error: {message}; see staticrt run --help\n"


def _beyond_the_gpus() -> tuple[str, str]:
    """A CUDA device index one past what torch sees (none on a CPU machine), and its way out."""
    seen = torch.cuda.device_count()
    way_out = (
        f"pass cuda:0 to cuda:{seen - 1}, or cpu"
        if seen
        else "pass cpu, or run on a machine with a GPU and torch's CUDA build (see the README)"
    )
    return f"cuda:{seen}", f"torch {torch.__version__} sees {seen} CUDA device(s); {way_out}"


@pytest.mark.parametrize("command", ["run", "serve", "bench-serve", "bench"])
def test_a_device_torch_cannot_reach_is_refused_before_the_model_loads(command, hf_checkpoints, capsys, monkeypatch):
    import staticrt.loading.weight_files as weights

    monkeypatch.setattr(weights, "_read_state_dict", lambda *_: pytest.fail("the checkpoint was read"))
    device, why = _beyond_the_gpus()
    flags = ["--prompt-ids", "1,2"] if command == "run" else []
    assert main([command, "--model", str(hf_checkpoints["llama"][0]), "--device", device, *flags]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"staticrt {command}: device '{device}': {why}"
    assert main(["run", "--model", "tiny-llama", "--device", "tpu", "--prompt-ids", "1,2"]) == 2
    assert (
        capsys.readouterr().err == "staticrt run: device 'tpu' is not one staticrt runs on; pass cpu, cuda or cuda:N\n"
    )
    with pytest.raises(ConfigError, match="^" + re.escape(f"device '{device}': {why}") + "$"):
        staticrt.load_model("tiny-llama", device=device)


def test_an_artifact_refuses_device_it_runs_where_it_was_built_for(artifact, capsys):
    assert main(["run", str(artifact), "--device", "cpu", "--prompt-ids", "1,2"]) == 2
    assert capsys.readouterr().err.replace("\n", "") == (
        "staticrt run: an artifact runs where it was built for: pt2 and aoti programs on the device they were "
        "exported on, onnx on CUDA where onnxruntime-gpu sees a GPU; drop --device"
    )


def test_the_cuda_graph_backends_load_the_model_on_a_gpu_when_there_is_one():
    from staticrt.cli.session import model_device

    gpu = "cuda" if torch.cuda.is_available() else "cpu"
    assert [model_device(None, b) for b in ("cudagraph", "reduce-overhead", "compiled", "eager", None)] == [
        gpu,
        gpu,
        "cpu",
        "cpu",
        "cpu",
    ]
    assert model_device("cpu", "cudagraph") == "cpu"


# 11. the smaller ones


def test_zero_sizes_are_refused_not_defaulted(model, artifact):
    with pytest.raises(CacheError, match="^max_batch_size is 0; it must be at least 1$"):
        staticrt.Generator(model, max_batch_size=0)
    with pytest.raises(CacheError, match="^max_cache_len is 0; it must be at least 1$"):
        staticrt.Generator(model, max_cache_len=0)
    with pytest.raises(ArtifactError, match="^threads is -3; it must be an int >= 1$"):
        load_artifact(artifact, "onnx", threads=-3)


def test_an_artifact_says_to_re_export_when_a_request_exceeds_it(artifact, capsys):
    ids = ",".join(["1"] * 60)
    assert main(["run", str(artifact), "--backend", "onnx", "--prompt-ids", ids, "--max-new-tokens", "8"]) == 2
    assert capsys.readouterr().err.replace("\n", "") == (
        "staticrt run: prompt 0 has 60 tokens; with max_new_tokens=8 that is 68, beyond max_cache_len=64; shorten "
        "the prompt, ask for fewer tokens or re-export the artifact with a larger --max-cache-len"
    )


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_artifact_permissions_follow_the_umask(tmp_path, model, umask):
    old = os.umask(umask)
    try:
        out = export_artifact(model, CacheSpec("static", 1, 32), [16], tmp_path / "tiny", ["pt2"])
    finally:
        os.umask(old)
    modes = {p.stat().st_mode & 0o777 for p in [out, *out.rglob("*")] if p.is_dir()}
    assert modes == {0o777 & ~umask}
    assert {p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()} == {0o666 & ~umask}


def test_a_program_written_into_a_folder_stays_executable(tmp_path):
    """bench-serve's llama-server is built into the user cache by `write_folder`: the umask's modes,
    with the execute bits its builder gave it kept."""
    from staticrt.artifacts.write import write_folder

    def build(folder):
        (folder / "program").write_text("#!/bin/sh\n")
        (folder / "program").chmod(0o755)
        (folder / "notes.txt").write_text("x")

    old = os.umask(0o022)
    try:
        out = write_folder(tmp_path / "built", build)
    finally:
        os.umask(old)
    assert ((out / "program").stat().st_mode & 0o777, (out / "notes.txt").stat().st_mode & 0o777) == (0o755, 0o644)
