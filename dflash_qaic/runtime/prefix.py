"""Automatic prefix caching (docs/DESIGN.md, Prefix caching): a prompt that extends what a
cache row (or the host tier) already holds resumes from the match instead of position 0.

Matching is by hashed token blocks, as vLLM does: a full block of `BLOCK` tokens hashes its
parent's hash and its ids (sha256), so two prompts share block k's hash only when they share
every token up to its end; the first block's parent is the *root*, the sha256 of the artifacts'
identity (both programs' ONNX sha256, `handoff.fingerprint`) and the request's `cache_salt`, so
requests of different salts, or of other artifacts, never share a block. Hashing runs per block
of prompt at admission and per new block of output at retirement, never per step.

Where state is held (`Entry`): a finished request's cache row stays resident (LRU over the idle
rows: a row is given to another request only when no empty row is free) and, when it is evicted
and a host tier is set (`kv_offloading_size`, GiB), its slot states go to the host
(`Program.read_slot`: the target's rows and the draft's cache), LRU, bounded in bytes.
An entry holds positions 0 … end − 1 of its tokens in the target and 0 … draft_end − 1 in the
draft, plus `owed`: the fused features of draft_end … end − 1, committed by the target but not
yet sent to the draft (the last step's rows and any context a decoding row kept waiting), so the
draft's context comes back whole and acceptance equals a cold run's.

Where a hit may resume (`Entry.resume`): at r ≤ end with prompt[:r] equal to the entry's
tokens, r ≤ P − 1 (the last prompt token is always computed: its logits give the first token).
A target whose state rolls (Gated DeltaNet states, sliding rings: state.rolls) holds its state
at `end`, and at the block boundaries its prefill saved (`Mark`), so it resumes at r = end or
at the furthest mark ≤ r, never elsewhere; a draft whose state rolls needs r ≥ draft_end (or a
mark). A full-attention cache resumes at any r: positions r … are rewritten by the new prefill
before any query reads them (a query at p reads only slots ≤ p, each written by this request's
calls or held from the matching prefix).

Marks (`Mark`): where a state rolls, a prompt's prefill ends a chunk at chosen 16-token block
boundaries b (`Sequence.marks`: the prompt's last whole block before its last token, and the
furthest block it shares with a cached entry, where prompts branch: the agent's system prompt)
and copies the rolling buffers there (`read_slot(row, 0)`: the recurrent states, conv windows
and rings whole, no positional slot), with the draft's context still owed at b. The positional
caches need no copy: the row keeps positions < b, which no later call of that request rewrites.
A hit at a mark writes the rolling buffers back into the row (after the host tier's state, for
a host entry). An entry keeps at most `MARKS` of them, carried on to the entry of a request
that resumed at or past them.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import heapq
import json
import weakref
from dataclasses import dataclass

import numpy as np

from dflash_qaic.state import SlotState

__all__ = ["BLOCK", "Entry", "Mark", "PrefixCache", "block_hashes", "root_key"]

BLOCK = 16  # tokens per hashed block (vLLM's default block size)
GIB = 1 << 30
MARKS = 4  # saved block boundaries per entry: its earliest and its latest three


def root_key(identity: dict, salt: str | None) -> bytes:
    """The parent hash of a prompt's first block: the artifacts' identity and the cache salt."""
    text = json.dumps(identity, sort_keys=True) + "\0" + (salt or "")
    return hashlib.sha256(text.encode()).digest()


def block_hashes(parent: bytes, ids, first: int = 0) -> list[bytes]:
    """The chained hashes of the full blocks of `ids` from block `first` (`parent`: the hash of
    block first − 1, or the root)."""
    a = np.asarray(ids, "<i8")
    out = []
    for k in range(first, len(a) // BLOCK):
        parent = hashlib.sha256(parent + a[k * BLOCK : (k + 1) * BLOCK].tobytes()).digest()
        out.append(parent)
    return out


def _common(a: list[bytes], b: list[bytes]) -> int:
    """How many leading block hashes `a` and `b` share."""
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def _nbytes(*states) -> int:
    return sum(a.nbytes for st in states if st is not None for a in st.arrays.values())


@dataclass
class Mark:
    """A rolling state saved at block boundary `end` of a prompt: the target's rolling buffers
    (`target`; None when only the draft rolls), the draft's (`draft`; None when it does not
    roll), the draft's positions held there (`draft_end`; None: no draft state) and the
    features it still owed, of draft_end … end − 1 (`owed`)."""

    end: int
    draft_end: int | None
    owed: np.ndarray | None
    target: SlotState | None
    draft: SlotState | None

    @property
    def nbytes(self) -> int:
        return _nbytes(self.target, self.draft) + (0 if self.owed is None else self.owed.nbytes)


@dataclass
class Entry:
    """One cached state: `tokens` its positions 0 … end − 1, `hashes` their full blocks' hashes,
    `draft_end` the draft's positions held (None: no draft state), `owed` the features of
    draft_end … end − 1 [end − draft_end, H]; resident in cache row `row`, or on the host
    (`saved`: the target's and the draft's slot states)."""

    root: bytes
    tokens: np.ndarray
    hashes: list[bytes]
    draft_end: int | None
    owed: np.ndarray | None
    row: int | None = None
    saved: tuple[SlotState, SlotState | None] | None = None
    marks: list[Mark] = dataclasses.field(default_factory=list)  # ascending ends < end

    @property
    def end(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Host bytes of its slot states, owed features and marks."""
        n = 0 if self.owed is None else self.owed.nbytes
        return n + _nbytes(*(self.saved or ())) + sum(m.nbytes for m in self.marks)

    def resume(self, ids, hashes, rolls: tuple[bool, bool], dflash: bool) -> int:
        """Where a prompt `ids` (its block `hashes`) resumes from this entry (0: no hit);
        `rolls`: whether the target's and the draft's states roll."""
        if dflash and self.draft_end is None:
            return 0
        limit = min(self.end, len(ids) - 1)
        r = min(_common(hashes, self.hashes) * BLOCK, limit)
        if r < limit:  # the partial block: token by token (at most BLOCK − 1)
            a = np.asarray(ids[r : min(limit, r + BLOCK)])
            same = a == self.tokens[r : r + len(a)]
            r += len(a) if same.all() else int(same.argmin())
        if self._held(r, rolls, dflash):
            return r
        # a rolling state exists at `end` and at the marks only: the furthest mark ≤ r
        ok = [m.end for m in self.marks if m.end <= r and (not dflash or m.draft_end is not None)]
        return max(ok, default=0)

    def _held(self, r: int, rolls: tuple[bool, bool], dflash: bool) -> bool:
        """Whether the entry's own state (no mark) resumes at r."""
        if rolls[0] and r != self.end:
            return False
        return not (dflash and rolls[1] and r < self.draft_end)

    def at(self, r: int, rolls: tuple[bool, bool], dflash: bool) -> Mark | None:
        """The mark a resume at r (from `resume`) restores; None: the entry's own state."""
        if r == 0 or self._held(r, rolls, dflash):
            return None
        return next(m for m in self.marks if m.end == r)


class PrefixCache:
    """The entries of one set of programs (resident rows and the host tier) and the counters
    (`queries`, `hits`: prompt tokens asked and found, vLLM's prefix_cache_queries/_hits)."""

    def __init__(self, identity: dict, rolls: tuple[bool, bool], host_gib: float = 0.0):
        self.identity, self.rolls = identity, rolls
        self.limit = int(host_gib * GIB)
        self.rows: collections.OrderedDict[int, Entry] = collections.OrderedDict()  # LRU first
        self.host: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self.host_bytes = 0
        self.queries = self.hits = 0

    def root(self, salt: str | None) -> bytes:
        return root_key(self.identity, salt)

    def lookup(self, root: bytes, ids, hashes, dflash: bool) -> tuple[Entry | None, int]:
        """The entry a prompt resumes furthest from (resident first on a tie) and where; a host
        entry only for a whole block or more."""
        best, where = None, 0
        for e in [*self.rows.values(), *self.host.values()]:
            if e.root != root:
                continue  # another salt or other artifacts: never shared
            r = e.resume(ids, hashes, self.rolls, dflash)
            if r > where and (e.row is not None or r >= BLOCK):
                best, where = e, r
        return best, where

    def common_blocks(self, root: bytes, hashes) -> int:
        """The most leading blocks `hashes` shares with an entry of `root` (where a prompt
        branches from what is cached: a mark is saved there)."""
        held = [*self.rows.values(), *self.host.values()]
        return max((_common(hashes, e.hashes) for e in held if e.root == root), default=0)

    def count(self, prompt: int, hit: int) -> None:
        self.queries += prompt
        self.hits += hit

    def forget(self, row: int) -> Entry | None:
        """The resident entry of `row` leaves the index (the row is being written)."""
        return self.rows.pop(row, None)

    def keep(self, row: int, entry: Entry) -> None:
        entry.row = row
        self.rows.pop(row, None)
        self.rows[row] = entry  # the most recently used

    def offload(self, entry: Entry, row: int, target, draft) -> None:
        """An evicted resident entry of `row` to the host tier (when set and it fits), the
        least recently used host entries out first."""
        entry.row = None
        if self.limit <= 0:
            return
        entry.saved = (
            target.read_slot(row, entry.end),
            None if entry.draft_end is None else draft.read_slot(row, entry.draft_end),
        )
        n = entry.nbytes
        if n > self.limit:
            entry.saved = None
            return
        while self.host_bytes + n > self.limit:
            self.drop(next(iter(self.host.values())))
        self.host[id(entry)] = entry
        self.host_bytes += n

    def drop(self, entry: Entry) -> None:
        """A host entry leaves the tier (evicted)."""
        self.claim(entry)
        entry.saved = None

    def claim(self, entry: Entry) -> None:
        """An entry a request resumes from leaves the index (its slot states, for a host entry,
        kept until they are written)."""
        if entry.row is not None:
            self.forget(entry.row)
        elif self.host.pop(id(entry), None) is not None:
            self.host_bytes -= entry.nbytes

    def evict(self, row: int, target, draft) -> None:
        """Row `row`'s resident entry leaves it (to the host tier when set)."""
        entry = self.forget(row)
        if entry is not None:
            self.offload(entry, row, target, draft)

    def clear(self) -> None:
        self.rows.clear()
        self.host.clear()
        self.host_bytes = 0


# ---------------------------------------------------------------------------------------------
# the engine's side (runtime/engine.py calls these at admission, entry and retirement)


def shared(pipe, config) -> PrefixCache | None:
    """The pipeline's cache for an engine of `config` (kept across its engines, since the
    programs' rows are); None, and the pipeline's cache dropped, when caching is off."""
    from dflash_qaic.runtime import handoff
    from dflash_qaic.state import rolls

    cache = getattr(pipe, "prefix_cache", None)
    if not config.enable_prefix_caching:
        pipe.prefix_cache = None
        return None
    gib = config.kv_offloading_size or 0.0
    if cache is None or cache.limit != int(gib * GIB):
        m = pipe.artifacts
        spin = (rolls(m.target.io.state or ()), rolls(m.draft.io.state or ()))
        cache = pipe.prefix_cache = PrefixCache(handoff.fingerprint(m), spin, gib)
        _register(cache, pipe.target, pipe.draft)
    return cache


#: program id -> the caches holding entries on its rows (pipelines may share a program)
_USERS: dict[int, weakref.WeakSet] = {}


def _register(cache: PrefixCache, *programs) -> None:
    for p in programs:
        _USERS.setdefault(id(p), weakref.WeakSet()).add(cache)


def _take(engine, slot: int) -> int:
    """`slot` out of the free rows; every other cache with an entry there (another pipeline
    over the same target or draft program) forgets it: the row is about to be written."""
    engine.free.remove(slot)
    heapq.heapify(engine.free)
    pre = engine.prefill
    for p in (pre.target, pre.draft):
        for other in list(_USERS.get(id(p), ())):
            if other is not engine.prefix:
                other.forget(slot)
    return slot


def free_row(engine) -> int:
    """A free cache row for a request that hits nothing there: the lowest holding no entry,
    else the least recently used idle row (its entry evicted, to the host tier when set)."""
    cache = engine.prefix
    if cache is None:
        return _take(engine, min(engine.free))
    empty = [r for r in engine.free if r not in cache.rows]
    slot = _take(engine, min(empty) if empty else next(iter(cache.rows)))
    cache.evict(slot, engine.prefill.target, engine.prefill.draft)
    return slot


def take_row(engine, seq) -> int:
    """The cache row a queued `seq` is admitted into: the row of the resident entry it resumes
    from, else a free row (`free_row`); its hit (`seq.resume`) is entered with its prefill."""
    cache = engine.prefix
    if cache is None:
        return free_row(engine)
    ids = seq.req.ids
    seq.root = cache.root(seq.req.cache_salt)
    seq.hashes = block_hashes(seq.root, ids)
    if getattr(seq, "handoff", None) is not None:  # prefilled elsewhere: its state arrives whole
        return free_row(engine)
    if seq.logprobs is not None and seq.logprobs.prompt is not None:
        cache.count(len(ids), 0)  # prompt logprobs need every prompt row computed (as vLLM)
        return free_row(engine)
    entry, r = cache.lookup(seq.root, ids, seq.hashes, engine.prefill.dflash)
    cache.count(len(ids), r)
    _choose_marks(engine, seq, r)
    if entry is None:
        return free_row(engine)
    seq.resume = (entry, r)
    row = entry.row
    cache.claim(entry)
    return free_row(engine) if row is None else _take(engine, row)


def _choose_marks(engine, seq, r: int) -> None:
    """Where `seq`'s prefill saves its rolling states (module docstring, Marks): past its hit r,
    the furthest block it shares with a cached entry and its last whole block before its last
    token; none where no state rolls."""
    cache, dflash = engine.prefix, engine.prefill.dflash
    if not (cache.rolls[0] or (dflash and cache.rolls[1])):
        return
    last = (len(seq.req.ids) - 1) // BLOCK * BLOCK
    branch = min(cache.common_blocks(seq.root, seq.hashes) * BLOCK, last)
    seq.marks = sorted({b for b in (branch, last) if b > r})


def save_mark(engine, seq) -> None:
    """After a prefill chunk: at one of `seq`'s marks, its rolling buffers (the target's, the
    draft's) and the draft's owed context there are kept (`Mark`) for its entry."""
    b, pre = seq.prefilled, engine.prefill
    if b in seq.marks:
        owed = pre.bufs.context(seq.slot)[0][0, : seq.pending].copy() if pre.dflash else None
        seq.saved.append(_mark(engine, seq.slot, b, owed))


def _mark(engine, slot: int, b: int, owed: np.ndarray | None) -> Mark:
    """Row `slot`'s rolling buffers at block boundary b, the draft owing `owed` (None: no
    draft) for the positions before b."""
    pre, rolls = engine.prefill, engine.prefix.rolls
    target = pre.target.read_slot(slot, 0) if rolls[0] else None  # no positional slot
    draft = pre.draft.read_slot(slot, 0) if pre.dflash and rolls[1] else None
    return Mark(b, None if owed is None else b - len(owed), owed, target, draft)


def enter(engine, seq) -> None:
    """`seq`'s hit into its row: a host entry's slot states written (`write_slot`), a mark's
    rolling buffers over them, the target resumes at r, and the draft's owed context up to r is
    queued (the hand-off's path). The entry's marks up to r are carried to `seq`'s entry."""
    from dflash_qaic.runtime import handoff

    (entry, r), seq.resume = seq.resume, None
    pre = engine.prefill
    mark = entry.at(r, engine.prefix.rolls, pre.dflash)
    if entry.saved is not None:  # from the host tier
        (target, draft), entry.saved = entry.saved, None
        pre.target.write_slot(seq.slot, target)
        if pre.dflash:
            pre.draft.write_slot(seq.slot, draft)
    if mark is not None:  # the rolling states at block boundary r
        if mark.target is not None:
            pre.target.write_slot(seq.slot, mark.target)
        if pre.dflash and mark.draft is not None:
            pre.draft.write_slot(seq.slot, mark.draft)
    seq.saved = [m for m in entry.marks if m.end <= r]
    seq.prefilled = seq.cached = r
    point = entry if mark is None else mark
    if pre.dflash and r > point.draft_end:
        room = min(engine.plan.prefill_seq_len, len(seq.req.ids) - r)
        feats = point.owed[: r - point.draft_end]
        handoff.queue_context(engine, seq, feats, point.draft_end, room)


def ended(engine, seqs) -> None:
    """After a step: the sequences it ended keep how many of their last committed rows the
    draft never took (a verify's rows; a decode call's row already waits in its context)."""
    queued = getattr(engine.spec, "_queued", True) or not engine.prefill.dflash
    for seq in seqs:
        if seq.reason is not None:
            seq.unsent = 0 if queued else seq.last_run


def keep(engine, seq) -> None:
    """A retiring sequence's row stays resident as an entry: its tokens with state in the
    target, the draft's, and the features the draft still owes (none after a failure, or where
    a rolling state is not at a known token)."""
    cache, slot, pre = engine.prefix, seq.slot, engine.prefill
    if cache is None or seq.reason == "error" or getattr(seq, "root", None) is None:
        return
    end = seq.prefilled if seq.t_dec is None else seq.end
    known = seq.req.ids + seq.tokens + seq.tail  # a cut last commit's tokens are committed
    T = min(end, len(known))
    if T < 1 or (cache.rolls[0] and T != end):
        return
    draft_end = owed = None
    if pre.dflash:
        parts = [pre.bufs.context(slot)[0][0, : seq.pending]]
        if seq.unsent:
            parts.append(engine.spec.bufs.draft.ctx[slot, : seq.unsent])
        owed = np.concatenate(parts)  # a copy
        draft_end = end - len(owed)
        owed = owed[: max(0, T - draft_end)]
        if draft_end < 0 or (cache.rolls[1] and T < draft_end):
            return
    tokens = np.asarray(known[:T], np.int64)
    n = min(len(seq.hashes), T // BLOCK)
    hashes = seq.hashes[:n]
    hashes += block_hashes(hashes[-1] if hashes else seq.root, tokens, n)
    marks = {m.end: m for m in seq.saved if m.end < T and (m.draft_end is None) == (owed is None)}
    marks = [marks[b] for b in sorted(marks)]
    marks = marks[:1] + marks[1:][-(MARKS - 1) :]  # the earliest and the latest
    cache.keep(slot, Entry(seq.root, tokens, hashes, draft_end, owed, marks=marks))


# ---------------------------------------------------------------------------------------------
# n > 1: one prompt's prefill forked into n cache rows


def choices(req, n: int) -> list:
    """The n child requests of a request: choice i samples with seed + i (vLLM's seeding of
    parallel sampling's children), its own generator; greedy choices are equal."""
    seed = req.sampling.seed
    out = []
    for i in range(n):
        sp = req.sampling if seed is None else dataclasses.replace(req.sampling, seed=seed + i)
        out.append(dataclasses.replace(req, sampling=sp))
    return out


def take_rows(engine, leader) -> list[int]:
    """Rows for a group (`leader` and its `fork`): the leader's as a lone request's (`take_row`:
    a cached prefix is its hit, resumed by `fork`), free rows for the others; each choice keeps
    the hashes for its entry at retirement and counts its prompt and the hit."""
    slots = [take_row(engine, leader)]
    r = 0 if leader.resume is None else leader.resume[1]
    for seq in leader.fork:
        if engine.prefix is not None:
            seq.root, seq.hashes = leader.root, leader.hashes
            engine.prefix.count(len(seq.req.ids), r)
        slots.append(free_row(engine))
    return slots


def fork(engine, leader) -> None:
    """The group's prompt but its last token prefilled once, in the leader's row (from its hit
    r, entered before: 0 on a miss), and its target state written into each follower's row
    (`write_slot`), with the draft's held positions on a hit; each row's draft context from
    there rebuilt from the features (the hit's owed ones, then the new ones: the hand-off's
    path); then each choice computes the last prompt token with its own sampler, as a decode
    side of the hand-off does."""
    from dflash_qaic.runtime import handoff

    followers = [f for f in leader.fork if not f.finished]  # an aborted one's row is not its
    leader.fork = []
    try:
        ids, pre = leader.req.ids, engine.prefill
        P, r, k = len(ids), leader.prefilled, leader.pending
        if P >= 2:
            feats = _group_prefill(engine, leader)
            state = pre.target.read_slot(leader.slot, P - 1)
            draft = pre.draft.read_slot(leader.slot, r - k) if pre.dflash and r else None
            for seq in followers:
                pre.target.write_slot(seq.slot, state)
                if draft is not None:
                    pre.draft.write_slot(seq.slot, draft)
            for seq in [leader, *followers]:
                seq.prefilled, seq.cached, seq.saved = P - 1, r, list(leader.saved)
                if pre.dflash:
                    handoff.queue_context(engine, seq, feats, r - k, 1)
    except Exception as e:
        engine._fail(followers, e)
        raise
    for seq in followers:
        seq.held = False


def _group_prefill(engine, leader) -> np.ndarray | None:
    """The group's prompt but its last token into the leader's row from its hit, a call ending
    at each of its marks, saved there (the draft not run yet: its state that of the hit, every
    feature since owed). Returns the features the draft is owed from the hit's draft_end: the
    hit's queued ones, then the new ones (None without a draft)."""
    from dflash_qaic.runtime import handoff

    pre, ids, lo, slot = engine.prefill, leader.req.ids, leader.prefilled, leader.slot
    parts = [pre.bufs.context(slot)[0][0, : leader.pending].copy()] if pre.dflash else None
    leader.pending = 0
    last = len(ids) - 1
    for end in [*(m for m in leader.marks if lo < m < last), last]:
        feats = handoff._prefill_rows(engine, ids[:end], slot, lo)
        lo = end
        if pre.dflash:
            parts.append(feats)
        if end < last:
            owed = np.concatenate(parts) if pre.dflash else None
            leader.saved.append(_mark(engine, slot, end, owed))
    return np.concatenate(parts) if pre.dflash else None
