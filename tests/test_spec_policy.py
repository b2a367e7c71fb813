"""The step policy (docs/DESIGN.md, Step policy; runtime/policy.py): per sequence and step, a
DFlash step or plain decoding.

- the decision logic on deterministic inputs (set costs and acceptances): the break-even
  estimate, drafting while it pays, probes that back off and come back, the confidences read
  through the pair's calibration, `always` and `never`;
- `never` is the target alone (no draft call at all); `auto` gives `always`'s greedy tokens on
  the built-in pair and on a random pair (where it decodes);
- a continuous batch where some rows draft and others decode in the same step gives each
  request the tokens it gets alone;
- the option is checked by name, reaches `EngineConfig`, and its path per step is in
  `res.stats` (`drafted_steps`, `decode_steps`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dflash_qaic
from dflash_qaic.runtime.engine import EngineConfig
from dflash_qaic.runtime.policy import StepPolicy, break_even, expected
from dflash_qaic.runtime.stats import StepCosts

PAIR = dict(block_size=8, tie_word_embeddings=False, target_layer_ids=[1, 3])


def costs(verify: dict, draft: float, decode: float | None) -> StepCosts:
    c = StepCosts()
    c.verify_s, c.draft_s, c.decode_s = dict(verify), draft, decode
    return c


def prompt(n, seed) -> list[int]:
    return torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------------ the decision logic


def test_threshold_is_the_break_even_estimate():
    # verify(4) = 2, verify(8) = 3, draft 1, decode 1: n = 4 needs 2 kept proposals, n = 8 needs 3
    c = costs({4: 2.0, 8: 3.0}, 1.0, 1.0)
    assert StepPolicy.threshold(c) == pytest.approx(2.0)
    assert StepPolicy.threshold(c, draft=False) == pytest.approx(1.0)  # the draft already ran
    # a verify length that cannot keep what it needs does not count: n = 4 keeps at most 3
    assert StepPolicy.threshold(costs({4: 5.0, 8: 5.0}, 1.0, 1.0)) == pytest.approx(5.0)
    assert StepPolicy.threshold(costs({4: 9.0}, 1.0, 1.0)) == np.inf  # never pays
    assert StepPolicy.threshold(StepCosts()) == -np.inf  # unmeasured: draft, to measure
    # no decode timed yet: the cheapest verify stands for it
    assert StepPolicy.threshold(costs({4: 2.0, 8: 4.0}, 2.0, None)) == pytest.approx(1.0)


def test_the_break_even_follows_the_backend_s_cost_profile():
    """One rule for every backend, read from the costs measured on it: where a verify is
    nearly free (the card: weight-bound, B rows for the price of one decode) a row keeping half
    a proposal per step drafts; with a CPU's costs (a 16-row verify ≈ 2 decodes) it decodes."""
    assert break_even({4: 2.0, 8: 3.0}, 1.0, 1.0) == (pytest.approx(2.0), 4)
    assert break_even({4: 9.0}, 1.0, 1.0) == (np.inf, None)
    card = costs({16: 1.05}, 0.1, 1.0)  # bench/project.py's roofline: verify ≈ decode
    cpu = costs({4: 1.3, 8: 1.5, 16: 2.0}, 0.8, 1.0)  # the built-in pair on ONNX Runtime
    assert StepPolicy.threshold(card) == pytest.approx(0.15)
    assert StepPolicy.threshold(cpu) == pytest.approx(1.1)
    for c, drafts in ((card, True), (cpu, False)):
        p = StepPolicy("auto", slots=1, block_size=16, confidence=False)
        p.join(0, None, c)
        p.est[0] = 0.5  # half a proposal kept per drafted step
        assert p.want([0], c) == [drafts]


def test_auto_drafts_while_it_pays_then_decodes_and_probes():
    c = costs({4: 2.0, 8: 3.0}, 1.0, 1.0)  # drafting pays at ≥ 2 kept proposals
    p = StepPolicy("auto", slots=2, block_size=8, confidence=False)
    p.join(0, None, c)
    p.join(1, None, c)
    assert p.est == [7.0, 7.0]  # no confidences, nothing kept yet: the block's worth
    assert p.want([0, 1], c) == [True, True]
    for _ in range(15):
        p.observe([0, 1], [7, 0], None, c)
    assert p.est[0] == 7.0 and p.est[1] == pytest.approx(7.0 * (1 - StepPolicy.WEIGHT) ** 15)
    assert p.est[1] < 2.0 and c.kept == 3.5  # the pair's memory: both rows' means
    assert p.want([0, 1], c) == [True, False]
    # row 1 decodes until its probe is due (PROBE_FIRST decode steps), then probes once
    decisions = [p.want([1], c)[0] for _ in range(StepPolicy.PROBE_FIRST + 1)]
    assert decisions == [False] * (StepPolicy.PROBE_FIRST - 1) + [True, False]
    assert p.probing[1] is False  # the step after the probe decided again
    assert p.wait[1] == 2 * StepPolicy.PROBE_FIRST  # the probe did not pay: twice the wait


def test_a_probe_that_pays_brings_the_drafts_back():
    c = costs({4: 2.0, 8: 3.0}, 1.0, 1.0)
    p = StepPolicy("auto", slots=1, block_size=8, confidence=False)
    p.join(0, None, c)
    p.est[0] = 0.0
    while not p.want([0], c)[0]:  # decode until the probe
        pass
    assert p.probing[0]
    p.observe([0], [7], None, c)  # the text became predictable
    assert p.est[0] == pytest.approx(7 * StepPolicy.WEIGHT_SAMPLED)  # a probe weighs more
    sampled = StepPolicy("auto", slots=1, block_size=8, confidence=False)
    sampled.join(0, None, c, sampled=True)
    sampled.observe([0], [0], None, c)
    assert sampled.est[0] == 0.0  # a sampled row's first observation replaces its prior
    assert p.want([0], c) == [True] and not p.probing[0]
    assert p.wait[0] == StepPolicy.PROBE_FIRST


def test_the_wait_between_probes_is_bounded():
    c = costs({4: 2.0}, 1.0, 1.0)
    p = StepPolicy("auto", slots=1, block_size=8, confidence=False)
    p.join(0, None, c)
    p.est[0] = 0.0
    gaps, gap = [], 0
    for _ in range(2000):
        gap += 1
        if p.want([0], c)[0]:
            gaps.append(gap)
            gap = 0
    assert gaps[:3] == [StepPolicy.PROBE_FIRST + 1, 2 * StepPolicy.PROBE_FIRST + 1, 33]
    assert max(gaps) == StepPolicy.PROBE_MAX + 1


def test_confidences_are_read_through_the_calibration():
    c = costs({4: 2.0, 8: 3.0}, 1.0, 1.0)
    sure = np.full((1, 7), 0.99, np.float32)  # promises ≈ 6.7 proposals
    p = StepPolicy("auto", slots=1, block_size=8)
    p.join(0, sure[0], c)
    assert p.est[0] == pytest.approx(float(expected(sure)[0]), rel=1e-6)
    assert p.use([0], sure, c) == [True]
    # the draft promised ≈ 6.7 and kept none, again and again: its promises count for nothing
    for _ in range(30):
        p.observe([0], [0], sure, c)
    assert c.kept < 0.2 < 6 < c.promised
    assert p.use([0], sure, c) == [False]
    p.join(0, sure[0], c)  # a new sequence starts from the pair's calibrated promise
    assert p.est[0] < 0.2
    assert p.wait[0] == StepPolicy.PROBE_LATE  # and probes late: drafting has not paid here


def test_always_and_never():
    c = costs({4: 9.0}, 9.0, 1.0)  # drafting never pays
    for mode, want in (("always", True), ("never", False)):
        p = StepPolicy(mode, slots=2, block_size=8)
        p.join(0, np.ones(7, np.float32), c)
        assert p.want([0, 1], c) == [want, want]
        assert p.use([0, 1], np.ones((2, 7)), c) == [want, want]
    with pytest.raises(ValueError, match="spec_policy must be one of auto, always, never"):
        StepPolicy("sometimes", 1, 8)
    with pytest.raises(ValueError, match="spec_policy must be one of auto, always, never"):
        EngineConfig(spec_policy="sometimes")


# ------------------------------------------------------------------ through the programs


def test_sampled_rows_keep_their_own_memory():
    """The pair's memory is kept apart for greedy and sampled rows: what sampled rows keep
    does not move the greedy rows' (nor the reverse), each kind's promises are read through its
    own calibration, and each kind's probes back off by its own record."""
    c = costs({4: 2.0, 8: 3.0}, 1.0, 1.0)  # drafting pays at ≥ 2 kept proposals
    sure = np.full((2, 7), 0.99, np.float32)
    p = StepPolicy("auto", slots=2, block_size=8)
    p.join(0, sure[0], c)
    p.join(1, sure[1], c, sampled=True)
    for _ in range(30):  # greedy rows keep 6 a step, sampled ones none
        p.observe([0, 1], [6, 0], sure, c)
    assert c.kept == pytest.approx(6.0, rel=0.05) and c.kept_sampled < 0.3
    assert c.promised == pytest.approx(c.promised_sampled) and c.promised > 6
    e_greedy, e_sampled = p.promise(sure, c, [False, True])
    assert e_greedy > 5.5 and e_sampled < 0.3  # the same confidences, each kind's calibration
    assert p.use([0, 1], sure, c) == [True, False]
    # a decoding greedy row's probes back off to 2 × PROBE_FIRST (greedy drafts pay here), a
    # sampled row's to PROBE_MAX (sampled ones do not)
    p.est = [0.0, 0.0]
    waits = {0: [], 1: []}
    for _ in range(1500):
        for r in (0, 1):
            p.want([r], c)
            waits[r].append(p.wait[r])
    assert max(waits[0]) == 2 * StepPolicy.PROBE_FIRST
    assert max(waits[1]) == StepPolicy.PROBE_MAX


def test_after_a_lucky_probe_the_wait_restarts_by_the_kind_s_record():
    """A probe that pays brings a row's drafts back; when they stop paying its next wait is
    PROBE_FIRST where its kind's drafts pay on the whole, PROBE_LATE where they do not (a
    sampled row on a CPU: a lucky step is most often followed by a plain one)."""
    c = costs({4: 2.0, 8: 3.0}, 1.0, 1.0)  # drafting pays at ≥ 2 kept proposals
    c.kept, c.kept_sampled = 6.0, 1.0
    p = StepPolicy("auto", slots=2, block_size=8, confidence=False)
    p.join(0, None, c)
    p.join(1, None, c, sampled=True)
    for r in (0, 1):
        p.est[r], p.probing[r] = 3.0, True  # a probe whose step paid
    assert p.want([0, 1], c) == [True, True]
    assert p.wait == [StepPolicy.PROBE_FIRST, StepPolicy.PROBE_LATE]


def test_a_row_whose_kind_has_not_paid_starts_decoding():
    """`lazy`: under auto, a sequence whose kind (greedy, sampled) kept less than half the
    break-even so far starts decoding without its first block, and probes after PROBE_MAX
    steps (a hopeless kind); until the kind has a record (or the costs are measured), and under always / never,
    it does not."""
    c = costs({4: 2.0, 8: 3.0}, 1.0, 1.0)
    p = StepPolicy("auto", slots=1, block_size=8)
    assert not p.lazy(c) and not p.lazy(c, sampled=True)  # no record yet: the first block runs
    c.kept_sampled, c.promised_sampled = 0.5, 4.0
    assert p.lazy(c, sampled=True) and not p.lazy(c)
    c.kept = 2.5  # greedy rows have paid
    assert not p.lazy(c)
    c.kept = 1.5  # short of paying, not hopeless: the first block still runs
    assert not p.lazy(c)
    c.kept = 0.8  # under half the break-even
    assert p.lazy(c)
    assert not p.lazy(StepCosts())  # nothing timed: every row drafts, to measure
    for mode in ("always", "never"):
        assert not StepPolicy(mode, slots=1, block_size=8).lazy(c, sampled=True)
    p.join(0, None, c, sampled=True, fresh=False)
    assert p.est[0] == 0.5 and p.wait[0] == StepPolicy.PROBE_MAX
    decisions = [p.want([0], c)[0] for _ in range(StepPolicy.PROBE_MAX + 2)]
    assert decisions == [False] * StepPolicy.PROBE_MAX + [True, False]


@pytest.fixture(scope="module")
def random_pair(exported):
    """A random tiny pair (τ ≈ 1) exported for 3 slots."""
    return exported("qwen3", pair=PAIR, prefill_seq_len=16, ctx_len=160, full_batch_size=3)


def test_never_is_the_target_alone(random_pair):
    pipe = random_pair.load()
    ids = prompt(9, 0)
    alone = pipe.generate_baseline(ids, 40, stop_token_ids=[])
    pipe.configure(spec_policy="never")
    assert pipe.spec_policy == "never"
    res = pipe.generate(ids, 40, stop_token_ids=[])
    assert res.tokens == alone.tokens
    assert res.stats["drafted_steps"] == 0 and res.stats["decode_steps"] == 39
    assert set(res.call_times) == {"prefill", "decode"}  # the draft never ran
    seeded = dict(temperature=1.0, seed=5, stop_token_ids=[])
    assert (
        pipe.generate(ids, 30, **seeded).tokens == pipe.generate_baseline(ids, 30, **seeded).tokens
    )


def test_auto_equals_always_on_a_random_pair(random_pair):
    pipe = random_pair.load()
    pipe.configure(spec_policy="always")
    ids = prompt(11, 1)
    want = pipe.generate(ids, 60, stop_token_ids=[])  # always: every step drafts
    assert want.stats["decode_steps"] == 0 and want.stats["drafted_steps"] == want.stats["steps"]
    pipe.generate_baseline(ids, 8, stop_token_ids=[])  # a decode call timed
    pipe.configure(spec_policy="auto")
    for _ in range(2):
        res = pipe.generate(ids, 60, stop_token_ids=[])
        assert res.tokens == want.tokens
    assert res.stats["drafted_steps"] + res.stats["decode_steps"] == res.stats["steps"]


def fixed_break_even(monkeypatch, kept: float = 2.0):
    """The break-even fixed, not read from the measured call times (which a loaded machine
    moves): a drafted step must keep `kept` proposals, and fresh proposals are always verified
    (the draft call's cost spent, a verify pays at any promise), so the pair's record fills."""
    rule = staticmethod(lambda costs, draft=True: kept if draft else -np.inf)
    monkeypatch.setattr(StepPolicy, "threshold", rule)


def test_a_lazy_row_sends_its_prompt_with_its_first_probe(random_pair, monkeypatch):
    """On a pair whose drafts have not paid, a new request's prefill runs no draft call (its
    prompt's context waits in its slot), it decodes, and the draft gets every position from the
    first on, in order: in calls of the context alone when the slot's context fills, and the
    rest with its first probe after PROBE_MAX decode steps; the tokens are the target's own."""
    from dflash_qaic.runtime.step import Prefill

    fixed_break_even(monkeypatch)
    pipe = random_pair.load()
    pipe.configure(spec_policy="auto")
    for i in range(3):  # the pair's record: its drafts keep nothing
        pipe.generate(prompt(10, 60 + i), 12, stop_token_ids=[])
    assert pipe.step_costs.kept < 1.0
    sent, real = [], Prefill.flush

    def flush(self, seq, end, first, costs=None):
        sent.append((end, seq.pending))
        real(self, seq, end, first, costs)

    monkeypatch.setattr(Prefill, "flush", flush)
    ids = prompt(9, 70)
    new = StepPolicy.PROBE_MAX + 8
    res = pipe.generate(ids, new, stop_token_ids=[])
    assert res.tokens == pipe.generate_baseline(ids, new, stop_token_ids=[]).tokens
    assert "draft_prefill" not in res.call_times  # no draft call at the prompt's end
    starts = [end - pending for end, pending in sent]
    assert starts == [0] + [end for end, _ in sent[:-1]]  # every position, from the prompt's first
    # the probe: the step after PROBE_MAX decode steps that waited, the first token's the 1
    assert len(ids) + 1 + StepPolicy.PROBE_MAX in [end for end, _ in sent]
    assert pipe.engine().prefill.context_rows < len(ids) + StepPolicy.PROBE_MAX  # one filled
    assert res.stats["decode_steps"] >= StepPolicy.PROBE_MAX


def test_a_lazy_row_waiting_to_join_has_no_proposals(random_pair, monkeypatch):
    """first_token_alone (the vLLM worker's engine): a lazily started request reports no
    proposals for its first step, and its tokens are the target's."""
    fixed_break_even(monkeypatch)
    pipe = random_pair.load()
    pipe.configure(spec_policy="auto")
    for i in range(3):
        pipe.generate(prompt(10, 80 + i), 12, stop_token_ids=[])
    engine = pipe.engine(first_token_alone=True)
    ids = prompt(12, 90)
    seq = engine.add(pipe.request(ids, 20, [], "dflash"))
    engine.step()
    assert seq.lazy and len(seq.tokens) == 1 and engine.proposals(seq).size == 0
    while not seq.finished:
        engine.step()
    assert seq.tokens == pipe.generate_baseline(ids, 20, stop_token_ids=[]).tokens


def test_auto_equals_always_on_the_default_pair(default_artifacts):
    pipe = dflash_qaic.load(default_artifacts)
    assert pipe.spec_policy == "auto"  # the default
    pipe.configure(spec_policy="always")
    text = "def fibonacci(n):"
    want = pipe.generate(text, 96, stop_token_ids=[])
    assert want.stats["drafted_steps"] == want.stats["steps"]
    pipe.configure(spec_policy="auto")
    for _ in range(2):
        res = pipe.generate(text, 96, stop_token_ids=[])
        assert res.tokens == want.tokens
    assert res.stats["drafted_steps"] > 0  # it drafts where drafting pays
    assert pipe.generate_baseline(text, 96, stop_token_ids=[]).tokens == want.tokens


def force(monkeypatch, pattern):
    """The policy's choice replaced by `pattern(slot, step) -> draft?` (every fresh block
    verified), so a batch mixes drafting and decoding rows deterministically; records each
    verify call's rows that decode and draft."""
    steps, mixed = {}, []

    def want(self, slots, costs):
        out = []
        for r in slots:
            steps[r] = steps.get(r, 0) + 1
            out.append(pattern(r, steps[r]))
        return out

    monkeypatch.setattr(StepPolicy, "want", want)
    monkeypatch.setattr(StepPolicy, "steady", lambda self, slots, costs: False)  # want decides
    monkeypatch.setattr(StepPolicy, "use", lambda self, slots, conf, costs: [True] * len(slots))
    from dflash_qaic.runtime import verifiers

    real = verifiers.ChainVerifier.fill

    def fill(self, rows, seqs):
        dec = self.step.state.decoding[rows]
        mixed.append(bool(dec.any() and not dec.all()))
        return real(self, rows, seqs)

    monkeypatch.setattr(verifiers.ChainVerifier, "fill", fill)
    return mixed


def test_a_mixed_batch_equals_each_alone(random_pair, monkeypatch):
    """3 slots, 4 requests: rows draft on some steps and decode on others (each its own
    rhythm, resuming after runs of decode steps), in the same verify calls; every request's
    tokens equal its run alone and the target alone's."""
    mixed = force(monkeypatch, lambda slot, step: (step + slot) % 3 == 0 or step % 7 < 2)
    pipe = random_pair.load()
    pipe.configure(spec_policy="auto")
    ps = [prompt(n, 20 + n) for n in (5, 12, 30, 9)]
    news = [25, 40, 18, 33]
    batch = pipe.generate(ps, max_new_tokens=news, stop_token_ids=[])
    assert any(mixed)  # some verify calls had drafting and decoding rows together
    for ids, new, res in zip(ps, news, batch):
        alone = pipe.generate(ids, max_new_tokens=new, stop_token_ids=[])
        target = pipe.generate_baseline(ids, max_new_tokens=new, stop_token_ids=[])
        assert res.tokens == alone.tokens == target.tokens
        s = res.stats
        assert s["drafted_steps"] > 0 and s["decode_steps"] > 0
        assert len(res.verify_lengths) == s["steps"]
        decoded = [n for n, v in zip(res.acceptance_lengths, res.verify_lengths) if v == 1]
        assert set(decoded) <= {1}  # a decode step commits one token


def test_a_resumed_row_proposes_from_its_whole_context(default_artifacts, monkeypatch):
    """A row that decoded for a while sends its waiting context before it drafts again, so its
    draft sees every position: each resumed block's proposals are the ones a fresh prompt of
    the same tokens gets from its prefill (which sends the whole prompt to the draft)."""
    from dflash_qaic.runtime.step import Prefill

    pipe = dflash_qaic.load(default_artifacts)
    ids = pipe.tokenizer.encode("def fibonacci(n):")
    pipe.configure(spec_policy="always")
    always = pipe.generate(ids, 100, stop_token_ids=[])
    force(monkeypatch, lambda slot, step: step % 6 == 0)  # draft once after 5 decode steps
    resumed, real = [], Prefill.flush

    def flush(self, seq, end, first, costs=None):
        real(self, seq, end, first, costs)
        if seq.prefilled == len(seq.req.ids):  # a decoding row's context, not its prompt
            resumed.append((end, self.state.proposals[seq.slot].copy()))

    monkeypatch.setattr(Prefill, "flush", flush)
    pipe.configure(spec_policy="auto")
    res = pipe.generate(ids, 100, stop_token_ids=[])
    assert res.tokens == always.tokens and len(resumed) >= 5
    same = []
    for end, proposals in resumed:
        engine = pipe.engine(first_token_alone=True)
        seq = engine.add(pipe.request(ids + res.tokens[: end - len(ids)], 1, [], "dflash"))
        engine.step()  # its prefill, its first token: the block the draft proposes after it
        assert seq.tokens == [res.tokens[end - len(ids)]]
        same.append(np.mean(engine.proposals(seq) == proposals))
    assert np.mean(same) > 0.95, same


# ------------------------------------------------------------------ the option, declared once


def test_the_flag_on_every_command(default_artifacts, capsys):
    """--spec-policy on dflash-run, dflash-serve, dflash-bench (and its --multi-turn and
    --long-context modes): one declaration (its default, auto, values and help), a bad value
    refused by argparse; dflash-run reports the path. The Python API's default is the same
    declaration's; replicas and Ray Serve parse dflash-serve's flags, and the vLLM plugin
    leaves the pipeline's default unless its block sets one."""
    import json

    from dflash_qaic.bench import longctx, multi_turn
    from dflash_qaic.bench.cli import parser as bench_parser
    from dflash_qaic.runtime.cli import main as run_main
    from dflash_qaic.runtime.cli import parser as run_parser
    from dflash_qaic.runtime.options import SPEC_POLICY
    from dflash_qaic.serve.cli import parser as serve_parser

    assert EngineConfig().spec_policy == SPEC_POLICY.default == "auto"
    assert dflash_qaic.load(default_artifacts).spec_policy == "auto"
    for make in (run_parser, serve_parser, bench_parser, multi_turn.parser):
        p = make()
        extra = ["--prompt", "x"] if make is run_parser else []
        assert p.parse_args(["a", *extra]).spec_policy == SPEC_POLICY.default
        assert p.parse_args(["a", *extra, "--spec-policy", "always"]).spec_policy == "always"
        with pytest.raises(SystemExit):
            p.parse_args(["a", *extra, "--spec-policy", "sometimes"])
    assert longctx.parse(["a"]).spec_policy == SPEC_POLICY.default
    capsys.readouterr()
    argv = [str(default_artifacts), "--prompt-ids", "1,2,3", "--max-new-tokens", "20", "--json"]
    assert run_main([*argv, "--spec-policy", "never", "--stop-token-ids", ""]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["decode_steps"] == stats["steps"] == 19 and stats["drafted_steps"] == 0


def test_metrics_count_each_path():
    """/metrics: a one-row step (decoded) counts under path="decode" and not as a draft."""
    import prometheus_client

    from dflash_qaic.serve.metrics import Metrics

    m = Metrics("m", 8)
    for committed, verified in ((3, 4), (1, 1), (1, 1), (8, None)):
        m.step(committed, verified)
    text = prometheus_client.generate_latest(m.registry).decode()
    assert 'dflash:spec_policy_steps_total{model_name="m",path="draft"} 2.0' in text
    assert 'dflash:spec_policy_steps_total{model_name="m",path="decode"} 2.0' in text
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 2.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 10.0' in text  # 3 + 7


def test_the_engine_reports_no_proposals_for_a_row_that_decodes(random_pair, monkeypatch):
    """What the vLLM worker schedules as drafts (`engine.proposals`) is empty for a row whose
    next step decodes."""
    force(monkeypatch, lambda slot, step: step % 3 == 0)
    pipe = random_pair.load()
    pipe.configure(spec_policy="auto")
    engine = pipe.engine()
    seq = engine.add(pipe.request(prompt(7, 3), 30, [], "dflash"))
    lengths = []
    while not seq.finished:
        engine.step()
        if not seq.finished:
            lengths.append(len(engine.proposals(seq)))
            assert lengths[-1] == (
                0 if engine.spec.state.decoding[seq.slot] else PAIR["block_size"] - 1
            )
    assert 0 in lengths


def test_a_preempted_call_moves_the_costs_by_a_bounded_step():
    """On a shared machine a call the OS preempts can take tens of times its cost; the running
    means the policy reads count it as at most CAP means, so one outlier moves a mean by a
    bounded step (and cannot flip every row's choice)."""
    c = StepCosts(warmup_calls=0)
    c.observe("decode", 1.0, 1)
    c.observe("decode", 50.0, 1)
    assert c.decode_s == pytest.approx(1.0 + StepCosts.WEIGHT * (StepCosts.CAP - 1.0))
    assert c.decode_s < 2.0
    c.step("decode", 1.5)  # 1.5 s of wall time, 50 + 1 of them in the calls: no host time
    assert c.host_s["decode"] == 0.0
    for _ in range(60):  # a real change of cost gets through
        c.observe("decode", 3.0, 1)
    assert c.decode_s == pytest.approx(3.0, rel=1e-3)


def test_drafting_again_at_the_end_of_the_context(exported, monkeypatch):
    """Rows that decode and draft again up to the last position (ctx_len 40): the block a
    resumed row proposes sits inside the context, and the sequence stops at the end with the
    target alone's tokens, for every budget that fits."""
    e = exported("qwen3", pair=PAIR, prefill_seq_len=8, ctx_len=40)
    pipe = e.load()
    ids = prompt(10, 3)
    base = pipe.generate_baseline(ids, max_new_tokens=100, stop_token_ids=[])
    assert base.stop_reason == "ctx_len" and len(ids) + len(base.tokens) == 40
    for period in (2, 3, 5):
        force(monkeypatch, lambda slot, step, p=period: step % p == 0)
        pipe.configure(spec_policy="auto")
        res = pipe.generate(ids, max_new_tokens=100, stop_token_ids=[])
        assert res.stop_reason == "ctx_len" and res.tokens == base.tokens, period
        assert res.stats["drafted_steps"] > 0 and "draft_context" in res.call_times
        for new in range(len(base.tokens) - 6, len(base.tokens) + 1):
            got = pipe.generate(ids, max_new_tokens=new, stop_token_ids=[])
            assert got.tokens == base.tokens[:new] and got.error is None, (period, new)


def test_a_mixed_tree_batch_equals_each_alone(exported, monkeypatch):
    """A tree program's batch where some rows decode (a tree of its root alone) beside rows
    that verify trees: every request's tokens are its own alone."""
    from test_tree_verify import build

    force(monkeypatch, lambda slot, step: (step + slot) % 3 != 0)
    pipe = build(exported, "qwen3", full_batch_size=3).load()
    pipe.configure(tree_budget=16, spec_policy="auto")
    ps = [prompt(n, 40 + n) for n in (5, 10, 38, 9)]
    news = [20, 31, 17, 26]
    batch = pipe.generate(ps, max_new_tokens=news, stop_token_ids=[])
    for ids, new, res in zip(ps, news, batch):
        assert res.error is None, res.error
        assert (
            res.tokens == pipe.generate_baseline(ids, max_new_tokens=new, stop_token_ids=[]).tokens
        )
        assert res.stats["drafted_steps"] > 0 and res.stats["decode_steps"] > 0


def test_a_greedy_row_starts_from_the_pair_s_memory():
    """A greedy row whose first block's confidences promise little still drafts when the
    pair's drafts have paid so far (its own steps then say whether they pay for it); a sampled
    row starts from the promise."""
    c = costs({4: 2.0, 8: 3.0}, 1.0, 1.0)  # drafting pays at ≥ 2 kept proposals
    c.kept, c.promised = 6.0, 6.0  # the pair's memory: 6 kept per drafted step
    unsure = np.full(7, 0.3, np.float32)  # this block promises ≈ 0.43
    p = StepPolicy("auto", slots=2, block_size=8)
    p.join(0, unsure, c)
    p.join(1, unsure, c, sampled=True)
    assert p.est[0] == 6.0 and p.est[1] < 0.5
    assert p.want([0, 1], c) == [True, False]
    for _ in range(20):  # a real desert takes the greedy row out
        p.observe([0], [0], None, c)
    assert p.want([0], c) == [False]


def test_the_call_means_follow_a_loaded_machine():
    """Under load a short call's wall time has a heavy tail: most decode calls take 1 ms, one
    in five is preempted to 20 ms (mean 4.8 ms). The running mean the policy reads follows the
    mean, not the typical call (a tight cap read ≈ 1.3 ms and made drafting look dearer)."""
    c = StepCosts(warmup_calls=0)
    seen = []
    for i in range(400):
        c.observe("decode", 0.020 if i % 5 == 4 else 0.001, 1)
        seen.append(c.decode_s)
    assert np.mean(seen[100:]) == pytest.approx(0.0048, rel=0.2)


def test_steady_is_want_and_use_in_one_pass():
    """`steady` (the usual greedy step's shortcut) says yes only where `want` would draft every
    row without a probe and `use` would verify every fresh block whatever its confidences."""
    c = costs({4: 2.0, 8: 3.0}, 1.0, 1.0)  # drafting pays at ≥ 2 kept; the verify alone at ≥ 1
    for est, probing, want in ((6.0, False, True), (3.0, False, True), (1.5, False, False),
                               (6.0, True, False)):  # fmt: skip
        p = StepPolicy("auto", slots=1, block_size=8)
        p.join(0, None, c)
        p.est[0], p.probing[0], p.idle[0] = est, probing, 3
        assert p.steady([0], c) is want
        if want:
            q = StepPolicy("auto", slots=1, block_size=8)
            q.join(0, None, c)
            q.est[0] = est
            nothing = np.zeros((1, 7), np.float32)  # promises no proposal
            assert q.want([0], c) == [True] and q.use([0], nothing, c) == [True]
            assert p.idle[0] == 0  # want's bookkeeping
    assert StepPolicy("always", 1, 8).steady([0], c) and not StepPolicy("never", 1, 8).steady(
        [0], c
    )
