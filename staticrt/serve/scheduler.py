"""Continuous batching on a static graph: the B rows of one backend's cache are B slots.

A request waits in a bounded queue until a row is free, is prefilled into that row (its prompt
in the bucket a lone `generate` would use, or in chunks of the largest bucket when longer), then
decodes one token a step beside the other rows; when it finishes, is cancelled or fails, its row
is free at once for the next request. The shapes are the backend's own (a bucket wide for prefill
steps, one token for decode steps), so nothing recompiles and CUDA graphs stay valid.

Prefill and decode steps alternate rather than share a step: a row decodes in the same width-1
graph as a lone generation, so greedy tokens equal a lone run's. With a prefiller (a batch-1
backend over the same model, which a model backend has and an artifact has not) a prompt is
prefilled alone there and its cache row copied into the job's row (`adopt_row`): a `[B, T]` prefill
step would spend B rows' compute on one prompt. A row decoding alone decodes there too;
prefiller_row.py copies the row only when the other cache is about to read it. Without a prefiller,
in a prefill step the decoding rows sit out (`num_new` 0), and their write of padding lands past
their length, where their mask hides it until a real token overwrites it; a prefill step of width T
waits until every decoding row has T positions left. A freed row is not cleared: masks are computed
from positions, and its next occupant writes every position it attends to before it attends to it.

A request is seated in the free row that holds the longest prefix of its prompt and prefills only
the rest; a freed row keeps its contents until it is reused, and then in a host pool (rows.py).

With speculation (`drafting`), a decode step becomes a verify step (planning.py): each row feeds
its next token and its drafted tokens, takes those the model agrees with (a sampled row: those
speculative sampling's rule keeps) plus the model's token; rows that drafted nothing advance one.

One thread runs the steps; requests come from any thread, and each job's `emit` is called on the
stepping thread. `staticrt serve` steps on the thread that loaded and compiled the model (`run`):
OpenMP gives every thread that starts parallel work a team of its own, and on a 2-core machine a
second team slowed each decode step by ~60% (docs/measurements.md). Imports no torch.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import StaticrtError
from ..generation.logprobs import TokenLogprob
from ..generation.loop import StepBackend
from .job import Completion, Event, Job, Plan, check_request
from .metrics import Metrics
from .outcome import step_outcome
from .planning import Drafting, plan_step
from .prefiller_row import PrefillerRow
from .rows import RowMemory, Saved

# The stepping thread may be the main one (`run`), the only one where Python runs a signal's
# handler, and the OS hands SIGTERM to any thread (uvicorn's, OpenMP's): an idle main thread
# asleep on the condition never ran it, and the server ignored SIGTERM. It wakes this often.
IDLE_WAKE_S = 0.5


class QueueFull(StaticrtError):
    """Every row is busy and the queue holds its limit: try again shortly (HTTP 429)."""


class NotAdmitting(StaticrtError):
    """The server is shutting down and takes no new requests (HTTP 503)."""


class Scheduler:
    """The rows of `backend`'s cache as slots; `submit` requests, `start` the stepping thread."""

    def __init__(
        self,
        backend: StepBackend,
        tokenizer: Any = None,
        max_queue: int = 64,
        metrics: Metrics | None = None,
        prefiller: StepBackend | None = None,
        reuse_prefix: bool = True,
        widest: int | None = None,
        drafting: Drafting | None = None,
        cache_ram_bytes: int = 0,
        narrow: tuple[StepBackend, ...] = (),
    ) -> None:
        self.backend = backend
        self.prefiller = prefiller  # batch 1, same model and cache layout; its row is copied into ours
        self.mirror = PrefillerRow(backend, prefiller)
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self.rows: list[Job | None] = [None] * backend.batch_size
        self.metrics.rows.set(len(self.rows))
        self.memory = RowMemory(backend, reuse_prefix, widest, cache_ram_bytes, [t.batch_size for t in narrow])
        self.drafting = drafting
        self.narrow = narrow  # twins of `backend` over its first rows (planning.py)
        self.waiting: deque[Job] = deque()
        self.cond = threading.Condition()
        self.admitting, self.stopped, self.last_prefilled = True, False, False
        self.counter = itertools.count()
        self.thread = threading.Thread(target=self._loop, name="staticrt-scheduler", daemon=True)
        self.driven = False  # stepping in a caller's thread (`run`) rather than in `thread`

    # -- the client side ---------------------------------------------------------------------
    def submit(self, request: Completion, emit: Callable[[Event], None], interval: int = 1) -> Job:
        """Queue `request` (checked first: GenerationError names what is wrong with it); its
        tokens go to `emit` `interval` at a time (the first at once; 0: all with the last)."""
        request = check_request(self.backend, self.tokenizer, request)
        with self.cond:
            if not self.admitting:
                raise NotAdmitting("the server is shutting down and takes no new requests; retry on another replica")
            # the waiting jobs take the free rows first; the queue holds what is left over
            queued = len(self.waiting) - sum(job is None for job in self.rows)
            if queued >= self.max_queue:
                raise QueueFull(
                    f"all {len(self.rows)} rows are busy and {queued} requests wait (--max-queue "
                    f"{self.max_queue}); retry shortly"
                )
            job = Job(request, emit, next(self.counter), interval, rng=np.random.default_rng(request.sampling.seed))
            job.stream = None if self.tokenizer is None else self.tokenizer.stream()
            self.waiting.append(job)
            self.metrics.queue.set(len(self.waiting))
            self.cond.notify()
        return job

    def start(self) -> None:
        """Step in a thread of the scheduler's own (an in-process server); nothing where `run` steps."""
        if self.driven or self.thread.is_alive():
            return
        self.backend.reset()
        self.thread.start()

    def run(self, ready: Callable[[], None] = lambda: None) -> None:
        """Step in the calling thread until `stop`; `ready` is called first, once the rows are
        this thread's to run (start the HTTP server there)."""
        self.driven = True
        self.backend.reset()
        ready()
        self._loop()

    def refuse_new(self) -> None:
        """Admit nothing new from now on: one flag that `submit` reads under the lock, written
        without it, so that a signal handler may call this in whatever thread it interrupts."""
        self.admitting = False

    def stop(self, drain_s: float = 0.0, timeout: float = 30.0) -> None:
        """Admit nothing new, let open requests finish for up to `drain_s` seconds, then stop
        stepping: what is still open gets 503 (a stream: an error event, then `[DONE]`)."""
        deadline = time.monotonic() + drain_s
        self.refuse_new()
        with self.cond:
            while (self.busy_rows or self.waiting) and not self.stopped and time.monotonic() < deadline:
                self.cond.wait(min(0.05, max(deadline - time.monotonic(), 0)))
            self.stopped = True
            self.cond.notify()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def health(self) -> dict[str, Any]:
        """What `GET /health` answers."""
        return {"status": "ok", "busy_rows": self.busy_rows, "queue": len(self.waiting)}

    @property
    def busy_rows(self) -> int:
        return sum(job is not None for job in self.rows)

    # -- the stepping thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cond:
                self._admit()
                while not self.stopped and self.busy_rows == 0:
                    self.cond.wait(IDLE_WAKE_S)
                    self._admit()
                if self.stopped:
                    self._fail_all(503, "the server stopped before this request finished")
                    return
            plan, start = None, time.perf_counter()  # a verify step's time includes its drafting
            try:
                plan, self.last_prefilled = plan_step(
                    self.backend,
                    self.prefiller,
                    self.memory,
                    self.rows,
                    self.last_prefilled,
                    self.drafting,
                    self.narrow,
                )
                self.mirror.before(plan)
                next_ids = plan.run()
                seconds = time.perf_counter() - start
                self.mirror.after(plan)
                taken = self._advance(plan, next_ids)
                if self.drafting is not None and not self.last_prefilled:
                    self.drafting.policy.timed(seconds, taken if plan.drafts is not None else None)
            except Exception as err:  # a failed step fails its own rows (all, if planning failed); serving goes on
                self.memory.forget()  # a step cut short leaves no row's contents known
                self.mirror.forget()
                message = f"the step failed: {type(err).__name__}: {err}"
                members = plan.members if plan is not None else self.rows
                for job in [j for j in members if j is not None and self.rows[j.row] is j]:  # not yet finished
                    self._finish(job, Event("error", status=500, message=message))

    def _admit(self) -> None:
        """Drop cancelled jobs (queued or in a row) and fill free rows from the queue (holding the lock)."""
        for job in self.rows:
            if job is not None and job.cancelled:
                self._free(job, "cancelled")
        gone = sum(job.cancelled for job in self.waiting)  # clients that left before they had a row
        self.metrics.finished.labels("cancelled").inc(gone)
        self.waiting = deque(j for j in self.waiting if not j.cancelled)
        if self.backend.row_positions:
            free = [r for r, job in enumerate(self.rows) if job is None]
            while free and self.waiting:
                job = self.waiting.popleft()
                try:  # a request that cannot be seated fails alone: the thread and the other rows go on
                    row, kept, saved = self.memory.best(job.request.prompt, free)
                    self._seat(job, row, kept, saved)
                    free.remove(row)
                except Exception as err:
                    self.memory.forget()  # what a failed seat left in the rows' memory is unknown
                    self._finish(job, Event("error", status=500, message=f"seating the request failed: {err!r}"))
        elif self.busy_rows == 0 and self.waiting:
            self._start_wave()
        self.metrics.queue.set(len(self.waiting))
        self.metrics.busy.set(self.busy_rows)

    def _seat(self, job: Job, row: int, kept: int = 0, saved: Saved | None = None) -> None:
        """`job` takes `row`, keeping `kept` prompt tokens of what it holds (of `saved`'s, restored there)."""
        self.mirror.seating(row, reads=self.memory.pool_bytes > 0, restores=saved is not None)
        kept = self.memory.seat(row, kept, job.order, saved)  # the row is the job's only once seated
        self.rows[row], job.row, job.fed, job.kept = job, row, kept, kept
        self.metrics.pool_restores.inc(saved is not None and kept > 0)  # 0: the pool failed, nothing restored
        self.metrics.pool_bytes.set(self.memory.pooled_bytes)

    def _start_wave(self) -> None:
        """A backend whose steps write one column of every row (the ONNX graph, genai's layout)
        takes requests in waves: when every row is free, the cache starts over and the oldest
        requests whose prompts and answers fit its columns together are prefilled in one step."""
        limit = self.backend.max_sequence_len
        longest_prompt = longest_answer = 0
        self.backend.reset()
        for row in range(len(self.rows)):
            if not self.waiting:
                return
            request = self.waiting[0].request
            prompt, answer = max(longest_prompt, len(request.prompt)), max(longest_answer, request.max_tokens)
            if row and limit is not None and prompt + answer > limit:
                return  # the next wave takes it
            longest_prompt, longest_answer = prompt, answer
            self._seat(self.waiting.popleft(), row)

    def _advance(self, plan: Plan, next_ids: np.ndarray) -> list[int]:
        """Give the finishing jobs their tokens (outcome.py); the tokens each took."""
        chosen = step_outcome(plan, next_ids, self.memory, self.metrics)
        for job in plan.finishing:
            for token in chosen[job]:
                if job.row is None or self.rows[job.row] is not job:
                    break  # finished at an earlier token of this step (a stop)
                self.metrics.observe_token(job)
                self._deliver(job, token, plan.entry(job, token))
        return [len(chosen[job]) for job in plan.finishing]

    def _deliver(self, job: Job, token: int, entry: TokenLogprob | None = None) -> None:
        """Send the token (its log-probabilities' `entry`, where asked) and the text it completes;
        finish the job on a stop id, a stop string or its length."""
        reason = job.accept(token, entry)
        event = job.due(last=reason is not None)
        if event is not None:
            job.emit(event)
        if reason is not None:
            self._finish(job, Event("done", finish_reason=reason, usage=job.usage))

    def _finish(self, job: Job, event: Event) -> None:
        with self.cond:
            self._free(job, event.finish_reason or "error")
            self.cond.notify_all()  # a drain waits for the rows to empty
        job.emit(event)

    def _free(self, job: Job, outcome: str) -> None:
        if job.row is not None and self.rows[job.row] is job:
            self.rows[job.row] = None
        self.metrics.finished.labels(outcome).inc()
        self.metrics.busy.set(self.busy_rows)

    def _fail_all(self, status: int, message: str) -> None:
        for job in [*filter(None, self.rows), *self.waiting]:
            self._free(job, "error")
            job.emit(Event("error", status=status, message=message))
        self.waiting.clear()
