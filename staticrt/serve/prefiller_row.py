"""Which of a server's rows the batch-1 prefiller's one row holds, so that a row is copied between
the two caches only when the other side is about to read it.

The prefiller prefills each prompt alone, and a row that decodes alone decodes there too
(planning.py's `_lone`): a [B, 1] step spends B rows' compute on one. Its row and the server's row
r then hold the same conversation, or the prefiller's holds more of it (`ahead`: a prefill or lone
decode steps since the last copy). Copies, each of a whole row:
- into the prefiller, before it continues a row it does not hold (a kept prefix, a lone decode);
- back into row r, before anything else reads row r or the prefiller takes another row: a step of
  the server's backend (any of its rows may be in it), a seat in row r that stashes it in the host
  pool or restores another entry there.
One client's conversation thus copies nothing between turns, and a second client arriving costs one
copy. Imports no torch.
"""

from __future__ import annotations

from typing import Any

from .job import Plan


class PrefillerRow:
    """The prefiller's row as a copy of one of `backend`'s rows (`row`, None: of none)."""

    def __init__(self, backend: Any, prefiller: Any) -> None:
        self.backend, self.prefiller = backend, prefiller
        self.row: int | None = None
        self.ahead = False  # the prefiller's row holds more than row `row` does

    def before(self, plan: Plan) -> None:
        """Before `plan` runs: the caches it reads hold what it continues."""
        if self.prefiller is None:
            return
        if plan.backend is not self.prefiller:
            self.settle()
            if any(job.row == self.row for job in plan.members):  # the row moves on without the prefiller
                self.row = None
            return
        job = plan.adopt or plan.members[0]
        if job.row == self.row:
            return  # it continues what the prefiller holds
        self.settle()
        if plan.adopt is None or job.fed > 0:  # a lone decode or a kept prefix continues the row
            self.prefiller.adopt_row(0, self.backend, job.row)
        self.row = job.row

    def after(self, plan: Plan) -> None:
        """After `plan` ran: a step of the prefiller left its row ahead of row `row`."""
        self.ahead = self.ahead or plan.backend is self.prefiller

    def seating(self, row: int, reads: bool, restores: bool) -> None:
        """Row `row` takes a request: where the seat `reads` the row (the host pool stashes it) it
        gets what the prefiller holds first; where it `restores` an entry there, the prefiller's
        copy is of nothing any more."""
        if row == self.row and (reads or restores):
            self.settle()
            if restores:
                self.row = None

    def settle(self) -> None:
        """Row `row` takes what the prefiller holds of it, where that is more."""
        if self.ahead and self.row is not None:
            self.backend.adopt_row(self.row, self.prefiller, 0)
        self.ahead = False

    def forget(self) -> None:
        """A step cut short: neither copy is known (rows.py forgets every row too)."""
        self.row, self.ahead = None, False
