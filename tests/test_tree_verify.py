"""Tree verification (docs/DESIGN.md, Tree verification; contract.TREE; runtime/tree.py).

- the sampling rule, on the graph's own functions: a node draws from the target's p and the
  walk descends while a child carries the draw; distributed as the target's own sampling
  (chi-square on a tiny vocabulary with prefix-dependent p), where the naive per-child
  `min(1, p/q)` rule on the same top-k-marginal tree is measurably wrong;
- tokens equal Hugging Face greedy on every target family it supports (dense and MoE), for a
  fixed budget, the size chosen per step, and chains on the same program;
- each step's accepted path equals a tree verifier written here from DDTree's rules with the
  target's own Hugging Face model (same tree, same acceptance, same tokens);
- seeded sampling through the programs gives the target alone's tokens for every tree shape;
- batched = solo with rows of different trees; the caches after a tree verify equal a chain
  replay of the accepted tokens; the export's fp16-faithful run covered the tree calls;
- hybrid targets, structured output and mismatched options are refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dflash_qaic import contract
from dflash_qaic.modeling.sampler import sample_tree
from dflash_qaic.modeling.target import accept_path
from dflash_qaic.runtime import tree as host_tree

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance compared with the reference and across runs, seeded tokens

# ---------------------------------------------------------------- the rule, on the graph's functions

V, K, SAMPLES = 5, 2, 40_000


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def rule_tables():
    """Target logits per prefix code at depths 0 … 2, and a draft whose per-position marginals
    (what a DFlash draft gives: not conditioned on the path) disagree with it."""
    rng = np.random.default_rng(0)
    target = [rng.normal(0, 1.5, (V**d, V)) for d in range(3)]
    draft = [rng.normal(0, 1.5, V) for _ in range(2)]  # depths 1, 2: one distribution each
    return target, draft


def the_tree(draft) -> host_tree.Tree:
    q = [softmax(d) for d in draft]
    ids = np.stack([np.argsort(-p)[:K] for p in q])  # [2, K]
    lps = np.stack([np.log(p[i]) for p, i in zip(q, ids)])
    t = host_tree.build_tree(ids, lps, 1 + K + K * K, root=0)  # every node of depth ≤ 2
    assert sorted(t.depths) == [0, 1, 1, 2, 2, 2, 2]
    return t


def codes(t: host_tree.Tree) -> list[int]:
    """Each node's prefix code (its path's tokens after the root, as base-V digits)."""
    out = [0]
    for r in range(1, len(t.parents)):
        out.append(out[t.parents[r]] * V + t.tokens[r])
    return out


def first_two(t, target, tokens, acc, rng):
    """Each sample's first 2 committed tokens, completed by the target alone past its commit."""
    first = np.zeros((len(acc), 2), np.int64)
    code = np.zeros(len(acc), np.int64)
    for d in range(2):
        p = softmax(target[d][code])
        alone = (p.cumsum(-1) < rng.random((len(acc), 1))).sum(-1).clip(max=V - 1)
        first[:, d] = np.where(acc + 1 > d, tokens[:, d], alone)
        code = code * V + first[:, d]
    return first


def chi2(target, first) -> float:
    exact = (softmax(target[0][0])[:, None] * softmax(target[1])).reshape(-1)
    counts = np.bincount(first[:, 0] * V + first[:, 1], minlength=V * V)
    exp = exact * len(first)
    small = exp < 5  # pooled into one cell (chi-square wants expected counts ≥ 5)
    obs, want = counts[~small], exp[~small]
    if small.any():
        obs, want = np.append(obs, counts[small].sum()), np.append(want, exp[small].sum())
    return chisquare(obs, want).pvalue


def test_tree_rule_is_the_targets_distribution(rule_tables):
    """The program's per-node plain sample and its path walk (accept_path, path order)."""
    target, draft = rule_tables
    t = the_tree(draft)
    code = codes(t)
    depth_of = np.array(t.depths)
    logits = np.stack([target[d][c] for d, c in zip(t.depths, code)])  # [n, V]
    rng = np.random.default_rng(1)
    ids = torch.tensor(np.tile(t.tokens, (SAMPLES, 1)))
    pos = torch.tensor(np.tile(depth_of, (SAMPLES, 1)))
    u_depth = rng.random((SAMPLES, 3, 2), dtype=np.float32)  # one uniform pair per depth
    u = torch.tensor(u_depth[:, depth_of])
    one = torch.ones(SAMPLES)
    choice = sample_tree(
        torch.tensor(np.tile(logits, (SAMPLES, 1, 1)), dtype=torch.float32), ids, pos, one,
        torch.zeros(SAMPLES, dtype=torch.int64), one, u, V,
    )  # fmt: skip
    mask = torch.tensor(
        np.tile(
            np.array(contract.RowLayout(tuple(t.parents), tuple(t.depths)).mask()), (SAMPLES, 1, 1)
        )
    )
    path, _, acc = accept_path(ids, pos, choice, mask, 64)
    tokens = choice.gather(1, path).numpy()
    first = first_two(t, target, tokens, acc.numpy(), rng)
    assert chi2(target, first) > 1e-3
    # the tree accepts more than its rank-0 chain would: some samples took a second child
    assert (acc.numpy() >= 1).mean() > softmax(target[0][0])[t.tokens[1]]


def naive_walk(t, target, draft, rng):
    """The biased rule (hipfire's first DDTree verifier): at each node try its children in rank order,
    accepting child c with min(1, p(c) / q(c)) (q: the draft's marginal at that depth), else
    p ← norm(max(p − q, 0)); the bonus from what is left."""
    q = [softmax(d) for d in draft]
    kids = {
        r: [c for c in range(len(t.parents)) if t.parents[c] == r] for r in range(len(t.parents))
    }
    code_of = codes(t)
    first = np.zeros((SAMPLES, 2), np.int64)
    for i in range(SAMPLES):
        node, out = 0, []
        while len(out) < 2:
            d = t.depths[node]
            p = softmax(target[d][code_of[node]])
            for c in kids[node]:
                tok = t.tokens[c]
                if rng.random() < min(1.0, p[tok] / q[d][tok]):
                    out.append(tok)
                    node = c
                    break
                p = np.maximum(p - q[d], 0)
                p = p / p.sum() if p.sum() > 0 else softmax(target[d][code_of[node]])
            else:
                out.append(int((p.cumsum() < rng.random()).sum().clip(max=V - 1)))
                break
        if len(out) < 2:  # completed by the target alone
            p = softmax(target[1][out[0]])
            out.append(int((p.cumsum() < rng.random()).sum().clip(max=V - 1)))
        first[i] = out
    return first


def test_naive_tree_rule_is_rejected_by_the_same_test(rule_tables):
    target, draft = rule_tables
    first = naive_walk(the_tree(draft), target, draft, np.random.default_rng(2))
    assert chi2(target, first) < 1e-6


def test_build_tree_is_best_first_and_prefix_closed():
    rng = np.random.default_rng(3)
    lp = np.sort(np.log(rng.dirichlet(np.ones(8), size=7)), axis=1)[:, ::-1][:, :4]
    ids = np.stack([rng.permutation(50)[:4] for _ in range(7)])
    t = host_tree.build_tree(ids, lp, 40, root=7)
    assert len(t.parents) == 40 and t.tokens[0] == 7 and t.parents[0] == -1
    scores = [0.0]
    for r in range(1, 40):
        p = t.parents[r]
        assert 0 <= p < r and t.depths[r] == t.depths[p] + 1  # parents first: every prefix a tree
        rank = list(ids[t.depths[r] - 1]).index(t.tokens[r])
        scores.append(scores[p] + lp[t.depths[r] - 1, rank])
    assert all(a >= b - 1e-12 for a, b in zip(scores, scores[1:]))  # popped best first
    for r in range(40):  # siblings carry distinct tokens
        kids = [t.tokens[c] for c in range(40) if t.parents[c] == r]
        assert len(kids) == len(set(kids))
    np.testing.assert_allclose(t.gains, np.cumsum(np.exp(scores)))
    assert host_tree.build_tree(ids, lp, 1, root=3).parents == [-1]


# ---------------------------------------------------------------- through the exported programs

UNTIED = dict(tie_word_embeddings=False, target_layer_ids=[1, 3])
# family -> (TinySpec fields, prefill chunk, ctx_len): biased pairs, acceptance 1 … B
CASES = {
    "qwen3": (dict(block_size=4, agree=1.25), 8, 160),
    "llama": (dict(block_size=8, agree=1.25), 16, 160),
    "qwen3_moe": (dict(block_size=4, agree=2.0), 8, 160),
}
BUDGETS = [8, 16]
# a 24-token vocabulary, no bias: the target's pick is often the draft's second or third choice
SMALL = dict(block_size=8, vocab_size=24)


def build(exported, family, **options):
    pair, chunk, ctx = CASES[family]
    return exported(family, "dflash", pair={**UNTIED, **pair}, prefill_seq_len=chunk, ctx_len=ctx,
                    tree_budgets=BUDGETS, **options)  # fmt: skip


def prompt(n, seed) -> list[int]:
    return torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(model, ids, n) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


# qwen3 in the fast tier; llama (another attention) and the MoE block in the slow one
@pytest.mark.parametrize(
    "family", ["qwen3", *(pytest.param(f, marks=pytest.mark.slow) for f in ("llama", "qwen3_moe"))]
)
def test_tree_tokens_equal_hf_greedy(exported, family):
    e = build(exported, family)
    model, pipe = e.model(), e.load()
    chunk = CASES[family][1]
    for seed, (n, new) in enumerate([(3, 40), (chunk + 5, 33)]):
        ids = prompt(n, seed)
        want = hf_greedy(model, ids, new)
        for budget in (16, None, 0):
            pipe.configure(tree_budget=budget)
            res = pipe.generate(ids, max_new_tokens=new, stop_token_ids=[])
            assert res.tokens == want, (family, n, budget)
            assert sum(res.acceptance_lengths) == new - 1
            if budget == 16:
                assert set(res.verify_lengths) <= {16}  # cut only near the end of the context


@torch.no_grad()
def test_each_step_equals_a_ddtree_verifier(exported, monkeypatch):
    """Every step's tree (recorded as the host built it) verified here with the target's own
    Hugging Face model: the target's argmax at each node after its path, descend while a child
    carries it. The program accepted the same path and committed the same tokens."""
    e = exported("qwen3", "dflash", pair={**UNTIED, **SMALL}, prefill_seq_len=16, ctx_len=160,
                 tree_budgets=BUDGETS)  # fmt: skip
    model, pipe = e.model(), e.load()
    pipe.configure(tree_budget=16)
    trees = []
    real = host_tree.build_tree
    monkeypatch.setattr(host_tree, "build_tree", lambda *a: trees.append(real(*a)) or trees[-1])
    ids = [int(x) % 24 for x in prompt(9, 4)]
    res = pipe.generate(ids, max_new_tokens=60, stop_token_ids=[])
    assert len(trees) == len(res.acceptance_lengths)
    committed, took_side = list(ids) + res.tokens[:1], 0
    for t, a in zip(trees, res.acceptance_lengths):
        t = host_tree.Tree(t.parents[:16], t.depths[:16], t.tokens[:16], t.gains[:16])
        paths = [[]]
        for r in range(1, len(t.parents)):
            paths.append(paths[t.parents[r]] + [t.tokens[r]])
        deepest = max(t.depths)
        seqs = torch.tensor([committed + p + [0] * (deepest - len(p)) for p in paths])
        logits = model(seqs, attention_mask=torch.ones_like(seqs)).logits
        at = [len(committed) + len(p) - 1 for p in paths]  # the row predicting after the path
        pick = [int(logits[r, at[r]].argmax()) for r in range(len(paths))]
        kids = {r: [c for c in range(len(paths)) if t.parents[c] == r] for r in range(len(paths))}
        node, out = 0, []
        while True:  # descend while a child carries the target's pick
            out.append(pick[node])
            kid = [c for c in kids[node] if t.tokens[c] == pick[node]]
            if not kid:
                break
            took_side += kid[0] != kids[node][0]  # not the parent's first (rank-0) child
            node = kid[0]
        assert a == len(out), (a, out)
        assert res.tokens[len(committed) - len(ids) : len(committed) - len(ids) + a] == out
        committed += out
    assert max(res.acceptance_lengths) > 1 and took_side > 0  # deep paths, and off the chain


def test_seeded_tree_sampling_is_the_target_alones(exported):
    """At T = 1 a node draws with the uniforms of its depth's token: the tokens a seed gives are
    the target alone's (decode calls), whatever the tree's shape, and the chain's."""
    pipe = build(exported, "llama").load()
    ids = prompt(9, 4)
    for seed in (1, 2):
        alone = pipe.generate_baseline(ids, 30, temperature=1.0, seed=seed, stop_token_ids=[])
        taus = []
        for budget in (0, 8, 16, None):
            pipe.configure(tree_budget=budget)
            res = pipe.generate(ids, 30, temperature=1.0, seed=seed, stop_token_ids=[])
            assert res.tokens == alone.tokens, (seed, budget)
            taus.append(res.stats["tau"])
    assert max(taus) > 1.0


def test_tree_batched_equals_solo(exported):
    """4 requests on 3 cache rows, each row its own tree: tokens and steps equal solo runs."""
    solo = build(exported, "qwen3").load()
    pipe = build(exported, "qwen3", full_batch_size=3).load()
    for p in (solo, pipe):
        p.configure(tree_budget=16)
    ps = [prompt(n, 40 + n) for n in (5, 10, 38, 9)]
    news = [20, 31, 17, 26]
    batch = pipe.generate(ps, max_new_tokens=news, stop_token_ids=[])
    for ids, new, res in zip(ps, news, batch):
        one = solo.generate(ids, max_new_tokens=new, stop_token_ids=[])
        assert res.tokens == one.tokens and res.acceptance_lengths == one.acceptance_lengths
    sampled = pipe.generate(
        ps, max_new_tokens=news, temperature=1.0, seed=[1, 2, 3, 4], stop_token_ids=[]
    )
    for ids, new, s, res in zip(ps, news, [1, 2, 3, 4], sampled):
        assert (
            res.tokens == solo.generate(ids, new, temperature=1.0, seed=s, stop_token_ids=[]).tokens
        )


def _session_feeds(m, ids, pos, mask, kv):
    io = m.target.io
    b, s = ids.shape
    feeds = {
        contract.INPUT_IDS: ids, contract.POSITION_IDS: pos,
        contract.COMP_CTX_LENGTHS: np.arange(m.ctx_len, dtype=np.int64),
        contract.TEMPERATURE: np.zeros(b, np.float32), contract.TOP_K: np.zeros(b, np.int64),
        contract.TOP_P: np.ones(b, np.float32),
        contract.RANDOM_U: np.zeros((b, 1, 2), np.float32), contract.TREE_MASK: mask, **kv,
    }  # fmt: skip
    assert set(feeds) == {t.name for t in io.inputs}
    return feeds


def _run(sess, m, ids, pos, mask, kv):
    outs = sess.run(None, _session_feeds(m, ids, pos, mask, kv))
    named = dict(zip([o.name for o in sess.get_outputs()], outs))
    kv = {s.name: named[contract.retained(s.name)] for s in m.target.io.kv}
    return named, kv


def test_cache_after_a_tree_equals_a_chain_replay(exported):
    """A tree whose accepted path zig-zags over its rows (rows 0, 2, 4, 5) leaves the same K/V in
    slots 0 … start + 3 as a chain verify of the same tokens, and returns the same tokens and
    features in path order."""
    import onnxruntime as ort

    e = build(exported, "qwen3")
    m = e.load(tokenizer=False).artifacts
    sess = ort.InferenceSession(
        str(e.artifacts / m.target.onnx), providers=["CPUExecutionProvider"]
    )
    ids = prompt(8, 5)
    g = hf_greedy(e.model(), ids, 4)  # the target's own continuation: g[0] is the anchor
    kv0 = {
        s.name: np.zeros(s.bind(batch_size=1, ctx_len=m.ctx_len), np.float32)
        for s in m.target.io.kv
    }
    tri = np.tri(8, dtype=np.int32)[None]
    _, kv = _run(sess, m, np.array([ids]), np.arange(8)[None], tri, kv0)
    wrong = [(x + 7) % 200 + 1 for x in g]
    layout = contract.RowLayout(parents=(-1, 0, 0, 1, 2, 4), depths=(0, 1, 1, 2, 2, 3))
    tokens = [g[0], wrong[1], g[1], wrong[2], g[2], g[3]]
    mask = np.array(layout.mask(), np.int32)[None]
    out_t, kv_t = _run(sess, m, np.array([tokens]), np.array([layout.positions(8)]), mask, kv)
    assert int(out_t[contract.NUM_ACCEPTED][0]) == 3
    chain = [g[0], g[1], g[2], g[3]]
    out_c, kv_c = _run(
        sess, m, np.array([chain]), np.arange(8, 12)[None], np.tri(4, dtype=np.int32)[None], kv
    )
    assert int(out_c[contract.NUM_ACCEPTED][0]) == 3
    np.testing.assert_array_equal(
        out_t[contract.NEXT_TOKENS][0, :4], out_c[contract.NEXT_TOKENS][0]
    )
    np.testing.assert_allclose(
        out_t[contract.HIDDEN_STATES][0, :4], out_c[contract.HIDDEN_STATES][0], atol=1e-5
    )
    for name in kv_c:
        np.testing.assert_allclose(kv_t[name][:, :, :12], kv_c[name][:, :, :12], atol=1e-5)


def test_tree_export_is_fp16_faithful_and_planned(exported):
    m = build(exported, "qwen3").load(tokenizer=False).artifacts
    assert m.tree_budgets == tuple(BUDGETS) and m.target.io.verify_rule == contract.TREE
    assert m.draft.io.top_k == contract.MAX_DRAFT_TOP_K  # the tree's candidates, by default
    names = {s["name"] for s in m.target.specializations}
    assert {"Verify[8]", "Verify[16]", "VerifySampled[16]"} <= names
    rep = m.target.check["fp16_faithful"]
    assert rep["ran"] and not rep["flagged"] and np.isfinite(rep["max_abs"]), rep


def test_tree_options_are_checked(exported):
    from dflash_qaic.artifacts.build import ExportOptions
    from dflash_qaic.exporter.options import ExportError

    with pytest.raises(ExportError, match="two verifiers"):
        ExportOptions(tree_budgets=(16,), verify_rule="block")
    with pytest.raises(ExportError, match="needs --tree-budgets"):
        ExportOptions(verify_rule="tree")
    assert ExportOptions(tree_budgets=(16, 32)).verify_rule == contract.TREE
    pipe = build(exported, "qwen3").load()
    with pytest.raises(ValueError, match=r"tree budgets \[8, 16\]"):
        pipe.configure(tree_budget=12)
    chain = exported(
        "qwen3", "dflash", pair={**UNTIED, **CASES["qwen3"][0]}, prefill_seq_len=8, ctx_len=160
    )
    with pytest.raises(ValueError, match="no tree budgets"):
        chain.load().configure(tree_budget=16)


def test_hybrid_and_structured_tree_exports_are_refused(tiny_pair, tmp_path):
    from dflash_qaic.artifacts.build import ExportOptions, build_artifacts

    t, d = tiny_pair(family="qwen3_5", block_size=4)
    with pytest.raises(Exception, match="not built for hybrid targets"):
        build_artifacts(
            t,
            d,
            tmp_path / "a",
            ExportOptions(
                compile=False, prefill_seq_len=16, ctx_len=112, tree_budgets=(8,), fp16_check=False
            ),
        )
    t, d = tiny_pair(family="qwen3", block_size=4)
    with pytest.raises(Exception, match="structured-output is not built"):
        build_artifacts(
            t,
            d,
            tmp_path / "b",
            ExportOptions(
                compile=False,
                prefill_seq_len=8,
                ctx_len=160,
                tree_budgets=(8,),
                structured_output=True,
                fp16_check=False,
            ),
        )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_bench_measures_each_tree_budget(exported, tmp_path, capsys):
    import json

    from dflash_qaic.bench.cli import main

    e = build(exported, "qwen3")
    out = tmp_path / "bench"
    args = [str(e.artifacts), "--out", str(out), "--num-prompts", "2", "--repeats", "1"]
    args += ["--warmup", "0", "--max-new-tokens", "12", "--threads", "1", "--no-peers"]
    assert main([*args, "--no-profile", "--temperatures", "0", "--tree-budgets", "0,16,auto"]) == 0
    res = json.loads((out / "results.json").read_text())
    trees = res["trees"]
    assert [t["budget"] for t in trees] == [0, 16, None]
    for t in trees:
        (s,) = t["temperatures"]
        assert s["check"]["passed"] and s["tau"] >= 1 and s["steps"] > 0
    assert "tree budgets" in capsys.readouterr().out
    assert "## Tree verification" in (out / "report.md").read_text()
    chain = exported("qwen3", "dflash", pair={**UNTIED, **CASES["qwen3"][0]}, prefill_seq_len=8,
                     ctx_len=160)  # fmt: skip
    bad = [str(chain.artifacts), "--out", str(tmp_path / "o"), "--no-peers", "--no-profile"]
    assert main([*bad, "--tree-budgets", "16"]) == 2
    assert "no tree budgets" in capsys.readouterr().err
    assert main([str(e.artifacts), "--out", str(tmp_path / "p"), "--tree-budgets", "x"]) == 2
    assert "--tree-budgets takes integers" in capsys.readouterr().err


def test_projection_reads_tau_per_budget_from_a_tree_bench(tmp_path):
    import json

    from dflash_qaic.bench.project import ProjectionError, tau_from

    def sec(T, tau):
        return {"temperature": T, "status": "measured", "tau": tau}

    trees = [
        {"draft": "DFlash (a)", "budget": b, "temperatures": [sec(0.0, t), sec(1.0, 2.0)]}
        for b, t in ((0, 8.876), (32, 10.9), (None, 9.5))
    ] + [{"draft": "DFlash-2 (b)", "budget": 32, "temperatures": [sec(0.0, 12.0)]}]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"trees": trees}))
    assert tau_from(str(path)) == {"chain": 8.88, 32: 10.9}
    path.write_text(json.dumps({"temperatures": []}))
    with pytest.raises(ProjectionError, match="no tree budgets measured"):
        tau_from(str(path))


def test_build_tree_ranks_branches_by_the_selectors_pairs():
    """A DFlash-2 draft's pairwise log q: each node's children ordered and scored after the
    node's own candidate, the root's after the anchor (row 0 of the table)."""
    rng = np.random.default_rng(5)
    depth, k = 4, 3
    ids = np.stack([rng.permutation(30)[:k] for _ in range(depth)])
    pair = np.log(rng.dirichlet(np.ones(k), size=(depth, k)))  # [depth, k(prev), k]
    t = host_tree.build_tree(ids, np.zeros((depth, k)), 25, root=1, pair=pair)
    cand = [0]
    for r in range(1, len(t.parents)):
        cand.append(list(ids[t.depths[r] - 1]).index(t.tokens[r]))
    scores = [0.0]
    for r in range(1, len(t.parents)):
        p, d = t.parents[r], t.depths[r]
        scores.append(scores[p] + pair[d - 1, cand[p] if d > 1 else 0, cand[r]])
        kids = [c for c in range(len(t.parents)) if t.parents[c] == p]
        got = [pair[d - 1, cand[p] if d > 1 else 0, cand[c]] for c in kids]
        assert got == sorted(got, reverse=True)  # siblings in their parent's order
    assert all(a >= b - 1e-12 for a, b in zip(scores, scores[1:]))
    np.testing.assert_allclose(t.gains, np.cumsum(np.exp(scores)))


def test_dflash2_tree_tokens_equal_hf_greedy(exported):
    """The DFlash-2 draft returns its selector's pairwise log q for the tree (pair_k); tokens
    stay Hugging Face greedy, and seeded sampling the target alone's."""
    pair = {**UNTIED, **dict(block_size=8, vocab_size=24, agree=2.0)}
    e = exported("qwen3", "dflash2", pair=pair, prefill_seq_len=16, ctx_len=160,
                 tree_budgets=BUDGETS)  # fmt: skip
    pipe = e.load()
    io = pipe.artifacts.draft.io
    assert io.top_k == contract.MAX_DRAFT_TOP_K and 0 < io.pair_k <= io.top_k  # the selector's k
    ids = [int(x) % 24 for x in prompt(11, 8)]
    want = hf_greedy(e.model(), ids, 36)
    for budget in (16, None):
        pipe.configure(tree_budget=budget)
        assert pipe.generate(ids, max_new_tokens=36, stop_token_ids=[]).tokens == want
    alone = pipe.generate_baseline(ids, 24, temperature=1.0, seed=3, stop_token_ids=[])
    assert pipe.generate(ids, 24, temperature=1.0, seed=3, stop_token_ids=[]).tokens == alone.tokens
