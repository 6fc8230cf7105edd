"""A 4-bit GGUF written again with Q8_0 projections (bench/gguf_requantize.py), as bench-serve's
int8 comparison against llama.cpp needs where only a 4-bit file exists."""

from __future__ import annotations

import numpy as np
import pytest

import staticrt
from staticrt.errors import BenchError

gguf = pytest.importorskip("gguf", reason="install the gguf extra, as the README's test command does")


def test_a_q4_0_file_requantized_to_q8_0_keeps_its_metadata_and_its_values_within_a_rounding(tmp_path):
    """Each value within half a Q8_0 step of the Q4_0 file's, plus what the step's float16 scale
    adds (ggml rounds with the float32 scale: 127 x 2^-11 of a step at most)."""
    from hf_models import save_hf_model

    from staticrt.bench.gguf_requantize import requantize_gguf
    from staticrt.bench.gguf_write import write_gguf

    save_hf_model("qwen3", tmp_path / "hf", head_dim=128)  # what transformers' GGUF reader takes (test_families)
    four = write_gguf(staticrt.load_model(tmp_path / "hf"), tmp_path / "q4.gguf", "Q4_0")
    assert requantize_gguf(four, tmp_path / "q8.gguf") == 14  # q, k, v, o, gate, up, down in 2 layers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "q4.gguf", "q8.gguf"]  # no partial left
    before, after = gguf.GGUFReader(four), gguf.GGUFReader(tmp_path / "q8.gguf")
    for name, field in before.fields.items():
        if not name.startswith("GGUF."):
            assert after.fields[name].contents() == field.contents(), name
    for old, new in zip(before.tensors, after.tensors, strict=True):
        assert old.name == new.name
        if old.tensor_type.name != "Q4_0":
            assert new.tensor_type == old.tensor_type and np.array_equal(new.data, old.data), old.name
            continue
        assert new.tensor_type.name == "Q8_0"
        values = gguf.quants.dequantize(old.data, old.tensor_type)
        again = gguf.quants.dequantize(new.data, new.tensor_type)
        steps = np.abs(values).reshape(-1, 32).max(axis=1) / 127  # Q8_0: a scale a block of 32
        assert np.all(np.abs(again - values).reshape(-1, 32) <= steps[:, None] * (0.5 + 127 * 2**-11) + 1e-7), old.name
    assert len(staticrt.Generator(staticrt.load_model(tmp_path / "q8.gguf")).generate([[1, 2, 3]], 4)[0]) == 4
    with pytest.raises(BenchError, match="^block type 'Q9_9' is not one the gguf library knows"):
        requantize_gguf(four, tmp_path / "x.gguf", "Q9_9")
