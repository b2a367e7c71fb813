"""QEfficient's habits (dflash_qaic/qeff.py): the sequence a QEfficient user types, on the
built-in pair, gives `pipe.generate`'s tokens; QEfficient's names map onto our options; a key
or keyword this face cannot honour is a clear error."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import dflash_qaic
from dflash_qaic.assets import default_pair, heldout_prompts
from dflash_qaic.exporter.options import ExportError
from dflash_qaic.qeff import AutoDFlashModel, QEffConfigError, compile_options, qaic_options

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance asserted (drafts accepted, every length), seeded tokens


def test_import_stays_light_and_the_name_resolves():
    code = (
        "import sys; from dflash_qaic import AutoDFlashModel; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules; "
        "print(AutoDFlashModel.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "AutoDFlashModel", out.stderr
    assert "AutoDFlashModel" in dflash_qaic.__all__
    with pytest.raises(AttributeError, match="no attribute 'AutoDFlash'"):
        dflash_qaic.AutoDFlash  # noqa: B018


@pytest.fixture(scope="module")
def sequence(cb_artifacts, tmp_path_factory, caplog_module):
    """The QEfficient user's sequence, typed as they type it, into a hard-linked copy of the
    session's continuous-batching artifacts (so the export is the reuse path, not a new
    export: the same inputs and program options)."""
    out = tmp_path_factory.mktemp("qeff") / "qwen3-tiny"
    shutil.copytree(cb_artifacts, out, copy_function=os.link)
    target, draft = default_pair()
    model = AutoDFlashModel.from_pretrained(
        str(target),
        continuous_batching=True,
        qaic_config={"target_layer_ids": [1, 2, 3, 4], "dflash_dlm_repo": str(draft)},
    )
    exported = model.export(out, prefill_seq_len=64, ctx_len=1024, full_batch_size=4)
    qpc = model.compile(
        prefill_seq_len=64,
        ctx_len=1024,
        full_batch_size=4,
        num_cores=12,
        num_devices=1,
        mxfp6_matmul=True,
        mxint8_kv_cache=True,
        mos=1,
        dflash_block_size=16,
    )
    prompts = [p[:120] for p in heldout_prompts()[:5]]  # 5 prompts: one waits for a cache row
    info = model.generate(prompts, generation_len=24)
    return model, exported, qpc, prompts, info


@pytest.fixture(scope="module")
def caplog_module():
    """Records the package's warnings while the module's sequence runs."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    log = logging.getLogger("dflash_qaic")
    log.addHandler(handler)
    yield records
    log.removeHandler(handler)


def test_the_sequence_equals_pipe_generate(sequence, cb_artifacts, caplog_module):
    model, exported, qpc, prompts, info = sequence
    assert exported == qpc == model.qpc_path
    # no qaic-compile here: the compile step wrote its inputs and said so
    assert model.manifest.compile_skipped is not None and not model.manifest.compiled
    assert any((qpc / "target").glob("qpc-*/specializations.json"))
    said = " ".join(r.getMessage() for r in caplog_module)
    assert "no AI100 compiler found" in said
    opts = model.manifest.options
    got = [opts[k] for k in ("num_cores", "mxfp6_matmul", "mxint8_kv_cache", "mos")]
    assert got == [12, True, True, 1]
    pipe = dflash_qaic.load(cb_artifacts)
    want = pipe.generate(prompts, max_new_tokens=24)
    assert [ids.tolist() for ids in info.generated_ids] == [r.tokens for r in want]
    assert info.generated_texts == [r.text for r in want]
    assert all(ids.dtype == np.int64 and len(ids) == 24 for ids in info.generated_ids)
    assert info.batch_size == 4 and info.tau > 1
    p = info.perf_metrics
    assert p.total_time > 0 and p.prefill_time > 0 and p.decode_perf > 0 and p.total_perf > 0
    assert "Decode is=" in repr(info) and "τ" in repr(info)


def test_generate_takes_qefficients_argument_order(sequence):
    """generate(tokenizer, prompts) as QEfficient's signature has it, and token-id prompts;
    runtime_ai100=False is ONNX Runtime."""
    model, _, _, prompts, info = sequence

    class Tok:  # a Hugging Face-like tokenizer: bytes are the ids of the built-in pair
        def __call__(self, text):
            return {"input_ids": list(text.encode())}

        def decode(self, ids):
            return bytes(ids).decode("utf-8", "replace")

    got = model.generate(Tok(), prompts[:2], generation_len=24, runtime_ai100=False)
    assert [g.tolist() for g in got.generated_ids] == [g.tolist() for g in info.generated_ids[:2]]
    assert got.generated_texts[0] == Tok().decode(info.generated_ids[0].tolist())
    one = model.generate(list(prompts[0].encode()), generation_len=24)
    assert one.generated_ids[0].tolist() == info.generated_ids[0].tolist()
    with pytest.raises(QEffConfigError, match="device_id"):
        model.generate(prompts, device_id=[0])


def test_qaic_config_maps_onto_our_options():
    ids = (0, 1, 2, 3)
    assert qaic_options({"target_layer_ids": [1, 2, 3, 4]}, ids) == {}
    got = qaic_options(
        {"dflash_block_size": 8, "include_sampler": False, "comp_ctx_lengths_decode": [512, 1024]},
        ids,
    )
    assert got == {"block_size": 8, "sampling": False, "comp_ctx_lengths": [512, 1024]}
    assert qaic_options({"num_speculative_tokens": 7}, ids) == {"num_speculative_tokens": 7}
    assert compile_options(
        {"dflash_block_size": 16, "mos": -1, "num_cores": 8, "prefill_only": None, "ctx_len": None}
    ) == {"block_size": 16, "num_cores": 8}


def test_clear_errors_for_what_cannot_be_honoured():
    ids = (0, 1, 2, 3)
    with pytest.raises(QEffConfigError, match="unknown qaic_config key 'spec_len'.*known:.*dflash"):
        qaic_options({"spec_len": 3}, ids)
    with pytest.raises(QEffConfigError, match="'dflash_dlm' is not taken here.*second argument"):
        qaic_options({"dflash_dlm": True}, ids)
    with pytest.raises(QEffConfigError, match=r"says \[0, 1, 2, 3\].*pass \[1, 2, 3, 4\]"):
        qaic_options({"target_layer_ids": [0, 1, 2, 3]}, ids)
    with pytest.raises(QEffConfigError, match="one set of attention windows"):
        qaic_options({"comp_ctx_lengths_prefill": [256], "comp_ctx_lengths_decode": [512]}, ids)
    with pytest.raises(ExportError, match="--block-size"):
        qaic_options({"dflash_block_size": 1}, ids)  # checked by the option's declaration
    with pytest.raises(TypeError, match="unknown compile option 'aic_hw'.*known:.*mos"):
        compile_options({"aic_hw": True})
    with pytest.raises(QEffConfigError, match="prefill_only=True is not supported"):
        compile_options({"prefill_only": True})
    target, draft = default_pair()
    with pytest.raises(TypeError, match="needs the DFlash draft"):
        AutoDFlashModel.from_pretrained(target)
    with pytest.raises(QEffConfigError, match="two drafts"):
        AutoDFlashModel.from_pretrained(target, draft, qaic_config={"dflash_dlm_repo": target})
    with pytest.raises(QEffConfigError, match="float32"):
        AutoDFlashModel.from_pretrained(target, draft, torch_dtype="float16")
    model = AutoDFlashModel.from_pretrained(target, draft, continuous_batching=True)
    with pytest.raises(TypeError, match="full_batch_size` is required"):
        model.compile(ctx_len=1024)
    with pytest.raises(TypeError, match="export or compile first"):
        model.generate(["x"])


@pytest.mark.parametrize("bad", [[1], "str", 7, ("dflash_dlm_repo", "x"), {1: 2}])
def test_qaic_config_of_the_wrong_type_is_named(bad):
    """A qaic_config that is not a dict of key names: an error naming qaic_config and a dict,
    before anything is converted (Python's own dict() error named neither)."""
    target, draft = default_pair()
    with pytest.raises(QEffConfigError, match=r"qaic_config (must be a dict|keys must be str)"):
        AutoDFlashModel.from_pretrained(target, draft, qaic_config=bad)


@pytest.mark.parametrize(
    "args, name",
    [((7, None), "pretrained_model_name_or_path"), (("t", 3.5), "draft")],
)
def test_checkpoint_arguments_of_the_wrong_type_are_named(args, name):
    with pytest.raises(TypeError, match=f"{name} must be a checkpoint directory"):
        AutoDFlashModel.from_pretrained(*args)
