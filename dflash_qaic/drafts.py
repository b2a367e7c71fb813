"""The draft checkpoint (docs/DESIGN.md, DFlash-2 drafts, Sliding drafts): a DFlash (b16) draft,
a DFlash-2 draft, either with sliding-window layers. Its config.json (`read_draft_config`) and its
tensor layout (`check_draft_tensors`); the draft borrows the target's embedding and head, so the
pair is checked in dflash_qaic/checkpoints.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash_qaic.checkpoint_files.config import (
    BOOLEAN,
    DECODER_FIELDS,
    LAYER_IDS,
    NUMBER,
    POSITIVE_INT,
    STRING,
    STRINGS,
    TOKEN_ID,
    CheckpointError,
    check_field_types,
    positive,
    read_config,
    rope_theta,
)
from dflash_qaic.checkpoint_files.safetensors import TensorInfo, check_layout, checkpoint_tensors

DRAFT_ARCH = "DFlashDraftModel"
# Per-layer tensors of a DFlash (b16) draft: 11 per layer, plus fc, hidden_norm and norm.
DRAFT_LAYER_KEYS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
DRAFT_TOP_KEYS = ("fc.weight", "hidden_norm.weight", "norm.weight")
# DFlash-2 drafts (docs/DESIGN.md, DFlash-2 drafts): a dynamic causal conv around attention and
# around the MLP of every layer, and a candidate selector. Its three tensors are stored without
# a `.weight` suffix in published checkpoints; they are read under the module names below.
DRAFT2_ARCH = "DFlash2DraftModel"
DRAFT2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
SELECTOR_KEYS = tuple(
    f"candidate_selector.{n}.weight"
    for n in ("hidden_projection", "predecessor_codebook", "successor_codebook")
)

# DFlash fields: in `dflash_config` in newer drafts, at top level in older ones (both checked)
_DFLASH_FIELDS = {
    "target_layer_ids": LAYER_IDS,
    "mask_token_id": TOKEN_ID,
    "block_size": POSITIVE_INT,
    "input_embedding_scale": NUMBER,
    "output_multiplier": NUMBER,
    "final_logit_softcapping": NUMBER,
    **dict.fromkeys(("conv_kernel_size", "conv_group_size"), POSITIVE_INT),  # DFlash-2
    **dict.fromkeys(("selector_rank", "selector_top_k"), POSITIVE_INT),
    # draft knobs of published drafts (docs/DESIGN.md, Draft knobs)
    "attention_sink_bias": BOOLEAN,
    "draft_vocab_size": POSITIVE_INT,
    "mask_embedding": STRING,
    "use_swa": BOOLEAN,  # every layer sliding (vLLM's reading; MiMo drafts)
    "swa_window_size": POSITIVE_INT,
    "causal": BOOLEAN,  # causality of every layer, below a top-level `is_causal`
}
DRAFT_FIELDS = (
    DECODER_FIELDS
    | {"num_target_layers": POSITIVE_INT, "is_causal": BOOLEAN}
    | {"is_neox_style": BOOLEAN, "add_swa_attention_sink_bias": BOOLEAN}
    | _DFLASH_FIELDS
    | {"dflash_config": _DFLASH_FIELDS}
)
# A reduced draft vocabulary's map (`d2t`: target id = draft id + d2t[draft id]) and its inverse
# (`t2d`, a mask over the target vocabulary, unused: the map alone defines the draft's tokens).
VOCAB_MAP_KEYS = ("d2t", "t2d")
# The separate mask embedding's default file names, as published (a tensor [H] or a dict with
# `embedding` and `mask_token_id`), when `dflash_config.mask_embedding` names none.
MASK_EMBEDDING_FILES = ("mask_embedding.pt", "mask_embedding.safetensors")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published default: one draft layer -> middle layer; else spread over 1 … L−3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DraftConfig:
    path: Path
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int | None
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # per layer "full_attention" | "sliding_attention" (empty: every layer full, the b16 form)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # keys a sliding layer's query sees (itself included)
    is_causal: bool | None = None  # None: causal in the block exactly in the sliding layers
    # DFlash-2 (None: a DFlash draft): conv kernel K and group size G, selector rank r and top-k
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    attention_bias: bool = False  # q/k/v/o biases (drafts for gpt-oss / Gemma 4 targets)
    # docs/DESIGN.md, Draft knobs: a learned per-head sink logit in every layer's softmax
    attention_sink_bias: bool = False
    # a reduced draft vocabulary: the draft's own `lm_head` [draft_vocab_size, H] and its `d2t`
    # map (target id = d + d2t[d]); None: the target's head and vocabulary
    draft_vocab_size: int | None = None
    mask_embedding_file: Path | None = None  # replaces embed[mask_token_id] in the block
    is_neox_style: bool = True  # False: RoPE rotates interleaved pairs (2i, 2i + 1)
    raw: dict = field(default=None, repr=False, compare=False)

    def layer_attention(self, i: int) -> tuple[bool, int | None]:
        """(causal inside the block, window) of draft layer i, as the reference decides them: a
        sliding layer sees a key iff query_pos − key_pos < window (and, not causal, also
        key_pos − query_pos < window); `is_causal`, when set, applies to every layer."""
        sliding = bool(self.layer_types) and self.layer_types[i] == "sliding_attention"
        causal = sliding if self.is_causal is None else self.is_causal
        return causal, (self.sliding_window if sliding else None)

    @property
    def dflash2(self) -> bool:
        """A DFlash-2 draft: convs in every layer and a candidate selector."""
        return self.conv_kernel_size is not None


def _dflash_value(cfg: dict, key: str, default=None):
    """DFlash fields live in `dflash_config` in newer checkpoints and at top level in older ones."""
    return (cfg.get("dflash_config") or {}).get(key, cfg.get(key, default))


def read_draft_config(directory: str | Path) -> DraftConfig:
    d = Path(directory)
    cfg = read_config(d, "draft")
    cpath = d / "config.json"
    check_field_types(cfg, {"architectures": STRINGS}, cpath)
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in (DRAFT_ARCH, DRAFT2_ARCH):
        raise CheckpointError(
            f"{cpath}: `architectures` is {cfg.get('architectures')}, expected [{DRAFT_ARCH!r}] "
            f"or [{DRAFT2_ARCH!r}] (a DFlash draft checkpoint in the published z-lab format)"
        )
    check_field_types(cfg, DRAFT_FIELDS, cpath)
    heads = positive(cfg, "num_attention_heads", cpath)
    hidden = positive(cfg, "hidden_size", cpath)
    n_layers = positive(cfg, "num_hidden_layers", cpath)
    n_target = positive(cfg, "num_target_layers", cpath)
    layer_ids = _dflash_value(cfg, "target_layer_ids")
    if layer_ids is None:
        layer_ids = default_target_layer_ids(n_target, n_layers)
    mask_id = _dflash_value(cfg, "mask_token_id")
    if mask_id is None:
        raise CheckpointError(f"{cpath}: field `dflash_config.mask_token_id` is missing")
    block = _dflash_value(cfg, "block_size")
    if block is None:
        raise CheckpointError(
            f"{cpath}: field `block_size` is missing (top level or in `dflash_config`)"
        )
    inner = (cfg.get("dflash_config") or {}).get("block_size")
    if inner is not None and cfg.get("block_size") is not None and inner != cfg["block_size"]:
        raise CheckpointError(
            f"{cpath}: `block_size` is {cfg['block_size']} but `dflash_config.block_size` is "
            f"{inner}; the draft was trained with one block size: keep one of them"
        )
    layer_types, window, causal = _draft_attention(cfg, cpath, n_layers)
    softcap = _dflash_value(cfg, "final_logit_softcapping")
    dflash2 = _dflash2_fields(cfg, cpath, hidden) if arch == DRAFT2_ARCH else {}
    knobs = _draft_knobs(cfg, d, arch)
    return DraftConfig(
        path=d,
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=positive(cfg, "num_key_value_heads", cpath, heads),
        head_dim=positive(cfg, "head_dim", cpath, hidden // heads or 1),
        intermediate_size=positive(cfg, "intermediate_size", cpath),
        vocab_size=cfg.get("vocab_size"),
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        rope_theta=rope_theta(cfg),
        block_size=block,
        target_layer_ids=tuple(layer_ids),
        mask_token_id=mask_id,
        num_target_layers=n_target,
        input_embedding_scale=float(_dflash_value(cfg, "input_embedding_scale", 1.0)),
        output_multiplier=float(_dflash_value(cfg, "output_multiplier", 1.0)),
        final_logit_softcapping=None if softcap in (None, 0) else float(softcap),
        layer_types=layer_types,
        sliding_window=window,
        is_causal=causal,
        **dflash2,
        attention_bias=bool(cfg.get("attention_bias", False)),
        **knobs,
        raw=cfg,
    )


def _draft_knobs(cfg: dict, d: Path, arch: str) -> dict:
    """The draft knobs read as the reference readers read them (docs/DESIGN.md, Draft knobs):
    the sink flag in `dflash_config.attention_sink_bias` (top level: `attention_sink_bias` or
    `add_swa_attention_sink_bias`), `draft_vocab_size` (equal to `vocab_size`: no reduction),
    the mask embedding file (`dflash_config.mask_embedding`, else a default file name present),
    `is_neox_style` at the top level (absent: true)."""
    cpath = d / "config.json"
    sink = _dflash_value(cfg, "attention_sink_bias")
    if sink is None:
        sink = cfg.get("add_swa_attention_sink_bias", False)
    vocab = cfg.get("vocab_size")
    dv = _dflash_value(cfg, "draft_vocab_size")
    if dv is not None and dv == vocab:
        dv = None  # the full vocabulary: no map
    if dv is not None:
        if not isinstance(vocab, int) or isinstance(vocab, bool) or dv > vocab:
            raise CheckpointError(
                f"{cpath}: `draft_vocab_size` {dv} needs `vocab_size` (the target's vocabulary, "
                f"which its `d2t` map points into) of at least that, got {vocab!r}"
            )
        if arch == DRAFT2_ARCH:
            raise CheckpointError(
                f"{cpath}: `draft_vocab_size` with a {DRAFT2_ARCH} (a candidate selector over a "
                "reduced vocabulary) is not supported; export a draft without it"
            )
    named = _dflash_value(cfg, "mask_embedding")
    if named is not None:
        mask_file = d / named
        if not mask_file.is_file():
            raise CheckpointError(
                f"{cpath}: `mask_embedding` names {named!r}, which is not a file of {d}; "
                "download the draft's complete directory"
            )
    else:
        found = [d / n for n in MASK_EMBEDDING_FILES if (d / n).is_file()]
        if len(found) > 1:
            raise CheckpointError(
                f"{d}: both {found[0].name} and {found[1].name} are present; keep the one the "
                "draft was trained with"
            )
        mask_file = found[0] if found else None
    return {
        "attention_sink_bias": bool(sink),
        "draft_vocab_size": dv,
        "mask_embedding_file": mask_file,
        "is_neox_style": cfg.get("is_neox_style", True) is not False,
    }


def read_vocab_map(c: DraftConfig):
    """A reduced-vocabulary draft's target id of every draft id, d + d2t[d] ([draft_vocab_size]
    int64), checked to name distinct ids of the target's vocabulary; None without one."""
    if c.draft_vocab_size is None:
        return None
    import torch
    from safetensors import safe_open

    info = checkpoint_tensors(c.path, "draft").get("d2t")
    if info is None:
        raise CheckpointError(f"{c.path}: a draft with `draft_vocab_size` needs its `d2t` tensor")
    with safe_open(str(info.file), "pt") as f:
        d2t = f.get_tensor("d2t")
    if d2t.is_floating_point() or list(d2t.shape) != [c.draft_vocab_size]:
        raise CheckpointError(
            f"{info.file}: `d2t` must be integers of shape [{c.draft_vocab_size}] "
            f"(draft_vocab_size), got {d2t.dtype} {list(d2t.shape)}"
        )
    ids = torch.arange(c.draft_vocab_size) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size or ids.unique().numel() != ids.numel():
        raise CheckpointError(
            f"{info.file}: `d2t` maps draft ids to target ids d + d2t[d] outside 0 … "
            f"{c.vocab_size - 1} or not distinct; this map is not for this draft's vocabulary"
        )
    return ids


def read_mask_embedding(c: DraftConfig):
    """The separate mask embedding [H] (fp32), or None: a tensor, or a dict of `embedding` and
    `mask_token_id` (which must be the config's), in a .pt file (read with weights_only) or a
    .safetensors file of one tensor."""
    if c.mask_embedding_file is None:
        return None
    import torch

    f = c.mask_embedding_file
    try:
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(f))
            state = state.get("embedding", next(iter(state.values()), None))
        else:
            state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # a pickle or header error of any kind: name the file
        raise CheckpointError(f"{f}: not a readable mask embedding ({e})") from e
    if isinstance(state, dict):
        if state.get("mask_token_id", c.mask_token_id) != c.mask_token_id:
            raise CheckpointError(
                f"{f}: its `mask_token_id` {state['mask_token_id']} is not the config's "
                f"dflash_config.mask_token_id {c.mask_token_id}"
            )
        state = state.get("embedding")
    if not isinstance(state, torch.Tensor) or state.numel() != c.hidden_size:
        raise CheckpointError(
            f"{f}: expected one embedding row of {c.hidden_size} values (hidden_size), got "
            f"{getattr(state, 'shape', type(state).__name__)}"
        )
    return state.reshape(-1).float()


def _dflash2_fields(cfg: dict, cpath: Path, hidden: int) -> dict:
    """The four DFlash-2 fields (top level or in `dflash_config`, as the reference reads them)."""
    out = {}
    for key in DRAFT2_FIELDS:
        v = _dflash_value(cfg, key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise CheckpointError(
                f"{cpath}: a {DRAFT2_ARCH} needs a positive integer `{key}` (top level or in "
                f"`dflash_config`), got {v!r}"
            )
        out[key] = v
    if hidden % out["conv_group_size"]:
        raise CheckpointError(
            f"{cpath}: `conv_group_size` {out['conv_group_size']} does not divide `hidden_size` "
            f"{hidden}; the conv's channels are split into groups of that size"
        )
    vocab = cfg.get("vocab_size")
    if not isinstance(vocab, int) or not 1 <= out["selector_top_k"] <= vocab:
        raise CheckpointError(
            f"{cpath}: a {DRAFT2_ARCH} needs `vocab_size` (its codebooks have one row per token) "
            f"and `selector_top_k` ({out['selector_top_k']}) at most that, got {vocab!r}"
        )
    return out


DRAFT_LAYER_TYPES = ("full_attention", "sliding_attention")


def _draft_attention(cfg: dict, cpath: Path, n_layers: int):
    """`layer_types`, `sliding_window` and `is_causal` of a draft config (top level, where the
    reference reads them; then, as vLLM reads them, `dflash_config.use_swa` making every layer
    sliding, `dflash_config.swa_window_size` its window and `dflash_config.causal` below
    `is_causal`), checked. A sliding layer's window is `sliding_window` as written:
    Hugging Face's Qwen3Config drops it unless `use_sliding_window` is true, so the reference
    run through transformers agrees only with configs that set it (docs/DESIGN.md, Sliding drafts)."""
    types = cfg.get("layer_types") or ()
    if types and (
        not isinstance(types, list) or len(types) != n_layers or set(types) - set(DRAFT_LAYER_TYPES)
    ):
        raise CheckpointError(
            f"{cpath}: `layer_types` must list one of {list(DRAFT_LAYER_TYPES)} per draft layer "
            f"({n_layers}), got {types!r}"
        )
    dc = cfg.get("dflash_config") or {}
    if dc.get("use_swa") and "sliding_attention" not in types:  # every layer slides
        types = ["sliding_attention"] * n_layers
    types = tuple(types) if "sliding_attention" in types else ()
    window = dc.get("swa_window_size", cfg.get("sliding_window")) if types else None
    if types and (not isinstance(window, int) or isinstance(window, bool) or window < 2):
        raise CheckpointError(
            f"{cpath}: `sliding_attention` layers need an integer `sliding_window` of at least 2 "
            f"(the keys a query sees, itself included), got {window!r}"
        )
    causal = cfg.get("is_causal")
    if causal is None:
        causal = dc.get("causal")
    if causal is not None and not isinstance(causal, bool):
        raise CheckpointError(f"{cpath}: `is_causal` must be true, false or absent, got {causal!r}")
    return types, window, causal


def expected_draft_shapes(c: DraftConfig) -> dict[str, list[int]]:
    H, hd = c.hidden_size, c.head_dim
    k = len(c.target_layer_ids)
    shapes = {"fc.weight": [H, k * H], "hidden_norm.weight": [H], "norm.weight": [H]}
    per_layer = {
        "self_attn.q_proj.weight": [c.num_heads * hd, H],
        "self_attn.k_proj.weight": [c.num_kv_heads * hd, H],
        "self_attn.v_proj.weight": [c.num_kv_heads * hd, H],
        "self_attn.o_proj.weight": [H, c.num_heads * hd],
        "self_attn.q_norm.weight": [hd],
        "self_attn.k_norm.weight": [hd],
        "mlp.gate_proj.weight": [c.intermediate_size, H],
        "mlp.up_proj.weight": [c.intermediate_size, H],
        "mlp.down_proj.weight": [H, c.intermediate_size],
        "input_layernorm.weight": [H],
        "post_attention_layernorm.weight": [H],
    }
    if c.dflash2:
        K, G, r = c.conv_kernel_size, c.conv_group_size, c.selector_rank
        for conv in ("attention_conv", "mlp_conv"):
            per_layer[f"{conv}.base_kernel"] = [2, K, H]
            per_layer[f"{conv}.kernel_projection.weight"] = [2 * K * (H // G), H]
        shapes[SELECTOR_KEYS[0]] = [r, H]
        shapes[SELECTOR_KEYS[1]] = shapes[SELECTOR_KEYS[2]] = [int(c.vocab_size), r]
    if c.attention_bias:
        q, kv = c.num_heads * hd, c.num_kv_heads * hd
        per_layer |= {f"self_attn.{p}_proj.bias": [n] for p, n in zip("qkvo", (q, kv, kv, H))}
    if c.attention_sink_bias:
        per_layer["self_attn.attention_sink_bias"] = [c.num_heads]
    if c.draft_vocab_size is not None:
        shapes["lm_head.weight"] = [c.draft_vocab_size, H]
        shapes["d2t"] = [c.draft_vocab_size]
    for i in range(c.num_layers):
        shapes.update({f"layers.{i}.{name}": s for name, s in per_layer.items()})
    return shapes


def draft_tensor_names(names, where) -> dict[str, str]:
    """Checkpoint key -> the name the draft's modules use: the selector's tensors are published
    without `.weight` (`candidate_selector.predecessor_codebook`); both spellings are read, one
    tensor may not appear under both."""
    out = {}
    for name in names:
        canon = name + ".weight" if name + ".weight" in SELECTOR_KEYS else name
        if canon in out.values():
            raise CheckpointError(
                f"{where}: tensor `{canon}` appears both with and without `.weight`; keep one"
            )
        out[name] = canon
    return out


def check_draft_tensors(c: DraftConfig) -> dict[str, TensorInfo]:
    """The 3 + 11·L tensor layout (DFlash-2: + 4 per layer + 3), exactly: unknown keys mean an
    unsupported draft. Returns the tensors, under the modules' names (`draft_tensor_names`)."""
    tensors = checkpoint_tensors(c.path, "draft")
    files = {i.file for i in tensors.values()}
    where = next(iter(files)) if len(files) == 1 else c.path
    names = draft_tensor_names(tensors, where)
    tensors = {names[k]: v for k, v in tensors.items()}
    arch = DRAFT2_ARCH if c.dflash2 else DRAFT_ARCH
    hint = f"this is not a {arch} with {c.num_layers} layers as its config.json describes"
    if not c.dflash2:
        hint += " (a DFlash-2 checkpoint with attention_conv / candidate_selector says so in "
        hint += f"`architectures`: [{DRAFT2_ARCH!r}])"
    shapes = {k: list(v.shape) for k, v in tensors.items()}
    expected = expected_draft_shapes(c)
    if c.draft_vocab_size is not None and "t2d" in shapes:  # unused (VOCAB_MAP_KEYS)
        expected["t2d"] = [int(c.vocab_size)]
    check_layout(where, shapes, expected, set(), hint)
    # the map is read apart (read_vocab_map): the tensors returned are the programs' weights
    return {k: v for k, v in tensors.items() if k not in VOCAB_MAP_KEYS}
