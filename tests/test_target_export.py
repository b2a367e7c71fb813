"""The target program on ONNX Runtime (CPU) against Hugging Face.

Tiny random Qwen3 (tied head, q/k norms) and Llama (untied head, attention/mlp biases, llama3 rope
scaling) targets. One exported graph serves chunked prefill, verify blocks and single-token
decode in one ORT session with the KV cache carried over; every valid position must give HF's
argmax and HF's fused feature hidden_norm(fc(concat(hidden_states[j + 1]))).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from dflash_qaic import contract
from dflash_qaic.exporter import onnx_export
from dflash_qaic.exporter.graph_check import GraphCheckError, check_graph, fp16_feed, fp16_session
from dflash_qaic.exporter.target import check_feeds, export_target

CTX, CHUNK, BLOCK = 64, 8, 4
VOCAB, H = 320, 64


# ---------------------------------------------------------------- helpers


def hf_dims(n_layers: int, **over) -> dict:
    """The shape of every family's tiny test target (its config fields), with overrides."""
    dims = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=128, head_dim=16)
    dims |= dict(num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2)
    return dims | dict(max_position_embeddings=512, initializer_range=0.1) | over


def make_hf(family: str, n_layers: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = hf_dims(n_layers)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=True))
    else:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        cfg = LlamaConfig(
            **common,
            tie_word_embeddings=False,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=rope,
        )
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # non-trivial norms and biases, so a mixed-up tensor shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.eval()


def make_draft_side(k: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    fc = torch.randn(H, k * H, generator=g) * 2.0  # large enough that the fp16 rescale kicks in
    hidden_norm = torch.rand(H, generator=g) + 0.5
    return fc, hidden_norm, 1e-6


def export_program(model, layer_ids, path, **options) -> dict:
    """`model`'s target program exported at the tests' sizes (CTX, CHUNK, BLOCK) with a random
    draft side: dict(model, fc, hn=(hn_w, hn_eps), path, facts). options: export_target's."""
    fc, hn_w, hn_eps = make_draft_side(len(layer_ids))
    facts = export_target(
        model, fc, hn_w, hn_eps, layer_ids, path, ctx_len=CTX, prefill_seq_len=CHUNK,
        block_size=BLOCK, **options,
    )  # fmt: skip
    return dict(model=model, fc=fc, hn=(hn_w, hn_eps), path=path, facts=facts)


def faithful_flows(model, layer_ids, path) -> list:
    """The fp16-faithful evaluation of `model`'s program (exported clean of fp16 flags) over
    test_fp16's SEQS: [(the program's flow, hf_reference's (logits, hidden, out))]; nothing
    flagged on the way."""
    from spec_loop import program_io
    from test_fp16 import SEQS, faithful_program, target_flow

    e = export_program(model, layer_ids, path)
    faithful = e["facts"]["check"]["fp16_faithful"]
    assert faithful["ran"] and faithful["flagged"] == [], faithful
    prog = faithful_program(path, program_io(e["facts"], path))
    flows = [
        (target_flow(prog, seq, p), hf_reference(model, seq, layer_ids, e["fc"], *e["hn"]))
        for p, seq in zip((16, 13), SEQS)
    ]
    assert prog.report.flagged == [], prog.report.summary()
    return flows


def hf_reference(model, tokens, layer_ids, fc, hn_w, hn_eps):
    """HF logits [n, V] and fused features [n, H] for a 1-D token sequence."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True)
        feats = torch.cat([out.hidden_states[j + 1] for j in layer_ids], dim=-1)
        y = feats @ fc.T
        y = hn_w * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + hn_eps))
    return out.logits[0].numpy(), y[0].numpy(), out


def margin_ok(logits: np.ndarray, eps: float) -> np.ndarray:
    """Positions whose top-1 logit beats the runner-up by more than eps (argmax well defined)."""
    top2 = np.sort(logits, axis=-1)[..., -2:]
    return (top2[..., 1] - top2[..., 0]) > eps


def greedy_feed(batch: int, seq: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """The sampling inputs set to greedy (temperature 0: next_tokens is the plain argmax)."""
    return {
        contract.TEMPERATURE: np.zeros(batch, dtype),
        contract.TOP_K: np.zeros(batch, np.int64),
        contract.TOP_P: np.ones(batch, dtype),
        contract.RANDOM_U: np.zeros((batch, seq, contract.N_RANDOM), dtype),
        contract.COMP_CTX_LENGTHS: np.arange(CTX, dtype=np.int64),  # every slot
    }


def input_type(sess: ort.InferenceSession, name: str) -> str:
    return next(i.type for i in sess.get_inputs() if i.name == name)


class Runner:
    """One ORT session with its KV cache carried from call to call (numpy, test only)."""

    def __init__(self, sess: ort.InferenceSession, io: contract.TargetIO):
        self.sess, self.io = sess, io
        self.out_names = [o.name for o in sess.get_outputs()]
        fp16 = "float16" in input_type(sess, io.kv[0].name)
        self.dtype = np.float16 if fp16 else np.float32
        self.kv = {s.name: np.zeros(s.bind(batch_size=1, ctx_len=CTX), self.dtype) for s in io.kv}

    def __call__(self, ids, pos) -> dict[str, np.ndarray]:
        feed = {
            contract.INPUT_IDS: np.asarray([ids], np.int64),
            contract.POSITION_IDS: np.asarray([pos], np.int64),
            **greedy_feed(1, len(ids), self.dtype),
            **self.kv,
        }
        out = dict(zip(self.out_names, self.sess.run(None, feed)))
        self.kv = {s.name: out[contract.retained(s.name)] for s in self.io.kv}
        return out

    def prefill(self, prompt, pad_token=lambda i: 0) -> dict[str, np.ndarray]:
        """Chunked prefill; the last chunk padded (position -1, token pad_token(i))."""
        rows = {contract.NEXT_TOKENS: [], contract.HIDDEN_STATES: [], contract.LOGITS: []}
        for start in range(0, len(prompt), CHUNK):
            ids = list(prompt[start : start + CHUNK])
            pos = list(range(start, start + len(ids)))
            n = len(ids)
            ids += [pad_token(i) for i in range(CHUNK - n)]
            pos += [contract.PAD_POSITION] * (CHUNK - n)
            out = self(ids, pos)
            for k in rows:
                if k in out:
                    rows[k].append(out[k][0, :n])
        return {k: np.concatenate(v) for k, v in rows.items() if v}


def session(path_or_bytes) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    return ort.InferenceSession(path_or_bytes, opts, providers=["CPUExecutionProvider"])


FAMILIES = {
    # family: (n_layers, target_layer_ids) -- both include the LAST layer (post-norm tap)
    "qwen3": (3, [0, 2]),
    "llama": (4, [1, 3, 0]),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def target_program(request, tmp_path_factory):
    family = request.param
    n_layers, layer_ids = FAMILIES[family]
    path = tmp_path_factory.mktemp(family) / "target.onnx"
    e = export_program(make_hf(family, n_layers), layer_ids, path, emit_logits=True)
    io = contract.TargetIO(n_layers, 2, 16, H, VOCAB, emit_logits=True, comp_ctx=True)
    return dict(e, family=family, layer_ids=layer_ids, io=io, sess=session(str(path)))


def run_flow(runner: Runner, seq, prompt_len, pad_token=lambda i: 0):
    """Chunked prefill of seq[:P], one verify block at P, one decode at P + BLOCK.
    Returns the outputs of all positions 0 .. P + BLOCK, concatenated."""
    p = prompt_len
    pre = runner.prefill(seq[:p], pad_token)
    ver = runner(seq[p : p + BLOCK], list(range(p, p + BLOCK)))
    dec = runner(seq[p + BLOCK : p + BLOCK + 1], [p + BLOCK])
    return {
        k: np.concatenate([pre[k], ver[k][0], dec[k][0]])
        for k in (contract.NEXT_TOKENS, contract.HIDDEN_STATES, contract.LOGITS)
    }


# ---------------------------------------------------------------- (1) against Hugging Face


@pytest.mark.parametrize("prompt_len", [16, 13])
def test_prefill_verify_decode_match_hf(target_program, prompt_len):
    e = target_program
    rng = np.random.default_rng(prompt_len)
    seq = rng.integers(0, VOCAB, prompt_len + BLOCK + 1).tolist()
    got = run_flow(Runner(e["sess"], e["io"]), seq, prompt_len)

    ref_logits, ref_hidden, out = hf_reference(e["model"], seq, e["layer_ids"], e["fc"], *e["hn"])
    # HF's last hidden_states entry is post-norm: lm_head applied to it gives the logits.
    with torch.no_grad():
        torch.testing.assert_close(e["model"].lm_head(out.hidden_states[-1]), out.logits)

    n = len(seq)
    assert got[contract.NEXT_TOKENS].shape == (n,)
    np.testing.assert_allclose(got[contract.LOGITS], ref_logits, atol=2e-4, rtol=1e-4)
    clear = margin_ok(ref_logits, 1e-3)
    assert clear.sum() >= n - 2, "test prompt has too many near-ties to be meaningful"
    np.testing.assert_array_equal(got[contract.NEXT_TOKENS][clear], ref_logits.argmax(-1)[clear])
    np.testing.assert_allclose(got[contract.HIDDEN_STATES], ref_hidden, atol=1e-4, rtol=1e-4)


def test_export_facts_and_graph(target_program):
    e = target_program
    facts, io = e["facts"], e["io"]
    assert facts["fc_scale"] > 1.0  # the fp16 rescale of fc is exercised by the HF comparison
    assert [s["name"] for s in facts["inputs"]] == [s.name for s in io.inputs]
    assert [s["name"] for s in facts["outputs"]] == [s.name for s in io.outputs]
    lengths = facts["verify_lengths"]  # Verify[n] and VerifySampled[n] below the block size
    assert lengths == contract.default_verify_lengths(lengths[-1]) and len(lengths) > 1
    names = [
        contract.PREFILL,
        contract.PREFILL_SAMPLED,
        *(f"{contract.VERIFY}[{n}]" for n in lengths[:-1]),
        contract.VERIFY,
        *(f"{contract.VERIFY_SAMPLED}[{n}]" for n in lengths[:-1]),
        contract.VERIFY_SAMPLED,
        contract.DECODE,
    ]
    windows = facts["comp_ctx_lengths"]
    assert windows[-1] == CTX and windows == sorted(windows)
    assert [s["name"] for s in facts["specializations"]] == [
        n if w == CTX else f"{n}@{w}" for w in windows for n in names
    ]
    assert [s["symbols"][contract.CCL] for s in facts["specializations"]] == [
        w for w in windows for _ in names
    ]
    check = facts["check"]
    assert check["ops"]["CtxScatter"] == 2 * io.n_layers
    assert check["unresolved_intermediates"] == [0] * len(names) * len(windows)
    # Prefill, PrefillSampled, Verify, VerifySampled, Decode (shorter verify blocks skipped)
    assert check["fp16_runs"] == 5 and 0 < check["fp16_max_abs"] < 6e4
    # the fp16-faithful evaluation ran (a tiny graph) and nothing came near fp16's maximum
    faithful = check["fp16_faithful"]
    assert faithful["ran"] and faithful["runs"] == 5 and faithful["flagged"] == []
    assert 0 < faithful["max_abs"] < 65504 / 16
    assert list(check["nodes_per_layer"]) == [str(i) for i in range(io.n_layers)] + ["other"]
    graph = onnx.load(str(e["path"]), load_external_data=False).graph
    layer_casts = [n.name for n in graph.node if n.op_type == "Cast" and "/layers." in n.name]
    assert layer_casts == []  # no per-layer Casts (the card would compute them in fp16 anyway)
    model = onnx.load(str(e["path"]))
    assert {(f.domain, f.name) for f in model.functions} == {("com.qualcomm.cloud", "CtxScatter")}
    assert model.ir_version <= 10
    assert facts["external_data"] is None


def test_batch_rows_are_independent(target_program):
    # batch_size is a graph symbol: two rows at different lengths give their batch-1 results
    e = target_program
    rng = np.random.default_rng(3)
    ids = rng.integers(0, VOCAB, (2, CHUNK))
    pos = np.stack([np.arange(CHUNK), np.r_[np.arange(5), [contract.PAD_POSITION] * 3]])
    kv = {s.name: np.zeros(s.bind(batch_size=2, ctx_len=CTX), np.float32) for s in e["io"].kv}
    feed = {contract.INPUT_IDS: ids, contract.POSITION_IDS: pos, **greedy_feed(2, CHUNK), **kv}
    both = e["sess"].run(None, feed)
    for row in range(2):
        one = Runner(e["sess"], e["io"])(ids[row], pos[row])
        valid = pos[row] >= 0
        np.testing.assert_array_equal(both[0][row][valid], one[contract.NEXT_TOKENS][0][valid])
        np.testing.assert_allclose(
            both[1][row][valid], one[contract.HIDDEN_STATES][0][valid], atol=1e-5
        )


# ---------------------------------------------------------------- (2) padding is inert


def test_padding_rows_never_leak(target_program):
    e = target_program
    rng = np.random.default_rng(7)
    seq = rng.integers(0, VOCAB, 13 + BLOCK + 1).tolist()
    a, b = Runner(e["sess"], e["io"]), Runner(e["sess"], e["io"])
    out_a = run_flow(a, seq, 13, pad_token=lambda i: 0)
    out_b = run_flow(b, seq, 13, pad_token=lambda i: (97 * i + 31) % VOCAB)
    for k in out_a:
        np.testing.assert_array_equal(out_a[k], out_b[k])
    # Padding wrote the padding slot and nothing else: the caches differ only at slot CTX - 1.
    for name in a.kv:
        np.testing.assert_array_equal(a.kv[name][:, :, : CTX - 1], b.kv[name][:, :, : CTX - 1])
    assert any(not np.array_equal(a.kv[n][:, :, -1], b.kv[n][:, :, -1]) for n in a.kv)


# ---------------------------------------------------------------- (3) rewind after rejection


def test_rewind_after_rejection_equals_fresh_run(target_program):
    e = target_program
    rng = np.random.default_rng(11)
    p = 10
    prompt = rng.integers(0, VOCAB, p).tolist()
    block1 = rng.integers(0, VOCAB, BLOCK).tolist()
    correction = int(rng.integers(0, VOCAB))
    block2 = rng.integers(0, VOCAB, BLOCK).tolist()

    # Rejected at once: only block1[0] (the anchor) commits, then the correction is decoded at
    # p + 1 while slots p + 1 .. p + 3 still hold block1's rejected rows; then a new block.
    stale = Runner(e["sess"], e["io"])
    stale.prefill(prompt)
    stale(block1, list(range(p, p + BLOCK)))
    dec_s = stale([correction], [p + 1])
    ver_s = stale(block2, list(range(p + 2, p + 2 + BLOCK)))

    fresh = Runner(e["sess"], e["io"])
    fresh.prefill(prompt + block1[:1])
    dec_f = fresh([correction], [p + 1])
    ver_f = fresh(block2, list(range(p + 2, p + 2 + BLOCK)))

    for s, f in ((dec_s, dec_f), (ver_s, ver_f)):
        np.testing.assert_array_equal(s[contract.NEXT_TOKENS], f[contract.NEXT_TOKENS])
        np.testing.assert_allclose(s[contract.HIDDEN_STATES], f[contract.HIDDEN_STATES], atol=1e-5)
        np.testing.assert_allclose(s[contract.LOGITS], f[contract.LOGITS], atol=1e-5)
    # and the committed history is what HF sees
    seq = prompt + block1[:1] + [correction] + block2
    ref_logits, _, _ = hf_reference(e["model"], seq, e["layer_ids"], e["fc"], *e["hn"])
    np.testing.assert_allclose(ver_s[contract.LOGITS][0], ref_logits[p + 2 :], atol=2e-4)


# ---------------------------------------------------------------- (4) fp16


def test_fp16_graph_picks_same_tokens(target_program):
    e = target_program
    model = onnx.load(str(e["path"]))
    s16 = fp16_session(model)
    assert input_type(s16, contract.past_key(0)) == "tensor(float16)"
    for prompt_len in (16, 13):
        seq = np.random.default_rng(prompt_len).integers(0, VOCAB, prompt_len + BLOCK + 1)
        ref = run_flow(Runner(e["sess"], e["io"]), seq.tolist(), prompt_len)
        half = run_flow(Runner(s16, e["io"]), seq.tolist(), prompt_len)
        assert half[contract.HIDDEN_STATES].dtype == np.float16
        assert np.isfinite(half[contract.HIDDEN_STATES]).all()
        # fp16 moves these logits by <= ~1e-2: every position whose fp32 top-1 leads by more
        # than 0.015 must keep its token (only a few near-ties are excused).
        logit_err = np.abs(half[contract.LOGITS].astype(np.float32) - ref[contract.LOGITS])
        assert logit_err.max() < 0.05
        clear = margin_ok(ref[contract.LOGITS], 0.015)
        assert clear.sum() >= len(seq) - 4
        np.testing.assert_array_equal(
            half[contract.NEXT_TOKENS][clear], ref[contract.NEXT_TOKENS][clear]
        )
        np.testing.assert_allclose(
            half[contract.HIDDEN_STATES].astype(np.float32),
            ref[contract.HIDDEN_STATES],
            atol=0.05,
            rtol=0.02,
        )


# ---------------------------------------------------------------- (5) graph_check rejects


def _tiny_graph(nodes, inits=(), functions=(), opsets=(("", 17),), out_dims=("n",)):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out_dims))
    g = helper.make_graph(nodes, "g", [x], [y], initializer=list(inits))
    ops = [helper.make_opsetid(d, v) for d, v in opsets]
    return helper.make_model(g, opset_imports=ops, functions=list(functions), ir_version=8)


TINY_IO = (
    [contract.TensorSpec("x", "float32", ("n",))],
    [contract.TensorSpec("y", "float32", ("n",))],
)


def _save(tmp_path, model, name="g.onnx"):
    p = tmp_path / name
    onnx.save(model, str(p))
    return p


def test_graph_check_accepts_plain_graph(tmp_path):
    p = _save(tmp_path, _tiny_graph([helper.make_node("Sigmoid", ["x"], ["y"])]))
    feed = [{"x": np.linspace(-5, 5, 7, dtype=np.float32)}]
    report = check_graph(p, TINY_IO, [{"n": 7}], feed)
    assert report["ops"] == {"Sigmoid": 1} and 0.99 < report["fp16_max_abs"] <= 1.0


def test_graph_check_rejects_foreign_op(tmp_path):
    node = helper.make_node("FastSigmoid", ["x"], ["y"], domain="com.acme")
    p = _save(tmp_path, _tiny_graph([node], opsets=(("", 17), ("com.acme", 1))))
    with pytest.raises(GraphCheckError, match="com.acme::FastSigmoid"):
        check_graph(p, TINY_IO, [{"n": 7}])


def test_graph_check_rejects_foreign_function_in_exported_graph(target_program, tmp_path):
    # a model-local function the checker accepts, but the AI100 compiler does not know
    model = onnx.load(str(target_program["path"]))
    fn = helper.make_function(
        "com.acme",
        "Swish",
        ["a"],
        ["b"],
        [helper.make_node("Sigmoid", ["a"], ["s"]), helper.make_node("Mul", ["a", "s"], ["b"])],
        [helper.make_opsetid("", 17)],
    )
    model.functions.append(fn)
    model.opset_import.append(helper.make_opsetid("com.acme", 1))
    node = next(n for n in model.graph.node if n.op_type == "Sigmoid")
    node.op_type, node.domain = "Swish", "com.acme"
    p = _save(tmp_path, model)
    specs = contract.target_specializations(
        contract.shape_plan(BLOCK, CHUNK, CTX, verify_lengths=[BLOCK])
    )
    with pytest.raises(GraphCheckError, match="com.acme::Swish"):
        check_graph(p, target_program["io"], specs)


def test_graph_check_rejects_wrong_io_and_dynamic_dims(tmp_path):
    ok = [helper.make_node("Sigmoid", ["x"], ["y"])]
    p = _save(tmp_path, _tiny_graph(ok, out_dims=("m",)))
    with pytest.raises(GraphCheckError, match="dims"):
        check_graph(p, TINY_IO, [{"n": 7}])
    bad_name = (TINY_IO[0], [contract.TensorSpec("z", "float32", ("n",))])
    p = _save(tmp_path, _tiny_graph(ok))
    with pytest.raises(GraphCheckError, match="outputs"):
        check_graph(p, bad_name, [{"n": 7}])


def test_graph_check_rejects_fp16_overflow(tmp_path):
    big = helper.make_tensor("big", TensorProto.FLOAT, [], [1.0e3])
    nodes = [
        helper.make_node("Mul", ["x", "big"], ["t"]),
        helper.make_node("Mul", ["t", "t"], ["y"]),
    ]
    p = _save(tmp_path, _tiny_graph(nodes, inits=[big]))
    feed = [{"x": np.full(7, 1.0, np.float32)}]
    check_graph(p, TINY_IO, [{"n": 7}])  # fine in fp32 and without fp16 inputs
    with pytest.raises(GraphCheckError, match="inf/NaN"):
        check_graph(p, TINY_IO, [{"n": 7}], feed)


# ---------------------------------------------------------------- export_onnx mechanics


def test_export_onnx_external_data_and_atomicity(target_program, tmp_path, monkeypatch):
    from dflash_qaic.modeling.target import ExportTarget

    e = target_program
    n_layers, _ = FAMILIES[e["family"]]
    module = ExportTarget.from_hf(e["model"], e["fc"], *e["hn"], e["layer_ids"], ctx_len=CTX)
    io = contract.TargetIO(n_layers, 2, 16, H, VOCAB, comp_ctx=True)
    sym = {
        "name": contract.PREFILL,
        "kind": contract.PREFILL,
        "symbols": dict(batch_size=1, seq_len=CHUNK, ctx_len=CTX),
    }
    sym["symbols"][contract.CCL] = CTX
    sym["symbols"][contract.SAMPLE] = CHUNK
    feed = check_feeds(io, [sym])[0]
    example = tuple(torch.from_numpy(feed[s.name]) for s in io.inputs)

    path = tmp_path / "ext" / "t.onnx"
    onnx_export.export_onnx(module, example, io.inputs, io.outputs, path, external_data=True)
    assert sorted(p.name for p in path.parent.iterdir()) == ["t.onnx", "t.onnx.data"]
    assert path.stat().st_size < 200_000 < (path.parent / "t.onnx.data").stat().st_size
    check_graph(path, io, [sym])
    got = session(str(path)).run(None, feed)
    want = e["sess"].run(None, feed)  # the emit_logits graph: logits sit at index 2
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], atol=1e-6)

    # an export that dies midway leaves nothing at the destination, and no temp files
    def boom(*a, **k):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(torch.onnx, "export", boom)
    dead = tmp_path / "dead" / "t.onnx"
    with pytest.raises(RuntimeError, match="interrupted"):
        onnx_export.export_onnx(module, example, io.inputs, io.outputs, dead)
    assert list(dead.parent.iterdir()) == []


def test_fp16_feed_casts_only_floats():
    f = fp16_feed({"a": np.ones(2, np.float32), "b": np.ones(2, np.int64)})
    assert f["a"].dtype == np.float16 and f["b"].dtype == np.int64


@pytest.mark.parametrize("tied", [True, False])
def test_vocab_table_stored_once(tiny_pair, tmp_path, tied):
    """A tied head doubles as the embedding: the V×H table appears once in the graph."""
    from dflash_qaic import checkpoints as ck
    from dflash_qaic.exporter.target import export_target

    t, d = tiny_pair(family="qwen3", target_layer_ids=[0, 3], tie_word_embeddings=tied)
    pair = ck.read_pair(t, d)
    model = ck.load_target_model(pair.target)
    state = ck.load_draft_state(pair.draft)
    facts = export_target(
        model,
        state["fc.weight"],
        state["hidden_norm.weight"],
        1e-6,
        [0, 3],
        tmp_path / "t.onnx",
        ctx_len=64,
        prefill_seq_len=8,
        block_size=4,
        fp16_check=False,
    )
    graph = onnx.load(facts["path"]).graph
    tables = [i for i in graph.initializer if sorted(i.dims) == [64, 256]]
    assert len(tables) == (1 if tied else 2)
