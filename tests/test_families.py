"""The families of 2025-26 (issue 63: Qwen3, Gemma 3, Phi-3/Phi-4-mini, SmolLM3, OLMo 2/3, Granite,
Ministral 3) on tiny random checkpoints transformers saved from each family's own config class
(tests/hf_models.py), loaded through staticrt's loader: greedy tokens equal transformers' on every
backend and on each cache kind the family's config allows.

Three prompts a batch (7, 40 and 3 tokens) and 40 new tokens: each row runs past position 32, where
the long-context rotaries change (yarn's and longrope's pretraining length, Ministral 3's query
scale), and Phi-3's longrope rows cross its switch (the short prompts, restarted from position 0
as transformers does) or start past it (the long one). The compiled graphs, the heavy part, are
built once a family; the backends whose point is the family, not the compile (the CUDA-graph
backend's host side, the torch.export programs), share nothing they do not need.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_models import NEW_FAMILIES, hf_greedy

import staticrt
from staticrt.backends.cudagraph import HostReplayBackend
from staticrt.caches import CacheSpec, build_cache
from staticrt.errors import CacheError, ConfigError, GenerationError
from staticrt.exporters import export_artifact
from staticrt.generation.generator import load_artifact

PROMPTS = [[5, 17, 99, 3, 200, 45, 8], list(range(10, 50)), [1, 2, 3]]
NEW_TOKENS = 40
OPTIONS = dict(max_batch_size=3, max_cache_len=160)
WINDOWED = {"gemma3_text": "hybrid", "olmo3": "hybrid"}  # a sliding layer, then a full one
CASES = [(f, c) for f in NEW_FAMILIES for c in ("static", "offloaded", *([WINDOWED[f]] if f in WINDOWED else []))]


@pytest.fixture
def expected(transformers_tokens):
    """family -> transformers' greedy tokens for PROMPTS, each prompt alone."""
    return lambda family: transformers_tokens(family, PROMPTS, NEW_TOKENS)


def cache_of(family: str) -> str:
    return WINDOWED.get(family, "static")


@pytest.mark.parametrize("family,cache", CASES)
def test_eager_tokens_equal_transformers_on_each_cache(hf_checkpoints, expected, family, cache):
    model = staticrt.load_model(hf_checkpoints[family][0])
    assert model.config.family == family
    gen = staticrt.Generator(model, cache=cache, **OPTIONS)
    assert gen.backend.cache.kind == cache
    assert gen.generate(PROMPTS, NEW_TOKENS) == expected(family)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_staticrt_run_answers_with_transformers_tokens(hf_checkpoints, expected, capsys, family):
    """What a new user tries first: `staticrt run --model DIR`, which refused these families."""
    import json

    from staticrt.cli.main import main

    ids = ",".join(map(str, PROMPTS[0]))
    command = ["run", "--model", str(hf_checkpoints[family][0]), "--prompt-ids", ids, "--json"]
    assert main([*command, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == expected(family)[:1]


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_logits_equal_transformers_over_a_prompt_past_the_long_context_switches(hf_checkpoints, family):
    """The logits themselves, which greedy tokens cannot check where a family scales them all
    (Granite's logits_scaling leaves every argmax as it was)."""
    folder, hf = hf_checkpoints[family]
    model = staticrt.load_model(folder)
    ids = torch.tensor([PROMPTS[1]])  # 40 tokens, past position 32
    cache = build_cache(model.config, CacheSpec(cache_of(family), 1, 64), torch.float32)
    with torch.no_grad():
        ours = model(ids, torch.tensor([0]), cache, last_only=False)[0]  # [T, V]
        theirs = hf(ids).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_compiled_and_replayed_graphs_give_transformers_tokens(hf_checkpoints, expected, family):
    """The compiled step graphs (never recompiled on a second generation), and the CUDA-graph
    backend's host side on the CPU (each graph replayed from its static buffers)."""
    model = staticrt.load_model(hf_checkpoints[family][0])
    compiled = staticrt.Generator(model, cache=cache_of(family), backend="compiled", prefill_buckets=[64], **OPTIONS)
    assert compiled.generate(PROMPTS, NEW_TOKENS) == expected(family)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert compiled.generate(PROMPTS[:1], NEW_TOKENS) == expected(family)[:1]
    replayed = staticrt.Generator(HostReplayBackend(model, cache=cache_of(family), prefill_buckets=[64], **OPTIONS))
    assert replayed.generate(PROMPTS, NEW_TOKENS) == expected(family)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_onnx_torch_export_and_aoti_artifacts_give_transformers_tokens(hf_checkpoints, expected, tmp_path, family):
    """The ONNX graph (norms and rotaries fused where they match the standard ops), run by
    staticrt's runner and by onnxruntime-genai, the torch.export programs, and the same programs
    compiled by AOTInductor (one export: the programs are traced once for both)."""
    model = staticrt.load_model(hf_checkpoints[family][0])
    folder = export_artifact(
        model, CacheSpec(cache_of(family), 3, 160), [64], tmp_path / family, ["pt2", "aoti", "onnx"]
    )
    for backend in ("onnx", "pt2", "aoti"):
        assert load_artifact(folder, backend).generate(PROMPTS, NEW_TOKENS) == expected(family), backend
    if family in WINDOWED or family == "phi3":
        # genai sizes a rotating layer its own way (tests/test_onnx.py runs the windows it takes), and
        # its loop does not compute a sequence again at LongRoPE's switch, so past it Phi-3's part
        return
    og = pytest.importorskip("onnxruntime_genai", reason="install onnxruntime-genai (--no-deps), as the README does")
    from genai_runner import genai_greedy

    genai = og.Model(str(folder))  # its generic decoder: the family's arithmetic is all in the graph
    for prompt, want in zip(PROMPTS, expected(family), strict=True):
        tokens = genai_greedy(og, genai, prompt, NEW_TOKENS)  # up to its eos: 0, these configs having none
        assert tokens == want[: len(tokens)] and (tokens == want or tokens[-1] == 0)


def test_longrope_restarts_a_row_from_position_0_at_its_switch_as_transformers_does(
    hf_checkpoints, expected, monkeypatch
):
    """Phi-3 in transformers computes a sequence again from position 0 once it passes
    original_max_position_embeddings (32 here): without the restart, the row that crosses keeps
    what it wrote with the short factors and its tokens part from transformers'."""
    model = staticrt.load_model(hf_checkpoints["phi3"][0])
    gen = staticrt.Generator(model, cache="static", **OPTIONS)
    assert gen.backend.rope_restart == 32
    gen.backend.rope_restart = None  # the mutant: the switch without the restart
    assert gen.generate(PROMPTS[:1], NEW_TOKENS) != expected("phi3")[:1]
    gen.backend.rope_restart = 32
    # The model as its own draft drafts every step (the policy's clock left out: it never pauses);
    # a verify step stops short of the switch (from this 8-token prompt one would cross it,
    # measured), and the row at it restarts.
    from staticrt.generation.draft_policy import DraftPolicy

    monkeypatch.setattr(DraftPolicy, "timed", lambda policy, seconds, tokens: policy.decode_s.append(seconds))
    own = staticrt.Speculation("model", 3, drafter=staticrt.Generator(model, cache="static", **OPTIONS))
    crossing = list(range(20, 28))
    assert gen.generate([crossing], NEW_TOKENS, speculative=own) == [hf_greedy(hf_checkpoints["phi3"][1], crossing, 40)]
    assert gen.last_stats.accepted == gen.last_stats.drafted >= 12
    with pytest.raises(GenerationError, match="beam search past position 32"):
        gen.generate(PROMPTS[:1], NEW_TOKENS, num_beams=2)
    narrow = staticrt.Generator(model, cache="static", prefill_buckets=[16], **OPTIONS)
    with pytest.raises(GenerationError, match=r"one step of 33 tokens, past the largest prefill bucket 16"):
        narrow.generate(PROMPTS[:1], NEW_TOKENS)
    assert narrow.generate(PROMPTS[:1], 20) == [expected("phi3")[0][:20]]  # within the switch: no restart


def test_a_kept_prefix_is_reused_only_on_its_own_side_of_the_longrope_switch(hf_checkpoints, expected):
    model = staticrt.load_model(hf_checkpoints["phi3"][0])
    gen = staticrt.Generator(model, cache="static", **OPTIONS)
    short = PROMPTS[0] + [9, 9, 9]  # 10 tokens: the row holds the short world
    gen.generate([short], 4)
    longer = short + list(range(60, 90))  # 40 tokens: past the switch, so computed again from 0
    assert gen.generate([longer], 8, reuse_prefix=True) == [hf_greedy(hf_checkpoints["phi3"][1], longer, 8)]
    assert gen.last_stats.kept == [0]
    assert gen.generate([longer + [5]], 8, reuse_prefix=True)[0] == hf_greedy(
        hf_checkpoints["phi3"][1], longer + [5], 8
    )
    assert gen.last_stats.kept[0] > 30  # both past it: the prefix is kept


@pytest.mark.parametrize("family", ["phi3", "smollm3", "ministral3"])
def test_the_sink_cache_refuses_a_model_whose_layers_rotate_otherwise(hf_checkpoints, family):
    model = staticrt.load_model(hf_checkpoints[family][0])
    with pytest.raises(CacheError, match="the sink cache rotates queries back by one rotary embedding"):
        staticrt.Generator(model, cache="sink", max_cache_len=64)


def test_an_unknown_family_is_refused_by_name_with_what_runs(tmp_path):
    from staticrt.loading.hf_config import config_from_hf

    with pytest.raises(ConfigError) as refused:
        config_from_hf({"model_type": "qwen2_moe"}, "config.json")
    assert str(refused.value) == (
        "config.json: model_type 'qwen2_moe' is not supported; staticrt runs llama, mistral, qwen2, gemma2, "
        "qwen3, gemma3_text, phi3, smollm3, olmo2, olmo3, granite, ministral3, mixtral, qwen3_moe, olmoe, gpt_oss, "
        "lfm2, mamba2, granitemoehybrid, falcon_h1, qwen3_5_text, gemma3, mistral3, qwen3_5 checkpoints"
    )
    with pytest.raises(ConfigError, match="use_bidirectional_attention is set: this is an encoder"):
        config_from_hf({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "config.json")


# Each family whose GGUF transformers reads, as its reader takes it: what it leaves to the config
# class's defaults (Qwen3's head_dim 128, Gemma 3's query_pre_attn_scalar, local base and 5:1
# layers, Phi-3's full rotary, Qwen3-MoE's expert width 768 and its experts on every layer, a
# Mixtral's window, which llama.cpp's Llama lacks) set to those defaults.
GGUF_CASES = {
    "qwen3": dict(head_dim=128),
    "gemma3_text": dict(
        num_hidden_layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        query_pre_attn_scalar=256,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    ),
    "phi3": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}),
    "qwen3_moe": dict(head_dim=128, mlp_only_layers=[], moe_intermediate_size=768),  # its experts 3-D, as llama.cpp's
    "lfm2": {},  # its conv layers marked by 0 K/V heads, the conv weights [C, K]
    "mixtral": dict(sliding_window=None),  # a "llama" GGUF with experts, which transformers reads without them
}


@pytest.mark.parametrize("family", GGUF_CASES)
def test_a_gguf_converts_and_runs_the_tokens_of_the_folder_it_was_written_from(tmp_path, family):
    """llama.cpp's layout for the family (bench/gguf_write.py: Qwen3's and Gemma 3's q/k norms,
    Gemma's norms as 1 + w, Phi-3's fused q/k/v and gate/up) read back through transformers' GGUF
    reader by `--model FILE.gguf`."""
    pytest.importorskip("gguf", reason="GGUF needs the gguf extra: use the README's test command")
    from hf_models import save_hf_model

    from staticrt.bench.gguf_write import write_gguf

    save_hf_model(family, tmp_path / family, **GGUF_CASES[family])
    model = staticrt.load_model(tmp_path / family)
    from_gguf = staticrt.load_model(write_gguf(model, tmp_path / f"{family}.F32.gguf", "F32"))
    # the same model but for the ids the GGUF's placeholder vocabulary names, and eps stored as float32
    same = {
        name: getattr(model.config, name) for name in ("rms_norm_eps", "bos_token_id", "pad_token_id", "eos_token_ids")
    }
    assert dataclasses.replace(from_gguf.config, **same) == model.config
    assert from_gguf.config.rms_norm_eps == pytest.approx(model.config.rms_norm_eps)
    options = dict(max_batch_size=3, max_cache_len=96)
    ours = staticrt.Generator(from_gguf, **options).generate(PROMPTS, 24)
    assert ours == staticrt.Generator(model, **options).generate(PROMPTS, 24)


def test_a_gguf_of_an_architecture_transformers_does_not_read_is_refused_by_name(tmp_path):
    pytest.importorskip("gguf", reason="GGUF needs the gguf extra: use the README's test command")
    from gguf_files import stub_gguf

    from staticrt.errors import CheckpointError

    with pytest.raises(CheckpointError) as refused:
        staticrt.load_model(stub_gguf(tmp_path / "olmo.gguf", "olmo2"))
    assert str(refused.value) == (
        "olmo.gguf holds a 'olmo2' model; staticrt convert reads GGUF through transformers, whose reader gives "
        "staticrt the architectures llama, mistral, qwen2, gemma2, qwen3, gemma3, phi3, qwen3moe, lfm2: convert the "
        "model's safetensors checkpoint folder instead (staticrt run --model FOLDER)"
    )


QWEN3_TEMPLATE = (  # the end of Qwen3's template: its thinking switch on the generation prompt
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them(tmp_path, capsys):
    """Qwen3's `enable_thinking`, from the Python API, `staticrt run --chat-template-kwargs` and a
    request's `chat_template_kwargs`: the text transformers renders with the same variables."""
    import transformers

    from staticrt.bench.serve_bench import checkpoint_folder
    from staticrt.cli.main import main
    from staticrt.serve.protocol import BadRequest, chat_prompt

    folder = checkpoint_folder("tiny-llama", tmp_path)
    (folder / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    ours, theirs = staticrt.load_model(folder).tokenizer, transformers.AutoTokenizer.from_pretrained(folder)
    turn = [{"role": "user", "content": "t5 t6"}]
    for extra in ({"enable_thinking": False}, {"enable_thinking": True}, None):
        text = ours.apply_chat_template(turn, tokenize=False, template_kwargs=extra)
        assert text == theirs.apply_chat_template(turn, tokenize=False, add_generation_prompt=True, **(extra or {}))
    assert "<think>" in ours.apply_chat_template(turn, tokenize=False, template_kwargs={"enable_thinking": False})
    body = {"messages": turn, "chat_template_kwargs": {"enable_thinking": False}}
    assert chat_prompt(body, ours) == (ours.apply_chat_template(turn, template_kwargs={"enable_thinking": False}), None)
    with pytest.raises(BadRequest, match="chat_template_kwargs sets messages, which the conversation itself gives"):
        chat_prompt({**body, "chat_template_kwargs": {"messages": []}}, ours)
    command = ["run", "--model", str(folder), "--chat", "t5 t6", "--max-new-tokens", "2", "--json"]
    assert main([*command, "--chat-template-kwargs", '{"enable_thinking": false}']) == 0
    with pytest.raises(SystemExit):
        main([*command, "--chat-template-kwargs", "[1]"])
    assert "is not a JSON object; write one like" in capsys.readouterr().err
