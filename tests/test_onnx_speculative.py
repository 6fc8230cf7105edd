"""Speculative decoding on an ONNX artifact: its one graph returns logits after every column of a
verify step (the optional `logits_index` input), so ONNX Runtime checks drafts as the torch
backends do. Greedy tokens against transformers' on the static, sliding and hybrid caches, with
prompt lookup (drafts rejected) and with the model as its own draft (every draft accepted);
sampled tokens against the eager backend's for a seed; what cannot verify refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest
import torch
from hf_models import hf_greedy

import staticrt
from staticrt.artifacts.manifest import seal, sha256
from staticrt.caches import CacheSpec
from staticrt.cli.main import main
from staticrt.errors import GenerationError
from staticrt.exporters import export_artifact
from staticrt.generation.draft_policy import DraftPolicy
from staticrt.generation.generator import load_artifact

# (checkpoint, cache), each exported with one row; rotating layers hold a window of 16 in 32 slots
CASES = [("llama", "static"), ("mistral-sw16", "sliding"), ("gemma2", "hybrid")]
NEW_TOKENS = 40


def prompt(seed: int = 1) -> list[int]:
    """Eight random tokens, twice over with a change: the second copy drafts from the first."""
    head = torch.randint(1, 256, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
    return head + [7, 7] + head[:5]


@pytest.fixture(scope="module")
def artifacts(hf_checkpoints, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("onnx-speculative")
    return {
        family: export_artifact(
            staticrt.load_model(hf_checkpoints[family][0]), CacheSpec(cache, 1, 128), [16], root / family, ["onnx"]
        )
        for family, cache in CASES
    }


def eager(hf_checkpoints, family: str, **options) -> staticrt.Generator:
    cache = dict(CASES)[family]
    return staticrt.Generator(staticrt.load_model(hf_checkpoints[family][0]), cache=cache, max_cache_len=128, **options)


@pytest.mark.parametrize("family,cache", CASES)
def test_an_onnx_artifact_verifies_drafts_and_keeps_transformers_greedy_tokens(
    artifacts, hf_checkpoints, family, cache
):
    gen = load_artifact(artifacts[family], backend="onnx")
    want = hf_greedy(hf_checkpoints[family][1], prompt(), NEW_TOKENS)
    assert gen.generate([prompt()], NEW_TOKENS, speculative="ngram:4")[0] == want
    stats = gen.last_stats
    assert stats.verify_steps > 0 and stats.drafted > stats.accepted  # a random model keeps few
    # the model as its own draft (an eager Generator over the checkpoint): every draft is kept
    own = staticrt.Speculation("model", 3, drafter=eager(hf_checkpoints, family))
    assert gen.generate([prompt(2)], NEW_TOKENS, speculative=own)[0] == hf_greedy(
        hf_checkpoints[family][1], prompt(2), NEW_TOKENS
    )
    stats = gen.last_stats
    assert stats.verify_steps > 0 and stats.accepted == stats.drafted > 2 * stats.verify_steps


@pytest.mark.parametrize("family,cache", CASES)
def test_a_conversation_keeps_its_prefix_between_turns_while_drafts_are_verified(
    artifacts, hf_checkpoints, family, cache
):
    """As `chat` runs it: each turn continues from what the row holds (rejected drafts' K/V past
    it), verifies drafts, and answers transformers' tokens for the whole conversation."""
    gen = load_artifact(artifacts[family], backend="onnx")
    chooser = torch.Generator().manual_seed(3)
    conversation = torch.randint(1, 256, (12,), generator=chooser).tolist()
    for turn in range(3):
        out = gen.generate([conversation], 16, speculative="ngram:4", reuse_prefix=True)[0]
        assert out == hf_greedy(hf_checkpoints[family][1], conversation, 16)
        assert gen.last_stats.verify_steps > 0 and (turn == 0 or gen.last_stats.kept[0] > len(conversation) // 2)
        conversation += out + torch.randint(1, 256, (5,), generator=chooser).tolist() + conversation[:6]


def test_onnx_speculative_sampling_draws_the_eager_backends_tokens_for_a_seed(artifacts, hf_checkpoints, monkeypatch):
    """The host's acceptance rule (host_sampling.verify) is the torch one's arithmetic, from the
    same uniforms: the same seed keeps and redraws the same tokens. The draft policy's clock is
    left out: which steps verify decides which uniforms draw what, and ONNX Runtime's steps and
    eager's take different times (a temperature of 0.3 keeps some drafts of a random tiny model)."""
    monkeypatch.setattr(DraftPolicy, "timed", lambda policy, seconds, tokens: policy.decode_s.append(seconds))
    gen = load_artifact(artifacts["llama"], backend="onnx")
    own = lambda: staticrt.Speculation("model", 3, drafter=eager(hf_checkpoints, "llama"))  # noqa: E731
    options = dict(do_sample=True, temperature=0.3, top_k=40, top_p=0.95, seed=1234)
    sampled = gen.generate([prompt()], NEW_TOKENS, speculative=own(), **options)[0]
    assert gen.last_stats.accepted > 0 and gen.last_stats.accepted < gen.last_stats.drafted  # kept and redrawn
    assert sampled == eager(hf_checkpoints, "llama").generate([prompt()], NEW_TOKENS, speculative=own(), **options)[0]
    assert sampled != gen.generate([prompt()], NEW_TOKENS, **options)[0]  # drafts change which uniform draws what


@pytest.mark.parametrize("flags", [["--speculative", "ngram:3"], ["--draft", "DRAFT:2"]])
def test_run_speculates_on_an_onnx_artifact_with_prompt_lookup_or_a_draft_model(
    artifacts, hf_checkpoints, flags, capsys
):
    """`staticrt run ARTIFACT` with either flag: the artifact's draft model (a checkpoint folder)
    runs on the eager backend, with the artifact's rows and positions."""
    flags = [flag.replace("DRAFT", str(hf_checkpoints["llama-linear-tied"][0])) for flag in flags]
    ids = ",".join(map(str, prompt()))
    command = ["run", str(artifacts["llama"]), "--backend", "onnx", "--prompt-ids", ids, "--max-new-tokens", "24"]
    assert main([*command, *flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"][0] == hf_greedy(hf_checkpoints["llama"][1], prompt(), 24)
    assert out["verify_steps"] > 0 and out["drafted"] > 0


def test_a_server_over_a_one_row_onnx_artifact_verifies_drafts(artifacts, hf_checkpoints):
    pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")
    import httpx
    from serving import client, running

    from staticrt.serve import serve_backend

    prompts = [prompt(1), prompt(2) + prompt(2), prompt(3)[:9]]
    app, _ = serve_backend(load_artifact(artifacts["gemma2"], backend="onnx").backend, name="m", speculative="ngram:4")
    with running(app) as url:
        api = client(url)
        for ids in prompts:
            reply = api.completions.create(model="m", prompt=ids, max_tokens=NEW_TOKENS, temperature=0)
            assert reply.choices[0].model_extra["token_ids"] == hf_greedy(hf_checkpoints["gemma2"][1], ids, NEW_TOKENS)
        drafted = next(
            line
            for line in httpx.get(f"{url}/metrics").text.splitlines()
            if line.startswith("staticrt_draft_tokens_total")
        )
    assert float(drafted.split()[-1]) > 0


def test_genai_and_a_plain_step_leave_logits_index_out_and_get_the_last_column(artifacts):
    """The input is optional: its default, an initializer, is [-1], so onnxruntime-genai (which
    knows neither it nor `indexed_logits`) lists the graph's inputs as before and reads `logits`,
    `[B, 1, V]`, the last column's (genai's own test is test_onnx.py's)."""
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(artifacts["llama"] / "onnx" / "model.onnx"), options)
    assert "logits_index" not in [value.name for value in session.get_inputs()]
    assert [value.name for value in session.get_overridable_initializers()] == ["logits_index"]
    feeds = {value.name: np.zeros([1, *value.shape[1:]], np.float32) for value in session.get_inputs()[3:]}
    ids = np.array([[5, 6, 7]], dtype=np.int64)
    feeds |= dict(input_ids=ids, attention_mask=np.ones_like(ids), position_ids=np.arange(3)[None])
    last, indexed = session.run(["logits", "indexed_logits"], feeds)
    every = session.run(["indexed_logits"], feeds | {"logits_index": np.array([-3, -2, -1])})[0]
    assert last.shape == indexed.shape == (1, 1, 256) and every.shape == (1, 3, 256)
    assert np.array_equal(indexed, last) and np.array_equal(every[:, -1:], last)


def test_what_an_onnx_artifact_cannot_verify_is_refused_by_name(artifacts, hf_checkpoints, tmp_path):
    two = export_artifact(
        staticrt.load_model(hf_checkpoints["llama"][0]), CacheSpec("static", 2, 64), [16], tmp_path / "two", ["onnx"]
    )
    with pytest.raises(GenerationError) as raised:
        load_artifact(two, backend="onnx").generate([prompt()], 8, speculative="ngram")
    assert str(raised.value) == (
        f"the onnx backend checks drafts in one row, and {two} holds 2: its graph writes a column of every row at "
        "once, so rows keeping different numbers of drafts would leave holes; re-export it with --batch-size 1 to "
        "speculate, or drop --speculative"
    )
    # a graph exported before the input: the last column's logits only; without speculation it still runs
    old = Path(shutil.copytree(artifacts["llama"], tmp_path / "old"))
    path = old / "onnx" / "model.onnx"
    graph = onnx.load(str(path), load_external_data=False)
    for values in (graph.graph.input, graph.graph.initializer):
        values.remove(next(value for value in values if value.name == "logits_index"))
    index = onnx.helper.make_node("Constant", [], ["logits_index"], value_ints=[-1])
    graph.graph.node.insert(0, index)
    onnx.save(graph, str(path))
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["onnx"]["inputs"] = [value for value in manifest["onnx"]["inputs"] if value["name"] != "logits_index"]
    manifest["files"]["onnx/model.onnx"] = sha256(path)
    (old / "manifest.json").write_text(json.dumps(seal(manifest)))
    gen = load_artifact(old, backend="onnx")
    assert gen.generate([prompt()], 8) == load_artifact(artifacts["llama"], backend="onnx").generate([prompt()], 8)
    with pytest.raises(GenerationError) as raised:
        gen.generate([prompt()], 8, speculative="ngram")
    assert str(raised.value) == (
        f"{old}'s graph returns the last column's logits only (exported by an earlier staticrt): re-export the "
        "artifact with `staticrt export` to speculate on it"
    )
