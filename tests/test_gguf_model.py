"""A `.gguf` file as --model (issue 45), as llama.cpp, Ollama and vLLM users pass one: converted
once into the user's cache, reused by every later process, converted again when the file changes."""

from __future__ import annotations

import json
import os

import pytest

from staticrt.cli.main import main

gguf_files = pytest.importorskip("gguf_files", reason="needs the gguf extra: use the README's test command")

RUN = ["run", "--prompt", "The capital of France is", "--max-new-tokens", "6", "--json"]


def tokens(capsys) -> tuple[list[int], str]:
    said = capsys.readouterr()
    return json.loads(said.out)["tokens"][0], said.err


def test_a_gguf_file_runs_as_model_converted_once_into_the_cache(smollm2_gguf, tmp_path, monkeypatch, capsys):
    source = gguf_files.cut_gguf(smollm2_gguf, tmp_path / "smollm2-2layers.gguf", 2, "Q8_0")
    cache = tmp_path / "cache"
    monkeypatch.setenv("STATICRT_CACHE", str(cache))
    assert main([*RUN, "--model", str(source)]) == 0
    first, log = tokens(capsys)
    folders = sorted((cache / "gguf").iterdir())
    assert [f.name.rsplit("-", 1)[0] for f in folders] == ["smollm2-2layers"]
    assert f"converting {source} once into {folders[0]} (later runs reuse it)" in log
    # no third-party noise: transformers' tqdm bars (torchao's and torch's lines show only where
    # this process imports torchao first)
    assert [noise for noise in ("it/s]", "Failed to load", "_pytree") if noise in log] == []

    assert main([*RUN, "--model", str(source)]) == 0  # a later process: the folder, no conversion
    second, log = tokens(capsys)
    assert second == first and "converting" not in log

    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file changed in place
    assert main([*RUN, "--model", str(source)]) == 0
    assert "converting" in tokens(capsys)[1]
    assert len(list((cache / "gguf").iterdir())) == 2
