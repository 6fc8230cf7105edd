"""A request as the scheduler runs it: the request (`Completion`), what its client is told
(`Event`), the limits it must keep (`check_request`), where it stands (`Job`: row, tokens, text
held back for stop strings), and one step's inputs over the rows (`Plan`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import GenerationError
from ..generation.buckets import chunk_end
from ..generation.logit_bias import RowBias, step_bias
from ..generation.logprobs import LogprobSink, TokenLogprob
from ..generation.params import SamplingParams
from ..generation.request import validate_request
from ..text.stop_strings import StopStrings

# OpenAI's limit on stop strings a request; each string's length bounds the text held back for it
MAX_STOPS, MAX_STOP_CHARS = 4, 1024


@dataclass(frozen=True)
class Completion:
    """One request, as the scheduler runs it (token ids; text only for stop strings)."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one


def check_stops(stops: Any) -> tuple[str, ...]:
    """`stops` as a tuple of at most MAX_STOPS strings of 1 to MAX_STOP_CHARS characters each."""
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise GenerationError(f"stop is {type(stops).__name__}; send a string or a list of up to {MAX_STOPS} strings")
    if len(stops) > MAX_STOPS:
        raise GenerationError(f"stop holds {len(stops)} strings; at most {MAX_STOPS}: send fewer")
    for s in stops:
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise GenerationError(
                f"a stop string has {len(s)} characters; each needs 1 to {MAX_STOP_CHARS}: "
                f"{'drop it' if not s else 'shorten it'}"
            )
    return tuple(stops)


def check_request(backend: Any, tokenizer: Any, request: Completion) -> Completion:
    """Every limit a request must keep on `backend`, checked before it is queued; the request as
    the stepping thread may run it (plain numbers in range: a top_k past the vocabulary is 0)."""
    checked = validate_request(
        backend, [request.prompt], request.max_tokens, request.sampling, request.stop_token_ids, chunked=True
    )
    check_stops(request.stop)
    if not backend.row_positions and len(request.prompt) > backend.buckets[-1]:
        raise GenerationError(
            f"the prompt has {len(request.prompt)} tokens, beyond the largest prefill bucket "
            f"{backend.buckets[-1]} ({backend.name} prefills a prompt in one step); shorten it or "
            f"{backend.remedy('prefill_buckets')}"
        )
    if request.stop and tokenizer is None:
        raise GenerationError("stop strings need the model's tokenizer.json, which this model has none of")
    limit = backend.max_sequence_len
    end = chunk_end(backend.buckets, len(checked.rows[0]))
    if limit is not None and end > limit:
        raise GenerationError(
            f"the prompt's {len(request.prompt)} tokens are prefilled in chunks of the largest bucket "
            f"{backend.buckets[-1]}, and the last chunk's bucket reaches position {end}, beyond "
            f"max_cache_len={limit}; shorten the prompt or {backend.remedy('max_cache_len')}"
        )
    return Completion(
        checked.rows[0], checked.max_new_tokens, checked.sampling, tuple(sorted(checked.stops)), tuple(request.stop)
    )


@dataclass
class Event:
    """What a job tells its client: `token` (one or more tokens, with the text they complete),
    `done`, or `error`."""

    kind: str
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length", with `done`
    usage: dict[str, Any] | None = None
    status: int = 0  # with `error`: 500 when a step failed, 503 when the server stopped
    message: str = ""
    logprobs: list[TokenLogprob] | None = None  # with `token`, where the request asked: an entry a token


@dataclass(eq=False)
class Job:
    """A request and where it stands: its row, the prompt tokens prefilled, the tokens chosen."""

    request: Completion
    emit: Callable[[Event], None]
    order: int
    interval: int = 1  # tokens an event: the first goes at once, then every `interval`; 0: only the last
    row: int | None = None
    fed: int = 0  # prompt tokens in the cache
    kept: int = 0  # of them, those the row held already (a reused prefix: OpenAI's cached_tokens)
    tokens: list[int] = field(default_factory=list)
    cancelled: bool = False
    rng: Any = None
    stream: Any = None  # a TextStream when stop strings are asked for, or text is wanted
    text: str = ""  # text of `tokens[:tokens_read]`, cut before a stop string
    text_final: bool = False  # no more text comes: the last token's read, or a stop string cut
    sent: int = 0  # characters of `text` already emitted (the rest held back for stop strings)
    tokens_read: int = 0  # of `tokens`, those in `text`
    tokens_sent: int = 0  # of `tokens`, those already emitted
    created_at: float = field(default_factory=time.perf_counter)
    last_at: float = 0.0
    stops: StopStrings | None = field(init=False)
    bias: RowBias | None = field(init=False)  # its logit_bias and penalties (logit_bias.py)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # an entry a token, where asked (logprobs.py)

    def __post_init__(self) -> None:
        self.stops = StopStrings(self.request.stop) if self.request.stop else None
        rule = self.request.sampling.rule
        self.bias = RowBias(rule) if rule else None

    @property
    def follows_tokens(self) -> bool:
        """Whether its bias changes with each token it takes (penalties, a JSON schema): it then
        drafts nothing (a verify step adds one bias at every position)."""
        return self.bias is not None and self.bias.rule.follows_tokens

    @property
    def top_logprobs(self) -> int | None:
        """The top tokens it wants beside each chosen one's log-probability; None: no log-probabilities."""
        return self.request.sampling.logprobs

    @property
    def position(self) -> int:
        """Tokens of this row in the cache: the prompt, then every chosen token but the newest."""
        return self.fed + max(len(self.tokens) - 1, 0)

    def cancel(self) -> None:
        """Free the row at the next step (a client that went away)."""
        self.cancelled = True

    def accept(self, token: int, entry: TokenLogprob | None = None) -> str | None:
        """Take the chosen `token` (with its log-probabilities' `entry`, where asked); why the job
        ends with it, if it does ("stop" on a stop id or string, "length" at max_tokens). Text is
        read token by token only where a stop string may end at this token; otherwise when an
        event is due (`due`), a few tokens at a time."""
        request = self.request
        self.tokens.append(token)
        if entry is not None:
            self.logprobs.append(entry)
        if self.bias is not None:
            self.bias.emitted(token)
        reason = "stop" if token in request.stop_token_ids else None
        if self.stops is not None and not self.text_final:
            cut = self._read()
            if cut is not None:
                self.text, self.text_final, reason = self.text[:cut], True, "stop"
        if reason is None and len(self.tokens) == request.max_tokens:
            reason = "length"
        return reason

    def _read(self, last: bool = False) -> int | None:
        """Bring `text` up to the newest token (`last`: with the characters still held back);
        where a stop string starts in it, if the new text completed one."""
        if self.stream is None or self.text_final:
            return None
        piece = self.stream.push(*self.tokens[self.tokens_read :])
        self.tokens_read = len(self.tokens)
        cut = None if self.stops is None else self.stops.feed(piece)
        self.text += piece
        if last:
            self.text, self.text_final = self.text + self.stream.flush(), True
        return cut

    def due(self, last: bool) -> Event | None:
        """The `token` event to send now, holding the tokens not yet sent and the text they let
        the client see, or None while fewer than `interval` wait: fewer events a token, for
        servers whose HTTP costs more than a step (as SGLang's and vLLM's `--stream-interval`).
        The first token goes at once; `interval` 0 sends only the last. Text that may be the start
        of a stop string is held back until the next token shows it is not."""
        waiting = len(self.tokens) - self.tokens_sent
        first = len(self.tokens) == 1 and self.interval > 0
        if not (last or first or (self.interval and waiting >= self.interval)):
            return None
        self._read(last)
        hold = 0 if last or self.stops is None else self.stops.held
        start, self.sent = self.sent, max(len(self.text) - hold, self.sent)
        event = Event("token", tokens=self.tokens[self.tokens_sent :], text=self.text[start : self.sent])
        if self.top_logprobs is not None:
            event.logprobs = self.logprobs[self.tokens_sent :]
        self.tokens_sent = len(self.tokens)
        return event

    @property
    def usage(self) -> dict[str, Any]:
        prompt = len(self.request.prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": len(self.tokens),
            "total_tokens": prompt + len(self.tokens),
            "prompt_tokens_details": {"cached_tokens": self.kept},
        }


class Plan:
    """One step's inputs (`[B, T]` ids, `[B]` write_index and num_new) for the backend that runs
    it, the jobs in it (each at its slot: its row, or 0 in a batch-1 prefiller) and the jobs that
    get a token from it; `adopt`: a job whose row takes the prefiller's row after the step;
    `drafts`: in a verify step (speculative.py), each job's drafted tokens, fed after its next one."""

    def __init__(self, backend: Any, width: int) -> None:
        batch = backend.batch_size
        self.backend = backend
        self.slot: dict[Job, int] = {}
        self.adopt: Job | None = None
        self.drafts: dict[Job, np.ndarray] | None = None
        self.input_ids = np.zeros((batch, width), dtype=np.int64)
        self.write_index = np.zeros(batch, dtype=np.int64)
        self.num_new = np.zeros(batch, dtype=np.int64)  # real tokens a row (0: the row sits the step out)
        self.members: list[Job] = []
        self.finishing: list[Job] = []
        self.sampling: tuple[SamplingParams, np.ndarray | None] = (SamplingParams(), None)
        self.logprobs: LogprobSink | None = None  # where the step puts log-probabilities, if a job asks

    def add(self, job: Job, ids: list[int], write_index: int, slot: int | None = None) -> None:
        slot = job.row if slot is None else slot
        assert slot is not None
        self.slot[job] = slot
        self.input_ids[slot, : len(ids)] = ids
        self.write_index[slot] = write_index
        self.num_new[slot] = len(ids)
        self.members.append(job)

    def choose(self, jobs: list[Job]) -> None:
        """How the step picks each row's token: greedy when every row of `jobs` is greedy (the
        greedy graph, as a lone generation uses); else the sampling graph with each row's own
        parameters and uniforms from its own generator, greedy rows as top_k 1 (the argmax): one
        a row, or in a verify step two a position `[T, 2]` (`sampling.verify_sample`)."""
        batch, width = self.input_ids.shape
        rows = {self.slot[job]: job.bias for job in jobs if job.bias is not None}
        bias = step_bias(rows, batch, self.backend.vocab_size)
        self.logprobs = LogprobSink() if any(job.top_logprobs is not None for job in jobs) else None
        sampled = [job for job in jobs if job.request.sampling.do_sample]
        if not sampled:
            self.sampling = (SamplingParams(bias=bias, logprobs_to=self.logprobs), None)
            return
        temperature = np.ones(batch, dtype=np.float32)
        top_k = np.ones(batch, dtype=np.int64)
        top_p = np.ones(batch, dtype=np.float32)
        draws = () if self.drafts is None else (width, 2)
        uniforms = np.zeros((batch, *draws), dtype=np.float32)
        for job in sampled:
            params, row = job.request.sampling, self.slot[job]
            temperature[row], top_k[row], top_p[row] = params.temperature, params.top_k, params.top_p
            uniforms[row] = job.rng.random(draws, dtype=np.float32)
        self.sampling = (
            SamplingParams(True, temperature, top_k, top_p, bias=bias, logprobs_to=self.logprobs),
            uniforms,
        )

    def entry(self, job: Job, token: int) -> TokenLogprob | None:
        """`job`'s log-probabilities of its `token` from this step, where it asked (never in a
        verify step: a row that asks drafts nothing)."""
        if self.logprobs is None or job.top_logprobs is None:
            return None
        return self.logprobs.entry(self.slot[job], token, job.top_logprobs)

    def run(self) -> np.ndarray:
        """The step: each row's next token `[B]`, or in a verify step the token after each position `[B, T]`."""
        if self.drafts is not None:
            return self.backend.verify_step(self.input_ids, self.write_index, self.num_new, *self.sampling)
        return self.backend.step(self.input_ids, self.write_index, self.num_new, *self.sampling)
