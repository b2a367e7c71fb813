"""Lossless sampling at temperature > 0, decided inside the target program (docs/DESIGN.md, Sampling).

(1) The graph rule. One batched call of the target program on a fixed sequence gives thousands
    of independent draws at every row (one pair of uniforms each). Whatever a row's proposal
    (likely, unlikely, removed by top-k / top-p, or none at the last row), the token it returns
    must follow p exactly: the softmax of Hugging Face's logits through HF's own temperature,
    top-k and top-p warpers. Wrong rules (accept every proposal; resample without removing the
    proposal) must fail the same chi-square test. Also on the fp16 conversion of the graph.
(2) End to end. Many seeded runs of one prompt: DFlash (`generate`) and the target alone
    (`generate_baseline`) give the same distribution of the first tokens (the first from
    prefill, the next ones from verify rows: accept, reject + residual, bonus), both match the
    exact distribution of the first two tokens, acceptance really happens, and a host loop that
    accepts every proposal is rejected by the same test.
(3) Temperature 0 is exactly greedy (HF generate); seeds reproduce; bad settings fail clearly;
    the CLI and the AI100 stand-in take the same settings.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import dflash_qaic
from dflash_qaic import checkpoints as ck
from dflash_qaic import contract
from dflash_qaic.artifacts.build import ExportOptions, build_artifacts
from dflash_qaic.exporter.graph_check import check_graph, fp16_feed, fp16_session
from dflash_qaic.exporter.onnx_export import export_onnx
from dflash_qaic.modeling.sampler import (
    inverse_cdf,
    sample_next_tokens,
    sampling_weights,
    vocab_tree,
)
from dflash_qaic.runtime import GenerationError, Pipeline

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance compared with the reference and across runs, seeded tokens

V, B, CHUNK, CTX = 32, 4, 8, 32
PROMPT = [7, 19, 3, 25, 11]  # shorter than the chunk: prefill pads, the first token has no proposal
# (temperature, top_k, top_p)
CONFIGS = [
    (0.7, 0, 1.0),
    (1.0, 0, 1.0),
    (1.5, 0, 1.0),
    (1.0, 4, 1.0),
    (1.0, 0, 0.7),
    (0.8, 6, 0.9),
]
ALPHA = 1e-3  # a correct rule fails a given check with probability ≈ ALPHA (seeds are fixed)
REJECT = 1e-8  # a wrong rule must be rejected far beyond doubt


@pytest.fixture(scope="module")
def art(tiny_pair, tmp_path_factory):
    # agree 1.5 with a 32-token vocabulary: the draft always proposes token 0 and the target
    # gives it p ≈ 0.8 / 0.6 / 0.35 at T = 0.7 / 1 / 1.5, so proposals are accepted and rejected
    t, d = tiny_pair(
        family="qwen3",
        vocab_size=V,
        block_size=B,
        agree=1.5,
        tie_word_embeddings=False,
        target_layer_ids=[1, 3],
    )
    out = tmp_path_factory.mktemp("sampling-art")
    build_artifacts(
        t,
        d,
        out,
        ExportOptions(prefill_seq_len=CHUNK, ctx_len=CTX, compile=False),
    )
    return out, ck.load_target_model(t)


@pytest.fixture(scope="module")
def pipe(art):
    pipe = dflash_qaic.load(art[0], threads=1)
    # whole blocks every step, so the bonus row is exercised (short verify lengths have their
    # own distribution test in test_verify_lengths.py)
    pipe.configure(verify_lengths=[B])
    return pipe


# ---------------------------------------------------------------- exact distributions and tests


def exact_probs(logits: torch.Tensor, cfg) -> np.ndarray:
    """p per row of HF logits [n, V]: Hugging Face's warpers in generate's order, then softmax."""
    t, k, p = cfg
    x = TemperatureLogitsWarper(t)(None, logits.clone().float())
    if k:
        x = TopKLogitsWarper(k)(None, x)
    if p < 1.0:
        x = TopPLogitsWarper(p)(None, x)
    return torch.softmax(x, dim=-1).double().numpy()


def hf_logits(model, seqs) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(seqs)).logits.float()


def _bins(expected: np.ndarray) -> list[np.ndarray]:
    """Groups of cells (ascending expected count) with every group's expectation ≥ 5."""
    order = np.argsort(expected)
    groups, cur, acc = [], [], 0.0
    for i in order:
        cur.append(i)
        acc += expected[i]
        if acc >= 5:
            groups.append(np.array(cur))
            cur, acc = [], 0.0
    if cur:
        if groups:
            groups[-1] = np.concatenate([groups[-1], cur])
        else:
            groups.append(np.array(cur))
    return groups


def gof(samples: np.ndarray, probs: np.ndarray) -> tuple[float, int, int]:
    """Chi-square goodness of fit of integer samples to probs [V]: (chi2, df, impossible),
    impossible = samples of zero-probability tokens (any such sample rejects outright)."""
    n = len(samples)
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    zero = probs <= 0
    impossible = int(counts[zero].sum())
    live = np.flatnonzero(~zero)
    groups = _bins(n * probs[live])
    obs = np.array([counts[live[g]].sum() for g in groups])
    exp = np.array([n * probs[live[g]].sum() for g in groups])
    return float(((obs - exp) ** 2 / exp).sum()), len(groups) - 1, impossible


def gof_pvalue(parts) -> float:
    """p-value of a sum of independent chi-square statistics [(chi2, df, impossible), ...]."""
    if any(imp for _, _, imp in parts):
        return 0.0
    chi, df = sum(c for c, _, _ in parts), sum(d for _, d, _ in parts)
    return float(stats.chi2.sf(chi, df)) if df > 0 else 1.0


def two_sample_pvalue(a: list, b: list) -> float:
    """Chi-square test that two samples of hashable outcomes share one distribution; outcomes
    seen fewer than 10 times in both together are pooled into one category."""
    keys = sorted(set(a) | set(b))
    ca = np.array([a.count(k) for k in keys], float)
    cb = np.array([b.count(k) for k in keys], float)
    rare = (ca + cb) < 10
    rows = [np.r_[ca[~rare], ca[rare].sum()], np.r_[cb[~rare], cb[rare].sum()]]
    table = np.array(rows)
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    return float(stats.chi2_contingency(table, correction=False).pvalue)


# ---------------------------------------------------------------- (1) the graph rule


def program_session(art_dir, fp16=False) -> ort.InferenceSession:
    path = str(art_dir / "target" / "target.onnx")
    if fp16:
        return fp16_session(onnx.load(path))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 2
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def program_draws(sess, manifest, seq, configs, n, seed, fp16=False):
    """One call of the target program with len(configs) * n batch rows, all on `seq` (fresh
    caches): returns next_tokens [len(configs), n, s] and the uniforms used."""
    s, b = len(seq), len(configs) * n
    rng = np.random.default_rng(seed)
    f = manifest["target"]
    feed = {
        contract.INPUT_IDS: np.tile(np.asarray(seq, np.int64), (b, 1)),
        contract.POSITION_IDS: np.tile(np.arange(s, dtype=np.int64), (b, 1)),
        contract.TEMPERATURE: np.repeat([c[0] for c in configs], n).astype(np.float32),
        contract.TOP_K: np.repeat([c[1] for c in configs], n).astype(np.int64),
        contract.TOP_P: np.repeat([c[2] for c in configs], n).astype(np.float32),
        contract.RANDOM_U: rng.random((b, s, contract.N_RANDOM), dtype=np.float32),
        contract.COMP_CTX_LENGTHS: np.arange(manifest["ctx_len"], dtype=np.int64),
    }
    kv_shape = (b, f["n_kv_heads"], manifest["ctx_len"], f["head_dim"])
    for i in range(f["n_layers"]):
        for name in (contract.past_key(i), contract.past_value(i)):
            feed[name] = np.zeros(kv_shape, np.float32)
    run_feed = fp16_feed(feed) if fp16 else feed
    (tokens,) = sess.run([contract.NEXT_TOKENS], run_feed)
    shape = (len(configs), n, s)
    return tokens.reshape(shape), feed[contract.RANDOM_U].reshape(*shape, contract.N_RANDOM)


def rule_pvalue(draws: np.ndarray, probs: np.ndarray) -> float:
    """draws [n, s] from one config; probs [s, V] the exact p of every row."""
    return gof_pvalue([gof(draws[:, j], probs[j]) for j in range(draws.shape[1])])


def _inverse_cdf(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    c = np.cumsum(probs, -1)
    return np.minimum((c[None] <= u[..., None] * c[..., -1:][None]).sum(-1), probs.shape[-1] - 1)


def wrong_rule(probs: np.ndarray, seq, u: np.ndarray, variant: str) -> np.ndarray:
    """A deliberately wrong rule on the exact p [s, V] with the uniforms u [n, s, 2]:
    'accept_all' keeps every proposal; 'no_removal' resamples from p itself after a rejection."""
    s = len(seq)
    d = np.asarray(seq[1:])  # proposal of rows 0 … s-2
    out = _inverse_cdf(probs, u[..., 1])  # [n, s], a sample from p per row
    if variant == "accept_all":
        out[:, : s - 1] = d
    else:
        p_d = probs[np.arange(s - 1), d]
        out[:, : s - 1] = np.where(u[:, : s - 1, 0] < p_d, d, out[:, : s - 1])
    return out


@pytest.fixture(scope="module")
def rule_case(art, pipe):
    """The sequence of the graph-rule tests: the prompt's tokens as (mostly unlikely) proposals,
    then the greedy continuation as (likely) ones; the last row has none."""
    art_dir, model = art
    greedy = pipe.generate(PROMPT[:4], CHUNK - 4, stop_token_ids=[]).tokens
    seq = PROMPT[:4] + greedy
    logits = hf_logits(model, [seq])[0]
    return seq, {cfg: exact_probs(logits, cfg) for cfg in CONFIGS}


def test_graph_rule_gives_exact_p_at_every_row(art, pipe, rule_case):
    art_dir, _ = art
    seq, probs = rule_case
    n = 3000
    draws, u = program_draws(program_session(art_dir), pipe.manifest, seq, CONFIGS, n, seed=1)
    # the proposals cover the cases the rule distinguishes
    p_d = np.array([[probs[c][j, seq[j + 1]] for j in range(len(seq) - 1)] for c in CONFIGS])
    assert (p_d > 0.5).any() and (p_d < 0.05).any() and (p_d == 0).any(), p_d.round(3)
    report = {}
    for i, cfg in enumerate(CONFIGS):
        good = rule_pvalue(draws[i], probs[cfg])
        bad = {
            v: rule_pvalue(wrong_rule(probs[cfg], seq, u[i], v), probs[cfg])
            for v in ("accept_all", "no_removal")
        }
        report[cfg] = (good, bad)
        assert good > ALPHA, (cfg, good)
        assert max(bad.values()) < REJECT, (cfg, bad)
    print("graph rule p-values (correct, wrong):", report)

    # the exported graph is the torch rule, draw for draw (up to last-ulp differences of logits)
    logits = hf_logits(art[1], [seq]).expand(len(CONFIGS) * n, -1, -1)
    ids = torch.tensor([seq]).expand(len(CONFIGS) * n, -1)
    eager = sample_next_tokens(
        logits,
        ids,
        torch.arange(len(seq)).expand(len(CONFIGS) * n, -1),
        torch.tensor([c[0] for c in CONFIGS]).repeat_interleave(n),
        torch.tensor([c[1] for c in CONFIGS]).repeat_interleave(n),
        torch.tensor([c[2] for c in CONFIGS]).repeat_interleave(n),
        torch.from_numpy(u.reshape(-1, len(seq), 2)),
        V,
    )
    same = (eager.numpy().reshape(draws.shape) == draws).mean()
    assert same > 0.999, same


def test_only_the_first_sample_len_rows_sample(art, pipe):
    """random_u of n < s rows (the greedy Verify binds n = 1): rows < n are exactly what the full
    sampler gives them, every later row is the argmax; in eager torch and in the exported
    target program alike."""
    V = pipe.vocab
    g = torch.Generator().manual_seed(5)
    b, s = 3, 6
    logits = torch.randn(b, s, V, generator=g) * 2
    ids = torch.randint(0, V, (b, s), generator=g)
    pos = torch.arange(s).expand(b, -1).clone()
    pos[2, -1] = contract.PAD_POSITION
    params = (torch.tensor([1.0, 0.7, 1.2]), torch.tensor([0, 5, 0]), torch.tensor([1.0, 1.0, 0.8]))
    u = torch.rand(b, s, 2, generator=g)
    full = sample_next_tokens(logits, ids, pos, *params, u, V)
    for n in (1, 2, s):
        part = sample_next_tokens(logits, ids, pos, *params, u[:, :n].contiguous(), V)
        assert torch.equal(part[:, :n], full[:, :n])
        assert torch.equal(part[:, n:], logits[:, n:].argmax(-1))

    m = dflash_qaic.load(art[0]).artifacts
    specs = {x["name"]: x["symbols"] for x in m.target.specializations}
    B = m.block_size
    assert specs["Verify"][contract.SAMPLE] == 1 and specs["VerifySampled"][contract.SAMPLE] == B
    sess = program_session(art[0])
    seq = torch.randint(0, V, (B,), generator=g).tolist()
    _, u_full = program_draws(sess, m, seq, [(1.0, 0, 1.0)], 4, seed=1)
    feed = {
        contract.INPUT_IDS: np.tile(np.asarray(seq, np.int64), (4, 1)),
        contract.POSITION_IDS: np.tile(np.arange(B, dtype=np.int64), (4, 1)),
        contract.TEMPERATURE: np.ones(4, np.float32),
        contract.TOP_K: np.zeros(4, np.int64),
        contract.TOP_P: np.ones(4, np.float32),
        contract.COMP_CTX_LENGTHS: np.arange(m["ctx_len"], dtype=np.int64),
    }
    f = m["target"]
    for i in range(f["n_layers"]):
        for name in (contract.past_key(i), contract.past_value(i)):
            feed[name] = np.zeros((4, f["n_kv_heads"], m["ctx_len"], f["head_dim"]), np.float32)
    (all_rows,) = sess.run([contract.NEXT_TOKENS], {**feed, contract.RANDOM_U: u_full[0]})
    (one_row,) = sess.run([contract.NEXT_TOKENS], {**feed, contract.RANDOM_U: u_full[0][:, :1]})
    feed[contract.TEMPERATURE][:] = 0
    (greedy,) = sess.run([contract.NEXT_TOKENS], {**feed, contract.RANDOM_U: u_full[0][:, :1]})
    np.testing.assert_array_equal(one_row[:, 0], all_rows[:, 0])
    np.testing.assert_array_equal(one_row[:, 1:], greedy[:, 1:])


def test_graph_rule_in_fp16(art, pipe, rule_case):
    # the compiler runs the program in fp16: its draws must still follow p (fp16 logits move
    # p by ~1%, far below what 2000 draws per row can see) and never hit a filtered-out token
    art_dir, _ = art
    seq, probs = rule_case
    configs = [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.5, 0, 0.9)]
    sess = program_session(art_dir, fp16=True)
    draws, _ = program_draws(sess, pipe.manifest, seq, configs, 2000, seed=2, fp16=True)
    for i, cfg in enumerate(configs):
        ref = probs.get(cfg)
        if ref is None:
            ref = exact_probs(hf_logits(art[1], [seq])[0], cfg)
        p = rule_pvalue(draws[i], ref)
        print("fp16", cfg, p)
        assert p > ALPHA, (cfg, p)


def test_weights_follow_hf_warpers():
    # sampling_weights alone, on random logits with ties and a wide range, against HF's warpers
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 50, generator=g) * 4
    logits[0, 0, :3] = logits[0, 0].max() + 1  # a three-way tie at the top
    for cfg in [(1.0, 0, 1.0), (0.5, 7, 1.0), (2.0, 0, 0.6), (0.9, 12, 0.8), (1.0, 1, 1.0)]:
        t, k, p = cfg
        w = sampling_weights(
            logits, torch.full((3,), t), torch.full((3,), k), torch.full((3,), p), 50
        )
        got = (w / w.sum(-1, keepdim=True)).double().numpy()
        want = exact_probs(logits.reshape(-1, 50), cfg).reshape(got.shape)
        np.testing.assert_allclose(got, want, atol=1e-6, err_msg=str(cfg))


def test_weights_with_fewer_candidates_than_tokens():
    # the thresholds come from the top `candidates` tokens: exact while top-k / the top-p head
    # fit in them; a longer top-p head keeps the whole distribution (at most 1 - top_p extra)
    g = torch.Generator().manual_seed(3)
    peaked = torch.randn(2, 3, 400, generator=g) * 4
    flat = torch.randn(2, 3, 400, generator=g) * 0.1

    def weights(logits, cfg):
        t, k, p = (torch.full((2,), x) for x in cfg)
        w = sampling_weights(logits, t, k, p, 400, candidates=64)
        return (w / w.sum(-1, keepdim=True)).double().numpy()

    for cfg in [(1.0, 10, 1.0), (1.0, 64, 0.9), (0.5, 0, 0.9), (1.0, 0, 1.0)]:
        want = exact_probs(peaked.reshape(-1, 400), cfg).reshape(2, 3, 400)
        if cfg[1] == 0 and cfg[2] < 1:
            assert ((want > 0).sum(-1) < 64).all()  # the head fits in the candidates
        np.testing.assert_allclose(weights(peaked, cfg), want, atol=1e-6, err_msg=str(cfg))
    want = exact_probs(flat.reshape(-1, 400), (1.0, 0, 0.9)).reshape(2, 3, 400)
    assert ((want > 0).sum(-1) > 64).all()  # a head longer than the candidates: kept whole
    plain = exact_probs(flat.reshape(-1, 400), (1.0, 0, 1.0)).reshape(2, 3, 400)
    np.testing.assert_allclose(weights(flat, (1.0, 0, 0.9)), plain, atol=1e-6)
    # top-k within the candidates stays exact on the flat rows too
    want = exact_probs(flat.reshape(-1, 400), (1.0, 20, 0.9)).reshape(2, 3, 400)
    np.testing.assert_allclose(weights(flat, (1.0, 20, 0.9)), want, atol=1e-6)


def test_inverse_cdf_descends_the_vocabulary_tree():
    # the hierarchical search is exactly "first token whose cumulative weight exceeds u · total"
    g = torch.Generator().manual_seed(1)
    for vocab in (2, 32, 50, 5000):
        x = torch.rand(3, 4, vocab, generator=g) ** 4 * (torch.rand(3, 4, vocab, generator=g) > 0.3)
        x[0, 0] = 0
        x[0, 0, vocab - 1] = 0.5  # a single token, last in the vocabulary
        u = torch.rand(3, 4, generator=g)
        u[1, 1] = 1 - 2**-11
        token, mass = inverse_cdf(x, u, vocab)
        c = x.double().cumsum(-1)
        want = (c <= (u.double() * c[..., -1])[..., None]).sum(-1)
        want = torch.where(c[..., -1] > 0, want, 0)  # nothing to draw from: token 0
        assert torch.equal(token, want), vocab
        torch.testing.assert_close(mass.double(), c[..., -1])
    assert vocab_tree(32) == (2, 6) and vocab_tree(151936) == (3, 54)


class _Sampler(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, logits, ids, pos, temperature, top_k, top_p, random_u):
        return sample_next_tokens(logits, ids, pos, temperature, top_k, top_p, random_u, self.vocab)


def test_sampler_graph_for_a_three_level_vocabulary(tmp_path):
    # the sampler alone, exported at a vocabulary that takes three tree levels: standard ops,
    # static shapes, the eager result in fp32, and in fp16 never a token outside top-k
    vocab = 5000
    assert vocab_tree(vocab)[0] == 3
    specs_in = [
        contract.TensorSpec("logits", "float32", (contract.BATCH, contract.SEQ, vocab)),
        contract.TensorSpec(contract.INPUT_IDS, "int64", (contract.BATCH, contract.SEQ)),
        contract.TensorSpec(contract.POSITION_IDS, "int64", (contract.BATCH, contract.SEQ)),
        *contract.sampling_specs(),
    ]
    specs_out = [contract.TensorSpec(contract.NEXT_TOKENS, "int64", (contract.BATCH, contract.SEQ))]
    g = torch.Generator().manual_seed(2)
    b, s = 4, 3
    logits = torch.randn(b, s, vocab, generator=g) * 3
    ids = torch.randint(0, vocab, (b, s), generator=g)
    ids[:, 1] = logits[:, 0].argmax(-1)  # row 0 proposes its most likely token
    pos = torch.tensor([[5, 6, 7]] * b)
    pos[3, 2] = contract.PAD_POSITION
    params = (
        torch.tensor([1.0, 0.7, 1.3, 0.0]),
        torch.tensor([0, 50, 0, 0]),
        torch.tensor([1.0, 1.0, 0.9, 1.0]),
    )
    example = (logits, ids, pos, *params, torch.rand(b, s, 2, generator=g))
    path = export_onnx(_Sampler(vocab), example, specs_in, specs_out, tmp_path / "sampler.onnx")
    sym = {contract.BATCH: b, contract.SEQ: s, contract.SAMPLE: s}
    report = check_graph(path, (specs_in, specs_out), [sym])
    assert report["unresolved_intermediates"] == [0]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    s16 = fp16_session(onnx.load(str(path)))
    names = [spec.name for spec in specs_in]
    top50 = logits[1].topk(50, dim=-1).indices.numpy()  # [s, 50]
    for seed in range(20):
        u = torch.rand(b, s, 2, generator=torch.Generator().manual_seed(seed))
        args = (logits, ids, pos, *params, u)
        feed = {n: a.numpy() for n, a in zip(names, args)}
        (got,) = sess.run(None, feed)
        np.testing.assert_array_equal(got, _Sampler(vocab)(*args).numpy())
        np.testing.assert_array_equal(got[3], logits[3].argmax(-1).numpy())  # temperature 0
        (half,) = s16.run(None, fp16_feed(feed))
        assert all(half[1, j] in top50[j] for j in range(s)), (seed, half[1])


# ---------------------------------------------------------------- (2) end to end


class AcceptEveryProposal:
    """A wrong target program for the negative check: every row with a proposal returns it."""

    def __init__(self, program):
        self.program = program

    @property
    def device_s(self):
        return self.program.device_s

    def run(self, feeds):
        out = dict(self.program.run(feeds))
        ids, pos = feeds[contract.INPUT_IDS], feeds[contract.POSITION_IDS]
        tokens = out[contract.NEXT_TOKENS].copy()
        tokens[:, :-1] = np.where(pos[:, 1:] >= 0, ids[:, 1:], tokens[:, :-1])
        out[contract.NEXT_TOKENS] = tokens
        return out


def runs(generate, n, cfg, seed0, max_new=5):
    t, k, p = cfg
    toks, lengths = [], []
    for i in range(n):
        res = generate(
            PROMPT, max_new, stop_token_ids=[], temperature=t, top_k=k, top_p=p, seed=seed0 + i
        )
        toks.append(tuple(res.tokens))
        lengths += res.acceptance_lengths
    return toks, lengths


def exact_first_two(model, cfg) -> tuple[np.ndarray, np.ndarray]:
    """Exact p(t1) and p(t2) (marginal over t1) after PROMPT."""
    p1 = exact_probs(hf_logits(model, [PROMPT])[0, -1:], cfg)[0]
    nxt = hf_logits(model, [PROMPT + [t] for t in range(V)])[:, -1]  # [V, V]: row t1
    p2 = p1 @ exact_probs(nxt, cfg)
    return p1, p2


def batched_first_two(pipe, model, n: int = 400, cfg=(1.0, 0, 1.0)):
    """n seeded requests of PROMPT in one call (batched as the artifacts allow): their first two
    tokens follow the exact distribution of the target's own sampling at cfg (chi-square).
    Returns the tokens [n, 2], p(t1) and p(t2)."""
    T, k, p = cfg
    res = pipe.generate(
        [PROMPT] * n, 2, stop_token_ids=[], temperature=T, top_k=k, top_p=p, seed=list(range(n))
    )
    a = np.array([r.tokens for r in res])
    p1, p2 = exact_first_two(model, cfg)
    assert gof_pvalue([gof(a[:, 0], p1)]) > 1e-3 / 2
    assert gof_pvalue([gof(a[:, 1], p2)]) > 1e-3 / 2
    return a, p1, p2


def end_to_end(pipe, model, cfg, n, n_negative=0):
    """DFlash vs the target alone vs the exact first two tokens; and (negative) a host loop
    whose target accepts every proposal, which the same tests must reject (n_negative runs)."""
    dflash, lengths = runs(pipe.generate, n, cfg, seed0=0)
    base, _ = runs(pipe.generate_baseline, n, cfg, seed0=10**6)
    p1, p2 = exact_first_two(model, cfg)

    def pvalues(sample):
        a = np.array(sample)
        return {
            "t1_exact": gof_pvalue([gof(a[:, 0], p1)]),
            "t2_exact": gof_pvalue([gof(a[:, 1], p2)]),
            **{
                f"t{k}t{k + 1}_vs_base": two_sample_pvalue(
                    [s[k - 1 : k + 1] for s in sample], [s[k - 1 : k + 1] for s in base]
                )
                for k in (1, 2, 3, 4)
            },
        }

    got = {
        "dflash": pvalues(dflash),
        "baseline": {k: v for k, v in pvalues(base).items() if "exact" in k},
    }
    if n_negative:
        wrong_pipe = Pipeline(pipe.manifest, AcceptEveryProposal(pipe.target), pipe.draft)
        got["accept_all"] = pvalues(runs(wrong_pipe.generate, n_negative, cfg, seed0=0)[0])
    # acceptance really happened: multi-token steps, including full blocks (the bonus row)
    tau = float(np.mean(lengths))
    hist = np.bincount(lengths, minlength=B + 1)[1:].tolist()
    print(cfg, f"tau {tau:.2f} lengths {hist}", json.dumps(got))
    n_tests = len(got["dflash"]) + len(got["baseline"])
    for name in ("dflash", "baseline"):
        for k, v in got[name].items():
            assert v > ALPHA / n_tests, (cfg, name, k, v)
    if n_negative:
        assert min(got["accept_all"].values()) < REJECT, got["accept_all"]
    assert tau > 1.15 and hist[-1] > 0.005 * len(lengths), (tau, hist)


@pytest.mark.parametrize(
    "cfg, n, n_negative",
    [((1.0, 0, 1.0), 800, 300), pytest.param((0.7, 8, 0.9), 500, 0, marks=pytest.mark.slow)],
    ids=str,
)
def test_dflash_sampling_matches_target_sampling(pipe, art, cfg, n, n_negative):
    end_to_end(pipe, art[1], cfg, n, n_negative)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_dflash_sampling_matches_target_sampling_long(pipe, art, cfg):
    end_to_end(pipe, art[1], cfg, 3000, n_negative=1000)


# ---------------------------------------------------------------- (3) greedy, seeds, errors


def hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def test_temperature_zero_is_greedy(pipe, art):
    want = hf_greedy(art[1], PROMPT, 20)
    for kw in ({}, {"temperature": 0.0, "top_k": 3, "top_p": 0.5, "seed": 9}):
        assert pipe.generate(PROMPT, 20, stop_token_ids=[], **kw).tokens == want
        assert pipe.generate_baseline(PROMPT, 20, stop_token_ids=[], **kw).tokens == want
    # greedy right after sampling: nothing of the sampling settings lingers
    pipe.generate(PROMPT, 8, stop_token_ids=[], temperature=1.3, seed=1)
    assert pipe.generate(PROMPT, 20, stop_token_ids=[]).tokens == want


def test_seeds_reproduce_and_differ(pipe):
    kw = dict(stop_token_ids=[], temperature=1.0, top_p=0.95)
    a = pipe.generate(PROMPT, 30, seed=7, **kw)
    b = pipe.generate(PROMPT, 30, seed=7, **kw)
    c = pipe.generate(PROMPT, 30, seed=8, **kw)
    assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths
    assert a.tokens != c.tokens
    assert a.stats["seed"] == 7 and a.stats["temperature"] == 1.0 and a.stats["top_p"] == 0.95
    assert list(pipe.stream(PROMPT, 30, seed=7, **kw)) == a.tokens
    base = pipe.generate_baseline(PROMPT, 30, seed=7, **kw)
    assert base.tokens == pipe.generate_baseline(PROMPT, 30, seed=7, **kw).tokens
    assert base.tokens[0] == a.tokens[0]  # same prefill draws
    # no seed: fresh entropy, reported so the run can be repeated
    free = pipe.generate(PROMPT, 30, **kw)
    assert isinstance(free.stats["seed"], int)
    assert pipe.generate(PROMPT, 30, seed=free.stats["seed"], **kw).tokens == free.tokens


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"temperature": -0.5}, "temperature must be a finite number ≥ 0"),
        ({"temperature": math.nan}, "temperature must be a finite number ≥ 0"),
        ({"temperature": math.inf}, "temperature must be a finite number ≥ 0"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_k": -1}, r"top_k must be ≥ 0"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_p": math.nan}, r"top_p must be in \(0, 1\]"),
        ({"seed": -3}, "seed must be an integer ≥ 0"),
        ({"seed": 1.5}, "seed must be an integer"),
    ],
)
def test_bad_sampling_settings(pipe, kw, match):
    kw = {"temperature": 1.0, **kw}
    for fn in (pipe.generate, pipe.generate_baseline):
        with pytest.raises(GenerationError, match=match):
            fn(PROMPT, 4, **kw)
    with pytest.raises(GenerationError, match=match):
        list(pipe.stream(PROMPT, 4, **kw))


def test_artifacts_without_sampling_inputs_refuse_sampling(pipe):
    m = dict(pipe.manifest)
    m.pop("specialization_count")  # recorded by the exporter; derived when absent
    m["target"] = {
        **m["target"],
        "inputs": [i for i in m["target"]["inputs"] if i["name"] not in contract.SAMPLING_INPUTS],
        # a program without sampling inputs has no `sample_len` symbol either
        "sampling": False,
        "specializations": contract.target_specializations(
            dataclasses.replace(pipe.artifacts.plan, sampling=False)
        ),
    }
    old = Pipeline(m, pipe.target, pipe.draft)
    assert not old.can_sample
    with pytest.raises(GenerationError, match="no sampling inputs"):
        old.generate(PROMPT, 4, temperature=0.8)


def test_top_k_above_the_candidates_is_refused(pipe):
    m = dict(pipe.manifest)
    m["target"] = {**m["target"], "sampling_candidates": 8}
    small = Pipeline(m, pipe.target, pipe.draft)
    with pytest.raises(GenerationError, match="top_k 9 is above the 8 candidates"):
        small.generate(PROMPT, 4, temperature=1.0, top_k=9)
    assert len(small.generate(PROMPT, 4, temperature=1.0, top_k=8, seed=0).tokens) == 4
    assert pipe.manifest["target"]["sampling_candidates"] == V  # min(512, V): all exact here


def test_standin_samples_like_ort(pipe, art):
    standin = dflash_qaic.load(art[0], backend="qaic-standin")
    standin.configure(pipe.config)  # the pipe's: whole blocks
    kw = dict(stop_token_ids=[], temperature=1.2, top_k=8, seed=3)
    a, b = pipe.generate(PROMPT, 24, **kw), standin.generate(PROMPT, 24, **kw)
    assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths
    assert standin.generate_baseline(PROMPT, 12, **kw).tokens == (
        pipe.generate_baseline(PROMPT, 12, **kw).tokens
    )


def test_dflash_run_cli_sampling(art, capsys):
    from dflash_qaic.runtime.cli import main

    args = [str(art[0]), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "16"]
    args += ["--stop-token-ids", "", "--json", "--threads", "1"]
    sampled = ["--temperature", "1.1", "--top-k", "10", "--top-p", "0.9", "--seed", "5"]
    outs = []
    for _ in range(2):
        assert main(args + sampled + ["--baseline"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["tokens"] == outs[1]["tokens"]
    assert outs[0]["baseline"]["tokens"] == outs[1]["baseline"]["tokens"]
    assert outs[0]["stats"]["seed"] == 5 and outs[0]["stats"]["top_k"] == 10
    assert main(args) == 0  # greedy by default
    assert json.loads(capsys.readouterr().out)["tokens"] == hf_greedy(art[1], PROMPT, 16)
    assert main(args + ["--temperature", "1", "--top-p", "2"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
