"""Export the draft program: ExportDraft -> ONNX -> graph checks -> facts for the manifest."""

from __future__ import annotations

import os

import numpy as np
import torch

from dflash_qaic import contract
from dflash_qaic.checkpoints import DraftConfig, Pair
from dflash_qaic.exporter import weights
from dflash_qaic.exporter.onnx_export import export_and_check, program_facts
from dflash_qaic.exporter.target import batch_index_feed, check_sizes, extended_feed, window_feed
from dflash_qaic.modeling.draft import DFlashDraft, ExportDraft


def draft_io(
    c: DraftConfig,
    vocab_size: int,
    block_size: int,
    emit_logits=False,
    continuous_batching=False,
    comp_ctx=True,
    confidence=True,
    ring_slots: tuple[int, ...] = (),
    q_top_k: int = 0,
    top_k: int = 0,
    pair_k: int = 0,
    extended_sampling: bool = False,
) -> contract.DraftIO:
    return contract.DraftIO(
        n_layers=c.num_layers,
        n_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        hidden_size=c.hidden_size,
        vocab_size=vocab_size,
        block_size=block_size,
        emit_logits=emit_logits,
        continuous_batching=continuous_batching,
        comp_ctx=comp_ctx,
        confidence=confidence,
        ring_slots=tuple(ring_slots),
        q_top_k=q_top_k,
        top_k=top_k,
        pair_k=pair_k,
        extended_sampling=extended_sampling,
    )


def check_feeds(io: contract.DraftIO, specializations: list[dict], mask_id: int, seed=0):
    """One feed per specialization: context rows at 0.. with the last one padded (−1),
    features of unit RMS (what hidden_norm produces), the block right after, empty caches."""
    rng = np.random.default_rng(seed)
    feeds = []
    for spec in specializations:
        sym = spec["symbols"]
        b, s, B = sym[contract.BATCH], sym[contract.SEQ], io.block_size
        pos_t = np.tile(np.arange(s, dtype=np.int64), (b, 1))
        if s > 1:
            pos_t[:, -1] = contract.PAD_POSITION
        start = s - 1 if s > 1 else s
        block = np.full((b, B), mask_id, dtype=np.int64)
        block[:, 0] = rng.integers(0, io.vocab_size, b)
        pos = np.tile(np.arange(start, start + B, dtype=np.int64), (b, 1))
        feed = {
            contract.TARGET_HIDDEN: rng.standard_normal((b, s, io.hidden_size)).astype(np.float32),
            contract.POSITION_IDS_TARGET: pos_t,
            contract.INPUT_IDS: block,
            contract.POSITION_IDS: pos,
            **batch_index_feed(io, sym, pos),
            **window_feed(io, sym),
        }
        if io.q_top_k:  # a sampled DFlash-2 draft: half the rows greedy, half at T = 0.8
            feed[contract.TEMPERATURE] = np.where(np.arange(b) % 2 == 1, 0.8, 0.0).astype(
                np.float32
            )
            feed[contract.DRAFT_RANDOM_U] = rng.random((b, B - 1)).astype(np.float32)
        if io.extended_sampling:  # every adjustment on, a random history (as the target's)
            ext = extended_feed(io, b, rng)
            feed |= {t.name: ext[t.name] for t in contract.draft_extended_specs(io.vocab_size)}
        if contract.BATCH_INDEX in feed:  # an inactive row's context positions are -1 too
            pos_t[feed[contract.BATCH_INDEX][:, 0] < 0] = contract.PAD_POSITION
        for kv in io.kv:
            feed[kv.name] = np.zeros(kv.bind(**sym), dtype=np.float32)
        feeds.append(feed)
    return feeds


def _outputs_k(module, draft_cfg, V: int, sampling: bool, sample_top_k: int, top_k: int):
    """(q's candidates, returned top-k) of the draft program, set on `module`: a DFlash-2 draft
    exported for sampling proposes a sampled path and returns its q (its selector's top-k); a
    DFlash draft does so from its own top `sample_top_k` when that is > 0."""
    q_top_k = min(draft_cfg.selector_top_k, V) if draft_cfg.dflash2 and sampling else 0
    if sampling and not draft_cfg.dflash2 and sample_top_k:  # a DFlash draft that samples
        q_top_k = module.q_top_k = min(sample_top_k, V)
    if not 0 <= top_k <= contract.MAX_DRAFT_TOP_K:
        raise ValueError(f"--draft-top-k must be in [0, {contract.MAX_DRAFT_TOP_K}], got {top_k}")
    module.top_k = top_k = min(top_k, V)
    if draft_cfg.dflash2 and top_k:  # the selector ranks a tree's branches after their parents
        module.pair_k = min(top_k, draft_cfg.selector_top_k)
    return q_top_k, top_k


def _module(cfg, state, stream_from, embed, head, ctx_len, emit_logits, cb, window, extended):
    """The ExportDraft of `export_draft`'s arguments (the placeholder draft when streaming).
    extended: it takes the target's extended sampling inputs, unless the draft has its own
    reduced vocabulary (its logits are not over the target's ids: it proposes unadjusted)."""
    if stream_from is not None:
        draft = weights.placeholder_draft(cfg)
    else:
        draft = DFlashDraft.from_checkpoint(cfg, state)
    module = ExportDraft(draft, embed, head, ctx_len, emit_logits, cb, context_window=window)
    module.extended = extended and module.vocab_map is None
    return module.eval()


def _plan(block_size, prefill_seq_len, ctx_len, comp_ctx_lengths, **sizes):
    """The shape plan of these sizes (the export's own is artifacts/preflight.py's)."""
    windows = contract.windows_or_default(comp_ctx_lengths, ctx_len, prefill_seq_len, block_size)
    return contract.shape_plan(block_size, prefill_seq_len, ctx_len, windows=windows, **sizes)


def export_draft(
    draft_cfg: DraftConfig,
    draft_state: dict[str, torch.Tensor],
    embed_weight: torch.Tensor,
    head_weight: torch.Tensor,
    out_path: str | os.PathLike,
    *,
    ctx_len: int,
    prefill_seq_len: int,
    block_size: int,
    batch_size: int = 1,
    full_batch_size: int | None = None,
    comp_ctx_lengths: list[int] | None = None,
    emit_logits: bool = False,
    external_data: bool | None = None,
    fp16_check: bool | str = True,
    stream_from: Pair | None = None,
    sampling: bool = False,
    sample_top_k: int = 0,
    top_k: int = 0,
    plan: contract.ShapePlan | None = None,
    context_window: int | None = None,
    extended_sampling: bool = False,
) -> dict:
    """Export the draft program to `out_path` and check it; returns facts for the manifest.

    `embed_weight` / `head_weight` are the target's (pass the same tensor twice for a tied head).
    stream_from: the streaming export (exporter/weights.py): `draft_state` is None, the embedding
    and head are placeholders (`weights.placeholder_head`), and the program's weights are written
    from this pair's checkpoints tensor by tensor.
    full_batch_size: continuous batching with this many cache rows (contract.py).
    comp_ctx_lengths: the attention windows (contract.COMP_CTX_LENGTHS); None: the default ones.
    sampling, sample_top_k: the draft samples its proposals and returns its q (`_outputs_k`).
    top_k: it also returns each proposal row's top-k ids and log-probabilities (0: not).
    plan: the export's shape plan (artifacts/preflight.py), made here from the sizes when None.
    context_window: full layers see only the last N context positions (`ExportDraft`).
    extended_sampling: the draft proposes from its logits adjusted as the target's (`_module`).
    """
    check_sizes(ctx_len, prefill_seq_len, block_size, min_block=2)
    cb = full_batch_size is not None
    module = _module(draft_cfg, draft_state, stream_from, embed_weight, head_weight, ctx_len,
                     emit_logits, cb, context_window, extended_sampling)  # fmt: skip
    rings = module.cache_slots()  # sliding layers (and windowed full ones): ring caches
    V = embed_weight.shape[0]
    Vd = draft_cfg.draft_vocab_size or V  # a reduced draft vocabulary bounds its top-k
    q_top_k, top_k = _outputs_k(module, draft_cfg, Vd, sampling, sample_top_k, top_k)
    io = draft_io(
        draft_cfg, V, block_size, emit_logits, cb, ring_slots=rings, q_top_k=q_top_k, top_k=top_k,
        pair_k=module.pair_k, extended_sampling=module.extended,
    )  # fmt: skip
    if plan is None:
        sizes = dict(batch_size=batch_size, full_batch_size=full_batch_size)
        plan = _plan(block_size, prefill_seq_len, ctx_len, comp_ctx_lengths, **sizes)
    specializations = contract.draft_specializations(plan)
    mask_id = draft_cfg.mask_token_id
    sources = None
    if stream_from is not None:
        sources = weights.draft_sources(weights.stream_ready(module), stream_from)
    path, report = export_and_check(
        module,
        io,
        specializations,
        lambda specs: check_feeds(io, specs, mask_id),
        out_path,
        check_specs=contract.draft_specializations(plan.longest()),
        trace_rows=2 if stream_from is not None else max(prefill_seq_len, 2),  # see export_target
        external_data=external_data,
        sources=sources,
        fp16_check=fp16_check,
    )
    return {
        **program_facts(path, io, specializations, report),
        "prefill_seq_len": prefill_seq_len,
        "block_size": block_size,
        "mask_token_id": mask_id,
        "tied_head": head_weight.data_ptr() == embed_weight.data_ptr(),
        "comp_ctx_lengths": list(plan.windows),
    }
