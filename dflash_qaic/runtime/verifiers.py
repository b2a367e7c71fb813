"""The host's side of a verify call (docs/DESIGN.md, Seams: verifiers), declared once
(`Verifier`): `fill` writes the call's rows, `call` runs it, `accept` reads how many proposals
each row keeps, `commit` moves the slot book on and commits each sequence's tokens. The chain
and block verifiers are here; the tree's is runtime/tree.py. They share functions, not a base
class: `commit` (the same for every rule, since each program returns the accepted path in
order), `pad_decoding` (a row that decodes this step is a 1-row verify) and `own_lengths`.

Which verifier a program gets is looked up by its verify rule's name in one registry
(runtime/step.py: VERIFIERS).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from dflash_qaic import contract
from dflash_qaic.runtime.calls import check_committed


class Verifier(Protocol):
    """What a DFlash step asks of its verifier. `lens` [slots]: each row's verify rows this
    step (1: the row decodes, no proposal)."""

    lens: np.ndarray

    def fill(self, rows: np.ndarray, seqs: list) -> tuple[int, object]:
        """The verify call's inputs over every slot; returns (its rows n, the call)."""

    def call(self, n: int, c, seqs: list) -> dict:
        """Run the call; returns the program's outputs."""

    def accept(self, n: int, c, out: dict) -> np.ndarray:
        """acc [slots]: the proposals each row keeps."""

    def commit(self, rows: np.ndarray, seqs: list, n: int, out: dict, acc: np.ndarray) -> list:
        """Move every row on by acc + 1 tokens; returns the sequences that go on."""


def pad_decoding(step, c, lens: np.ndarray) -> None:
    """The rows that decode this step (`SlotBook.decoding`, the step policy's choice) verify
    their anchor alone: their other rows are padding (position -1), so they keep no proposal
    and commit the target's own token, exactly as a decode call would (docs/DESIGN.md, Step
    policy)."""
    dec = step.state.decoding
    if dec.any():
        np.copyto(c.pos[:, 1:], contract.PAD_POSITION, where=dec[:, None])
        lens[dec] = 1


def own_lengths(step, rows: np.ndarray, seqs: list) -> tuple[int, np.ndarray | None, list]:
    """A chain call's verify length n; per sampled row its own (None when greedy), and the
    sampled rows' slots. Only the rows that draft this step count (the others are 1-row)."""
    st = step.state
    n, own, sampled = step.plan.block_size, None, []
    if len(step.lengths) > 1:
        dec = st.decoding
        sampled = [q.slot for q in seqs if q.uniforms is not None and not dec[q.slot]]
        if sampled:  # each sampled row its own length, the call the longest of them
            own = step.costs.row_lengths(step.lengths, st.confidence[sampled])
            n = int(own.max())
        else:
            drafting = rows[~dec[rows]]
            n = step.costs.best_length(step.lengths, st.confidence[drafting])
    return n, own, sampled


def commit(step, lens: np.ndarray, rows, seqs: list, n: int, out: dict, acc: np.ndarray) -> list:
    """Move every row on by its acc + 1 tokens (the first acc + 1 of its choices: the accepted
    proposals, then the target's token), the committed rows' features to the draft's context,
    each sequence's tokens committed; returns the sequences that go on. A decode call (n 1,
    acc 0) commits through here too."""
    st, d = step.state, step.bufs.draft
    choice = out[contract.NEXT_TOKENS]  # [N, n]
    if contract.NUM_COMMITTED in out:  # a hybrid target's own count must agree
        check_committed("verify" if n > 1 else "decode", out, rows, acc[rows] + 1, seqs)
    k = acc + 1  # committed tokens per row: the draft's context rows
    k *= st.alive
    m = min(n, step.plan.block_size)  # a tree's path is at most B rows (its depths < B)
    d.ctx[:, :m] = out[contract.HIDDEN_STATES][:, :m]
    np.add(st.start[:, None], step._arange_b, out=d.ctx_pos)  # from the anchor's position
    np.copyto(d.ctx_pos, contract.PAD_POSITION, where=step._arange_b >= k[:, None])
    st.start += k
    st.anchor[:] = choice[step.bufs.slot_ids, acc]
    tokens, accepted = choice.tolist(), acc.tolist()
    step.furthest = int(st.start.max())
    full = step.furthest >= step.max_pos  # some row has no slot left for its anchor
    going = []
    for seq in seqs:  # per sequence: its tokens (the accepted ones, then the target's)
        r = seq.slot
        seq.verified.append(int(lens[r]))
        commit_rows(step.bufs, seq, r, out, tokens[r][: accepted[r] + 1])
        if seq.reason is None and full and st.start[r] >= step.max_pos:
            seq.reason = "ctx_len"  # positions ≥ ctx_len − 1 have no slot (contract.py)
        if seq.reason is None:
            going.append(seq)
        else:  # an inactive row in the draft call
            step.leave(r)
            d.ctx_pos[r] = contract.PAD_POSITION
    if len(going) < len(seqs):
        step.furthest = int(st.start.max())
    return going


def commit_rows(bufs, seq, r: int, out: dict, tokens: list[int]) -> None:
    """Commit call row r's first len(tokens) choices to `seq`: their logprobs (the committed
    rows' only, never a rejected proposal's; runtime/logprobs.py), the tokens, then the
    tokens behind the new anchor into the row's history (runtime/history.py)."""
    if seq.logprobs is not None:
        seq.logprobs.rows(out, r, 0, len(tokens))
    before = len(seq.tokens)
    seq.commit(tokens, step=True)
    if bufs.sampling.ext is not None:
        bufs.sampling.ext.advance(r, seq.tokens, before)


class ChainVerifier:
    """The chain (docs/DESIGN.md, Algorithm): row r verifies [anchor_r, proposals_r[:n−1]] at
    start_r … start_r+n−1 (row j's parent is row j − 1, its cache slot its position); acc_r =
    leading proposals equal to the target's choice; it commits them and the target's token
    after them."""

    def __init__(self, step):
        self.step = step
        plan = step.plan
        self.same = {n: np.zeros((plan.cache_rows, n), bool) for n in step.lengths}
        self.lens = np.zeros(plan.cache_rows, np.int64)  # each row's verify length this step

    def fill(self, rows: np.ndarray, seqs: list):
        s, st, b = self.step, self.step.state, self.step.bufs
        cons = s.masks.propose(seqs) if s.masks.on else ()  # fills and cuts proposals
        n, own, sampled = own_lengths(s, rows, seqs)
        c = b.verify[n]  # ids, pos: [N, n]
        c.ids[:, 0] = st.anchor
        c.ids[:, 1:] = st.proposals[:, : n - 1]
        np.add(st.start[:, None], st.offsets[:, :n], out=c.pos)  # inactive rows: all -1
        np.copyto(c.pos, contract.PAD_POSITION, where=c.pos >= s.max_pos)  # past the end
        self.lens.fill(n)
        if own is not None:  # a sampled row's rows past its own length are padding
            self.lens[sampled] = own
            np.copyto(c.pos, contract.PAD_POSITION, where=s._arange_b[:n] >= self.lens[:, None])
        pad_decoding(s, c, self.lens)
        if cons:
            s.masks.verify(cons, c, n)
        if b.q and st.q_ids is not None:  # the draft's q of these proposals: q-aware verify
            np.copyto(b.q[contract.DRAFT_Q_IDS], st.q_ids)
            np.copyto(b.q[contract.DRAFT_Q_PROBS], st.q_probs)
        return n, c

    def call(self, n: int, c, seqs: list) -> dict:
        return self.step._target("verify", n, c, seqs, self.step.costs)

    def accept(self, n: int, c, out: dict) -> np.ndarray:
        """acc [N]: the leading proposals equal to the target's choice (the first False of
        `same`, whose last column is always False), every row at once."""
        st, choice, same = self.step.state, out[contract.NEXT_TOKENS], self.same[n]
        np.equal(st.proposals[:, : n - 1], choice[:, : n - 1], out=same[:, : n - 1])
        same[:, : n - 1] &= c.pos[:, 1:] >= 0  # a proposal at a padding position is not taken
        return same.argmin(axis=1)

    def commit(self, rows, seqs: list, n: int, out: dict, acc: np.ndarray) -> list:
        return commit(self.step, self.lens, rows, seqs, n, out, acc)


class BlockVerifier(ChainVerifier):
    """Block verification (docs/DESIGN.md, Block verification): the chain's rows, but the
    target program decides how many proposals each row keeps jointly and returns it
    (contract.NUM_ACCEPTED); the row's committed tokens are its first acc + 1 choices as in the
    chain. A padding row has no proposal, so a 1-row verify keeps none."""

    def accept(self, n: int, c, out: dict) -> np.ndarray:
        return out[contract.NUM_ACCEPTED].astype(np.int64, copy=False)
