"""The command line as a user drives it: JSON output, text prompts through tokenizer.json, errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import torch
from hf_models import hf_greedy

import staticrt
from staticrt.cli.main import main


def test_run_json_matches_transformers(hf_checkpoints, capsys):
    folder, hf = hf_checkpoints["qwen2"]
    rows = [[5, 17, 99, 3], [1, 2]]
    args = ["run", "--model", str(folder), "--max-new-tokens", "12", "--json"]
    for row in rows:
        args += ["--prompt-ids", ",".join(map(str, row))]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == [hf_greedy(hf, r, 12) for r in rows]


def test_run_text_prompt_uses_the_checkpoint_tokenizer(hf_checkpoints, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "with-tokenizer"
    shutil.copytree(hf_checkpoints["llama"][0], folder)
    vocab = {f"w{i}": i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    assert main(["run", "--model", str(folder), "--prompt", "w5 w17 w99", "--max-new-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = hf_greedy(hf_checkpoints["llama"][1], [5, 17, 99], 8)
    assert out["tokens"] == [expected]
    assert out["text"] == [tok.decode(expected)]


def test_sampling_defaults_come_from_generation_config_and_flags_override_them(hf_checkpoints, tmp_path, capsys):
    folder = tmp_path / "sampler"
    shutil.copytree(hf_checkpoints["llama"][0], folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 4, "top_p": 0.8}))

    def cli(*flags: str) -> list[int]:
        argv = ["run", "--model", str(folder), "--prompt-ids", "1,2,3", "--max-new-tokens", "12", "--do-sample"]
        assert main([*argv, "--seed", "5", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["tokens"][0]

    gen = staticrt.Generator(staticrt.load_model(folder), max_cache_len=15)
    stops = gen.backend.eos_token_ids

    def api(**sampling: float) -> list[int]:
        return gen.generate([[1, 2, 3]], 12, do_sample=True, seed=5, stop_token_ids=stops, **sampling)[0]

    assert cli() == api(temperature=0.3, top_k=4, top_p=0.8) != api()
    assert cli("--temperature", "1.5", "--top-k", "0") == api(temperature=1.5, top_k=0, top_p=0.8)


def test_chat_without_a_tokenizer_names_what_it_needs(capsys):
    assert main(["chat", "--model", "tiny-llama"]) == 2
    assert capsys.readouterr().err == (
        "staticrt chat: chat needs the checkpoint's tokenizer.json and chat template, and tiny-llama has no "
        "tokenizer.json; use a checkpoint folder (or an artifact exported from one) that has both\n"
    )


def test_run_reports_bad_input_with_exit_code_2(capsys):
    code = main(
        ["run", "--model", "tiny-llama", "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--max-cache-len", "5"]
    )
    assert code == 2
    assert "beyond max_cache_len=5" in capsys.readouterr().err


def test_demo_runs_every_backend_and_they_agree():
    proc = subprocess.run([sys.executable, "-m", "staticrt.cli", "demo"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # eager, compiled, exported-pt2, onnx; on a GPU also cudagraph and reduce-overhead, there
    backends = 6 if torch.cuda.is_available() else 4
    assert f"all {backends} backends agree token for token" in proc.stderr
    assert "exported-pt2" in proc.stderr


def test_run_sliding_cache_generates_past_max_cache_len_and_matches_transformers(hf_checkpoints, capsys):
    folder, hf = hf_checkpoints["mistral-sw16"]
    args = [
        "run",
        "--model",
        str(folder),
        "--cache",
        "sliding",
        "--prompt-ids",
        "5,17,99,3",
        "--max-new-tokens",
        "60",
        "--json",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cache"] == "sliding"  # max_cache_len defaulted to the window, 16: far below 64 positions
    assert out["tokens"] == [hf_greedy(hf, [5, 17, 99, 3], 60)]


def test_inspect_prints_each_layer_and_the_total_against_static(capsys):
    assert main(["inspect", "--model", "tiny-gemma2", "--cache", "hybrid", "--max-cache-len", "4096"]) == 0
    err = capsys.readouterr().err
    # tiny-gemma2: 2 KV heads of 16, layer 0 windowed (64 slots), layer 1 global; float32
    assert "tiny-gemma2: hybrid cache, batch 1, max_cache_len 4096, window 64" in err
    assert inspect_cells(err) == [
        ["0", "sliding_attention", "sliding", "device", "1x2x64x16", "16,384"],
        ["1", "full_attention", "static", "device", "1x2x4096x16", "1,048,576"],
    ]
    assert (
        "device bytes (K/V and lengths): 1,064,968; host bytes: 0; a static cache of the same length "
        "holds 2,097,160 on the device (50.8% of it)"
    ) in err


def inspect_cells(err: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("│")[1:-1]] for line in err.splitlines() if line.count("│") == 7]


def test_inspect_shows_offloaded_layers_on_the_host_and_two_working_buffers_on_the_device(capsys):
    assert main(["inspect", "--model", "bench-llama", "--cache", "offloaded", "--max-cache-len", "8192"]) == 0
    err = capsys.readouterr().err
    # bench-llama: 8 layers, 2 KV heads of 64, float32: 8 MiB of K and V a layer
    assert inspect_cells(err) == [
        [str(i), "full_attention", "offloaded", "host", "1x2x8192x64", "8,388,608"] for i in range(8)
    ]
    assert (
        "device bytes (K/V, working buffers and lengths): 16,777,224; host bytes: 67,108,864; a static "
        "cache of the same length holds 67,108,872 on the device (25.0% of it)"
    ) in err


def test_inspect_refuses_a_cache_the_model_cannot_use(capsys):
    assert main(["inspect", "--model", "tiny-llama", "--cache", "sliding"]) == 2
    assert (
        "no layer of this llama model attends through a sliding window; use cache='static'" in capsys.readouterr().err
    )


def test_export_suggests_what_the_artifact_can_run(tmp_path):
    """A chat model's artifact is chatted with, a tokenizer's takes text, a preset's takes ids."""
    from staticrt.cli.export import _next_command

    (tmp_path / "preset").mkdir()
    assert _next_command(tmp_path / "preset") == f"run it with: staticrt run {tmp_path / 'preset'} --prompt-ids 1,2,3"
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "tokenizer.json").write_text("{}")
    assert _next_command(tmp_path / "text") == f'run it with: staticrt run {tmp_path / "text"} --prompt "Hello"'
    (tmp_path / "text" / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert _next_command(tmp_path / "text") == f"chat with it: staticrt chat {tmp_path / 'text'}"


def test_the_serve_banner_lists_the_prefill_shapes_the_backend_has():
    """An ONNX graph takes any prompt width; listing its longest sequence as a bucket misled."""
    from argparse import Namespace
    from types import SimpleNamespace

    from staticrt.cli.serve import banner

    args = Namespace(served_model_name=None, artifact="artifacts/s", model=None, host="127.0.0.1", port=8000)
    onnx = SimpleNamespace(name="onnx", batch_size=8, max_cache_len=512, buckets=(512,))
    compiled = SimpleNamespace(name="compiled", batch_size=8, max_cache_len=512, buckets=(64, 256))
    tail = "Ctrl-C or SIGTERM drains and stops"
    assert banner(args, onnx) == (
        f"serving artifacts/s on http://127.0.0.1:8000/v1 (onnx, 8 rows of 512 positions, prompts of any length "
        f"up to 512); {tail}"
    )
    assert banner(args, compiled).endswith(f"(compiled, 8 rows of 512 positions, prefill buckets [64, 256]); {tail}")
