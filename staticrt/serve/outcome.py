"""What one step's tokens mean for the jobs in it (scheduler.py): how far each row advanced and
which tokens each job takes. In a decode step a row takes the model's one token; in a verify step
(speculative.py) it takes the drafts the model agreed with and the model's token after them, and
the rejected drafts it was fed are struck from its row's memory (rows.py). Imports no torch."""

from __future__ import annotations

import numpy as np

from ..generation.speculative import accepted
from .job import Job, Plan
from .metrics import Metrics
from .rows import RowMemory


def step_outcome(plan: Plan, next_ids: np.ndarray, memory: RowMemory, metrics: Metrics) -> dict[Job, list[int]]:
    """Record in `memory` what each of `plan`'s rows was fed (and, for a prefilling job, how far
    its prompt got); each member's tokens, in order. `next_ids`: `[B]` (decode, prefill) or
    `[B, 1 + drafts]` (verify), B the plan's backend's rows."""
    chosen: dict[Job, list[int]] = {}
    for job in plan.members:
        slot = plan.slot[job]
        fed, rejected = int(plan.num_new[slot]), 0
        chosen[job] = [int(next_ids[slot])] if next_ids.ndim == 1 else []
        if plan.drafts is not None:
            draft = plan.drafts[job]
            took = accepted(draft, next_ids[slot])
            chosen[job] = next_ids[slot, : took + 1].tolist()
            fed, rejected = took + 1, len(draft) - took
            metrics.drafted_tokens.inc(len(draft))
            metrics.accepted_tokens.inc(took)
        memory.fed(job.row, plan.input_ids[slot, :fed], rejected)
        if len(job.tokens) == 0:
            job.fed += fed
    return chosen
