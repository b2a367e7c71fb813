"""A program call of the step loop and its failure (`CallFailed`), and the check of what a
hybrid target says it committed (`check_committed`): what the prompt, the steps and every
verifier share (docs/DESIGN.md, Runtime)."""

from __future__ import annotations

import numpy as np

from dflash_qaic import contract
from dflash_qaic.runtime.stats import timed_call


class CallFailed(Exception):
    """A program call raised: `seqs` are the sequences it served, `cause` what it raised."""

    def __init__(self, kind: str, seqs: list, cause: BaseException):
        super().__init__(f"the {kind} call failed: {type(cause).__name__}: {cause}")
        self.seqs, self.cause = seqs, cause


def call(kind: str, program, feeds: dict, seqs: list, costs=None, rows: int = 0) -> dict:
    """`program` on `feeds` (timed, see stats.timed_call); a call that raises is re-raised as
    `CallFailed`, naming the sequences of that call, so the engine fails those and no others."""
    try:
        return timed_call(kind, program, feeds, seqs, costs, rows)
    except Exception as e:
        raise CallFailed(kind, seqs, e) from e


def check_committed(kind: str, out: dict, rows: np.ndarray, committed, seqs: list) -> None:
    """A hybrid target commits its recurrent state inside the call and says how many positions
    (`num_committed`, docs/DESIGN.md, Hybrid targets): it must be what the host commits, or the
    state no longer matches the tokens. Program and host apply one rule, so this never fires
    unless one of them is broken; then the call's sequences fail, not a silent divergence."""
    count = out.get(contract.NUM_COMMITTED)
    if count is not None and not np.array_equal(count[rows], committed + 0 * count[rows]):
        raise CallFailed(
            kind,
            seqs,
            RuntimeError(
                f"the target committed {count[rows].tolist()} positions of its recurrent state, "
                f"the host {np.broadcast_to(committed, count[rows].shape).tolist()}"
            ),
        )
