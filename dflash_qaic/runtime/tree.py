"""Tree verification, the host's side (docs/DESIGN.md, Tree verification).

One draft pass gives each block position's top-k tokens and log-probabilities (the draft's
`draft_top_ids` / `draft_top_logprobs`). `build_tree` grows a tree over them best-first on the
path's summed log-probability (DDTree): pop the best node, push its next sibling (same depth,
next rank) and its first child (next depth, rank 0), until the budget. Every prefix of that
order is itself a tree, so one build serves every size a step may pick, and the sum of the
first n nodes' path probabilities is what a tree of n rows is expected to commit (under the
draft's own, per-position, distributions).

`TreeVerifier` writes the tree into the verify call: row r's token, its position start +
depth, and its ancestors in `tree_mask`. The program picks a token at every node (the argmax,
or a plain sample from the target's p drawn with the uniform of the node's depth), accepts the
path that follows those picks from the root, writes that path's K/V to consecutive slots and
returns its tokens and features in path order (contract.TREE): the commit is the chain's
(runtime/verifiers.py: commit), shared as a function; the tree verifier stands beside the chain
on the `Verifier` interface, not on its internals.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from dflash_qaic import contract
from dflash_qaic.runtime import verifiers


@dataclass
class Tree:
    """A tree in best-first order: row 0 is the root (the last committed token)."""

    parents: list[int]  # row -> its parent row (-1: the root)
    depths: list[int]  # row -> its depth (its position is start + depth)
    tokens: list[int]  # row -> its token (the root's: the anchor)
    gains: np.ndarray  # [rows]: expected committed tokens of the tree of the first i + 1 rows


def build_tree(
    top_ids: np.ndarray,
    top_logprobs: np.ndarray,
    size: int,
    root: int,
    pair: np.ndarray | None = None,
) -> Tree:
    """The best-first tree of at most `size` rows over the draft's top-k per depth: top_ids,
    top_logprobs [B − 1, k] (row d − 1: the candidates for depth d, most likely first).
    pair [B − 1, k', k'] (a DFlash-2 draft's, contract.DRAFT_PAIR_LOGPROBS): a node's children
    are its depth's first k' candidates, ranked and scored by their log q after the node's own
    candidate (the root's: after the anchor) instead of by their marginal."""
    ids = top_ids.tolist()
    depth_max = len(ids)
    if pair is None:  # every parent ranks its children alike: the marginal order
        k = len(ids[0])
        lp = [[row] for row in top_logprobs.tolist()]  # [d][0][rank]
        order = [[list(range(k))] for _ in range(depth_max)]
        same = True
    else:
        k = pair.shape[-1]
        order_np = np.argsort(-pair, axis=-1, kind="stable")  # [B − 1, k, k]: ranks per parent
        lp = np.take_along_axis(pair, order_np, -1).tolist()  # [d][parent's candidate][rank]
        order = order_np.tolist()
        same = False
    # a node: its row, its candidate index at its depth (its children's conditional); heap
    # entries (−score, depth, rank, parent row)
    parents, depths, tokens, scores, cands = [-1], [0], [root], [0.0], [0]
    heap = [(-lp[0][0][0], 1, 0, 0)] if depth_max and size > 1 else []
    while heap and len(parents) < size:
        neg, d, r, p = heapq.heappop(heap)
        pc = 0 if same else cands[p]
        c = order[d - 1][pc][r]
        row = len(parents)
        parents.append(p)
        depths.append(d)
        tokens.append(ids[d - 1][c])
        scores.append(-neg)
        cands.append(c)
        if r + 1 < k:  # the next sibling
            heapq.heappush(heap, (-(scores[p] + lp[d - 1][pc][r + 1]), d, r + 1, p))
        if d < depth_max:  # the first child
            heapq.heappush(heap, (neg - lp[d][0 if same else c][0], d + 1, 0, row))
    return Tree(parents, depths, tokens, np.cumsum(np.exp(scores)))


class TreeVerifier:
    """The verifier of a tree program (contract.TREE): each live row verifies the first n rows
    of its best-first tree, n picked per call by `StepCosts.best_rows` from the trees' expected
    tokens and the measured call costs (`EngineConfig.tree_sizes`: the verify lengths and the
    tree budgets, or one budget). Near the end of the context a row's tree is cut to the slots
    left, and a row that decodes this step (the step policy's choice) has the root alone. The
    program returns the accepted count and the path in order, so `commit` is the chain's."""

    def __init__(self, step):
        self.step = step
        self.sizes = list(step.trees)
        big, rows = max(self.sizes), step.plan.cache_rows
        self.lens = np.zeros(rows, np.int64)  # each row's tree rows this step
        self._depth = np.zeros((rows, big), np.int64)  # each row's node depths this step
        self._u = np.zeros((big, contract.N_RANDOM), np.float32)  # one row's uniforms by depth

    def fill(self, rows: np.ndarray, seqs: list):
        s, st = self.step, self.step.state
        if st.top_ids is None:
            raise RuntimeError(
                "a tree step needs the draft's top-k (draft_top_ids): re-export with --tree-budgets"
            )
        trees = {}
        for seq in seqs:
            r = seq.slot
            room = s.max_pos - int(st.start[r])  # rows whose positions and slots stay below
            size = 1 if st.decoding[r] else min(self.sizes[-1], room)
            # a DFlash-2 draft's selector ranks a sampled row's branches (its q predicts a
            # draw); a greedy row's by the marginals, which predict the argmax better
            # (docs/DESIGN.md, Tree verification)
            sampled = st.top_pair is not None and seq.uniforms is not None
            pair = st.top_pair[r] if sampled else None
            tree = build_tree(st.top_ids[r], st.top_logprobs[r], size, int(st.anchor[r]), pair)
            trees[r] = tree
        n = self.size(trees)
        c = s.bufs.verify[n]  # ids, pos [N, n]; tree [N, n, n]
        c.pos.fill(contract.PAD_POSITION)  # rows without a sequence, and past each tree
        self.lens.fill(0)
        for r, t in trees.items():
            m = min(n, len(t.parents))
            depth = self._depth[r, :n]
            depth.fill(0)
            depth[:m] = t.depths[:m]
            c.ids[r, :m] = t.tokens[:m]
            c.pos[r, :m] = st.start[r] + depth[:m]
            mask = c.tree[r]  # row i sees its ancestors and itself
            mask.fill(0)
            # a padding row (past this row's tree: cut at the end of the context, or a row
            # that decodes, its root alone) sees itself only: a row that sees nothing would
            # count as on the accepted path (no ancestor of it fails)
            np.fill_diagonal(mask, 1)
            for i in range(1, m):
                mask[i] = mask[t.parents[i]]
                mask[i, i] = 1
            self.lens[r] = m
        return n, c

    def size(self, trees: dict) -> int:
        """The call's rows: the size of most expected tokens per second over the live rows."""
        if len(self.sizes) == 1:
            return self.sizes[0]
        sizes = np.asarray(self.sizes)
        gains = np.zeros(len(sizes))
        for t in trees.values():
            gains += t.gains[np.minimum(sizes, len(t.gains)) - 1]
        return self.step.costs.best_rows(self.sizes, gains)

    def call(self, n: int, c, seqs: list) -> dict:
        """The verify call; a sampled row's node of depth d draws with the uniforms of the token
        at start + d + 1, so the tokens a seed gives do not depend on the tree's shape."""
        s = self.step

        def by_depth(seq, u: np.ndarray) -> None:  # u: the row's [n, 2] of random_u
            seq.fill_uniforms(self._u[:n], int(s.state.start[seq.slot]) + 1)
            np.take(self._u, self._depth[seq.slot, :n], axis=0, out=u)

        return s._target("verify", n, c, seqs, s.costs, by_depth)

    def accept(self, n: int, c, out: dict) -> np.ndarray:
        return out[contract.NUM_ACCEPTED].astype(np.int64, copy=False)

    def commit(self, rows, seqs: list, n: int, out: dict, acc: np.ndarray) -> list:
        return verifiers.commit(self.step, self.lens, rows, seqs, n, out, acc)
