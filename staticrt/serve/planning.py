"""One step's plan over a server's rows (scheduler.py): which jobs it runs, at which positions,
and which of them get a token from it. Prefill and decode steps alternate; a prompt is prefilled
alone in a batch-1 prefiller where there is one, else beside the rows it shares a bucket with,
while the decoding rows sit out with their padding past their length; a row decoding alone
decodes in the prefiller too. With speculation, a decode step becomes a verify step where some
decoding rows drafted tokens.
Imports no torch."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from ..errors import GenerationError
from ..generation.buckets import bucket_for
from ..generation.draft_policy import DraftPolicy
from ..generation.loop import StepBackend
from ..generation.prefix import draft_room
from ..generation.speculative import Speculation
from .job import Job, Plan
from .rows import RowMemory

log = logging.getLogger("staticrt")


@dataclass
class Drafting:
    """A server's speculation: what it drafts (`spec`) and when that pays (`policy`, over every row's steps)."""

    spec: Speculation
    policy: DraftPolicy = field(default_factory=DraftPolicy)


def plan_step(
    backend: StepBackend,
    prefiller: StepBackend | None,
    memory: RowMemory,
    rows: list[Job | None],
    last_prefilled: bool,
    drafting: Drafting | None = None,
    narrow: tuple[StepBackend, ...] = (),
) -> tuple[Plan, bool]:
    """The next step's plan over `rows` (their jobs, None where a row is free), and whether it
    prefills: a prefill when a prompt waits, unless the step before prefilled and rows decode.
    `narrow`: twins of `backend` over its first rows, narrowest first (`narrow_backends`): a
    decode step whose rows all lie within one runs there."""
    jobs = [job for job in rows if job is not None]
    prefilling = [job for job in jobs if job.fed < len(job.request.prompt)]
    decoding = [job for job in jobs if job.fed == len(job.request.prompt)]
    if prefilling and (not decoding or not last_prefilled):
        if prefiller is None:
            plan = _prefill_plan(backend, memory, rows, prefilling, decoding)
        else:
            plan = _alone(backend, prefiller, prefilling, memory.widest)
        if plan is not None:
            return plan, True
    if drafting is None and prefiller is not None and len(jobs) == len(decoding) == 1:
        return _lone(prefiller, decoding[0]), False
    plan = None if drafting is None else _verify_plan(backend, memory, rows, decoding, prefilling, drafting)
    if plan is None:
        within = max(job.row for job in decoding) + 1
        backend = next((twin for twin in narrow if twin.batch_size >= within), backend)
        sitting = [job for job in prefilling if job.row < backend.batch_size]
        plan = _decode_plan(backend, memory, rows[: backend.batch_size], decoding, sitting)
    return plan, False


def _prefill_plan(
    backend: StepBackend, memory: RowMemory, rows: list[Job | None], prefilling: list[Job], decoding: list[Job]
) -> Plan | None:
    """The oldest prefilling row's next chunk, with every unstarted row whose whole prompt
    takes the same bucket; None while a decoding row lacks the room for its padding."""
    head = min(prefilling, key=lambda job: job.order)
    largest = backend.buckets[-1]
    chunk = min(len(head.request.prompt) - head.fed, largest)
    width = bucket_for(backend.buckets, chunk)
    limit = backend.max_sequence_len
    if limit is not None and any(job.position + width > limit for job in decoding):
        return None
    for job in prefilling:  # a kept prefix too near the end for this step's padding is given up
        if job is not head and limit is not None and job.fed + width > limit:
            job.fed = job.kept = 0
            memory.forget(job.row)
    if not backend.row_positions:  # a wave: every row in one step, as wide as its longest prompt
        width = bucket_for(backend.buckets, max(len(job.request.prompt) for job in prefilling))
    members = [head] + [
        job
        for job in prefilling
        if job is not head
        and job.fed == job.kept  # nothing of this request prefilled yet
        and (
            not backend.row_positions
            or bucket_for(backend.buckets, len(job.request.prompt) - job.fed, exact=True) == width
        )
    ]
    plan = Plan(backend, width)
    for job in members:
        take = min(len(job.request.prompt) - job.fed, largest)
        plan.add(job, job.request.prompt[job.fed : job.fed + take], job.fed)
    for job in decoding:
        plan.write_index[job.row] = job.position  # sits out: num_new 0, padding past its length
    for job in prefilling:
        if job not in plan.slot:
            plan.write_index[job.row] = job.fed  # sits out, its padding after what it holds
    memory.park(plan.write_index, rows, width)
    plan.finishing = [job for job in members if job.fed + plan.num_new[plan.slot[job]] == len(job.request.prompt)]
    plan.choose(plan.finishing)
    return plan


def _alone(backend: StepBackend, prefiller: StepBackend, prefilling: list[Job], widest: int | None) -> Plan:
    """The oldest prefilling job's next chunk, in the batch-1 prefiller, whose row the job's
    row then takes: prefill costs one row's compute, not B rows' (the others padding)."""
    head = min(prefilling, key=lambda job: job.order)
    largest = backend.buckets[-1] if head.kept == 0 or widest is None else widest  # a kept prefix's continuing graphs
    take = min(len(head.request.prompt) - head.fed, largest)
    plan = Plan(prefiller, bucket_for(backend.buckets, take))
    plan.add(head, head.request.prompt[head.fed : head.fed + take], head.fed, slot=0)
    plan.adopt = head
    plan.finishing = [head] if head.fed + take == len(head.request.prompt) else []
    plan.choose(plan.finishing)
    return plan


def _lone(prefiller: StepBackend, job: Job) -> Plan:
    """A decode step of the only busy row in the batch-1 prefiller (prefiller_row.py keeps the two
    copies of the row in step): a [B, 1] step would spend B rows' compute on one (SmolLM2 int4, 8
    rows: 21 tok/s for one client against 110 alone, docs/measurements.md)."""
    plan = Plan(prefiller, 1)
    plan.add(job, [job.tokens[-1]], job.position, slot=0)
    plan.finishing = [job]
    plan.choose([job])
    return plan


def _verify_plan(
    backend: StepBackend,
    memory: RowMemory,
    rows: list[Job | None],
    decoding: list[Job],
    prefilling: list[Job],
    drafting: Drafting,
) -> Plan | None:
    """A verify step where the policy lets it, every row has k + 1 positions left and some row
    drafted; else None (a decode step). Greedy rows take the drafts the model's argmax agrees
    with; sampled rows (beside them, greedy ones as top_k 1) speculative sampling's rule."""
    spec, limit = drafting.spec, backend.max_sequence_len
    if not decoding or not drafting.policy.ready() or any(job.top_logprobs is not None for job in decoding):
        return None  # a verify step returns no log-probabilities
    ends = [job.position for job in decoding] + [job.fed for job in prefilling]
    if limit is not None and max(ends) + spec.k + 1 > limit:
        return None
    contexts = [spec.idle_context(r) for r in range(len(rows))]  # a drafter's step takes every row
    rooms = [0] * len(rows)
    for job in decoding:
        contexts[job.row] = np.array(job.request.prompt + job.tokens, dtype=np.int64)
        rooms[job.row] = draft_room(job.position, spec.k, backend.rotating_layouts)
    try:
        proposed = spec.propose(contexts, rooms, catch_up=True)
    except GenerationError as err:  # a draft model's failure costs this step's drafts, never a request
        log.warning("the draft model failed, so this step verifies nothing: %s", err)
        spec.drafter.held[:] = [[] for _ in spec.drafter.held]  # what its rows hold is no longer known
        return None
    drafts = {
        job: proposed[job.row][: 0 if job.follows_tokens else None] for job in decoding
    }  # a row whose bias follows its tokens drafts nothing
    if not any(len(d) for d in drafts.values()):
        return None
    return _decode_plan(backend, memory, rows, decoding, prefilling, drafts, spec.k + 1)


def _decode_plan(
    backend: StepBackend,
    memory: RowMemory,
    rows: list[Job | None],
    decoding: list[Job],
    prefilling: list[Job],
    drafts: dict[Job, np.ndarray] | None = None,
    width: int = 1,
) -> Plan:
    """A decode step, or with `drafts` (of at most `width` - 1 tokens) a verify step: each decoding
    row feeds its newest token, then its draft (right-padded), as `speculative.verify_inputs` lays out."""
    plan = Plan(backend, width)
    # Only decoding rows feed tokens (num_new 1 + drafts); the others sit out with num_new 0: their
    # padding lands past what they hold, where masks hide it, and a Mamba2 layer's state stays as it
    # is (caches/recurrent.py), so a free row keeps its conversation and a chunked prompt its prefix.
    for job in decoding:
        plan.add(job, [job.tokens[-1], *([] if drafts is None else drafts[job].tolist())], job.position)
    for job in prefilling:  # a chunked prompt between chunks: its padding at `fed`, written next anyway
        plan.write_index[job.row] = job.fed
    memory.park(plan.write_index, rows, width)
    plan.drafts = drafts
    plan.finishing = decoding
    plan.choose(decoding)
    return plan
