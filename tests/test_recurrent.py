"""Recurrent state beside the KV cache (issue 65), LFM2 first: its gated short convolutions keep their
last inputs in a rotating buffer of the cache (caches/conv_state.py) beside the attention layer's
K/V, on a tiny checkpoint transformers saved from its own `Lfm2Config` (conv, attention, conv; its
logits test covers tests/test_mamba.py's Mamba2 checkpoints too). Tokens and logits equal
transformers' on eager, compiled, cudagraph's host side, pt2, AOTInductor and ONNX, batch 4 and 1,
prompts past the conv buffer's 64 slots, 200 new tokens; a prompt prefilled in two steps, a
conversation continued from its row (eager and ONNX) and rejected drafts read the conv layers'
history from the cache; the buffer holds what transformers' conv state holds.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import RECURRENT_FAMILIES, hf_greedy

import staticrt
from staticrt.backends.cudagraph import HostReplayBackend
from staticrt.caches import CacheSpec, build_cache
from staticrt.errors import CacheError
from staticrt.exporters import export_artifact
from staticrt.generation.generator import load_artifact
from staticrt.generation.prefix import continues

PROMPTS = [[5, 17, 99, 3, 200, 45, 8], list(range(10, 80)), [1, 2, 3], list(range(100, 120))]
NEW_TOKENS = 200
OPTIONS = dict(max_cache_len=288, prefill_buckets=(16, 128))


@pytest.fixture(scope="module")
def expected(transformers_tokens):
    return transformers_tokens("lfm2", PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def model(hf_checkpoints):
    loaded = staticrt.load_model(hf_checkpoints["lfm2"][0])
    assert loaded.config.layer_types == ("conv", "full_attention", "conv")
    assert loaded.config.intermediate_size == 128 and loaded.config.conv_kernel == 3
    return loaded


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_logits_equal_transformers_in_one_step_continued_and_a_token_at_a_time(hf_checkpoints, family):
    """70 tokens in one step (Mamba2: five chunks of its scan); the same in two steps (the second
    reads the conv layers' last inputs, and a Mamba2 layer's state, from the cache); and after 29,
    one decode step a token (Mamba2: the recurrence), on LFM2, Mamba2 and Granite 4.0-H."""
    model, hf = staticrt.load_model(hf_checkpoints[family][0]), hf_checkpoints[family][1]
    ids = torch.tensor([PROMPTS[1]])  # 70 tokens
    cache = build_cache(model.config, CacheSpec("static", 1, 96), torch.float32)
    with torch.no_grad():
        theirs = hf(ids).logits[0]
        whole = model(ids, torch.tensor([0]), cache, last_only=False)[0]
        model(ids[:, :29], torch.tensor([0]), cache, last_only=False)
        rest = model(ids[:, 29:], torch.tensor([29]), cache, last_only=False)[0]
        model(ids[:, :29], torch.tensor([0]), cache)
        steps = [model(ids[:, t : t + 1], torch.tensor([t]), cache) for t in range(29, 70)]
    torch.testing.assert_close(whole, theirs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rest, theirs[29:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(steps), theirs[29:], rtol=1e-4, atol=1e-4)


# family -> (a recurrent layer, its state's part, a prompt over several chunks, tolerance): Mamba2's
# chunks are 16 positions, DeltaNet's 64 (its triangular solve rounds further from transformers').
# The layer is transformers'; ours is its first cache layer (Falcon-H1's layer 1: cache layers 2, 3).
STATES = {
    "granitemoehybrid": (2, "ssm", list(range(10, 80)), 1e-5),
    "falcon_h1": (1, "ssm", list(range(10, 80)), 1e-5),
    "qwen3_5_text": (1, "state", list(range(10, 80)) + list(range(3, 90)), 1e-4),
}


@pytest.mark.parametrize("family", STATES)
def test_the_state_is_transformers_and_a_row_that_sits_a_step_out_keeps_it(hf_checkpoints, family):
    """Row 0 prefills a prompt over several chunks, row 1 three tokens right-padded to its length:
    each state is transformers' after its own prompt (padding gets dt 0, or beta and g 0). Then a
    step where row 1 feeds nothing (num_new 0, a server's idle row) leaves its state and conv
    inputs bit for bit as they were."""
    theirs_layer, part, prompt, tolerance = STATES[family]
    model, hf = staticrt.load_model(hf_checkpoints[family][0]), hf_checkpoints[family][1]
    layer = model.config.cache_layers(theirs_layer)[0]
    cache = build_cache(model.config, CacheSpec("static", 2, 256), torch.float32)
    ids = torch.tensor([prompt, [1, 2, 3] + [0] * (len(prompt) - 3)])
    with torch.no_grad():
        states = [hf(torch.tensor([p]), use_cache=True).past_key_values for p in (prompt, [1, 2, 3])]
        model(ids, torch.tensor([0, 0]), cache, num_new=torch.tensor([len(prompt), 3]))
        assert cache.layer_layout(layer) == model.config.layer_types[layer]
        for row, past in enumerate(states):
            theirs = past.get_recurrent_state(theirs_layer, 0)[0]
            torch.testing.assert_close(
                getattr(cache, f"{part}_{layer}")[row], theirs, rtol=tolerance, atol=tolerance / 10
            )
        held = [buf[1].clone() for buf in cache.step_buffers(layer)]
        model(torch.tensor([[7] * 4, [9] * 4]), torch.tensor([len(prompt), 3]), cache, num_new=torch.tensor([4, 0]))
    assert all(torch.equal(buf[1], kept) for buf, kept in zip(cache.step_buffers(layer), held, strict=True))


def test_the_conv_buffer_holds_the_inputs_transformers_conv_state_holds(hf_checkpoints, model):
    """Row 0 prefills 70 tokens; row 1 three, right-padded to 70, whose padding writes nothing."""
    hf = hf_checkpoints["lfm2"][1]
    ids = torch.tensor([PROMPTS[1], PROMPTS[2] + [0] * 67])
    cache = build_cache(model.config, CacheSpec("static", 2, 96), torch.float32)
    with torch.no_grad():
        # transformers' conv state: each row's last K = 3 inputs `[C, K]`
        states = [hf(torch.tensor([p]), use_cache=True).past_key_values.get_conv_state(0, 0)[0] for p in PROMPTS[1:3]]
        model(ids, torch.tensor([0, 0]), cache, num_new=torch.tensor([70, 3]))
    assert cache.conv_0.shape == (2, 1, 64, 64) and cache.layer_layout(0) == "conv"
    torch.testing.assert_close(cache.conv_0[0, 0, [67 % 64, 68 % 64, 69 % 64]], states[0].T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cache.conv_0[1, 0, :3], states[1].T, rtol=1e-5, atol=1e-6)
    assert not cache.conv_0[1, 0, 3:].any()


def test_eager_tokens_equal_transformers_batch_four_and_one(model, expected):
    gen = staticrt.Generator(model, max_batch_size=4, **OPTIONS)
    assert gen.generate(PROMPTS, NEW_TOKENS) == expected
    alone = staticrt.Generator(model, max_batch_size=1, **OPTIONS)
    assert alone.generate([PROMPTS[1]], NEW_TOKENS) == [expected[1]]


def test_compiled_and_replayed_graphs_give_transformers_tokens(model, expected):
    """The compiled step graphs, and the CUDA-graph backend's host side replayed on the CPU (its
    captures write the conv buffers at their fixed addresses, as they write K/V)."""
    gen = staticrt.Generator(model, max_batch_size=4, backend="compiled", **OPTIONS)
    assert gen.generate(PROMPTS, NEW_TOKENS) == expected
    replayed = staticrt.Generator(HostReplayBackend(model, max_batch_size=4, **OPTIONS))
    assert replayed.generate(PROMPTS, NEW_TOKENS) == expected


def test_a_conversation_continues_from_its_row_with_transformers_tokens(hf_checkpoints, model):
    """Each turn is the whole conversation; the row keeps all but the last answer token, whose
    position the conv buffer still reaches (64 slots, 3 read)."""
    hf = hf_checkpoints["lfm2"][1]
    gen = staticrt.Generator(model, max_batch_size=1, **OPTIONS)
    conversation, kept = list(PROMPTS[0]), []
    for user in ([7, 8, 9, 10], list(range(30, 50))):
        answer = gen.generate([conversation], 12, reuse_prefix=True)[0]
        assert answer == hf_greedy(hf, conversation, 12)
        kept.append(gen.last_stats.kept[0])
        conversation += answer + user
    assert gen.generate([conversation], 12, reuse_prefix=True)[0] == hf_greedy(hf, conversation, 12)
    assert gen.last_stats.kept[0] == len(conversation) - 20 - 1  # all but the user turn and the last answer token
    assert kept[1] == len(PROMPTS[0]) + 12 - 1
    # a new prompt in the row the conversation filled (the logits test reads stale slots below 0)
    assert gen.generate([[42]], 12)[0] == hf_greedy(hf, [42], 12)


def test_a_conv_layer_continues_only_where_its_buffer_still_holds_the_inputs():
    """prefix.py's rule with a conv layer's (64 slots, window 3): a row that wrote up to 100 goes
    back to 39 at most (100 - 39 = 61 = 64 - 3)."""
    conv = ((64, 3),)
    assert continues(100, 39, conv) and not continues(100, 38, conv)
    assert continues(50, 0, conv)  # never wrapped


@pytest.mark.parametrize("kind", ["offloaded", "sink", "static-int8"])
def test_caches_that_cannot_hold_conv_layers_are_refused_by_name(model, kind):
    with pytest.raises(CacheError) as raised:
        build_cache(model.config, CacheSpec(kind, 1, 64), torch.float32)
    assert str(raised.value) == (
        f"cache {kind!r} cannot hold this lfm2 model's conv layers (their state is kept in float on the "
        "device); use cache='static'"  # the window kinds too, for a model with sliding layers
    )


def test_the_artifacts_run_the_conv_layers_with_transformers_tokens(model, expected, tmp_path):
    """torch.export's program (and AOTInductor's library of it) holds the conv buffers as it holds
    K/V; the ONNX graph takes them as past/present inputs by position, its rows left-padded
    (onnx_step.py's GraphConvView), and has no genai_config.json (genai feeds no conv state)."""
    folder = export_artifact(model, CacheSpec("static", 4, 288), [128], tmp_path / "torch", ["pt2", "aoti"])
    for backend in ("pt2", "aoti"):
        assert load_artifact(folder, backend).generate(PROMPTS, NEW_TOKENS) == expected, backend
    folder = export_artifact(model, CacheSpec("static", 4, 288), [128], tmp_path / "onnx", ["onnx"])
    assert load_artifact(folder, "onnx").generate(PROMPTS, NEW_TOKENS) == expected
    assert not (folder / "genai_config.json").exists()


def test_an_onnx_row_continues_its_conversation_and_verifies_drafts(hf_checkpoints, model, tmp_path):
    """A batch-1 ONNX row keeps the conversation's tokens and prefills the turn, and a verify step
    whose drafts are rejected leaves the conv buffer where it continues exactly."""
    hf = hf_checkpoints["lfm2"][1]
    folder = export_artifact(model, CacheSpec("static", 1, 160), [64], tmp_path / "onnx", ["onnx"])
    gen = load_artifact(folder, "onnx")
    conversation = list(PROMPTS[0])
    for user in ([7, 8, 9, 10], list(range(30, 50))):
        assert gen.generate([conversation], 12, reuse_prefix=True)[0] == hf_greedy(hf, conversation, 12)
        conversation += hf_greedy(hf, conversation, 12) + user
    assert gen.generate([conversation], 12, reuse_prefix=True)[0] == hf_greedy(hf, conversation, 12)
    assert gen.last_stats.kept[0] == len(conversation) - 20 - 1
    repeats = PROMPTS[0] * 3
    assert gen.generate([repeats], 40, speculative="ngram:4")[0] == hf_greedy(hf, repeats, 40)
    assert gen.last_stats.verify_steps > 0 and gen.last_stats.drafted > gen.last_stats.accepted


def test_lfm2s_checkpoint_names_go_back_to_what_transformers_loads(hf_checkpoints, model):
    """The bench's transformers contender loads the decoder's weights under LFM2's names."""
    from staticrt.loading.checkpoint_layouts import lfm2_names

    theirs = {k.removeprefix("model."): v for k, v in hf_checkpoints["lfm2"][1].state_dict().items()}
    ours = lfm2_names(model.state_dict())
    assert sorted(ours) == sorted(k for k in theirs if k != "lm_head.weight")
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
