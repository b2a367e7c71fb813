"""The host buffers of every program call the engine makes, allocated once and refilled in place
(docs/DESIGN.md, Runtime). One dataclass per call kind; each holds its feeds already bound by
name to the contract's inputs (`bind`), so a call hands the same dict to the program every time
and reordering the contract cannot rebind a tensor.

    StepBuffers     the calls over every slot (full_batch_size rows): verify at each verify
                    length, decode, the draft block
    PrefillBuffers  the batch-1 calls of one prompt: a target chunk at each prefill length, the
                    draft's prompt context at each DraftPrefill row count (per slot)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_qaic import contract
from dflash_qaic.runtime.history import ExtendedRows


def bind(io, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The feeds of a call of the program with contract I/O `io` (TargetIO / DraftIO): every
    input but the caches, by name, in the contract's order. A name the contract has and
    `arrays` lacks, or the reverse, is an error."""
    kv = {s.name for s in io.kv}
    names = [s.name for s in io.inputs if s.name not in kv]
    missing, extra = set(names) - set(arrays), set(arrays) - set(names)
    if missing or extra:
        raise ValueError(
            f"the host buffers do not match the program's inputs: missing {sorted(missing)}, "
            f"unknown {sorted(extra)}"
        )
    return {n: arrays[n] for n in names}


@dataclass
class SamplingRows:
    """The target's sampling inputs of a call's rows (contract.SAMPLING_INPUTS)."""

    temperature: np.ndarray  # float32 [rows]
    top_k: np.ndarray  # int64 [rows]
    top_p: np.ndarray  # float32 [rows]
    u: dict[int, np.ndarray]  # sample_len -> float32 [rows, sample_len, N_RANDOM]
    # the extended sampling inputs (runtime/history.py), when the program takes them
    ext: ExtendedRows | None = None

    @classmethod
    def alloc(cls, rows: int, sample_lens, extended_vocab: int = 0) -> SamplingRows:
        u = {n: np.zeros((rows, n, contract.N_RANDOM), np.float32) for n in sorted(sample_lens)}
        ext = ExtendedRows(rows, extended_vocab) if extended_vocab else None
        return cls(
            np.zeros(rows, np.float32), np.zeros(rows, np.int64), np.ones(rows, np.float32), u, ext
        )

    def set_row(self, r: int, sp, req=None) -> None:
        """Row r's settings (runtime.pipeline.Sampling), or greedy for None; req: the row's
        request (its prompt and stop set: the extended inputs' history starts there)."""
        self.temperature[r] = sp.temperature if sp else 0.0
        self.top_k[r] = sp.top_k if sp else 0
        self.top_p[r] = sp.top_p if sp else 1.0
        if self.ext is not None:
            self.ext.set_row(r, sp, req)

    def arrays(self, sample_len: int) -> dict[str, np.ndarray]:
        out = {
            contract.TEMPERATURE: self.temperature,
            contract.TOP_K: self.top_k,
            contract.TOP_P: self.top_p,
            contract.RANDOM_U: self.u[sample_len],
        }
        return out | (self.ext.arrays() if self.ext is not None else {})


@dataclass
class TargetCall:
    """A target call of rows × n tokens: its ids and positions, and its feeds per sample_len."""

    ids: np.ndarray  # int64 [rows, n]
    pos: np.ndarray  # int64 [rows, n]
    feeds: dict[int, dict[str, np.ndarray]]  # sample_len -> the call's named feeds
    # structured output: int32 [rows, n, words], the grammar's allowed tokens per row (all
    # ones, -1, on a row without a grammar); None when the program has no token bitmask
    mask: np.ndarray | None = None
    # a tree program (contract.TREE_MASK): int32 [rows, n, n], row r sees row c; lower-
    # triangular (a chain) unless a tree step writes a tree (runtime/tree.py)
    tree: np.ndarray | None = None
    # logprobs (contract.LOGPROB_IDS): int64 [rows, n], the token each row scores (a prompt
    # row's next prompt token); None when the program returns no logprobs
    scored: np.ndarray | None = None


@dataclass
class DraftCall:
    """A draft call: n rows of target features as context, then the block."""

    ctx: np.ndarray  # float32 [rows, n, H]: target features of committed tokens
    ctx_pos: np.ndarray  # int64 [rows, n]: their positions (-1: none)
    blk_ids: np.ndarray  # int64 [rows, B]: [anchor, MASK, …]
    blk_pos: np.ndarray  # int64 [rows, B]
    feeds: dict[str, np.ndarray]


class _Shared:
    """Arrays every call of one batch size shares: the cache row of each call row, the sampling
    rows, the attention windows."""

    def __init__(self, plan: contract.ShapePlan, rows: int, sample_lens, target_io, draft_io):
        self.plan, self.target_io, self.draft_io = plan, target_io, draft_io
        self.bidx = np.zeros((rows, 1), np.int64)  # batch_index: the cache row of each row
        self.slot_ids = np.arange(rows, dtype=np.int64)
        vocab = target_io.vocab_size if target_io.extended_sampling else 0
        self.sampling = SamplingRows.alloc(rows, sample_lens, vocab)
        # a DFlash-2 draft exported for sampling: its uniform per proposal in, its q out and
        # into the target (docs/DESIGN.md, DFlash-2 drafts); the rows' temperatures are shared
        B = plan.block_size
        self.draft_u = np.zeros((rows, B - 1), np.float32) if draft_io.q_top_k else None
        dq = target_io.draft_q if target_io.sampling else ()
        self.q = {}
        if dq:
            self.q[contract.DRAFT_Q_IDS] = np.zeros((rows, *dq), np.int64)
            self.q[contract.DRAFT_Q_PROBS] = np.zeros((rows, *dq), np.float32)
        # attention windows (contract.COMP_CTX_LENGTHS): a call reads the smallest one holding
        # every slot it needs, so its cost follows the context, not ctx_len
        self.draft_ext = []  # the draft's extended sampling inputs (contract.draft_extended_specs)
        if draft_io.extended_sampling:
            self.draft_ext = contract.draft_extended_specs(draft_io.vocab_size)
        self.windows = list(plan.windows or ())
        self.window_ids = {n: np.arange(n, dtype=np.int64) for n in self.windows}

    def _common(self) -> dict[str, np.ndarray]:
        out = {}
        if self.plan.full_batch_size is not None:
            out[contract.BATCH_INDEX] = self.bidx
        if self.plan.windows:
            out[contract.COMP_CTX_LENGTHS] = self.window_ids[self.plan.windows[-1]]
        return out

    def target_call(
        self, ids: np.ndarray, pos: np.ndarray, sample_lens, mask=None, scored=None
    ) -> TargetCall:
        if scored is None and self.target_io.logprobs:
            scored = np.zeros(ids.shape, np.int64)
        if mask is None and self.target_io.token_bitmask:
            words = contract.bitmask_words(self.target_io.vocab_size)
            mask = np.full((*ids.shape, words), -1, np.int32)
        tree = None
        if self.target_io.rule.takes_tree:
            rows, n = ids.shape
            tree = np.broadcast_to(np.tri(n, dtype=np.int32), (rows, n, n)).copy()
        feeds = {}
        for s in sample_lens:
            arrays = {contract.INPUT_IDS: ids, contract.POSITION_IDS: pos, **self._common()}
            if tree is not None:
                arrays[contract.TREE_MASK] = tree
            if self.plan.sampling:
                arrays.update(self.sampling.arrays(s))
                arrays.update(self.q)
            if mask is not None:
                arrays[contract.TOKEN_BITMASK] = mask
            if scored is not None:
                arrays[contract.LOGPROB_IDS] = scored
            feeds[s] = bind(self.target_io, arrays)
        return TargetCall(ids, pos, feeds, mask, tree, scored)

    def draft_call(self, ctx, ctx_pos, blk_ids, blk_pos, ext=None) -> DraftCall:
        """ext: the extended sampling arrays the draft reads, by name (None: this call's rows,
        the target's arrays themselves: never a copy)."""
        arrays = {
            contract.TARGET_HIDDEN: ctx,
            contract.POSITION_IDS_TARGET: ctx_pos,
            contract.INPUT_IDS: blk_ids,
            contract.POSITION_IDS: blk_pos,
            **self._common(),
        }
        if self.draft_ext:  # adjusts its proposals as the target's rows will be
            ext = self.sampling.ext.arrays() if ext is None else ext
            arrays.update((t.name, ext[t.name]) for t in self.draft_ext)
        if self.draft_u is not None:
            arrays[contract.TEMPERATURE] = self.sampling.temperature
            arrays[contract.DRAFT_RANDOM_U] = self.draft_u
        return DraftCall(ctx, ctx_pos, blk_ids, blk_pos, bind(self.draft_io, arrays))

    def window(self, feeds: dict, needed: int) -> dict:
        """`feeds` reading the smallest attention window that holds slots 0 … needed-1."""
        if self.window_ids:
            n = contract.window_for(self.windows, needed)
            feeds[contract.COMP_CTX_LENGTHS] = self.window_ids[n]
        return feeds


class StepBuffers(_Shared):
    """The calls over every slot: row r is cache row r (an inactive row has batch_index -1)."""

    def __init__(self, plan, lengths, target_io, draft_io, mask_id: int):
        N, B, H = plan.cache_rows, plan.block_size, draft_io.hidden_size
        sample_lens = {plan.sample_len(n, g) for n in (1, *lengths) for g in (True, False)}
        super().__init__(plan, N, sample_lens, target_io, draft_io)

        def target(n: int) -> TargetCall:
            ids, pos = np.zeros((N, n), np.int64), np.zeros((N, n), np.int64)
            return self.target_call(ids, pos, {plan.sample_len(n, g) for g in (True, False)})

        self.verify = {n: target(n) for n in lengths}
        self.decode = target(1)
        self.draft = self.draft_call(
            np.zeros((N, B, H), np.float32),
            np.zeros((N, B), np.int64),
            np.full((N, B), mask_id, np.int64),
            np.zeros((N, B), np.int64),
        )


class PrefillBuffers(_Shared):
    """The batch-1 calls of a prompt. A target chunk of each prefill length (views of one
    [1, C] pair); the draft's prompt context per slot (its rows wait there across chunks, and
    prefills of several slots may interleave), allocated at a slot's first prompt. A draft
    taking the extended sampling inputs reads the slot's row of the step's (views, no copy):
    the history a decoding row drafting again has there, empty at the prompt's end."""

    def __init__(self, plan, target_io, draft_io, mask_id: int, step_ext=None):
        """step_ext: the step's ExtendedRows, whose slot row a DraftPrefill call reads."""
        C, B = plan.prefill_seq_len, plan.block_size
        sample_lens = {plan.sample_len(n, g) for n in plan.prefill_lengths for g in (True, False)}
        super().__init__(plan, 1, sample_lens, target_io, draft_io)
        self.H, self.mask_id = draft_io.hidden_size, mask_id
        ids, pos = np.zeros((1, C), np.int64), np.zeros((1, C), np.int64)
        scored = np.zeros((1, C), np.int64) if target_io.logprobs else None
        mask = None
        if target_io.token_bitmask:
            mask = np.full((1, C, contract.bitmask_words(target_io.vocab_size)), -1, np.int32)
        self.chunk = {
            L: self.target_call(
                ids[:, :L],
                pos[:, :L],
                {plan.sample_len(L, g) for g in (True, False)},
                None if mask is None else mask[:, :L],
                None if scored is None else scored[:, :L],
            )
            for L in plan.prefill_lengths
        }
        self.blk_ids = np.full((1, B), mask_id, np.int64)
        self.blk_pos = np.zeros((1, B), np.int64)
        self._ctx: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # slot -> ctx, ctx_pos
        self._calls: dict[tuple[int, int], DraftCall] = {}  # (slot, rows) -> its call
        self.step_ext = step_ext

    def context(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """The slot's prompt-context rows: float32 [1, D, H] and int64 [1, D]."""
        if slot not in self._ctx:
            D = self.plan.draft_prefill_rows[-1]
            self._ctx[slot] = np.zeros((1, D, self.H), np.float32), np.zeros((1, D), np.int64)
        return self._ctx[slot]

    def draft_prefill(self, slot: int, rows: int) -> DraftCall:
        """The DraftPrefill call of `rows` context rows, from the slot's context."""
        call = self._calls.get((slot, rows))
        if call is None:
            ctx, ctx_pos = self.context(slot)
            ext = None
            if self.draft_ext:  # the slot's history as the step holds it: [1, …] views
                ext = {n: a[slot : slot + 1] for n, a in self.step_ext.arrays().items()}
            call = self.draft_call(
                ctx[:, :rows], ctx_pos[:, :rows], self.blk_ids, self.blk_pos, ext
            )
            self._calls[slot, rows] = call
        return call
