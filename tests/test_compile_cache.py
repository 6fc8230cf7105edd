"""The compile cache (backends/graph_store.py): a compiled CPU graph stored once and loaded by every
later backend and process instead of compiled; a corrupt, mismatched or stale entry compiled again,
never run; two processes filling one entry at once; `staticrt cache list|clear`.

The model is a transformers Llama of hidden 256 (saved with save_pretrained, the oracle's tokens):
the smallest size the store serves (`PACK_MIN_HIDDEN`), with a decode graph over packed weights."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_models import hf_greedy, save_hf_model

import staticrt
from staticrt import GenerationError
from staticrt.backends.step import VERIFY
from staticrt.bench.probes import weight_bytes_per_step
from staticrt.models import a8_kernels
from staticrt.models.packed_linear import PACK_MIN_HIDDEN, PackedLinear, PackedLookup, address, packing_available

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]]
NEW = 12


@pytest.fixture(scope="module")
def llama_256(tmp_path_factory):
    pytest.importorskip("transformers", reason="transformers is the oracle; install the test extra")
    folder = tmp_path_factory.mktemp("llama-256")
    hf = save_hf_model("llama", folder, hidden_size=PACK_MIN_HIDDEN, intermediate_size=512)
    return folder, [hf_greedy(hf, p, NEW) for p in PROMPTS]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def compiled_run(model: staticrt.Generator, new: int = NEW) -> tuple[list[list[int]], list[str]]:
    """A new compiled backend's `new` tokens for PROMPTS (1: the prefill graph alone), and what the
    staticrt log said meanwhile."""
    gen = staticrt.Generator(model, max_batch_size=2, max_cache_len=64, backend="compiled", prefill_buckets=[16])
    logger, lines = logging.getLogger("staticrt"), _Lines()
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        return gen.generate(PROMPTS, new), lines.lines
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)


def entries(kind: str = "graphs") -> list[Path]:
    return sorted((Path(os.environ["STATICRT_CACHE"]) / kind).iterdir())


@pytest.fixture(scope="module")
def stored(llama_256, new_user_cache):
    """`compiled_run`'s graphs compiled once for the module, with what the log said: each test
    starts from a copy (`from_stored`) rather than compiling them again."""
    root = new_user_cache("stored")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STATICRT_CACHE", str(root))
        tokens, said = compiled_run(staticrt.load_model(llama_256[0]))
    return root / "graphs", tokens, said


def graph_entries(kept: list[Path]) -> dict[tuple, Path]:
    """Each stored entry by the graph it holds: (tokens a row, choice, starts fresh)."""
    return {tuple(json.loads((e / "entry.json").read_text())["fields"]["graph"]): e for e in kept}


def from_stored(stored) -> list[Path]:
    shutil.copytree(stored[0], Path(os.environ["STATICRT_CACHE"]) / "graphs")
    return entries()


def test_a_new_backend_loads_the_stored_graphs_and_gives_transformers_tokens(llama_256, stored):
    folder, expected = llama_256
    _, tokens, said = stored
    assert tokens == expected
    assert [line.split(" in ")[0] for line in said if line.startswith("compiled the")] == [
        "compiled the prefill16 step graph",
        "compiled the decode step graph",
    ]
    kept = from_stored(stored)
    model = staticrt.load_model(folder)
    assert len(kept) == 2 and all((e / "step.so").is_file() and (e / "entry.json").is_file() for e in kept)
    # no library holds weights (one that did would be copied into memory at load: the weights
    # twice): both read the packed twin's
    prefill, decode = graph_entries(kept)[(16, "pick", True)], graph_entries(kept)[(1, "pick", False)]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all((e / "step.so").stat().st_size < weights / 2 for e in kept)

    tokens, said = compiled_run(model)
    assert tokens == expected
    assert [re.sub(r"about (\d+ min )?\d+ s left", "about N s left", line.split(" in ")[0]) for line in said] == [
        "loading the prefill16 step graph, 1 of 2 (first use; later generations reuse it) ...",
        f"loaded from the compile cache, {prefill}, the prefill16 step graph",
        "loading the decode step graph, 2 of 2 (first use; later generations reuse it; about N s left) ...",
        f"loaded from the compile cache, {decode}, the decode step graph",
    ]
    assert entries() == kept  # nothing new written


def test_every_packed_graph_reads_one_packed_copy_of_the_weights(llama_256):
    """The decode, verify and prefill graphs trace over one packed twin of the model (packed_linear.py):
    its linear layers read oneDNN's packed copies, everything else is the model's own tensors;
    weights replaced since make a new twin of the new ones."""
    model = staticrt.load_model(llama_256[0])
    backend = staticrt.Generator(model, max_batch_size=1, max_cache_len=64, backend="compiled").backend
    keys = ((1, "pick", False), (5, VERIFY, False), (16, "pick", True))
    decode, verify, prefill = (backend._stored_graph(key).model for key in keys)
    assert decode is verify is prefill is not model
    packed = decode.layers[0].mlp.down_proj.weight
    assert packed.is_mkldnn and torch.equal(packed.to_dense(), model.layers[0].mlp.down_proj.weight)
    assert decode.embed_tokens.weight is model.embed_tokens.weight and decode.norm is not model.norm
    assert decode.norm.weight is model.norm.weight and not model.layers[0].mlp.down_proj.weight.is_mkldnn

    layer = model.layers[0].mlp.down_proj
    layer.weight = torch.nn.Parameter(layer.weight.detach() * -1, requires_grad=False)
    again = backend._stored_graph(keys[0]).model
    assert again is not decode and torch.equal(again.layers[0].mlp.down_proj.weight.to_dense(), layer.weight)


@pytest.mark.parametrize("store", ["on", "off"])
def test_a_model_packed_in_place_holds_its_weights_once_and_gives_transformers_tokens(llama_256, store, monkeypatch):
    """`load_model(packed=True)` (what a compiled CLI process loads): every linear layer, and the
    tied head, read packed copies and no float matrix is left; the model is its own twin, and
    compiled graphs stored or compiled in the process (every one frozen, holding its tensors) and
    the eager backend give transformers' tokens."""
    monkeypatch.setenv("STATICRT_COMPILE_CACHE", store)
    folder, expected = llama_256
    model = staticrt.load_model(folder, packed=True)
    assert model.packed and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.layers[0].self_attn.qkv_proj.weight.is_mkldnn and model.lm_head.weight.is_mkldnn
    assert not model.embed_tokens.weight.is_mkldnn  # the lookup table stays
    tokens, said = compiled_run(model)
    assert tokens == expected
    assert staticrt.Generator(model, max_batch_size=2, max_cache_len=64).generate(PROMPTS, NEW) == expected
    if store == "on":
        assert compiled_run(model)[1][-1].startswith("loaded from the compile cache")
        assert compiled_run(model)[0] == expected
        backend = staticrt.Generator(model, max_batch_size=1, max_cache_len=64, backend="compiled").backend
        assert backend._stored_graph((1, "pick", False)).model is model


def test_a_tied_model_packed_in_place_holds_its_table_once_packed_and_looks_rows_up_in_it(tmp_path):
    """Packed in place, a tied model's head reads a packed copy of the table and its lookup reads
    the rows out of that copy: no other tensor of the table's size is held; compiled and eager
    give transformers' tokens, and the bench counts the table's bytes once, as unpacked."""
    pytest.importorskip("transformers", reason="transformers is the oracle; install the test extra")
    hf = save_hf_model("llama", tmp_path, hidden_size=PACK_MIN_HIDDEN, intermediate_size=512, tie_word_embeddings=True)
    expected = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    model = staticrt.load_model(tmp_path, packed=True)
    head, size = model.lm_head.weight, hf.model.embed_tokens.weight.numel()
    assert model.packed and head.is_mkldnn and isinstance(model.embed_tokens, PackedLookup)
    assert model.embed_tokens.flat.data_ptr() == address(head)  # the lookup reads the head's copy
    tensors = [*model.parameters(), *model.buffers()]
    packed = {address(t) for t in tensors if t.is_mkldnn}  # a dense view of a packed copy (a lookup, blocks) is no copy
    assert [t.shape for t in tensors if not t.is_mkldnn and t.numel() >= size and address(t) not in packed] == []
    assert weight_bytes_per_step(model, 1) == weight_bytes_per_step(staticrt.load_model(tmp_path), 1)
    assert compiled_run(model)[0] == expected
    assert staticrt.Generator(model, max_batch_size=2, max_cache_len=64).generate(PROMPTS, NEW) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_lookup_gives_every_row_exactly_or_is_refused(dtype):
    """`PackedLookup.of` finds oneDNN's layout (a vocabulary that is not a whole number of blocks,
    a width that is padded) and gives each row bit for bit; a packed copy of another table is
    refused, and `pack` keeps the table then."""
    if not packing_available(dtype):
        pytest.skip(f"this CPU's oneDNN does not compute {dtype} (packing_available)")
    table = torch.randn(1000, 100).to(dtype)  # 1000 = 15 blocks of 64 + 40; 100 padded
    lookup = PackedLookup.of(PackedLinear(table, None, None).weight, table)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert lookup is not None and torch.equal(lookup(torch.arange(1000)).view(bits), table.view(bits))
    other = PackedLinear(table.roll(1, dims=0), None, None).weight
    assert PackedLookup.of(other, table) is None


def test_a_corrupt_or_mismatched_entry_is_compiled_again_with_a_warning(llama_256, stored):
    folder, expected = llama_256
    decode = graph_entries(from_stored(stored))[(1, "pick", False)]
    library = decode / "step.so"
    with open(library, "r+b") as f:  # one byte flipped in the library, the size kept
        f.seek(library.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    model = staticrt.load_model(folder)
    tokens, said = compiled_run(model)
    assert tokens == expected
    assert (
        f"the stored graph in {decode} is unusable (step.so does not check to what entry.json records); "
        "compiling it again"
    ) in said
    assert said[-1].startswith("compiled the decode step graph")

    entry = json.loads((decode / "entry.json").read_text())
    entry["fields"]["torch"] = "0.0.0"  # an entry written for another torch, in this key's folder
    (decode / "entry.json").write_text(json.dumps(entry))
    tokens, said = compiled_run(model)
    assert tokens == expected
    assert (
        f"the stored graph in {decode} is unusable (its entry.json records other fields than this graph's); "
        "compiling it again"
    ) in said
    assert compiled_run(model)[1][-1].startswith("loaded from the compile cache")  # whole again


def test_changed_weights_miss_the_cache(llama_256, stored):
    """The prefill graph alone (one new token) shows it: the key holds the weights' bytes."""
    folder, expected = llama_256
    kept = from_stored(stored)
    model = staticrt.load_model(folder)
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.mul_(-1)
    eager = staticrt.Generator(model, max_batch_size=2, max_cache_len=64).generate(PROMPTS, 1)
    assert eager != [row[:1] for row in expected]  # the change shows in the first tokens
    tokens, said = compiled_run(model, 1)
    assert tokens == eager
    assert [line.split(",")[0] for line in said if line.endswith("...")] == ["compiling the prefill16 step graph"]
    assert len(entries()) == len(kept) + 1


def cli(*argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "staticrt.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_two_processes_fill_one_entry_at_once_and_a_third_loads_it(llama_256, tmp_path):
    """Two cold `run`s at once each compile and store the same graphs (each rename puts a whole
    folder in place); a third process loads them, compiles nothing, and gives the same tokens."""
    folder, expected = llama_256
    run = ["run", "--model", str(folder), "--backend", "compiled", "--max-new-tokens", str(NEW), "--json"]
    run += ["--prompt-ids", ",".join(map(str, PROMPTS[1])), "--threads", "1"]
    together = [cli(*run), cli(*run)]
    said = [p.communicate(timeout=600) for p in together]
    for process, (out, err) in zip(together, said):
        assert process.returncode == 0, err
        assert json.loads(out)["tokens"] == [expected[1]]
        assert "compiling the decode step graph" in err
    assert len(entries()) == 2 and not [p for p in entries()[0].parent.iterdir() if p.name.startswith(".")]
    third = cli(*run)
    out, err = third.communicate(timeout=600)
    assert json.loads(out)["tokens"] == [expected[1]]
    assert "compiling" not in err and err.count("loaded from the compile cache") == 2

    listing = cli("cache", "list", "--format", "csv")
    out, _ = listing.communicate(timeout=60)
    rows = out.strip().splitlines()
    assert rows[0] == "kind,entry,MB,days unused,holds" and len(rows) == 3
    assert any("decode (pick) of a 2-layer llama of hidden 256, static cache 1x256, 1 threads" in r for r in rows)
    foreign = entries()[0].parent / "notes.txt"  # something of the user's beside the entries
    foreign.write_text("mine")
    out, err = cli("cache", "clear", "--kind", "graphs").communicate(timeout=60)
    assert err.startswith("removed 2 entries (")
    assert entries() == [foreign]


def test_a_weight_replaced_after_loading_is_read_by_the_stored_graph_that_runs_next(llama_256, stored):
    """A stored graph points at the model's tensors; a weight replaced by a new tensor between
    generations (where dynamo's guards would recompile) makes the graph load again for the new one,
    never read the old tensor's memory. The frozen decode graph refuses the change by name."""
    folder, _ = llama_256
    from_stored(stored)
    model = staticrt.load_model(folder)
    gen = staticrt.Generator(model, max_batch_size=2, max_cache_len=64, backend="compiled", prefill_buckets=[16])
    before = gen.generate(PROMPTS, 1)  # the prefill graph alone
    layer = model.layers[0].mlp.down_proj
    layer.weight = torch.nn.Parameter(layer.weight.detach() * -1, requires_grad=False)
    eager = staticrt.Generator(model, max_batch_size=2, max_cache_len=64).generate(PROMPTS, 1)
    assert eager != before  # the change shows in the first tokens
    assert gen.generate(PROMPTS, 1) == eager
    # the decode graph, first built now, packs the new weights; once built, a replacement is refused
    assert gen.generate(PROMPTS, 4) == staticrt.Generator(model, max_batch_size=2, max_cache_len=64).generate(
        PROMPTS, 4
    )
    layer.weight = torch.nn.Parameter(layer.weight.detach() * -1, requires_grad=False)
    with pytest.raises(GenerationError, match="weights changed in place after its decode graph froze them"):
        gen.generate(PROMPTS, 4)


@pytest.mark.skipif(a8_kernels.unavailable() is not None, reason="int8-a8 needs AVX512-VNNI or AVX2 (test_a8_kernels)")
def test_graphs_calling_staticrts_kernels_are_stored_with_their_calls_and_loaded(llama_256):
    """An int8-a8 (or int4-a8: the same path) model's graphs call the kernels by name: the entry
    keeps the calls beside the library (step.json), and a new backend loads both and gives eager's
    tokens."""
    quantize = "int8-a8"
    model = staticrt.load_model(llama_256[0], quantize=quantize)
    expected = staticrt.Generator(model, max_batch_size=2, max_cache_len=64).generate(PROMPTS, NEW)
    tokens, said = compiled_run(model)
    assert tokens == expected and sum(line.startswith("compiled the") for line in said) == 2
    kept = entries()
    assert len(kept) == 2 and all((e / "step.json").is_file() for e in kept)
    tokens, said = compiled_run(model)
    assert tokens == expected
    assert [line.split(",")[0] for line in said if line.startswith("loaded")] == ["loaded from the compile cache"] * 2
    assert entries() == kept
