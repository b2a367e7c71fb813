"""Train a DFlash draft for a target directory, on CPU, in the published checkpoint format.

    python -m dflash_lab.train.draft --target DIR --corpus PATH... --out DIR
        [--block-size 16] [--draft-layers 1] [--target-layer-ids 1 3] [--steps N] [--seed S]
        [--resume] [--eval-prompts FILE]
    dflash-train-draft ...

Recipe (the DFlash paper's): the target is frozen. Training sequences are the target's *own*
continuations of prompts cut from the corpus, a mix of greedy and sampled ones (`--sampled-frac`;
generated once, cached in `OUT/train_state/sequences.pt`), so every label is what the target
itself would say at decode time, greedy or sampling. Each step draws sequences and random anchor positions p in the continuation; the block is
`[token at p, MASK × (B−1)]` at positions p … p+B−1 (MASK is the target's own embedding row
`mask_token_id`); the context is the fused target feature (`hidden_norm(fc(concat))` of the
target layers `target_layer_ids`; id j is Hugging Face's `hidden_states[j + 1]`) of every position
< p; block row j (1 … B−1) is trained to predict the token at p + j with cross-entropy weighted by
exp(−(j − 1)/γ). The draft's embedding and head are the target's, frozen and not saved.

`--form dflash2` trains a DFlash-2 draft (`DFlash2DraftModel`): the convs around attention and
MLP start as the identity, and the candidate selector's scores (with the true predecessor) are
trained against the target's own next-token distribution, so its q approaches p and a q-aware
verifier accepts more at T > 0 (docs/DESIGN.md, DFlash-2 drafts). `--init-from DIR` starts from a
trained draft of the same dimensions.

Many anchors of one sequence train in one forward: the block rows of all anchors are laid side by
side, and an attention mask lets each block see its own context prefix and its own rows only
(`multi_block_forward`, which computes exactly what `DFlashDraft.forward` computes per block).

`OUT/config.json` + `OUT/model.safetensors` (3 + 11·L tensors) are written at the end;
`OUT/train_state/` holds the sequence cache, the checkpoint (draft, optimizer, RNG state; written
atomically every `--save-every` steps), the log and a summary. `--resume` continues from the
checkpoint; the data of step s is drawn from a generator seeded with (seed, s), so a resumed run
equals an uninterrupted one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from dflash_lab.train.common import (
    DTYPES,
    THREADS_HELP,
    Log,
    adamw,
    atomic_save,
    atomic_write_text,
    load_state,
    lr_at,
    resume,
    save_safetensors_atomic,
    step_generator,
    torch_settings,
)
from dflash_qaic import checkpoints as ck
from dflash_qaic.modeling.draft import DFlashDraft
from dflash_qaic.modeling.layers import MASK_VALUE

# Settings that must match for --resume.
RESUME_KEYS = (
    "block_size",
    "draft_layers",
    "target_layer_ids",
    "mask_token_id",
    "intermediate_size",
    "steps",
    "seed",
    "batch_size",
    "anchors",
    "lr",
    "warmup",
    "weight_decay",
    "gamma",
    "threads",
    "data_key",
    "form",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "selector_weight",
    "init_from",
)


def default_gamma(block_size: int) -> float:
    """The paper's loss decay: γ = 7 for B = 16, 5 for B = 10, 4 for B = 8."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, 7.0 * block_size / 16)


# ---------------------------------------------------------------------------------------------
# Target side: tokens, the target's continuations, features


def load_tokenizer(target_dir: Path):
    """The target's own tokenizer, or None when the directory ships none."""
    if not any((target_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir, local_files_only=True)


def encode_docs(docs: list[tuple[str, str]], tokenizer, vocab_size: int) -> list[torch.Tensor]:
    """Token ids of every document: the target's tokenizer, else raw UTF-8 bytes."""
    out = []
    for _, text in docs:
        if tokenizer is not None:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = list(text.encode("utf-8"))
            if ids and max(ids) >= vocab_size:
                raise SystemExit(
                    f"the target has no tokenizer and a vocabulary of {vocab_size}: its corpus "
                    "must be bytes below that (ship a tokenizer with the target)"
                )
        out.append(torch.tensor(ids, dtype=torch.long))
    return out


@torch.no_grad()
def continue_target(
    model, prompts: torch.Tensor, n_new: int, temperature: float = 0.0, gen=None
) -> torch.Tensor:
    """[n, P] prompts (one length) -> [n, P + n_new]: the target's own continuation, not stopped
    at EOS (as `dflash_generate(..., stop_token_ids=None)` decodes). Greedy at temperature 0,
    else sampled from softmax(logits / temperature) with `gen`."""
    from transformers import DynamicCache

    def pick(logits: torch.Tensor) -> torch.Tensor:  # [n, V] -> [n]
        if temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=gen)[:, 0]

    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompts, past_key_values=cache, use_cache=True, logits_to_keep=1)
    new = [pick(out.logits[:, -1])]
    for _ in range(n_new - 1):
        out = model(input_ids=new[-1][:, None], past_key_values=cache, use_cache=True)
        new.append(pick(out.logits[:, -1]))
    return torch.cat([prompts, torch.stack(new, dim=1)], dim=1)


def greedy_continue(model, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """The target's greedy continuation (`continue_target` at temperature 0)."""
    return continue_target(model, prompts, n_new)


def make_sequences(model, doc_ids: list[torch.Tensor], a, gen: torch.Generator) -> list[dict]:
    """`a.num_seqs` training sequences: a prompt cut from a random document (chosen in proportion
    to its length) followed by `a.gen_len` target tokens. A generation batch is sampled at
    `a.sample_temperature` with probability `a.sampled_frac`, else greedy (the published drafts
    learn from the target's sampled responses; a greedy-only draft accepts little at T > 0).
    Prompts of one generation batch share a length (drawn from `a.prompt_len`), so no padding
    ever enters the target."""
    from tqdm import tqdm

    lengths = torch.tensor([len(d) for d in doc_ids], dtype=torch.float64)
    lo, hi = a.prompt_len
    seqs: list[dict] = []
    bar = tqdm(total=a.num_seqs, desc="target sequences", mininterval=2)
    while len(seqs) < a.num_seqs:
        n = min(a.gen_batch, a.num_seqs - len(seqs))
        plen = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        weights = torch.where(lengths >= plen, lengths, torch.zeros_like(lengths))
        if weights.sum() == 0:
            raise SystemExit(f"no corpus document has {plen} tokens; lower --prompt-len")
        docs = torch.multinomial(weights, n, replacement=True, generator=gen)
        room = lengths[docs] - plen + 1
        starts = (torch.rand(n, generator=gen, dtype=torch.float64) * room).long()
        prompts = torch.stack([doc_ids[d][s : s + plen] for d, s in zip(docs.tolist(), starts)])
        # the coin is drawn only when mixing, so a greedy-only run draws what it always drew
        sampled = a.sampled_frac > 0 and float(torch.rand(1, generator=gen)) < a.sampled_frac
        temperature = a.sample_temperature if sampled else 0.0
        for row in continue_target(model, prompts, a.gen_len, temperature, gen):
            seqs.append({"tokens": row.clone(), "prompt_len": plen, "sampled": sampled})
        bar.update(n)
    bar.close()
    return seqs


@torch.no_grad()
def target_features(model, tokens: torch.Tensor, layer_ids, probs: bool = False):
    """[b, L] -> concat of hidden_states[j + 1] for j in layer_ids: [b, L, k·H]; with `probs`
    also the target's next-token distribution at every position, softmax(logits) [b, L, V]."""
    out = model(input_ids=tokens, output_hidden_states=True)
    hs = out.hidden_states
    features = torch.cat([hs[j + 1] for j in layer_ids], dim=-1).float()
    return (features, out.logits.float().softmax(-1)) if probs else features


# ---------------------------------------------------------------------------------------------
# The draft side


def draft_config_dict(
    t: ck.TargetConfig,
    *,
    block_size: int,
    draft_layers: int,
    target_layer_ids: list[int],
    mask_token_id: int,
    intermediate_size: int,
    dtype: str,
    dflash2: dict | None = None,
) -> dict:
    """config.json of a DFlash draft for target `t`, in the published (z-lab) layout; with
    `dflash2` (conv_kernel_size, conv_group_size, selector_rank, selector_top_k) a
    `DFlash2DraftModel`, its four fields in `dflash_config` as published."""
    raw = t.raw
    cfg = {
        "architectures": ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": t.hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": draft_layers,
        "num_attention_heads": t.num_heads,
        "num_key_value_heads": t.num_kv_heads,
        "head_dim": t.head_dim,
        "vocab_size": t.vocab_size,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": t.rope_theta,
        "max_position_embeddings": int(raw.get("max_position_embeddings", 4096)),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "num_target_layers": t.num_layers,
        "block_size": block_size,
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "target_layer_ids": list(target_layer_ids),
            "block_size": block_size,
            **(dflash2 or {}),
        },
        "torch_dtype": dtype,
    }
    rp = raw.get("rope_parameters") or {}
    if rp.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
        cfg["rope_parameters"] = rp or None
        cfg["rope_scaling"] = raw.get("rope_scaling")
    return cfg


def init_draft(c: ck.DraftConfig, seed: int, std: float = 0.02) -> DFlashDraft:
    """A fresh draft: normal(0, std) matrices, unit norms (Hugging Face's Qwen3 init). DFlash-2:
    every conv starts as the identity (base kernel 1 at offset 0, no dynamic part), so a fresh
    DFlash-2 draft computes what a DFlash draft with the same layers computes; the codebooks
    start at normal(0, 1/√r), so the selector's pair scores start small but not zero."""
    draft = DFlashDraft(c)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("base_kernel"):  # [2, K, H]: the identity conv
                p.zero_()[:, 0] = 1.0
            elif name.endswith("kernel_projection.weight"):
                p.zero_()
            elif name.endswith("codebook.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * c.selector_rank**-0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return draft


def init_from(draft: DFlashDraft, source: Path) -> None:
    """Start `draft` from a trained draft of the same dimensions (a DFlash-2 draft from a DFlash
    one): every tensor of `source` must exist in `draft` with the same shape; the rest (the
    convs, the selector) keep `init_draft`'s values."""
    c = ck.read_draft_config(source)
    state = ck.load_draft_state(c)
    own = draft.state_dict()
    bad = {k: tuple(v.shape) for k, v in state.items() if k not in own or own[k].shape != v.shape}
    if bad:
        raise SystemExit(
            f"--init-from {source}: tensors {sorted(bad)} do not fit the draft being trained "
            "(same hidden size, layers, heads and intermediate size are needed)"
        )
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v.float())


def multi_block_forward(
    draft: DFlashDraft, ctx: torch.Tensor, block_emb: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """Many blocks against one context in one pass, through the draft's own layers.

    ctx [S, T, H]: fused features at positions 0 … T−1; anchors [S, A]: block start positions;
    block_emb [S, A·B, H]: the A blocks' embeddings side by side. Returns the normed block hidden
    [S, A·B, H]. Block a's rows attend to context positions < anchors[a] and to the rows of block
    a (bidirectionally), nothing else: per block, exactly `DFlashDraft.forward(ctx[:, :p],
    arange(p), block_emb_a, p + arange(B))` with p = anchors[a]. The S·A blocks are the batch of
    `DraftLayer` (the one attention of modeling/draft.py); each sees the context K/V of its own
    sequence, computed once per sequence, under an additive mask that hides positions ≥ p."""
    S, T, H = ctx.shape
    A = anchors.shape[1]
    B = block_emb.shape[1] // A
    block_pos = (anchors[:, :, None] + torch.arange(B)).reshape(S * A, B)
    ccos, csin = draft.rope(torch.arange(T)[None])  # [1, T, hd]
    cos, sin = draft.rope(block_pos)  # [S·A, B, hd]
    hidden = torch.arange(T)[None, :] >= anchors.reshape(S * A, 1)  # [S·A, T]
    ctx_mask = torch.where(hidden, MASK_VALUE, 0.0)[:, None, None, :]  # [S·A, 1, 1, T]
    h = block_emb.reshape(S * A, B, H)
    for layer in draft.layers:
        k, v = layer.self_attn.kv(ctx, ccos, csin)  # [S, n_kv, T, hd], no input_layernorm
        k, v = k.repeat_interleave(A, dim=0), v.repeat_interleave(A, dim=0)  # [S·A, …]
        h = layer(h, cos, sin, k, v, ctx_mask)
    return draft.norm(h).reshape(S, A * B, H)


def sample_batch(
    seqs: list[dict], n_anchors: int, batch_size: int, block_size: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Sequence indices, anchors in each continuation (p ∈ [prompt_len, len − 2], so at least one
    label), block token ids and labels (−100 past a sequence's end)."""
    idx = torch.randint(0, len(seqs), (batch_size,), generator=gen)
    lens = torch.tensor([seqs[i]["tokens"].numel() for i in idx.tolist()])
    plen = torch.tensor([seqs[i]["prompt_len"] for i in idx.tolist()])
    span = (lens - 1 - plen).clamp(min=1)  # number of anchor choices
    anchors = (
        plen[:, None] + (torch.rand(batch_size, n_anchors, generator=gen) * span[:, None]).long()
    )
    L = int(lens.max())
    tokens = torch.zeros(batch_size, L, dtype=torch.long)
    for r, i in enumerate(idx.tolist()):
        tokens[r, : lens[r]] = seqs[i]["tokens"]
    pos = anchors[:, :, None] + torch.arange(block_size)  # [S, A, B]
    labels = tokens.gather(1, pos.clamp(max=L - 1).view(batch_size, -1)).view(pos.shape)
    labels = torch.where(pos < lens[:, None, None], labels, -100)
    return {"idx": idx, "lens": lens, "tokens": tokens, "anchors": anchors, "labels": labels}


def block_loss(
    draft: DFlashDraft,
    ctx: torch.Tensor,
    batch: dict[str, torch.Tensor],
    embed_w: torch.Tensor,
    head_w: torch.Tensor,
    mask_token_id: int,
    weights: torch.Tensor,
    target_probs: torch.Tensor | None = None,
    selector_weight: float = 1.0,
) -> tuple[torch.Tensor, dict]:
    """Weighted cross-entropy of block rows 1 … B−1, plus the training acceptance estimate
    (1 + the number of leading rows whose argmax is right, averaged over blocks).

    DFlash-2 adds the selector's loss: row j's scores over the vocabulary, unary logit +
    ⟨pred(token j−1) · proj(h_j), succ(c)⟩ with the true predecessor (teacher forcing, as the
    verifier keeps a proposal only after accepting its predecessor), against the target's own
    distribution at that position (`target_probs` [S, A, B−1, V]: soft labels, so q learns p and
    q-aware sampling accepts Σ min(p, q)). Its estimates: `tau` of the selector's greedy path and
    `tau_t1`, 1 + Σ_k Π_{j≤k} Σ_c min(p_j, q_j) (T = 1, teacher-forced)."""
    labels = batch["labels"]  # [S, A, B]
    S, A, B = labels.shape
    block_ids = torch.full_like(labels, mask_token_id)
    block_ids[:, :, 0] = labels[:, :, 0]  # the anchor's own token (always valid)
    emb = draft.embed(block_ids.view(S, A * B), embed_w)
    h = multi_block_forward(draft, ctx, emb, batch["anchors"]).view(S, A, B, -1)[:, :, 1:]
    logits = draft.logits(h, head_w).float()  # [S, A, B−1, V]
    target = labels[:, :, 1:]
    valid = target >= 0
    w = weights.view(1, 1, -1) * valid

    def weighted(ce: torch.Tensor) -> torch.Tensor:  # ce [S·A·(B−1)]
        return (ce.view(S, A, B - 1) * w).sum() / w.sum()

    ce = F.cross_entropy(logits.flatten(0, 2), target.flatten().clamp(min=0), reduction="none")
    loss, chosen, stats = weighted(ce), logits, {}
    sel = draft.candidate_selector
    if sel is not None:
        prev = labels[:, :, :-1].clamp(min=0)  # [S, A, B−1]: row j's true predecessor
        query = sel.predecessor_codebook(prev) * sel.hidden_projection(h)  # [S, A, B−1, r]
        scores = logits + query @ sel.successor_codebook.weight.T  # [S, A, B−1, V]
        logq = scores.log_softmax(-1)
        p = target_probs.float()
        loss = loss + selector_weight * weighted(-(p * logq).sum(-1).flatten())
        chosen = scores
        with torch.no_grad():
            overlap = torch.minimum(p, logq.exp()).sum(-1) * valid  # [S, A, B−1]
            stats["tau_t1"] = (1 + overlap.cumprod(-1).sum(-1)).mean().item()
    with torch.no_grad():
        right = (chosen.argmax(-1) == target) & valid
        tau = 1 + right.long().cumprod(-1).sum(-1).float().mean()
        acc = right.sum() / valid.sum()
    return loss, {"tau": tau.item(), "acc": acc.item(), **stats}


# ---------------------------------------------------------------------------------------------
# Training


def _data_key(a, target_digest: str, corpus_digest: str) -> str:
    fields = [
        target_digest,
        corpus_digest,
        a.seed,
        a.num_seqs,
        a.prompt_len,
        a.gen_len,
        a.gen_batch,
        a.sampled_frac,
        a.sample_temperature,
    ]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]


class FeatureSource:
    """Target features of training sequences: all computed once and kept in memory when they fit
    in `budget_gb`, else computed per batch (the target is causal, so right-padding a batch
    leaves every real position's features unchanged). With `probs` (DFlash-2's selector) also
    the target's next-token distributions, kept as float16."""

    def __init__(self, model, seqs, layer_ids, budget_gb: float, group: int, probs: bool = False):
        self.model, self.seqs, self.layer_ids, self.probs = model, seqs, list(layer_ids), probs
        k_h = len(self.layer_ids) * model.config.hidden_size
        per_token = k_h * 4 + (model.config.vocab_size * 2 if probs else 0)
        need = sum(s["tokens"].numel() for s in seqs) * per_token / 1e9
        self.cache: list[torch.Tensor] | None = None
        self.prob_cache: list[torch.Tensor] = []
        if need <= budget_gb:
            from tqdm import tqdm

            self.cache = []
            i = 0
            bar = tqdm(total=len(seqs), desc=f"features ({need:.2f} GB)", mininterval=2)
            while i < len(seqs):  # runs of equal length, as generated
                j = i
                while (
                    j < len(seqs)
                    and j - i < group
                    and len(seqs[j]["tokens"]) == len(seqs[i]["tokens"])
                ):
                    j += 1
                toks = torch.stack([s["tokens"] for s in seqs[i:j]])
                got = target_features(model, toks, self.layer_ids, probs)
                if probs:
                    got, p = got
                    self.prob_cache.extend(p.half().unbind(0))
                self.cache.extend(got.unbind(0))
                bar.update(j - i)
                i = j
            bar.close()

    def __call__(self, batch: dict[str, torch.Tensor]):
        """Features [S, L, k·H] of the batch's sequences (with `probs`: and [S, L, V])."""
        if self.cache is None:
            return target_features(self.model, batch["tokens"], self.layer_ids, self.probs)
        S, L = batch["tokens"].shape
        out = torch.zeros(S, L, self.cache[0].shape[-1])
        probs = torch.zeros(S, L, self.prob_cache[0].shape[-1]) if self.probs else None
        for r, i in enumerate(batch["idx"].tolist()):
            f = self.cache[i]
            out[r, : f.shape[0]] = f
            if probs is not None:
                probs[r, : f.shape[0]] = self.prob_cache[i]
        return (out, probs) if self.probs else out


def block_probs(probs: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """probs [S, L, V] (the target's distribution of the token after each position), anchors
    [S, A] -> the distributions of block rows 1 … B−1, [S, A, B−1, V]: row j's token follows
    position anchor + j − 1."""
    S, L, V = probs.shape
    pos = (anchors[:, :, None] + torch.arange(block_size - 1)).clamp(max=L - 1)  # [S, A, B−1]
    return probs.gather(1, pos.view(S, -1, 1).expand(-1, -1, V)).view(*pos.shape, V)


def train(a: argparse.Namespace, stop_after: int | None = None) -> dict:
    """Run (or resume) training as `a` says; returns the summary."""
    with torch_settings(a.seed, a.threads):
        return _train(a, stop_after)


def _train(a: argparse.Namespace, stop_after: int | None) -> dict:
    t_start = time.time()
    out = Path(a.out)
    state_dir = Path(a.state_dir) if a.state_dir else out / "train_state"
    ckpt_path = state_dir / "checkpoint.pt"
    if not a.resume and ckpt_path.is_file():
        raise SystemExit(f"{ckpt_path} exists: pass --resume to continue it, or use a new --out")

    tdir = Path(a.target)
    t = ck.read_target_config(tdir)
    target = ck.load_target_model(t)
    for p in target.parameters():
        p.requires_grad_(False)
    tokenizer = load_tokenizer(tdir)
    cfg, c = _draft_config(a, t, tokenizer, state_dir)
    seqs, t_gen = _training_sequences(a, tdir, t, target, tokenizer, state_dir / "sequences.pt")
    dflash2 = a.form == "dflash2"
    features = FeatureSource(
        target, seqs, a.target_layer_ids, a.feature_cache_gb, a.gen_batch, probs=dflash2
    )

    draft = init_draft(c, a.seed)
    if a.init_from:
        init_from(draft, Path(a.init_from))
    draft.train()
    opt = adamw(draft, a.lr, a.weight_decay)
    settings = {k: getattr(a, k) for k in RESUME_KEYS}
    start, history, elapsed = 0, [], 0.0
    if a.resume and ckpt_path.is_file():
        start, history, elapsed = resume(ckpt_path, settings, draft, "draft", opt)

    embed_w = target.get_input_embeddings().weight.detach()  # [V, H]
    head_w = target.get_output_embeddings().weight.detach()  # [V, H]
    weights = torch.exp(-torch.arange(a.block_size - 1, dtype=torch.float32) / a.gamma)  # [B−1]
    log = Log(state_dir / "log.jsonl")
    n_params = sum(p.numel() for p in draft.parameters())
    if start == 0:
        log.write(
            event="start", params=n_params, sequences=len(seqs), gen_s=round(t_gen, 1), **settings
        )

    t0 = time.time()

    def checkpoint(step: int) -> None:
        state = {"step": step, "draft": draft.state_dict(), "optimizer": opt.state_dict()}
        _save_checkpoint(ckpt_path, state, history, elapsed + time.time() - t0, settings)

    def step_loss(step: int) -> tuple[torch.Tensor, dict]:  # the batch of `step`
        batch = sample_batch(
            seqs, a.anchors, a.batch_size, a.block_size, step_generator(a.seed, step)
        )
        got = features(batch)
        probs = None
        if dflash2:
            got, probs = got
            probs = block_probs(probs, batch["anchors"], a.block_size)  # [S, A, B−1, V]
        ctx = draft.fuse(got)  # [S, L, H]
        loss, stats = block_loss(
            draft, ctx, batch, embed_w, head_w, c.mask_token_id, weights, probs, a.selector_weight
        )
        return loss, stats

    end = a.steps if stop_after is None else min(a.steps, stop_after)
    _run_steps(a, start, end, draft, opt, step_loss, history, log, checkpoint)
    checkpoint(end)
    elapsed += time.time() - t0
    if end < a.steps:
        print(f"stopped at step {end}; continue with --resume", file=sys.stderr)
        return {"step": end, "history": history}

    save_draft(draft, cfg, out, DTYPES[a.dtype])
    summary = _summary(a, history, n_params, len(seqs), elapsed, t_start, t_gen, settings)
    if a.eval_prompts:
        summary["eval"] = _eval_tau(a, tdir, out)
    atomic_write_text(state_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    log.write(event="done", **{k: v for k, v in summary.items() if k != "settings"})
    print(json.dumps({k: v for k, v in summary.items() if k not in ("settings",)}))
    summary["history"] = history
    return summary


def _draft_config(a: argparse.Namespace, t: ck.TargetConfig, tokenizer, state_dir: Path):
    """Fills the draft defaults into `a` (layer ids, mask token, intermediate size, γ), writes the
    draft's config.json into the state dir and reads it back, so the draft is built from exactly
    the config.json that ships with it. Returns (the config dict, the parsed DraftConfig)."""
    layer_ids = a.target_layer_ids or ck.default_target_layer_ids(t.num_layers, a.draft_layers)
    if a.mask_token_id is None:
        mid = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
        a.mask_token_id = int(mid) if mid is not None else t.vocab_size - 1
    a.target_layer_ids = [int(i) for i in layer_ids]
    a.intermediate_size = a.intermediate_size or int(t.raw.get("intermediate_size"))
    a.gamma = a.gamma or default_gamma(a.block_size)

    cfg = draft_config_dict(
        t,
        block_size=a.block_size,
        draft_layers=a.draft_layers,
        target_layer_ids=a.target_layer_ids,
        mask_token_id=a.mask_token_id,
        intermediate_size=a.intermediate_size,
        dtype=a.dtype,
        dflash2={k: getattr(a, k) for k in ck.DRAFT2_FIELDS} if a.form == "dflash2" else None,
    )
    atomic_write_text(state_dir / "config.json", json.dumps(cfg, indent=2) + "\n")
    c = ck.read_draft_config(state_dir)
    ck.validate_pair(t, c)
    return cfg, c


def _training_sequences(
    a: argparse.Namespace, tdir: Path, t: ck.TargetConfig, target, tokenizer, seq_path: Path
) -> tuple[list[dict], float]:
    """The target's own continuations (greedy and sampled) of corpus prompts, generated once and
    cached in `seq_path`; sets `a.data_key`. Returns (sequences, generation seconds; 0 if read
    from the cache)."""
    from dflash_lab.train.corpus import corpus_digest, read_corpus

    docs = read_corpus(a.corpus, a.glob)
    a.data_key = _data_key(a, ck.file_digest(tdir), corpus_digest(docs))
    # The sequence cache is only read to resume (a fresh run regenerates it), and only as tensors
    # and plain containers: a planted file can neither run code nor replace the data unasked.
    cached = None
    if a.resume and seq_path.is_file():
        cached = load_state(seq_path)
    if cached is not None and cached.get("key") == a.data_key:
        return cached["seqs"], 0.0
    if cached is not None:
        print(f"{seq_path} was made for other data; regenerating", file=sys.stderr)
    t0 = time.time()
    doc_ids = encode_docs(docs, tokenizer, t.vocab_size)
    seqs = make_sequences(target, doc_ids, a, torch.Generator().manual_seed(a.seed))
    t_gen = time.time() - t0
    atomic_save({"key": a.data_key, "seqs": seqs, "seconds": t_gen}, seq_path)
    return seqs, t_gen


def _save_checkpoint(
    path: Path, state: dict, history: list, elapsed: float, settings: dict
) -> None:
    """`state` (step, weights, optimizer) + the global RNG state, history, elapsed training
    seconds and settings, written atomically."""
    rest = {"rng": torch.get_rng_state(), "history": history, "elapsed": elapsed}
    atomic_save({**state, **rest, "settings": settings}, path)


def _run_steps(
    a: argparse.Namespace,
    start: int,
    end: int,
    draft: DFlashDraft,
    opt: torch.optim.Optimizer,
    step_loss,
    history: list,
    log: Log,
    checkpoint,
) -> None:
    """Steps start … end−1, each: the scheduled lr, `step_loss(step)` -> (loss, τ), backward,
    clip, AdamW. Appends (loss, τ) to `history`, logs the means of the last 20 every 20 steps,
    checkpoints every `a.save_every` steps before `end` (the caller checkpoints `end`)."""
    from tqdm import tqdm

    bar = tqdm(range(start, end), initial=start, total=a.steps, desc="draft", mininterval=2)
    for step in bar:
        lr = lr_at(step, a.steps, a.lr, a.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, stats = step_loss(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        # (loss, τ) and, for DFlash-2, the teacher-forced T = 1 estimate
        history.append(
            (loss.item(), stats["tau"], *([stats["tau_t1"]] if "tau_t1" in stats else []))
        )
        means = _means(history[-20:])
        shown = dict(loss=f"{means[0]:.3f}", tau=f"{means[1]:.2f}", lr=f"{lr:.1e}")
        extra = {"tau_t1_train": round(means[2], 3)} if len(means) > 2 else {}
        bar.set_postfix(shown | {k: f"{v:.2f}" for k, v in extra.items()})
        if (step + 1) % 20 == 0:
            log.write(
                step=step + 1, loss=round(means[0], 4), tau_train=round(means[1], 3), lr=lr, **extra
            )
        if (step + 1) % a.save_every == 0 and step + 1 < end:
            checkpoint(step + 1)
    bar.close()


def _means(rows: list) -> list[float]:
    """Column means of history rows (loss, τ[, τ at T = 1])."""
    return [sum(col) / len(col) for col in zip(*rows)]


def _summary(
    a: argparse.Namespace,
    history: list,
    n_params: int,
    n_seqs: int,
    elapsed: float,
    t_start: float,
    t_gen: float,
    settings: dict,
) -> dict:
    """The run summary: final loss and training τ (means of the last 50 steps), timings."""
    means = _means(history[-50:])
    return {
        "steps": a.steps,
        "params": n_params,
        "sequences": n_seqs,
        "final_loss": round(means[0], 4),
        "final_tau_train": round(means[1], 3),
        **({"final_tau_t1_train": round(means[2], 3)} if len(means) > 2 else {}),
        "train_wall_time_s": round(elapsed, 1),
        "run_wall_time_s": round(time.time() - t_start, 1),
        "generation_s": round(t_gen, 1),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "settings": settings,
    }


def _eval_tau(a: argparse.Namespace, tdir: Path, out: Path) -> dict:
    """τ of the saved draft on `a.eval_prompts` (mean, pooled, per prompt)."""
    from dflash_lab.train.tau import measure_tau, read_prompts

    prompts, keys = read_prompts(a.eval_prompts), ("mean_tau", "pooled_tau", "per_prompt_tau")
    res = measure_tau(tdir, out, prompts, max_new_tokens=a.eval_max_new_tokens)
    got = {k: res[k] for k in keys}
    if a.form == "dflash2":  # its sampled path is verified q-aware: τ at T = 1 too
        res = measure_tau(tdir, out, prompts, a.eval_max_new_tokens, temperature=1.0, seed=a.seed)
        got["t1"] = {k: res[k] for k in keys}
    return got


def save_draft(draft: DFlashDraft, cfg: dict, out: Path, dtype: torch.dtype) -> None:
    """config.json + model.safetensors (the 3 + 11·L tensors; DFlash-2: + 4·L + 3), each written
    atomically."""
    out.mkdir(parents=True, exist_ok=True)
    # the selector's codebooks are published without `.weight` (checkpoints.SELECTOR_KEYS)
    name = lambda k: k.removesuffix(".weight") if "codebook" in k else k  # noqa: E731
    state = {name(k): v.detach().to(dtype) for k, v in draft.state_dict().items()}
    save_safetensors_atomic(state, out / "model.safetensors")
    atomic_write_text(out / "config.json", json.dumps(cfg, indent=2) + "\n")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash_lab.train.draft",
        description="Train a DFlash draft for a target directory (CPU).",
    )
    p.add_argument("--target", required=True, help="Hugging Face target directory (frozen)")
    p.add_argument("--corpus", nargs="+", default=["stdlib"], help="stdlib | files | dirs")
    p.add_argument("--glob", default="*.py", help="files taken from corpus directories")
    p.add_argument("--out", required=True, help="draft directory to write")
    p.add_argument("--state-dir", default=None, help="default OUT/train_state")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=None)
    p.add_argument("--mask-token-id", type=int, default=None, help="default: tokenizer's mask")
    p.add_argument("--intermediate-size", type=int, default=None, help="default: target's")
    p.add_argument(
        "--form",
        choices=["dflash", "dflash2"],
        default="dflash",
        help="dflash2: a DFlash2DraftModel (a dynamic causal conv around attention and MLP in "
        "every layer, and a candidate selector trained on the target's own distributions)",
    )
    p.add_argument("--conv-kernel-size", type=int, default=4, help="dflash2: conv kernel K")
    p.add_argument("--conv-group-size", type=int, default=32, help="dflash2: channels per group")
    p.add_argument("--selector-rank", type=int, default=32, help="dflash2: codebook rank r")
    p.add_argument("--selector-top-k", type=int, default=16, help="dflash2: candidates per row")
    p.add_argument("--selector-weight", type=float, default=1.0, help="dflash2: selector loss")
    p.add_argument(
        "--init-from",
        default=None,
        help="start from this trained draft's tensors (same dimensions; e.g. a DFlash-2 draft "
        "from the DFlash one: its convs start as the identity, the selector fresh)",
    )
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--anchors", type=int, default=32, help="anchors (blocks) per sequence")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--gamma", type=float, default=None, help="loss decay; default 7 at B=16")
    p.add_argument("--num-seqs", type=int, default=2048, help="target-generated sequences")
    p.add_argument(
        "--sampled-frac",
        type=float,
        default=0.0,
        help="share of generation batches sampled (the rest greedy); default 0 = greedy only",
    )
    p.add_argument("--sample-temperature", type=float, default=1.0)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 320], metavar=("MIN", "MAX"))
    p.add_argument("--gen-len", type=int, default=192, help="target tokens per sequence")
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--feature-cache-gb", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=1, help=THREADS_HELP)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16", help="saved weights")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    p.add_argument("--stop-after", type=int, default=None, help="checkpoint and stop at this step")
    p.add_argument("--eval-prompts", default=None, help="JSONL prompts: measure τ at the end")
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    return p


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    if a.gen_len < 2 or a.block_size < 2:
        raise SystemExit("--gen-len and --block-size must be at least 2")
    if not 0.0 <= a.sampled_frac <= 1.0 or a.sample_temperature <= 0:
        raise SystemExit("--sampled-frac must be in [0, 1] and --sample-temperature above 0")
    train(a, stop_after=a.stop_after)


if __name__ == "__main__":
    main()


__all__ = [
    "default_gamma",
    "draft_config_dict",
    "continue_target",
    "greedy_continue",
    "multi_block_forward",
    "sample_batch",
    "target_features",
    "train",
]
