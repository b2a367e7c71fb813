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
at `end` only, so it resumes at r = end exactly or not at all; a draft whose state rolls needs
r ≥ draft_end. A full-attention cache resumes at any r: positions r … are rewritten by the new
prefill before any query reads them (a query at p reads only slots ≤ p, each written by this
request's calls or held from the matching prefix).
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

__all__ = ["BLOCK", "Entry", "PrefixCache", "block_hashes", "root_key"]

BLOCK = 16  # tokens per hashed block (vLLM's default block size)
GIB = 1 << 30


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

    @property
    def end(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Host bytes of its slot states and owed features."""
        n = 0 if self.owed is None else self.owed.nbytes
        for st in self.saved or ():
            if st is not None:
                n += sum(a.nbytes for a in st.arrays.values())
        return n

    def resume(self, ids, hashes, rolls: tuple[bool, bool], dflash: bool) -> int:
        """Where a prompt `ids` (its block `hashes`) resumes from this entry (0: no hit);
        `rolls`: whether the target's and the draft's states roll."""
        if dflash and self.draft_end is None:
            return 0
        k = 0
        for a, b in zip(hashes, self.hashes):
            if a != b:
                break
            k += 1
        limit = min(self.end, len(ids) - 1)
        r = min(k * BLOCK, limit)
        if r < limit:  # the partial block: token by token (at most BLOCK − 1)
            a = np.asarray(ids[r : min(limit, r + BLOCK)])
            same = a == self.tokens[r : r + len(a)]
            r += len(a) if same.all() else int(same.argmin())
        if rolls[0] and r != self.end:
            return 0  # a rolling state exists at `end` only
        if dflash and rolls[1] and r < self.draft_end:
            return 0
        return r


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
    if seq.logprobs is not None and seq.logprobs.prompt is not None:
        cache.count(len(ids), 0)  # prompt logprobs need every prompt row computed (as vLLM)
        return free_row(engine)
    entry, r = cache.lookup(seq.root, ids, seq.hashes, engine.prefill.dflash)
    cache.count(len(ids), r)
    if entry is None:
        return free_row(engine)
    seq.resume = (entry, r)
    row = entry.row
    cache.claim(entry)
    return free_row(engine) if row is None else _take(engine, row)


def enter(engine, seq) -> None:
    """`seq`'s hit into its row: a host entry's slot states written (`write_slot`), the target
    resumes at r, and the draft's owed context up to r is queued (the hand-off's path)."""
    from dflash_qaic.runtime import handoff

    (entry, r), seq.resume = seq.resume, None
    pre = engine.prefill
    if entry.saved is not None:  # from the host tier
        (target, draft), entry.saved = entry.saved, None
        pre.target.write_slot(seq.slot, target)
        if pre.dflash:
            pre.draft.write_slot(seq.slot, draft)
    seq.prefilled = seq.cached = r
    if pre.dflash and r > entry.draft_end:
        room = min(engine.plan.prefill_seq_len, len(seq.req.ids) - r)
        feats = entry.owed[: r - entry.draft_end]
        handoff.queue_context(engine, seq, feats, entry.draft_end, room)


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
    cache.keep(slot, Entry(seq.root, tokens, hashes, draft_end, owed))


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
    """Rows for a group (`leader` and its `fork`): free rows, no lookup (the group's prompt is
    prefilled once and forked); each keeps its hashes for its entry at retirement."""
    slots = []
    for seq in [leader, *leader.fork]:
        if engine.prefix is not None:
            seq.root = engine.prefix.root(seq.req.cache_salt)
            seq.hashes = block_hashes(seq.root, seq.req.ids)
            engine.prefix.count(len(seq.req.ids), 0)
        slots.append(free_row(engine))
    return slots


def fork(engine, leader) -> None:
    """The group's prompt but its last token prefilled once, in the leader's row, and its
    target state written into each follower's row (`write_slot`); each row's draft context
    rebuilt from the features (the hand-off's path); then each choice computes the last prompt
    token with its own sampler, as a decode side of the hand-off does."""
    from dflash_qaic.runtime import handoff

    followers = [f for f in leader.fork if not f.finished]  # an aborted one's row is not its
    leader.fork = []
    try:
        ids, pre = leader.req.ids, engine.prefill
        P = len(ids)
        if P >= 2:
            feats = handoff._prefill_rows(engine, ids[: P - 1], leader.slot)
            state = pre.target.read_slot(leader.slot, P - 1)
            for seq in followers:
                pre.target.write_slot(seq.slot, state)
            for seq in [leader, *followers]:
                seq.prefilled = P - 1
                if pre.dflash:
                    handoff.queue_context(engine, seq, feats, 0, 1)
    except Exception as e:
        engine._fail(followers, e)
        raise
    for seq in followers:
        seq.held = False
