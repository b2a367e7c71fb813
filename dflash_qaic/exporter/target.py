"""Export the target program: ExportTarget -> ONNX -> graph checks -> facts for the manifest."""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence

import numpy as np
import torch

from dflash_qaic import checkpoints as ck
from dflash_qaic import contract, families
from dflash_qaic.exporter import weights
from dflash_qaic.exporter.onnx_export import export_and_check, program_facts
from dflash_qaic.exporter.options import tree_refusal
from dflash_qaic.modeling.sampler import SAMPLING_CANDIDATES
from dflash_qaic.modeling.target import ExportTarget

# Sampling settings of the fp16 check, per specialization: the check exercises the sampling
# path (temperature > 0, with and without top-k / top-p); greedy rows are a plain ArgMax.
CHECK_SAMPLING = {
    contract.PREFILL: (1.0, 0, 1.0),
    contract.PREFILL_SAMPLED: (1.0, 0, 1.0),
    contract.VERIFY: (0.7, 5, 0.9),
    contract.DECODE: (1.5, 0, 0.8),
}


def check_feeds(io: contract.TargetIO, specializations: list[dict], seed: int = 0) -> list[dict]:
    """One feed per specialization for the fp16 check: random tokens at positions 0.. (prefill)
    or right after them (verify, decode), the last row of each padded (-1), empty caches, and
    (with sampling) the settings of CHECK_SAMPLING with random uniforms. Each specialization
    draws from its own generator (seed and its name), so adding one leaves the others' feeds."""
    feeds = []
    for spec in specializations:
        rng = np.random.default_rng([seed, zlib.crc32(spec["name"].encode())])
        sym = spec["symbols"]
        b, s = sym[contract.BATCH], sym[contract.SEQ]
        name = spec["kind"]
        start = 0 if name in contract.PREFILLS else min(s, sym[contract.CTX] - 1 - s)
        pos = np.tile(np.arange(start, start + s, dtype=np.int64), (b, 1))
        if s > 1:
            pos[:, -1] = contract.PAD_POSITION
        feed = {
            contract.INPUT_IDS: rng.integers(0, io.vocab_size, (b, s), dtype=np.int64),
            contract.POSITION_IDS: pos,
            **batch_index_feed(io, sym, pos),
            **window_feed(io, sym),
        }
        if io.sampling:
            t, k, p = CHECK_SAMPLING.get(name, (1.0, 0, 1.0))
            feed[contract.TEMPERATURE] = np.full((b,), t, np.float32)
            feed[contract.TOP_K] = np.full((b,), k, np.int64)
            feed[contract.TOP_P] = np.full((b,), p, np.float32)
            shape = (b, sym.get(contract.SAMPLE, s), contract.N_RANDOM)
            feed[contract.RANDOM_U] = rng.random(shape, dtype=np.float32)
        if io.sampling and io.draft_q:  # a DFlash-2 draft's q: k distinct ids, probabilities
            rows, k = io.draft_q
            ids = rng.permuted(np.tile(np.arange(io.vocab_size), (b * rows, 1)), axis=1)[:, :k]
            feed[contract.DRAFT_Q_IDS] = ids.reshape(b, rows, k).astype(np.int64)
            q = rng.random((b, rows, k)).astype(np.float32)
            feed[contract.DRAFT_Q_PROBS] = q / q.sum(-1, keepdims=True)
        if contract.rule(
            io.verify_rule
        ).takes_tree:  # a verify: a random tree of s rows at start + depth; else the chain's
            layout = (
                random_tree(s, rng) if name in (contract.VERIFY, contract.VERIFY_SAMPLED) else None
            )
            layout = layout or contract.RowLayout.chain(s)
            mask = np.array(layout.mask(), np.int32)
            feed[contract.TREE_MASK] = np.broadcast_to(mask, (b, s, s)).copy()
            depth = np.array(layout.depths, np.int64)
            real = pos >= 0
            pos[real] = (pos[:, :1] + depth[None, :])[real]
        if io.token_bitmask:  # a grammar's mask: random bits, token 0 always allowed
            words = contract.bitmask_words(io.vocab_size)
            bits = rng.integers(-(2**31), 2**31, (b, s, words), dtype=np.int64)
            feed[contract.TOKEN_BITMASK] = (bits | 1).astype(np.int32)
        if io.logprobs:  # the tokens the rows score
            feed[contract.LOGPROB_IDS] = rng.integers(0, io.vocab_size, (b, s), dtype=np.int64)
        if io.extended_sampling:
            feed |= extended_feed(io, b, rng)
        for kv in io.kv:
            feed[kv.name] = np.zeros(kv.bind(**sym), dtype=np.float32)
        feeds.append(feed)
    return feeds


def random_tree(n: int, rng) -> contract.RowLayout | None:
    """A random tree of n rows (row r's parent drawn from rows before it), or None for n < 3."""
    if n < 3:
        return None
    parents, depths = [-1], [0]
    for r in range(1, n):
        p = int(rng.integers(0, r))
        parents.append(p)
        depths.append(depths[p] + 1)
    return contract.RowLayout(tuple(parents), tuple(depths))


def batch_index_feed(io, sym: dict, pos: np.ndarray) -> dict:
    """`batch_index` of a check feed (continuous batching): a batch-1 call writes the last cache
    row; a full-batch call has row r on cache row r, and its last row (if it has several) is an
    inactive row (batch_index and every position -1, set here in `pos`)."""
    if not io.continuous_batching:
        return {}
    b, n = pos.shape[0], sym[contract.FULL_BATCH]
    rows = np.arange(b, dtype=np.int64)[:, None] if b > 1 else np.array([[n - 1]], np.int64)
    if b > 1:
        rows[-1] = contract.INACTIVE_ROW
        pos[-1] = contract.PAD_POSITION
    return {contract.BATCH_INDEX: rows}


def window_feed(io, sym: dict) -> dict:
    """`comp_ctx_lengths` of a check feed: the specialization's window, slots 0 … L-1."""
    if not io.comp_ctx:
        return {}
    return {contract.COMP_CTX_LENGTHS: np.arange(sym[contract.CCL], dtype=np.int64)}


def check_sizes(ctx_len: int, prefill_seq_len: int, block_size: int, min_block: int) -> None:
    if not min_block <= block_size <= contract.max_positions(ctx_len):
        raise ValueError(
            f"block_size {block_size} must be in [{min_block}, ctx_len - 1 = {ctx_len - 1}]"
        )
    if not 1 <= prefill_seq_len <= contract.max_positions(ctx_len):
        raise ValueError(f"prefill_seq_len {prefill_seq_len} must be in [1, ctx_len - 1]")


def target_io(
    module: ExportTarget,
    hidden_size: int,
    emit_logits: bool,
    sampling: bool,
    draft_q=(),
    token_bitmask: bool = False,
    verify_rule: str = contract.CHAIN,
) -> contract.TargetIO:
    """The contract of the program `module` exports to: its layers declare their state specs,
    which the contract records (and must give back whole)."""
    io = contract.TargetIO(
        **module.io_dims(),
        hidden_size=hidden_size,
        vocab_size=module.vocab_size,
        emit_logits=emit_logits,
        sampling=sampling,
        continuous_batching=module.continuous_batching,
        comp_ctx=module.comp_ctx,
        draft_q=tuple(draft_q),
        token_bitmask=token_bitmask,
        verify_rule=verify_rule,
        logprobs=module.logprobs,
        logprobs_mode=module.logprobs_mode,
        extended_sampling=module.extended,
    )
    if io.state != module.state_specs():  # a layer kind the contract's record cannot carry
        raise ValueError(f"the target contract cannot record these layers' state: {io.state}")
    return io


def program_options(
    hf_model: torch.nn.Module,
    prefill_seq_len: int,
    block_size: int,
    draft_q: tuple[int, ...],
    token_bitmask: bool,
) -> dict:
    """The module options a target needs beyond the common ones: the longest call (a sliding
    layer's ring, a hybrid's doubling levels); a hybrid's DeltaNet layers tell a prefill chunk
    from a verify call by its rows, and q-aware verification is not built for hybrids yet."""
    options = {"max_rows": max(prefill_seq_len, block_size)}
    options |= {"token_bitmask": True} if token_bitmask else {}
    if not families.for_hf(hf_model.config).hybrid:
        return options
    if prefill_seq_len <= block_size:
        raise ValueError(
            f"a hybrid target needs prefill_seq_len > block_size (the program tells a prefill "
            f"chunk from a verify call by its rows), got {prefill_seq_len} <= {block_size}"
        )
    if draft_q:
        raise ValueError("q-aware verification (draft_q) is not built for hybrid targets")
    return dict(block_size=block_size, **options)


def sampling_options(k: int, mode: str, extended: bool) -> dict:
    """The module options of --logprobs k and --extended-sampling (none when off, so the
    program is the one without)."""
    if not 0 <= k <= contract.MAX_LOGPROBS:
        raise ValueError(f"--logprobs must be in 0 … {contract.MAX_LOGPROBS} (got {k})")
    if mode not in contract.LOGPROBS_MODES:
        raise ValueError(f"--logprobs-mode must be one of {', '.join(contract.LOGPROBS_MODES)}")
    out = {"logprobs": k, "logprobs_mode": mode} if k else {}
    return out | ({"extended_sampling": True} if extended else {})


def extended_feed(io, b: int, rng) -> dict:
    """The extended sampling inputs of a check feed: every adjustment on, random history."""
    V, c = io.vocab_size, contract
    ids = lambda *shape: rng.integers(0, V, shape, dtype=np.int64)  # noqa: E731
    words = ids(b, c.MAX_BAD_WORDS, c.BAD_WORD_TOKENS)
    words[:, ::2, :2] = -1  # half of the words are two tokens long
    return {
        c.REPETITION_PENALTY: np.full((b,), 1.3, np.float32),
        c.PRESENCE_PENALTY: np.full((b,), 0.5, np.float32),
        c.FREQUENCY_PENALTY: np.full((b,), 0.2, np.float32),
        c.MIN_P: np.full((b,), 0.05, np.float32),
        c.GENERATED_FROM: np.zeros((b,), np.int64),
        c.OUTPUT_COUNTS: rng.integers(0, 3, (b, V)).astype(np.float32),
        c.PROMPT_TOKENS: rng.integers(-(2**31), 2**31, (b, c.bitmask_words(V))).astype(np.int32),
        c.STOP_ALLOWED_FROM: np.full((b,), 2, np.int64),
        c.MIN_TOKENS_STOP_IDS: ids(b, c.MAX_STOP_IDS),
        c.LOGIT_BIAS_IDS: ids(b, c.MAX_LOGIT_BIAS),
        c.LOGIT_BIAS: rng.uniform(-5, 5, (b, c.MAX_LOGIT_BIAS)).astype(np.float32),
        c.BAD_WORDS: words,
        c.OUTPUT_TAIL: ids(b, c.BAD_WORD_TOKENS - 1),
    }


def set_rule(module: ExportTarget, verify_rule: str, sampling: bool, token_bitmask: bool):
    """The program's verification rule (contract.py), the effective one for its sampling
    (block verification only decides sampled verifies); a rule the program does not support
    (`ExportTarget.unsupported`) is refused by name. Returns the rule."""
    rule = contract.rule(verify_rule).effective(sampling)
    why = module.unsupported(rule)
    if why is not None:
        raise ValueError(
            f"{rule.describe} is {why}; this target verifies by "
            f"{' or '.join(module.verify_rules)}: export without {rule.flag}"
        )
    if rule.takes_tree and token_bitmask:
        raise ValueError(
            "tree verification (--tree-budgets) with --structured-output is not built (a grammar "
            "state per tree node): export one or the other"
        )
    why = tree_refusal(module.logprobs, module.extended) if rule.takes_tree else None
    if why is not None:
        raise ValueError(why)
    module.rule = rule
    return rule


def export_target(
    hf_model: torch.nn.Module,
    fc_weight: torch.Tensor,
    hidden_norm_weight: torch.Tensor,
    hidden_norm_eps: float,
    target_layer_ids: Sequence[int],
    out_path: str | os.PathLike,
    *,
    ctx_len: int,
    prefill_seq_len: int,
    block_size: int,
    batch_size: int = 1,
    full_batch_size: int | None = None,
    comp_ctx_lengths: list[int] | None = None,
    verify_lengths: list[int] | None = None,
    emit_logits: bool = False,
    sampling: bool = True,
    sampling_candidates: int = SAMPLING_CANDIDATES,
    external_data: bool | None = None,
    fp16_check: bool = True,
    stream_from: ck.Pair | None = None,
    draft_q: tuple[int, ...] = (),
    token_bitmask: bool = False,
    verify_rule: str = contract.CHAIN,
    plan: contract.ShapePlan | None = None,
    logprobs: int = 0,
    logprobs_mode: str = contract.RAW_LOGPROBS,
    extended_sampling: bool = False,
) -> dict:
    """Export the target program to `out_path` and check it; returns facts for the manifest.

    stream_from: streaming export (exporter/weights.py): placeholder `hf_model`, weights from these.
    sampling: the program takes temperature / top_k / top_p / random_u and returns the lossless
    speculative-sampling choice; False: argmax only. sampling_candidates: the largest top_k
    (modeling.sampler.sampling_weights). fp16_check: the graph check's fp16 evaluations.
    full_batch_size (cache rows; None: off), comp_ctx_lengths, verify_lengths: contract.py;
    draft_q: (B − 1, k), q-aware verification of a DFlash-2 draft's q (not for a hybrid);
    token_bitmask, logprobs (top K), logprobs_mode, extended_sampling: docs/DESIGN.md sections.
    verify_rule: contract.BLOCK, block verification of sampled verifies (docs/DESIGN.md, Block
    verification; the program also returns num_accepted; not for a hybrid target);
    contract.TREE, tree verification (docs/DESIGN.md, Tree verification; plan.tree_budgets).
    plan: the export's shape plan (artifacts/preflight.py), made here from the sizes when None.
    """
    check_sizes(ctx_len, prefill_seq_len, block_size, min_block=1)
    options = program_options(hf_model, prefill_seq_len, block_size, draft_q, token_bitmask)
    module = ExportTarget.from_hf(
        hf_model,
        fc_weight,
        hidden_norm_weight,
        hidden_norm_eps,
        target_layer_ids,
        ctx_len=ctx_len,
        emit_logits=emit_logits,
        sampling=sampling,
        sampling_candidates=sampling_candidates,
        continuous_batching=full_batch_size is not None,
        **options,
        **sampling_options(logprobs, logprobs_mode, extended_sampling),
    ).eval()
    rule = set_rule(module, verify_rule, sampling, token_bitmask)
    cfg = hf_model.config
    io = target_io(
        module,
        cfg.get_text_config().hidden_size,
        emit_logits,
        sampling,
        draft_q if sampling else (),
        token_bitmask,
        rule.name,
    )
    if plan is None:
        sizes = (batch_size, full_batch_size, comp_ctx_lengths, verify_lengths, sampling)
        plan = _plan(block_size, prefill_seq_len, ctx_len, *sizes)
    path, specializations, report = _export(
        module, io, plan, out_path, stream_from, external_data, fp16_check
    )
    sizes = dict(block_size=block_size, prefill_seq_len=prefill_seq_len)
    sizes |= dict(comp_ctx_lengths=list(plan.windows), verify_lengths=list(plan.verify_lengths))
    facts = _module_facts(module, cfg, sampling, hidden_norm_eps)
    return {**program_facts(path, io, specializations, report), **sizes, **facts}


def _plan(B, prefill_seq_len, ctx_len, batch_size, full_batch_size, windows, verify, sampling):
    """The shape plan of these sizes, for a caller that gives none (default windows)."""
    windows = contract.windows_or_default(windows, ctx_len, prefill_seq_len, B)
    sizes = dict(batch_size=batch_size, full_batch_size=full_batch_size, windows=windows)
    return contract.shape_plan(
        B, prefill_seq_len, ctx_len, **sizes, verify_lengths=verify, sampling=sampling
    )


def _export(module, io, plan, out_path, stream_from, external_data, fp16_check):
    """Trace `module` at the prefill shape, at least 2 rows (no size-1 dim specialised away);
    streaming: at 2 rows (the same graph: every varying dim is symbolic; the tracer keeps
    intermediates). -> (path, specializations, graph report)."""
    specializations = contract.target_specializations(plan)
    sources = None
    if stream_from is not None:
        sources = weights.target_sources(weights.stream_ready(module), stream_from)
    path, report = export_and_check(
        module,
        io,
        specializations,
        lambda specs: check_feeds(io, specs),
        out_path,
        check_specs=contract.target_specializations(plan.longest()),
        trace_rows=2 if stream_from is not None else max(plan.prefill_seq_len, 2),
        external_data=external_data,
        sources=sources,
        fp16_check=fp16_check,
    )
    return path, specializations, report


def _module_facts(module: ExportTarget, cfg, sampling: bool, hidden_norm_eps: float) -> dict:
    return {
        "sampling": sampling,
        "sampling_candidates": module.sampling_candidates if sampling else None,
        "target_layer_ids": list(module.target_layer_ids),
        "model_type": cfg.model_type,
        "fc_scale": module.fc_scale,
        "hidden_norm_eps": float(hidden_norm_eps),
    }
