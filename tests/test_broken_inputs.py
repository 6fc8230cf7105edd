"""Broken checkpoints and careless input (issue 40): what used to load and decode NaN as token 0,
cast the wrong weights without a word, or end in a traceback is refused by name, with the way out."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import staticrt
from staticrt.bench.serve_bench import checkpoint_folder
from staticrt.cli.main import main
from staticrt.errors import CheckpointError, ConfigError
from staticrt.loading.convert import convert_gguf

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}<assistant>"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """tiny-llama as a checkpoint folder with a word-level tokenizer (t0 .. t511) and a chat template."""
    path = checkpoint_folder("tiny-llama", tmp_path_factory.mktemp("broken"))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


def copy(folder: Path, target: Path) -> Path:
    shutil.copytree(folder, target)
    return target


def with_config(folder: Path, target: Path, **fields) -> Path:
    out = copy(folder, target)
    config = json.loads((out / "config.json").read_text())
    config.update(fields)
    (out / "config.json").write_text(json.dumps(config))
    return out


NOT_FINITE = st.sampled_from([float("nan"), float("inf"), -float("inf")])
# each field with the values that decode NaN: rope theta and a linear factor must be > 0, epsilon >= 0
BAD = {
    "rope_theta": st.floats(max_value=0) | NOT_FINITE,
    "factor": st.floats(max_value=0) | NOT_FINITE,
    "rms_norm_eps": st.floats(max_value=-1e-12) | NOT_FINITE,
}


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data(), field=st.sampled_from(sorted(BAD)))
def test_config_values_that_decode_nan_are_refused_by_name(folder, tmp_path_factory, data, field):
    """A zero or negative rope theta, linear rope factor or norm epsilon loaded and decoded NaN
    logits as token 0, exit status 0."""
    value = data.draw(BAD[field])
    rope = {"rope_type": "default", "rope_theta": 10000.0}  # transformers 5 writes theta here, not at the top
    if field == "rms_norm_eps":
        fields = {field: value}
    else:
        fields = {"rope_parameters": {**rope, **({"rope_theta": value} if field == "rope_theta" else {})}}
        if field == "factor":
            fields["rope_parameters"].update(rope_type="linear", factor=value)
    bad = with_config(folder, tmp_path_factory.mktemp("config") / "model", **fields)
    label = {"rope_theta": "rope theta", "factor": "rope factor"}.get(field, field)
    with pytest.raises(ConfigError, match=f"{label} is "):
        staticrt.load_model(bad)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(theta=st.floats(1.0, 1e7), eps=st.floats(0, 1e-3), factor=st.floats(0.25, 8))
def test_any_valid_config_values_load_and_generate(folder, tmp_path_factory, theta, eps, factor):
    good = with_config(
        folder,
        tmp_path_factory.mktemp("config") / "model",
        rms_norm_eps=eps,
        rope_parameters={"rope_type": "linear", "rope_theta": theta, "factor": factor},
    )
    generator = staticrt.Generator(staticrt.load_model(good), max_cache_len=16, backend="eager")
    assert len(generator.generate([[1, 2, 3]], 2)[0]) == 2


NOT_FLOAT = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data(), dtype=st.sampled_from(NOT_FLOAT))
def test_integer_or_bool_weights_are_refused_not_cast(folder, tmp_path_factory, data, dtype):
    """Any weight of any integer or bool dtype, where a float one belongs, was cast without a word."""
    bad = copy(folder, tmp_path_factory.mktemp("weights") / "model")
    state = load_file(bad / "model.safetensors")
    name = data.draw(st.sampled_from(sorted(state)))
    state[name] = torch.ones_like(state[name], dtype=dtype)
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    message = f"{name.removeprefix('model.')} is {str(dtype)[6:]}, where a weight is floating point"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        staticrt.load_model(bad)


def test_text_that_is_not_utf8_is_refused_by_name(folder, capsys):
    assert main(["run", "--model", str(folder), "--prompt", "t1 \udcff t2", "--max-new-tokens", "2"]) == 2
    assert main(["run", "--model", str(folder), "--chat", "t1 \udcff", "--max-new-tokens", "2"]) == 2
    said = capsys.readouterr()
    assert "--prompt is not valid UTF-8 (character 3 is a lone surrogate, '\\udcff'); send UTF-8 text" in said.err
    assert "--chat is not valid UTF-8" in said.err


def test_chat_keeps_the_conversation_past_a_line_that_is_not_utf8(folder):
    command = [sys.executable, "-m", "staticrt.cli", "chat", "--model", str(folder), "--max-new-tokens", "3"]
    done = subprocess.run(command, input=b"t1 \xff\xfe t2\nt3 t4\n", capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    out = (done.stdout + done.stderr).decode()
    assert "staticrt chat: the text is not valid UTF-8" in out
    assert len([line for line in done.stdout.decode().splitlines() if line.strip()]) >= 1  # the second turn's answer


def test_a_template_that_is_not_utf8_fails_only_the_chats(folder, tmp_path, capsys):
    bad = copy(folder, tmp_path / "model")
    (bad / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")
    assert main(["run", "--model", str(bad), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]) == 0
    assert main(["run", "--model", str(bad), "--prompt", "t1 t2", "--max-new-tokens", "2"]) == 0
    assert main(["run", "--model", str(bad), "--chat", "t1", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{bad / 'chat_template.jinja'} is not UTF-8 text (byte 0 is 0xff); restore the checkpoint's" in err


@pytest.fixture
def in_tmp(tmp_path):
    here = os.getcwd()
    os.chdir(tmp_path)
    yield tmp_path
    os.chdir(here)


def test_convert_refuses_files_that_are_not_whole_gguf(in_tmp, smollm2_gguf):
    pytest.importorskip("gguf")
    (in_tmp / "empty.gguf").write_bytes(b"")
    (in_tmp / "other.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with smollm2_gguf.open("rb") as whole, (in_tmp / "cut.gguf").open("wb") as cut:
        cut.write(whole.read(1 << 20))  # the header and the first MiB of tensors
    cases = [
        ("empty.gguf", "empty.gguf is not a GGUF file (it starts with b'', not b'GGUF')"),
        ("other.gguf", "other.gguf is not a GGUF file (it starts with b'PK\\x03\\x04', not b'GGUF')"),
        ("cut.gguf", "cut.gguf cannot be read as GGUF ("),
    ]
    for name, message in cases:
        with pytest.raises(CheckpointError) as err:
            convert_gguf(in_tmp / name, in_tmp / "out")
        assert message in str(err.value)
        assert not (in_tmp / "out").exists()
    with pytest.raises(CheckpointError, match="/proc/staticrt-out"):  # a place the file system refuses
        convert_gguf(smollm2_gguf, Path("/proc/staticrt-out"))


def test_convert_refuses_outputs_it_cannot_write_before_reading(in_tmp):
    source = in_tmp / "model.gguf"
    source.write_bytes(b"GGUF")
    (in_tmp / "file").write_text("keep")
    (in_tmp / "link").symlink_to(in_tmp / "nowhere")
    way_out = "choose a new output folder"
    cases = [
        (in_tmp / "file" / "out", f"the output {in_tmp / 'file' / 'out'} lies under {in_tmp / 'file'}, which is not"),
        (Path("."), f"the output '.' is the current or a parent folder, not a new one; {way_out}"),
        (in_tmp / "link", f"the output {in_tmp / 'link'} is a symbolic link, not a folder; {way_out} or remove"),
        (in_tmp / "file", f"the output {in_tmp / 'file'} is a file, not a folder; {way_out} or remove the file"),
    ]
    for target, message in cases:
        with pytest.raises(CheckpointError) as err:
            convert_gguf(source, target)
        assert message in str(err.value)
    assert (in_tmp / "file").read_text() == "keep" and (in_tmp / "link").is_symlink()
    assert sorted(p.name for p in in_tmp.iterdir()) == ["file", "link", "model.gguf"]
