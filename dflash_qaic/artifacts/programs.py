"""Export both programs of a pair into a staging directory, with the files that travel with them
(the tokenizer, the target's config.json), and describe the result as a `Manifest` (its files
still unrecorded: `artifacts/build.py` records them after the compile step).

The export streams (exporter/weights.py): placeholder modules are traced, and the weights go from
the safetensors files to the programs one tensor at a time. The shape plan is the one the
preflight made (`artifacts/preflight.py`): both programs are exported for it and the manifest
stores it.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_qaic import __version__, contract
from dflash_qaic import checkpoints as ck
from dflash_qaic.artifacts.manifest import Manifest, ProgramRecord
from dflash_qaic.artifacts.preflight import TOKENIZER_FILES, Preflight, eos_ids
from dflash_qaic.exporter.options import ExportOptions

log = logging.getLogger(__name__)

#: the target's config.json, copied to OUT/config.json (and OUT/tokenizer/): what vLLM reads to
#: know the target when it serves the artifacts (`vllm serve OUT`, docs/DESIGN.md, vLLM platform plugin)
MODEL_CONFIG = "config.json"


def copy_tokenizer(target_dir: Path, out: Path) -> str | None:
    """Copy the tokenizer files into `out/tokenizer` (a fresh staging directory)."""
    files = [target_dir / f for f in TOKENIZER_FILES if (target_dir / f).is_file()]
    if not files:
        return None
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, out / "tokenizer" / f.name)  # umask permissions, not the source's
    return "tokenizer"


def copy_model_config(target_dir: Path, out: Path) -> None:
    """OUT/config.json, and one beside the tokenizer files (vLLM reads a tokenizer directory's
    config.json too)."""
    shutil.copyfile(target_dir / MODEL_CONFIG, out / MODEL_CONFIG)
    if (out / "tokenizer").is_dir():
        shutil.copyfile(target_dir / MODEL_CONFIG, out / "tokenizer" / MODEL_CONFIG)


@dataclass
class _Weights:
    """What the export reads of the checkpoints before tracing: the placeholder target, the
    draft's fc and hidden norm (fp32), the placeholder embedding and head, the checkpoints'
    sha256."""

    target: object
    fc: object
    hidden_norm: object
    embed: object
    head: object
    digests: dict


def _read_weights(pair: ck.Pair, steps) -> _Weights:
    """Before any tracing: every weight finite and within fp16's range, read once (that read
    gives the manifest's sha256 of each checkpoint too); fc's fp16 scale finite. Then the
    structure of both checkpoints, as placeholders."""
    from dflash_qaic.exporter import weights

    t = time.perf_counter()
    log.info("checking the weights of %s and %s", pair.target.path, pair.draft.path)
    digests = ck.check_weight_values(pair)
    fc_info = pair.draft_tensors["fc.weight"]
    fc = weights.load_fp32(fc_info)
    ck.fp16_fc_scale(fc, fc_info)
    steps.append(("check weights", "finite, within fp16", time.perf_counter() - t))
    t = time.perf_counter()
    log.info("reading %s and %s (structure only)", pair.target.path, pair.draft.path)
    target = weights.placeholder_target(pair.target)
    hidden_norm = weights.load_fp32(pair.draft_tensors["hidden_norm.weight"])
    embed, head = weights.placeholder_head(pair.target)
    steps.append(("load checkpoints", "structure + fc", time.perf_counter() - t))
    return _Weights(target, fc, hidden_norm, embed, head, digests)


def _common(pair: ck.Pair, plan: contract.ShapePlan, o: ExportOptions) -> dict:
    """The keyword arguments both program exports take."""
    return dict(
        ctx_len=plan.ctx_len,
        prefill_seq_len=plan.prefill_seq_len,
        block_size=plan.block_size,
        batch_size=plan.batch_size,
        full_batch_size=plan.full_batch_size,
        comp_ctx_lengths=list(plan.windows),
        emit_logits=o.emit_logits,
        fp16_check=_check_dtype(o),
        stream_from=pair,
    )


def _check_dtype(o: ExportOptions) -> bool | str:
    """The graph check's arithmetic: off, or the dtype the compile profile computes in
    (exporter/fp16_check.check_dtype: bf16's range on a bf16 profile)."""
    from dflash_qaic.compiler.profiles import ProfileError, load_profile
    from dflash_qaic.exporter.fp16_check import check_dtype

    if not o.fp16_check:
        return False
    try:
        return check_dtype(load_profile(o.qpc_config))
    except ProfileError:  # the compile step names it; the check stays fp16's
        return "float16"


def _block(o: ExportOptions) -> bool:
    """--verify-rule block on a sampling program (docs/DESIGN.md, Block verification)."""
    return o.verify_rule == contract.BLOCK and o.sampling


def _q_aware(pair: ck.Pair, o: ExportOptions) -> bool:
    """A DFlash-2 draft, or any draft under --verify-rule block, sampling, a dense target: the
    draft samples its path and returns its q (a DFlash draft from its top-k), and the target
    verifies q-aware (docs/DESIGN.md, DFlash-2 drafts; Block verification)."""
    tree = o.verify_rule == contract.TREE  # a tree samples every node from p: no q
    return (pair.draft.dflash2 or _block(o)) and o.sampling and not pair.target.hybrid and not tree


def _q_top_k(pair: ck.Pair) -> int:
    """The candidates a sampling draft draws its proposals from."""
    return pair.draft.selector_top_k if pair.draft.dflash2 else contract.DRAFT_SAMPLE_TOP_K


def _export_target(pair, w: _Weights, plan, o: ExportOptions, out: Path, steps) -> dict:
    import torch

    from dflash_qaic.exporter.target import export_target

    B = plan.block_size
    q_aware = _q_aware(pair, o)
    draft_q = (B - 1, min(_q_top_k(pair), pair.target.vocab_size)) if q_aware else ()
    t = time.perf_counter()
    log.info(
        "exporting the target program (ctx %d, chunk %d, B %d)",
        plan.ctx_len,
        plan.prefill_seq_len,
        B,
    )
    with torch.no_grad():
        facts = export_target(
            w.target,
            w.fc,
            w.hidden_norm,
            pair.draft.rms_norm_eps,
            pair.draft.target_layer_ids,
            out / "target" / "target.onnx",
            sampling=o.sampling,
            verify_lengths=list(plan.verify_lengths),
            draft_q=draft_q,
            token_bitmask=o.structured_output,
            verify_rule=o.verify_rule,
            plan=plan,
            logprobs=o.logprobs,
            logprobs_mode=o.logprobs_mode,
            extended_sampling=o.extended_sampling,
            **_common(pair, plan, o),
        )
    w.target = None  # the placeholder modules go before the draft is traced
    steps.append(("export target", f"{facts['onnx_bytes'] / 1e6:.1f} MB", time.perf_counter() - t))
    return facts


def _export_draft(pair, w: _Weights, plan, o: ExportOptions, out: Path, steps) -> dict:
    import torch

    from dflash_qaic.exporter.draft import export_draft

    t = time.perf_counter()
    log.info("exporting the draft program")
    with torch.no_grad():
        facts = export_draft(
            pair.draft,
            None,
            w.embed,
            w.head,
            out / "draft" / "draft.onnx",
            sampling=_q_aware(pair, o),
            sample_top_k=_q_top_k(pair) if _block(o) else 0,
            top_k=o.draft_top_k,
            plan=plan,
            context_window=o.draft_context_window,
            extended_sampling=o.extended_sampling,
            **_common(pair, plan, o),
        )
    steps.append(("export draft", f"{facts['onnx_bytes'] / 1e6:.1f} MB", time.perf_counter() - t))
    return facts


def export_programs(pre: Preflight, out: Path, o: ExportOptions, key: str, steps) -> Manifest:
    """Export both programs of `pre.pair` for `pre.plan` into `out`, copy the tokenizer and
    config.json beside them; the manifest that describes them (files not yet recorded)."""
    pair, plan = pre.pair, pre.plan
    w = _read_weights(pair, steps)
    tfacts = _export_target(pair, w, plan, o, out, steps)
    dfacts = _export_draft(pair, w, plan, o, out, steps)
    tok = copy_tokenizer(pair.target.path, out)
    copy_model_config(pair.target.path, out)
    return Manifest(
        block_size=plan.block_size,
        mask_token_id=pair.draft.mask_token_id,
        target_layer_ids=tuple(pair.draft.target_layer_ids),
        prefill_seq_len=plan.prefill_seq_len,
        ctx_len=plan.ctx_len,
        batch_size=plan.batch_size,
        vocab_size=pair.target.vocab_size,
        hidden_size=pair.target.hidden_size,
        programs={
            contract.TARGET: ProgramRecord.from_facts(contract.TARGET, tfacts, out),
            contract.DRAFT: ProgramRecord.from_facts(contract.DRAFT, dfacts, out),
        },
        prefill_lengths=plan.prefill_lengths,
        verify_lengths=plan.verify_lengths,
        tree_budgets=plan.tree_budgets,
        draft_prefill_rows=plan.draft_prefill_rows,
        full_batch_size=plan.full_batch_size,
        comp_ctx_lengths=plan.windows,
        eos_token_ids=tuple(eos_ids(pair.target.path)),
        tokenizer=tok,
        input_hash=key,
        sources=_sources(pair, w.digests),
        versions=_versions(),
    )


def _sources(pair: ck.Pair, digests: dict) -> dict:
    return {
        "target": {
            "path": str(pair.target.path.resolve()),
            "family": pair.target.family,
            "sha256": digests["target"],
        },
        "draft": {"path": str(pair.draft.path.resolve()), "sha256": digests["draft"]},
    }


def _versions() -> dict:
    import onnx
    import onnxruntime
    import torch
    import transformers

    return {
        "dflash_qaic": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
    }
