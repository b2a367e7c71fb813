"""The host runtime on ONNX Runtime: lossless against Hugging Face greedy generate, per-step
acceptance equal to the reference `dflash_generate`, the AI100 buffer logic through a strict
stand-in, stops, limits, and bad input."""

from __future__ import annotations

import json

import pytest
import torch
from dflash.model import DFlashDraftModel, dflash_generate

import dflash_qaic
from dflash_qaic import checkpoints as ck
from dflash_qaic import contract
from dflash_qaic.artifacts.build import ExportOptions, build_artifacts
from dflash_qaic.runtime import ArtifactsError, BackendError, GenerationError

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance compared with the reference and across runs, seeded tokens

# family, block, prefill chunk, ctx, agreement bias (see dflash_lab.tiny)
CONFIGS = [("qwen3", 4, 8, 160, 1.25), ("llama", 8, 16, 160, 1.25), ("qwen3", 16, 16, 192, 1.5)]
CONFIGS += [("qwen3", 4, 32, 160, 2.0)]  # two prefill lengths: 8 and the chunk of 32
# the first two are the conformance ladder's qwen3 and llama cases (tests/test_conformance.py:
# tokens = HF greedy, acceptance = the reference); here the block of 16 and two prefill lengths
EDGES = CONFIGS[2:]


@pytest.fixture(scope="module")
def built(exported):
    """built(family, B, chunk, ctx, agree) -> (target, draft, artifacts, HF model), shared."""

    def make(family, B, chunk, ctx, agree):
        pair = dict(block_size=B, agree=agree, tie_word_embeddings=False, target_layer_ids=[1, 3])
        e = exported(family, pair=pair, prefill_seq_len=chunk, ctx_len=ctx)
        return e.target, e.draft, e.artifacts, e.model()

    return make


def prompt(n, seed):
    return torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(model, ids, n, eos=None):
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("cfg", EDGES, ids=lambda c: f"{c[0]}-B{c[1]}-C{c[2]}")
def test_lossless_against_hf_generate(built, cfg, planned_chunks):
    family, B, chunk, ctx, _ = cfg
    _, _, art, model = built(*cfg)
    pipe = dflash_qaic.load(art)
    pipe.configure(verify_lengths=[B])  # whole blocks every step, so full-block steps happen
    lengths = []
    for seed, (n, new) in enumerate(
        [(1, 30), (chunk - 1, 41), (chunk + 3, 25), (2 * chunk + 5, 57), (3 * chunk - 2, 33)]
    ):
        ids = prompt(n, seed)
        res = pipe.generate(ids, max_new_tokens=new)
        assert res.tokens == hf_greedy(model, ids, new), (n, new)
        assert len(res.tokens) == new and res.stop_reason == "max_new_tokens"
        assert sum(res.acceptance_lengths) == new - 1
        # the draft takes up to draft_prefill_rows of context a call: fewer calls than chunks
        rows = contract.draft_prefill_rows(ctx, chunk, B)
        assert rows > chunk and res.stats["draft_prefill_calls"] == -(-n // rows)
        chunks = contract.prefill_lengths(chunk, B)
        assert res.stats["prefill_calls"] == len(planned_chunks(n, chunks))
        lengths += res.acceptance_lengths
    # the biased pair makes acceptance vary from 1 to B step to step
    assert min(lengths) == 1 and max(lengths) >= B - 1 and len(set(lengths)) >= 3, lengths


def _full_block_steps(ref_lengths, P, max_new, B):
    """How many leading reference steps verified a whole block (it shrinks its last blocks)."""
    start, k = P, 0
    for n in ref_lengths:
        if P + max_new - start < B:
            break
        start += n
        k += 1
    return k


@pytest.mark.parametrize("cfg", EDGES, ids=lambda c: f"{c[0]}-B{c[1]}-C{c[2]}")
@torch.no_grad()
def test_acceptance_equals_reference(built, cfg):
    family, B, chunk, ctx, _ = cfg
    t, d, art, model = built(*cfg)
    ref = DFlashDraftModel.from_pretrained(d, dtype=torch.float32).eval()
    pipe = dflash_qaic.load(art)
    pipe.configure(verify_lengths=[B])  # whole blocks every step, as the reference verifies
    compared = 0
    for seed, n in enumerate([3, chunk + 1, 2 * chunk + 7]):
        ids = prompt(n, 100 + seed)
        out = dflash_generate(ref, model, torch.tensor([ids]), 48, None, return_stats=True)
        res = pipe.generate(ids, max_new_tokens=48)
        assert res.tokens == out.output_ids[0, n:].tolist()
        k = _full_block_steps(out.acceptance_lengths, n, 48, B)
        assert res.acceptance_lengths[:k] == out.acceptance_lengths[:k]
        compared += k
    assert compared >= 6


def test_strict_standin_runs_the_same_loop(built):
    _, _, art, _ = built(*CONFIGS[1])
    ort_pipe = dflash_qaic.load(art)
    standin = dflash_qaic.load(art, backend="qaic-standin")
    for p in (ort_pipe, standin):  # the same steps on both (lengths picked by timing differ)
        p.configure(verify_lengths=[p.B])
    for seed, n in enumerate([5, 20, 37]):
        ids = prompt(n, seed)
        a, b = ort_pipe.generate(ids, 40), standin.generate(ids, 40)
        assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths
        assert standin.generate_baseline(ids, 12).tokens == a.tokens[:12]
    # greedy verify calls pick the specialization that samples one row, sampled ones the other
    used = standin.target.session.used
    kind = {s["name"]: s["kind"] for s in standin.artifacts.target.specializations}
    assert {kind[n] for n in used} == {"Prefill", "Verify", "Decode"}
    used.clear()
    a = ort_pipe.generate(prompt(20, 5), 40, temperature=1.0, seed=2)
    b = standin.generate(prompt(20, 5), 40, temperature=1.0, seed=2)
    assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths
    # 20 prompt tokens in chunks of 16: the first chunk's tokens are thrown away, so only the
    # last chunk pays for sampling every row
    assert [kind[n] for n in used[:2]] == ["Prefill", "PrefillSampled"]
    assert {kind[n] for n in used} == {"Prefill", "PrefillSampled", "VerifySampled"}


def test_prefill_lengths_plan(planned_chunks):
    """A prompt takes chunks while one is filled, then the fewest rows that cover the rest (the
    longest length on a tie): fewer padded rows than whole chunks, fewer calls than the short
    length alone."""
    assert contract.prefill_lengths(256, 16) == [64, 256]
    assert contract.prefill_lengths(64, 16) == [64]  # 16 is no more than the block: one length
    assert contract.prefill_lengths(128, 16) == [32, 128]
    L = [64, 256]
    assert planned_chunks(280, L) == [256, 64]
    assert planned_chunks(200, L) == [256]  # 4 × 64 is as many rows in more calls
    assert planned_chunks(130, L) == [64, 64, 64]  # 192 rows, not 256
    assert planned_chunks(600, L) == [256, 256, 64, 64]
    assert planned_chunks(5, L) == [64] and planned_chunks(700, [64]) == [64] * 11
    assert contract.default_comp_ctx_lengths(1024, 256, 16) == [128, 256, 512, 1024]


def test_prompt_chunks_take_the_planned_prefill_lengths(built):
    """With two prefill lengths the stand-in sees the planned specializations (a prompt's rest
    on the short one, sampled last chunks on PrefillSampled of their length), the draft takes
    its prompt at the smallest DraftPrefill that holds it, and tokens equal ONNX Runtime's."""
    _, _, art, model = built(*CONFIGS[3])
    ort_pipe = dflash_qaic.load(art)
    standin = dflash_qaic.load(art, backend="qaic-standin")
    target_used, draft_used = standin.target.session.used, standin.draft.session.used
    m = standin.artifacts
    assert m.plan.prefill_lengths == (8, 32) and m.plan.draft_prefill_rows == (8, 32, 128)
    for p in (ort_pipe, standin):
        p.configure(verify_lengths=[p.B])
    spec = {s["name"]: s for p in (m.target, m.draft) for s in p.specializations}

    def names(used, base):  # the specialization names at the full context (no `@window`)
        at_ctx = {
            s["name"]: s
            for s in spec.values()
            if s["symbols"].get(contract.CCL, m.ctx_len) == m.ctx_len
        }
        by_shape = {(s["kind"], s["symbols"][contract.SEQ]): n for n, s in at_ctx.items()}
        got = [
            by_shape[base, spec[n]["symbols"][contract.SEQ]]
            for n in used
            if spec[n]["kind"] == base
        ]
        used.clear()
        return got

    for n, want, draft in [
        (45, ["Prefill", "Prefill[8]", "Prefill[8]"], ["DraftPrefill"]),
        (5, ["Prefill[8]"], ["DraftPrefill[8]"]),
        (27, ["Prefill"], ["DraftPrefill[32]"]),
    ]:
        ids = prompt(n, 40 + n)
        a, b = ort_pipe.generate(ids, 20), standin.generate(ids, 20)
        assert a.tokens == b.tokens == hf_greedy(model, ids, 20), n
        assert names(target_used, contract.PREFILL) == want, n
        assert names(draft_used, contract.DRAFT_PREFILL) == draft, n
        target_used.clear()
    ids = prompt(45, 7)
    a = ort_pipe.generate(ids, 20, temperature=1.0, seed=3)
    b = standin.generate(ids, 20, temperature=1.0, seed=3)
    assert a.tokens == b.tokens
    prefills = [
        (spec[n]["kind"], spec[n]["symbols"][contract.SEQ])
        for n in target_used
        if spec[n]["kind"] in contract.PREFILLS
    ]
    assert prefills == [("Prefill", 32), ("Prefill", 8), ("PrefillSampled", 8)]


def test_draft_prefill_takes_the_smallest_specialization_that_holds_it(built):
    """The draft's prompt calls hand over up to draft_prefill_rows at a time, on the long
    DraftPrefill; a call of at most a chunk (a short prompt, a long prompt's rest) takes the
    chunk-sized one, so a short prompt never pays for the long one."""
    _, _, art, _ = built(*CONFIGS[1])
    standin = dflash_qaic.load(art, backend="qaic-standin")
    chunk, used = standin.chunk, standin.draft.session.used
    rows = standin.artifacts.plan.draft_prefill_rows
    assert rows == (chunk, 4 * chunk)
    spec = {s["name"]: s for s in standin.artifacts.draft.specializations}

    def prefills():  # the context rows of every DraftPrefill call
        got = [spec[n]["symbols"][contract.SEQ] for n in used if spec[n]["kind"] == "DraftPrefill"]
        used.clear()
        return got

    short, long = chunk, 4 * chunk
    standin.generate(prompt(chunk - 3, 1), 4)
    assert prefills() == [short]
    standin.generate(prompt(2 * rows[-1] + 5, 2), 4)
    assert prefills() == [long, long, short]


def test_standin_refuses_what_the_card_refuses(built):
    import numpy as np

    _, _, art, _ = built(*CONFIGS[1])
    pipe = dflash_qaic.load(art, backend="qaic-standin")
    sess = pipe.target.session
    with pytest.raises(
        BackendError, match=r"no compiled specialization has \(batch_size, seq_len\) \(1, 5\)"
    ):
        pipe.target.run(
            {
                contract.INPUT_IDS: np.zeros((1, 5), np.int64),
                contract.POSITION_IDS: np.zeros((1, 5), np.int64),
            }
        )
    with pytest.raises(BackendError, match="match no compiled specialization"):
        sess.run(
            {
                contract.INPUT_IDS: np.zeros((1, 5), np.int64),
                contract.POSITION_IDS: np.zeros((1, 5), np.int64),
            }
        )
    with pytest.raises(BackendError, match="sent from the host"):
        sess.run({"past_key.0": np.zeros((1, 2, 160, 16), np.float32)})
    with pytest.raises(BackendError, match="retained state"):
        sess.set_buffers({"past_key.0_RetainedState": np.zeros(1)})


def test_stop_token_inside_accepted_run(built):
    _, _, art, model = built(*CONFIGS[1])
    pipe = dflash_qaic.load(art)
    pipe.configure(verify_lengths=[pipe.B])  # the same steps in both runs
    # find a step that committed several tokens, and stop on one in the middle of it
    for seed in range(20):
        ids = prompt(9 + seed, seed)
        res = pipe.generate(ids, 60, stop_token_ids=[])
        pos = 1  # index in res.tokens of the first token of the current step
        for n in res.acceptance_lengths:
            # a step that committed ≥ 3 tokens whose first is new: stopping on it cuts the
            # step's accepted run in the middle
            if n >= 3 and res.tokens[pos] not in res.tokens[:pos]:
                stop = res.tokens[pos]
                break
            pos += n
        else:
            continue
        got = pipe.generate(ids, 60, stop_token_ids=[stop])
        assert got.stop_reason == "stop_token"
        assert got.tokens == res.tokens[: pos + 1]
        assert got.tokens == hf_greedy(model, ids, 60, eos=stop)
        assert sum(got.acceptance_lengths) == len(got.tokens) - 1
        return
    pytest.fail("no multi-token step with a fresh token found")


def test_context_limit_stops_cleanly(tiny_pair, tmp_path):
    t, d = tiny_pair(
        family="qwen3", block_size=8, agree=1.25, tie_word_embeddings=False, target_layer_ids=[1, 3]
    )
    build_artifacts(
        t,
        d,
        tmp_path,
        ExportOptions(prefill_seq_len=8, ctx_len=40, compile=False),
    )
    pipe = dflash_qaic.load(tmp_path)
    model = ck.load_target_model(t)
    ids = prompt(10, 3)
    res = pipe.generate(ids, max_new_tokens=100)
    assert res.stop_reason == "ctx_len"
    # positions 0 … 38 hold tokens (slot 39 is the padding slot); the last token is never
    # written: DFlash fills the context to the end as the target alone does (the last steps
    # verify what is left of the block)
    assert len(ids) + len(res.tokens) == 40
    assert res.tokens == hf_greedy(model, ids, len(res.tokens))
    base = pipe.generate_baseline(ids, max_new_tokens=100)
    assert base.stop_reason == "ctx_len" and base.tokens == res.tokens
    # every request that fits gets all it asked for, up to the last position
    for new in range(40 - len(ids) - 9, 40 - len(ids) + 1):
        got = pipe.generate(ids, max_new_tokens=new, stop_token_ids=[])
        assert got.tokens == base.tokens[:new], new
        assert got.stop_reason == "max_new_tokens", new


def test_streaming_and_baseline(built):
    _, _, art, model = built(*CONFIGS[0])
    pipe = dflash_qaic.load(art)
    ids = prompt(11, 7)
    chunks = []
    res = pipe.generate(ids, 30, on_tokens=chunks.append)
    assert [t for c in chunks for t in c] == res.tokens
    assert [len(c) for c in chunks[1:]] == res.acceptance_lengths
    assert list(pipe.stream(ids, 30)) == res.tokens
    base = pipe.generate_baseline(ids, 30)
    assert base.tokens == res.tokens and base.stats["tau"] == 1.0
    for key in ("tau", "ttft_s", "tpot_s", "tokens_per_s", "host_s", "device_s", "bytes_per_step"):
        assert key in res.stats and key in base.stats
    # per step: B ids + B positions + the sampling inputs (temperature, top_k, top_p, two
    # uniforms per row) in, B ids + B feature rows out (verify), and for the draft
    # B feature rows + B context positions + B ids + B positions in, B−1 ids out: no logits, no KV
    # plus, per call, the attention window: L slot ids (L ≤ ctx_len)
    B, H, window = 4, 64, 8 * pipe.ctx_len
    verify = 2 * B * 8 + (4 + 8 + 4 + B * 2 * 4) + B * 8 + B * H * 4 + window
    draft = B * H * 4 + 3 * B * 8 + (B - 1) * 8 + window
    assert res.stats["bytes_per_step"] <= verify + draft


def test_kv_stays_in_ortvalues(built):
    _, _, art, _ = built(*CONFIGS[0])
    pipe = dflash_qaic.load(art)
    for prog in (pipe.target, pipe.draft):
        assert prog.inplace and len(prog._kv) == 1  # one set: bound as input and output
    before = [(id(v), v.data_ptr()) for prog in (pipe.target, pipe.draft) for v in prog.caches]
    pipe.generate(prompt(9, 1), 20)
    pipe.generate(prompt(5, 2), 20, temperature=1.0, seed=3)
    after = [(id(v), v.data_ptr()) for prog in (pipe.target, pipe.draft) for v in prog.caches]
    assert after == before


def test_inplace_caches_equal_double_buffered(built):
    """A whole generation (greedy and sampled, prefill, verify, draft, decode) with the caches
    updated in place equals the double-buffered run token for token, and leaves the same cache
    contents behind."""
    import numpy as np

    from dflash_qaic.runtime.backends import OrtProgram

    _, _, art, _ = built(*CONFIGS[2])
    inplace, double = dflash_qaic.load(art), dflash_qaic.load(art)
    for p in (inplace, double):  # the same steps in both runs
        p.configure(verify_lengths=[p.B])
    m = double.manifest
    for name in ("target", "draft"):
        prog = m[name]
        sym = {"batch_size": int(m["batch_size"]), "ctx_len": int(m["ctx_len"])}
        path = art / prog["onnx"]
        setattr(double, name, OrtProgram(path, prog["inputs"], prog["outputs"], sym, inplace=False))
    assert not double.target.inplace and len(double.target._kv) == 2
    for seed, (n, new) in enumerate([(5, 40), (23, 61), (40, 30)]):
        ids = prompt(n, seed)
        for kw in ({}, {"temperature": 1.0, "seed": seed}, {"temperature": 0.7, "top_k": 5}):
            kw = {"seed": 11, **kw} if kw else kw
            a, b = inplace.generate(ids, new, **kw), double.generate(ids, new, **kw)
            assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths
        a, b = inplace.generate_baseline(ids, 20), double.generate_baseline(ids, 20)
        assert a.tokens == b.tokens
    for x, y in ((inplace.target, double.target), (inplace.draft, double.draft)):
        for u, v in zip(x.caches, y.caches):
            np.testing.assert_array_equal(u.numpy(), v.numpy())


def test_inplace_needs_the_update_to_be_the_only_reader(built, tmp_path):
    """The aliasing check: both exported programs pass, in the ONNX files and in the graph
    ONNX Runtime actually runs after its optimizations; a graph in which anything but the cache
    update reads a cache is refused in place and runs double buffered."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from dflash_qaic.runtime.backends import OrtProgram, inplace_cache_safe

    _, _, art, _ = built(*CONFIGS[0])
    m = json.loads((art / "manifest.json").read_text())
    for name in ("target", "draft"):
        path = art / m[name]["onnx"]
        kv = [i["name"] for i in m[name]["inputs"] if i["name"].startswith("past_")]
        assert inplace_cache_safe(path, kv)
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = str(tmp_path / f"{name}.opt.onnx")
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        opt = onnx.load(so.optimized_model_filepath, load_external_data=False)
        assert not any(n.op_type == "CtxScatter" for n in opt.graph.node)  # inlined
        assert inplace_cache_safe(so.optimized_model_filepath, kv)

    # past -> ScatterND -> retained, and past also read by an Identity: not safe
    f32 = TensorProto.FLOAT
    shape = [1, 1, 4, 2]
    graph = helper.make_graph(
        [
            helper.make_node(
                "ScatterND", ["past_key.0", "idx", "upd"], ["past_key.0_RetainedState"]
            ),
            helper.make_node("Identity", ["past_key.0"], ["old"]),
        ],
        "g",
        [
            helper.make_tensor_value_info("past_key.0", f32, shape),
            helper.make_tensor_value_info("idx", TensorProto.INT64, [1, 1]),
            helper.make_tensor_value_info("upd", f32, [1, 1, 4, 2]),
        ],
        [
            helper.make_tensor_value_info("old", f32, shape),
            helper.make_tensor_value_info("past_key.0_RetainedState", f32, shape),
        ],
    )
    path = tmp_path / "reader.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert not inplace_cache_safe(path, ["past_key.0"])
    ins = [
        {"name": "idx", "dtype": "int64", "shape": [1, 1]},
        {"name": "upd", "dtype": "float32", "shape": [1, 1, 4, 2]},
        {"name": "past_key.0", "dtype": "float32", "shape": shape},
    ]
    outs = [
        {"name": "old", "dtype": "float32", "shape": shape},
        {"name": "past_key.0_RetainedState", "dtype": "float32", "shape": shape},
    ]
    prog = OrtProgram(path, ins, outs, {})
    assert not prog.inplace
    feeds = {"idx": np.zeros((1, 1), np.int64), "upd": np.ones((1, 1, 4, 2), np.float32)}
    assert prog.run(feeds)["old"].sum() == 0  # the cache before this call's update
    assert prog.run(feeds)["old"].sum() == 8
    with pytest.raises(BackendError, match="in place"):
        OrtProgram(path, ins, outs, {}, inplace=True)


def test_bad_inputs(built, tmp_path):
    _, _, art, _ = built(*CONFIGS[0])
    pipe = dflash_qaic.load(art)
    with pytest.raises(GenerationError, match="empty"):
        pipe.generate([], 5)
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        pipe.generate([1, 256, 3], 5)
    with pytest.raises(GenerationError, match="allows at most 155"):
        pipe.generate([1] * 156, 5)
    with pytest.raises(GenerationError, match="tokenizer"):
        pipe.generate("hello", 5)
    with pytest.raises(GenerationError, match="max_new_tokens"):
        pipe.generate([1], 0)
    with pytest.raises(ArtifactsError, match="does not exist"):
        dflash_qaic.load(tmp_path / "nope")
    half = tmp_path / "half"
    half.mkdir()
    (half / "target").mkdir()
    with pytest.raises(ArtifactsError, match="not a finished artifacts directory"):
        dflash_qaic.load(half)
    with pytest.raises(BackendError, match="needs the AI100 runtime"):
        dflash_qaic.load(art, backend="qaic")
    with pytest.raises(BackendError, match="unknown backend"):
        dflash_qaic.load(art, backend="cuda")
    assert dflash_qaic.load(art, backend="auto").backend == "ort"


def test_dflash_run_cli(built, capsys):
    from dflash_qaic.runtime.cli import main

    _, _, art, model = built(*CONFIGS[0])
    ids = prompt(6, 2)
    assert (
        main(
            [
                str(art),
                "--prompt-ids",
                ",".join(map(str, ids)),
                "--max-new-tokens",
                "12",
                "--json",
                "--baseline",
            ]
        )
        == 0
    )
    obj = json.loads(capsys.readouterr().out)
    assert obj["tokens"] == hf_greedy(model, ids, 12)
    assert obj["baseline"]["tokens"] == obj["tokens"]
    assert len(obj["acceptance_lengths"]) == obj["stats"]["steps"]
    assert main([str(art), "--prompt-ids", "", "--json"]) == 2
    assert "empty" in capsys.readouterr().err


def test_import_needs_no_sdk():
    import subprocess
    import sys

    code = "import dflash_qaic, sys; assert 'torch' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
