"""A greedy speculative-decoding loop over an exported target program (ORT), for the tests of
targets whose runtime path is not built yet: proposals come from an oracle (the target's own
greedy continuation) corrupted at chosen rows, so every acceptance length 0 … B − 1 occurs, and
the committed tokens must equal Hugging Face's greedy `generate` whatever was accepted."""

from __future__ import annotations

import numpy as np
import torch
from test_target_export import BLOCK, CHUNK, VOCAB

from dflash_qaic import contract


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n
    )
    return out[0, len(prompt) :].tolist()


def speculate(runner, prompt: list[int], oracle: list[int], n: int, seed: int = 0):
    """Decode n tokens: chunked prefill, then blocks [anchor, d1 … d_{B−1}] where d follows
    `oracle` for a random number of rows and is wrong after. Returns (tokens, accepted lengths)."""
    rng = np.random.default_rng(seed)
    first = runner.prefill(prompt)[contract.NEXT_TOKENS][-1]
    out, accepted = [int(first)], []
    while len(out) < n:
        p = len(prompt) + len(out) - 1  # the anchor's position
        good = int(rng.integers(0, BLOCK))  # rows that follow the oracle
        block = [out[-1]]
        for j in range(1, BLOCK):
            t = oracle[len(out) - 1 + j] if len(out) - 1 + j < len(oracle) else 0
            block.append(t if j <= good else (t + 1 + int(rng.integers(0, VOCAB - 1))) % VOCAB)
        got = runner(block, list(range(p, p + BLOCK)))[contract.NEXT_TOKENS][0]
        k = 0
        while k < BLOCK - 1 and block[k + 1] == got[k]:
            k += 1
        accepted.append(k)
        out += [int(t) for t in got[: k + 1]]
    return out[:n], accepted


__all__ = ["CHUNK", "hf_greedy", "speculate"]


def program_io(facts: dict, path) -> contract.TargetIO:
    """The exported program's contract I/O, through the manifest's reading of the exporter's
    facts (so per-layer cache shapes and ring slots round-trip)."""
    from dflash_qaic.artifacts.manifest import ProgramRecord

    return ProgramRecord.from_facts("target", {**facts, "path": str(path)}, path.parent).io


def run_batch(sess, io, seqs: list[list[int]], prompt_lens: list[int]) -> list[dict]:
    """Each sequence's chunked prefill of seq[:P], one verify block at P and a decode, all rows of
    a batch in the same calls (a shorter prompt's missing chunk rows are padding). Returns per
    sequence its next_tokens and hidden_states at positions 0 … P + BLOCK."""
    from test_target_export import CTX, greedy_feed

    b = len(seqs)
    out_names = [o.name for o in sess.get_outputs()]
    kv = {s.name: np.zeros(s.bind(batch_size=b, ctx_len=CTX), np.float32) for s in io.kv}
    rows = [{contract.NEXT_TOKENS: [], contract.HIDDEN_STATES: []} for _ in seqs]

    def call(ids, pos, n):
        nonlocal kv
        feed = {
            contract.INPUT_IDS: np.asarray(ids, np.int64),
            contract.POSITION_IDS: np.asarray(pos, np.int64),
            **greedy_feed(b, len(ids[0])),
            **kv,
        }
        out = dict(zip(out_names, sess.run(None, feed)))
        kv = {s.name: out[contract.retained(s.name)] for s in io.kv}
        for r in range(b):
            for k in rows[r]:
                rows[r][k].append(out[k][r, : n[r]])

    for lo in range(0, max(prompt_lens), CHUNK):
        ids, pos, n = [], [], []
        for seq, p in zip(seqs, prompt_lens):
            m = max(0, min(p, lo + CHUNK) - lo)
            ids.append(seq[lo : lo + m] + [0] * (CHUNK - m))
            pos.append(list(range(lo, lo + m)) + [contract.PAD_POSITION] * (CHUNK - m))
            n.append(m)
        call(ids, pos, n)
    for width in (BLOCK, 1):
        at = [p if width == BLOCK else p + BLOCK for p in prompt_lens]
        call(
            [seq[a : a + width] for seq, a in zip(seqs, at)],
            [list(range(a, a + width)) for a in at],
            [width] * b,
        )
    return [{k: np.concatenate(v) for k, v in r.items()} for r in rows]


def assert_batched_equals_solo(sess, io) -> None:
    rng = np.random.default_rng(3)
    lens = [19, 10]
    seqs = [rng.integers(0, VOCAB, p + BLOCK + 1).tolist() for p in lens]
    both = run_batch(sess, io, seqs, lens)
    for r, (seq, p) in enumerate(zip(seqs, lens)):
        solo = run_batch(sess, io, [seq], [p])[0]
        for k in (contract.NEXT_TOKENS, contract.HIDDEN_STATES):
            np.testing.assert_allclose(both[r][k], solo[k], atol=1e-5, rtol=1e-5)
