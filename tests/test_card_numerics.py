"""Card numerics: MX rounding bit for bit against the OCP MX v1.0 rules, the card form of a
program (MXFP6 MatMul weights, MXINT8 KV, fp16), the evaluation, AI 200 profiles."""

from __future__ import annotations

import hashlib
import json

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dflash_qaic import state
from dflash_qaic.compiler.profiles import ProfileError, load_profile, profile_from_dict
from dflash_qaic.exporter import card_numerics as cn
from dflash_qaic.exporter import mx

# ---------------------------------------------------------------- MX rounding, bit for bit


def block(*values) -> np.ndarray:
    return np.array(list(values) + [0.0] * (32 - len(values)), np.float32)


def test_fp6_e2m3_edge_cases():
    # largest 7.5 -> shared exponent floor(log2 7.5) - emax 2 = 0: X = 1, E8M0 127
    x = block(7.5, 1.0, 0.125, 0.0625, 0.1875, -7.5, -0.0, 0.875, 0.9375)
    scale, codes, values = mx.mx_quantize(x, "fp6_e2m3")
    assert scale.tolist() == [127]
    want = [0x1F, 0x08, 0x01, 0x00, 0x02, 0x3F, 0x20, 0x07, 0x08]
    # 7.5 = 1.111b·2^2; 1.0 = 1.000b·2^0; 0.125 the smallest subnormal; 0.0625 a tie between 0
    # and 0.125 -> even (0); 0.1875 a tie between 0.125 and 0.25 -> even (0.25); -0 keeps its
    # sign; 0.875 the largest subnormal; 0.9375 a tie between 0.875 and 1.0 -> even (1.0)
    assert [hex(c) for c in codes[:9]] == [hex(c) for c in want]
    assert values[:9].tolist() == [7.5, 1.0, 0.125, 0.0, 0.25, -7.5, -0.0, 0.875, 1.0]
    assert np.signbit(values[6])


def test_fp6_e3m2_and_scale():
    scale, codes, values = mx.mx_quantize(block(28.0, 0.0625, -0.25, 0.1875), "fp6_e3m2")
    assert scale.tolist() == [127]  # floor(log2 28) = 4 = emax of E3M2
    assert [hex(c) for c in codes[:4]] == ["0x1f", "0x1", "0x24", "0x3"]
    # 100 in E2M3: s = 6 - 2 = 4 (E8M0 131); 100 / 16 = 6.25 -> 1.100b·2^2 (tie 6.0/6.5 -> even)
    scale, codes, values = mx.mx_quantize(block(100.0), "mxfp6")
    assert scale.tolist() == [131] and hex(codes[0]) == "0x1c" and values[0] == 96.0


def test_saturation_and_rounding_across_a_binade():
    # 7.9 / X = 7.9 rounds to 8.0, beyond E2M3's 7.5: saturates to the largest normal
    _, codes, values = mx.mx_quantize(block(7.9, -7.9), "fp6_e2m3")
    assert codes[:2].tolist() == [0x1F, 0x3F] and values[:2].tolist() == [7.5, -7.5]
    # 1.9375 (largest 1.9375: s = -2, X = 1/4 -> 7.75 -> saturates to 7.5 -> 1.875)
    _, _, values = mx.mx_quantize(block(1.9375), "fp6_e2m3")
    assert values[0] == 1.875


def test_mxint8():
    x = block(1.0, 32.5 / 64, -1.0, 1.99, -1.999, 1 / 128, 3 / 128)
    scale, codes, values = mx.mx_quantize(x, "mxint8")
    assert scale.tolist() == [127]  # floor(log2 1.999) = 0 = emax of INT8
    # k/64, ties to even; 1.99 -> 127; -1.999 -> -128 clamped to -127 (0x80 never produced)
    assert codes[:7].view(np.int8).tolist() == [64, 32, -64, 127, -127, 0, 2]
    assert values[:7].tolist() == [1.0, 0.5, -1.0, 127 / 64, -127 / 64, 0.0, 2 / 64]


def test_zero_block_and_tiny_values():
    scale, codes, values = mx.mx_quantize(np.zeros(32, np.float32), "fp6_e2m3")
    assert scale.tolist() == [0] and not codes.any() and not values.any()
    # an fp32 subnormal block: s clamps at -127 and the elements underflow to (signed) zero
    tiny = np.float32(2.0**-140)
    scale, codes, values = mx.mx_quantize(block(tiny, -tiny), "fp6_e2m3")
    assert scale.tolist() == [0] and codes[:2].tolist() == [0x00, 0x20]
    # the smallest normal fp32 magnitudes still get their own exponent
    scale, _, values = mx.mx_quantize(block(2.0**-120), "fp6_e2m3")
    assert scale.tolist() == [127 - 122] and values[0] == 2.0**-120


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_refused(bad):
    with pytest.raises(ValueError, match="non-finite"):
        mx.mx_round(block(1.0, bad), "mxfp6")


@pytest.mark.parametrize(
    ("fmt", "top"), [("fp6_e2m3", 7.5), ("fp6_e3m2", 28.0), ("fp4_e2m1", 6.0), ("int8", 127 / 64)]
)
def test_every_code_round_trips(fmt, top):
    """Every element code decodes to a value that, in a block whose largest value is the
    format's largest (X = 1), encodes back to the same code (both zeros, every subnormal)."""
    f = mx.mx_format(fmt)
    codes = np.arange(1 << f.bits, dtype=np.uint8)
    if f.is_int:
        codes = codes[codes != 0x80]  # -2.0: never produced
    n = len(codes)
    padded = np.concatenate([codes, np.zeros((-n) % 32, np.uint8)])
    values = mx.decode(np.full(len(padded) // 32, 127, np.uint8), padded, fmt)[:n]
    assert np.abs(values).max() == top and len(np.unique(values[values != 0])) == n - 2 + f.is_int
    blocks = np.zeros((n, 32))
    blocks[:, 0], blocks[:, 1] = values, top
    scale, back, again = mx.mx_quantize(blocks, fmt)
    assert (scale == 127).all() and np.array_equal(back[:, 0], codes)
    assert np.array_equal(again[:, 0], values)


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [("fp6_e2m3", ml_dtypes.float6_e2m3fn), ("fp6_e3m2", ml_dtypes.float6_e3m2fn)],
)
def test_elements_match_ml_dtypes(fmt, dtype):
    """Element rounding of V / X agrees bit for bit with ml_dtypes' FP6 casts (round to
    nearest even) on spread-out random blocks, along either axis, with a partial last block."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((40, 70)).astype(np.float32)
    a *= rng.lognormal(0, 4, (40, 1)).astype(np.float32)
    for axis in (0, 1):
        scale, codes, values = mx.mx_quantize(a, fmt, axis=axis)
        moved = np.moveaxis(a, axis, -1)
        X = np.repeat(2.0 ** (scale.astype(np.int64) - 127), 32, axis=-1)[..., : moved.shape[-1]]
        ref = (moved / X).astype(dtype)
        assert np.array_equal(ref.view(np.uint8), np.moveaxis(codes, axis, -1))
        assert np.array_equal(ref.astype(np.float64) * X, np.moveaxis(values, axis, -1))
        assert np.array_equal(mx.decode(scale, np.moveaxis(codes, axis, -1), fmt) ,
                              np.moveaxis(values, axis, -1))  # fmt: skip


def test_rounding_is_idempotent_and_keeps_dtype():
    rng = np.random.default_rng(1)
    k = rng.standard_normal((2, 3, 7, 64)).astype(np.float16)
    for fmt in ("mxint8", "mxfp6"):
        once = mx.mx_round(k, fmt)
        assert once.dtype == np.float16 and not np.array_equal(once, k)
        assert np.array_equal(mx.mx_round(once, fmt), once)
        rel = np.abs(once - k).max() / np.abs(k).max()
        assert 0 < rel < (2**-6 if fmt == "mxint8" else 2**-2)


# ---------------------------------------------------------------- the card form of a graph


def tiny_graph() -> onnx.ModelProto:
    """x·W (MatMul), Gemm with transB, a tied table read by Gather and MatMul."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 8)).astype(np.float32)
    wt = rng.standard_normal((8, 64)).astype(np.float32)
    table = rng.standard_normal((64, 40)).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in ((w, "w"), (wt, "wt"), (table, "table"))]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"]),
        helper.make_node("Gemm", ["x", "wt"], ["z"], transB=1),
        helper.make_node("Gather", ["table", "ids"], ["e"]),
        helper.make_node("MatMul", ["x", "table"], ["h"]),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "yzeh"],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_matmul_weights_rounded_along_the_reduction_axis():
    model = tiny_graph()
    before = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    card = cn.card_model(model, cn.CardNumerics())
    after = {t.name: numpy_helper.to_array(t) for t in card.graph.initializer}
    assert np.array_equal(after["w"], mx.mx_round(before["w"], "mxfp6", axis=0))
    assert np.array_equal(after["wt"], mx.mx_round(before["wt"], "mxfp6", axis=1))
    # the tied table: the Gather reads the original, the MatMul a rounded copy
    assert np.array_equal(after["table"], before["table"])
    copy = card.graph.node[3].input[1]
    assert copy != "table" and card.graph.node[2].input[0] == "table"
    assert np.array_equal(after[copy], mx.mx_round(before["table"], "mxfp6", axis=0))
    assert np.array_equal(numpy_helper.to_array(model.graph.initializer[0]), before["w"])
    none = cn.card_model(model, cn.CardNumerics(weights=None, kv=None, profile="fp16"))
    assert none.SerializeToString() == model.SerializeToString()


def test_kv_rounding_only_for_k_and_v():
    v = np.random.default_rng(3).standard_normal((1, 2, 8, 32)).astype(np.float16)
    specs = [
        state.FullAttentionSpec(0, "batch_size", 2, 8),
        state.GatedDeltaNetSpec(1, "batch_size"),
    ]
    q = cn.quantized_buffers([s.to_json() for s in specs])  # by the state specs, not by name
    assert q == {"past_key.0", "past_value.0"}
    assert np.array_equal(cn.round_kv("past_key.0", v, "mxint8", q), mx.mx_round(v, "mxint8"))
    assert cn.round_kv("past_state.1", v, "mxint8", q) is v
    assert cn.round_kv("past_value.0", v, None, q) is v


def test_numerics_from_profiles():
    n = cn.CardNumerics.from_profile(load_profile("ai100_mxfp6_mxint8"))
    assert (n.weights, n.kv) == ("mxfp6", "mxint8") and "E2M3" in n.describe().upper()
    n = cn.CardNumerics.from_profile(load_profile("ai100_fp16"))
    assert (n.weights, n.kv) == (None, None)
    with pytest.raises(cn.CardNumericsError, match="fp16 compute only"):
        cn.CardNumerics.from_profile(load_profile("ai200_bf16"))


# ---------------------------------------------------------------- AI 200 profiles


def test_ai200_profile_and_alias():
    from dflash_qaic.compiler.qpc import compile_command

    p = load_profile("ai200_bf16")
    argv = compile_command("qaic-compile", "m.onnx", "/q", p.target, p)
    assert "-aic-hw-version=ai200" in argv and "-convert-to-fp16" not in argv
    base = {"name": "x", "kv_dtype": "bfloat16", "target": {"num_cores": 4}}
    base["draft"] = {"num_cores": 4}
    assert profile_from_dict({**base, "aic_hw_version": "ai200"}).hw_version == "ai200"
    with pytest.raises(ProfileError, match="bfloat16 needs hw_version ai200"):
        profile_from_dict({**base, "aic_hw_version": "ai100"})


# ---------------------------------------------------------------- the evaluation


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_card_programs_round_weights_and_cache(default_artifacts):
    from dflash_qaic.exporter import fp16_check

    m = json.loads((default_artifacts / "manifest.json").read_text())
    files = [default_artifacts / m[p]["onnx"] for p in ("target", "draft")]
    digests = [sha(f) for f in files]
    card = cn.card_programs(default_artifacts, m, cn.CardNumerics())["target"]
    spec = {k: m[k] for k in ("batch_size", "ctx_len")}
    plain = fp16_check.FaithfulProgram(files[0], m["target"]["inputs"], m["target"]["outputs"], {
        "batch_size": spec["batch_size"], "ctx_len": spec["ctx_len"]})  # fmt: skip
    n = 8
    feeds = {
        "input_ids": np.arange(3, 3 + n, dtype=np.int64)[None],
        "position_ids": np.arange(n, dtype=np.int64)[None],
    }
    names = {i["name"] for i in m["target"]["inputs"]}
    feeds = {k: v for k, v in feeds.items() if k in names}
    for i in m["target"]["inputs"]:
        if i["name"] not in feeds and not i["name"].startswith("past_"):
            shape = [n if d == "seq_len" else 1 if isinstance(d, str) else d for d in i["shape"]]
            if i["name"] == "comp_ctx_lengths":
                shape = [m["ctx_len"]]
            feeds[i["name"]] = np.zeros(shape, np.dtype(i["dtype"]))
    a = card.run(feeds)["hidden_states"]
    b = plain.run(feeds)["hidden_states"]
    rel = np.abs(a - b).max() / np.abs(b).max()
    assert 0 < rel < 0.25  # MXFP6 moves the features, within a few percent of their scale
    k = card.kv["past_key.0"]
    assert np.abs(k[:, :, :n]).max() > 0 and np.array_equal(mx.mx_round(k, "mxint8"), k)
    assert not np.array_equal(mx.mx_round(plain.kv["past_key.0"], "mxint8"), plain.kv["past_key.0"])
    assert [sha(f) for f in files] == digests  # the exported programs are untouched


def run_card(art, out, *flags) -> tuple[int, dict]:
    from dflash_qaic.bench import card_numerics

    argv = [str(art), "--card-profile", "ai100_mxfp6_mxint8", "--out", str(out), *flags]
    rc = card_numerics.main(argv)
    return rc, json.loads((out / "card_numerics.json").read_text())


def test_evaluation_on_the_default_pair(default_artifacts, tmp_path):
    """Greedy DFlash under card numerics commits the card-numerics target's own tokens."""
    from dflash_qaic.bench import project

    out = tmp_path / "cn"
    flags = ("--num-prompts", "2", "--max-new-tokens", "16", "--chi2-seeds", "0")
    rc, r = run_card(default_artifacts, out, *flags)
    g = r["greedy"]
    assert rc == 0 and g["lossless_card"] and g["lossless_fp32"] and "sampled" not in r
    assert r["weights_format"] == "mxfp6" and r["kv_format"] == "mxint8"
    # the trained built-in pair accepts drafts in both numerics (a broken draft side gives τ = 1)
    assert 1 < g["tau_card"] <= 16 and 1 < g["tau_fp32"] <= 16
    moved = g["moved_by_target"] + g["moved_by_draft"]
    assert g["tau_card"] - g["tau_fp32"] == pytest.approx(moved)
    assert len(g["target_agreement"]["first_divergence"]) == 2
    # the projection takes its chain τ from the run, and says so
    assert project.tau_from(str(out / "card_numerics.json")) == {"chain": round(g["tau_card"], 2)}
    src = project.tau_sources(str(out / "card_numerics.json"), None)["chain"]
    assert "card numerics" in src and "ai100_mxfp6_mxint8" in src


def test_recorded_logits_are_the_committed_choices(default_artifacts):
    """`record`: the card-numerics target's logits per call and position; the target alone's
    argmax at every position is the token it committed (and DFlash's, at the last call that
    computed the position); the gaps `margin_at` reports read from them."""
    from dflash_qaic.bench import card_numerics as bcn

    pipe = bcn.pipelines(default_artifacts, cn.CardNumerics())["card", "card"]
    ids = list(b"def f(x):\n    return")
    base, alone = bcn.record(pipe, ids, 12, dflash=False)
    dfl, spec = bcn.record(pipe, ids, 12, dflash=True)
    n = len(ids)
    assert base == dfl and bcn.margin_at(n, base, dfl, alone, spec) is None
    for i, tok in enumerate(base):
        assert int(np.argmax(alone[n + i - 1][-1][1])) == tok
        assert int(np.argmax(spec[n + i - 1][-1][1])) == tok
    assert {rows for k in range(n, n + 11) for rows, _ in alone[k]} == {1}  # Decode calls
    assert max(rows for k in range(n, n + 11) for rows, _ in spec[k]) == pipe.B  # Verify
    # a divergence at token 2: each run's choice, runner-up and gap there
    other = base[:2] + [base[2] + 1] + base[3:]
    logits = np.ones(258)
    logits[other[2]], logits[base[2]] = 9.0, 2.0
    fake = {**spec, n + 1: [(pipe.B, logits)]}
    m = bcn.margin_at(n, base, other, alone, fake)
    assert m["token"] == 2 and m["position"] == n + 1
    assert m["alone"]["choice"] == base[2] and m["alone"]["rows"] == 1 and m["alone"]["gap"] >= 0
    assert m["dflash"] == {"rows": pipe.B, "choice": other[2], "runner_up": base[2], "gap": 7.0}


@pytest.mark.slow
def test_sampling_is_the_card_target_distribution(default_artifacts, tmp_path):
    """T = 1: DFlash's tokens and the card-numerics target's own, pooled over seeds: χ²."""
    flags = ("--num-prompts", "1", "--max-new-tokens", "4", "--chi2-prompts", "1")
    flags += ("--chi2-seeds", "40", "--chi2-tokens", "6")
    rc, r = run_card(default_artifacts, tmp_path / "cn", *flags)
    s = r["sampled"]
    assert rc == 0 and s["ran"] and s["pairs"] == 40 and s["df"] >= 1
    assert s["p_permutation"] > 1e-3 and s["p_asymptotic"] > 1e-4


def test_bf16_profile_refused_by_the_evaluation(default_artifacts, capsys):
    from dflash_qaic.bench import card_numerics

    rc = card_numerics.main([str(default_artifacts), "--card-profile", "ai200_bf16"])
    assert rc == 2 and "fp16 compute only" in capsys.readouterr().err


def test_export_flag_writes_the_report_beside_the_artifacts(
    default_artifacts, monkeypatch, tmp_path
):
    from dflash_qaic.bench import card_numerics
    from dflash_qaic.exporter import cli

    seen = {}

    def small(art, profile, **kw):
        seen["profile"] = profile
        return evaluate(art, profile, num_prompts=1, max_new=8, chi2_seeds=0, **kw)

    evaluate = card_numerics.evaluate
    monkeypatch.setattr(card_numerics, "evaluate", small)
    art = tmp_path / "art"
    art.symlink_to(default_artifacts, target_is_directory=True)
    assert cli.check_card_numerics(art, None, debug=False) == 0
    report = json.loads((tmp_path / "art.card-numerics.json").read_text())
    assert seen["profile"] is None and report["profile"] == "ai100_fp16"  # the export's own
    assert report["weights_format"] is None and "sampled" not in report
    assert (
        cli.parser().parse_args(["--out", "x", "--check-card-numerics"]).check_card_numerics == ""
    )
