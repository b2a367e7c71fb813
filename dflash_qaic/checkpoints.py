"""Load a Hugging Face target directory and a DFlash draft directory (local paths only), and
validate them against each other.

Every problem raises `CheckpointError` with one message that names the file, the field and the fix.
Validation reads only `config.json` files and safetensors headers, so it is cheap and runs before
any heavy work.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_qaic import kind_checkpoints as kinds

# Rope types whose tables depend on the sequence length: the static RoPE tables cannot hold them.
UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")
SUPPORTED_TARGETS = {
    "qwen3": ("Qwen3ForCausalLM",),
    "llama": ("LlamaForCausalLM",),
    # hybrids (Gated DeltaNet + gated full attention): the published multimodal form (text model
    # under `text_config`, tensors under model.language_model.*) and the text-only form
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeForCausalLM",),
    # hybrid and MoE at once (every layer's MLP: routed experts + a gated shared expert)
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
}
# targets with layer kinds (sliding and full attention of their own shapes): Gemma 4, in the
# published multimodal form and the text-only form (dflash_qaic/kind_checkpoints.py)
SUPPORTED_TARGETS |= kinds.KIND_TARGETS
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")
MOE_FAMILIES = ("qwen3_moe", "qwen3_5_moe")
# model_type of the text-only hybrid (what Qwen3_5ForCausalLM.save_pretrained writes)
_TEXT_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
_TEXT_MODEL_TYPES |= kinds.KIND_TEXT_MODEL_TYPES
# Tensors of a published multimodal checkpoint that the text model does not use (Hugging Face's
# Qwen3_5ForCausalLM ignores them too): the vision tower and the multi-token-prediction head.
_MULTIMODAL_IGNORED = ("model.visual.", "mtp.")
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


class CheckpointError(ValueError):
    """A checkpoint directory is missing something or does not fit its partner."""


def _read_config(directory: Path, what: str) -> dict:
    if not directory.is_dir():
        raise CheckpointError(
            f"{what} directory {directory} does not exist: pass a local directory holding "
            "config.json and *.safetensors (or a Hugging Face model id that is in the local cache)"
        )
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{what} {path} is missing: a checkpoint directory needs config.json")
    try:
        cfg = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{what} {path} is not UTF-8 text ({e}); re-save it as UTF-8") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{what} {path} is not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(
            f"{what} {path} holds a JSON {type(cfg).__name__}, not an object of config fields"
        )
    return cfg


def _safetensors_files(directory: Path, what: str) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{what} {directory} holds no *.safetensors weights (expected model.safetensors "
            "or sharded model-0000x-of-0000y.safetensors)"
        )
    return files


def _rope_theta(cfg: dict, default: float = 10000.0) -> float:
    """transformers 5.x writes `rope_parameters`; older checkpoints a top-level `rope_theta`."""
    rp = cfg.get("rope_parameters") or {}
    return float(rp.get("rope_theta") or cfg.get("rope_theta") or default)


# ---------------------------------------------------------------- config field types
#
# Every config.json field we read (or hand to transformers to build a module), with the JSON
# type it must have: checked by name before any value is used, so a wrong type is refused with
# the file, the field, the value found and the type expected, never coerced (1.5 -> 1) nor left
# to fail inside int() or transformers (docs/DESIGN.md, Streaming export and checkpoint
# validation). A field that is absent or null is left to its reader's default or "missing"
# error. Booleans are not integers. A nested table checks an object's fields.


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool)) and math.isfinite(v)


@dataclass(frozen=True)
class FieldType:
    """What a field must be (`expected`, as the message says it) and the test of a value; for a
    list type, `item` tests each element (the message names the first that fails)."""

    expected: str
    ok: Callable[[object], bool]
    item: Callable[[object], bool] | None = None  # for lists: each element


POSITIVE_INT = FieldType("a positive integer", lambda v: _is_int(v) and v >= 1)
TOKEN_ID = FieldType("an integer ≥ 0 (a token id)", lambda v: _is_int(v) and v >= 0)
NUMBER = FieldType("a finite number", _is_number)
POSITIVE_NUMBER = FieldType("a positive number", lambda v: _is_number(v) and v > 0)
BOOLEAN = FieldType("true or false", lambda v: isinstance(v, bool))
STRING = FieldType("a string", lambda v: isinstance(v, str))
STRINGS = FieldType(
    "a list of strings", lambda v: isinstance(v, list), lambda i: isinstance(i, str)
)
LAYER_IDS = FieldType(
    "a list of integers ≥ 0 (layer ids)",
    lambda v: isinstance(v, list),
    lambda i: _is_int(i) and i >= 0,
)
TOKEN_IDS = FieldType(
    "an integer ≥ 0 or a list of them (token ids)",
    lambda v: isinstance(v, list) or TOKEN_ID.ok(v),
    lambda i: _is_int(i) and i >= 0,
)

_ROPE_FIELDS = {
    "rope_type": STRING,
    "type": STRING,  # the older spelling of rope_type
    "rope_theta": POSITIVE_NUMBER,
    "factor": POSITIVE_NUMBER,
    "partial_rotary_factor": POSITIVE_NUMBER,
}
# Fields of a Qwen3 / Llama-style decoder config: a target's (or its `text_config`) and a draft's.
_DECODER_FIELDS = {
    "architectures": STRINGS,
    "model_type": STRING,
    "hidden_size": POSITIVE_INT,
    "num_hidden_layers": POSITIVE_INT,
    "num_attention_heads": POSITIVE_INT,
    "num_key_value_heads": POSITIVE_INT,
    "head_dim": POSITIVE_INT,
    "intermediate_size": POSITIVE_INT,
    "vocab_size": POSITIVE_INT,
    "max_position_embeddings": POSITIVE_INT,
    "rms_norm_eps": POSITIVE_NUMBER,
    "rope_theta": POSITIVE_NUMBER,
    "partial_rotary_factor": POSITIVE_NUMBER,
    "rope_parameters": _ROPE_FIELDS,
    "rope_scaling": _ROPE_FIELDS,
    "hidden_act": STRING,
    "tie_word_embeddings": BOOLEAN,
    "attention_bias": BOOLEAN,
    "mlp_bias": BOOLEAN,
    "layer_types": STRINGS,
    "sliding_window": POSITIVE_INT,
    "use_sliding_window": BOOLEAN,
    "eos_token_id": TOKEN_IDS,
}
# + the experts (Qwen3-MoE, Qwen3.5-MoE) and the Gated DeltaNet layers (Qwen3.5 hybrids)
_TEXT_FIELDS = _DECODER_FIELDS | {
    "num_experts": POSITIVE_INT,
    "num_local_experts": POSITIVE_INT,
    "num_experts_per_tok": POSITIVE_INT,
    "decoder_sparse_step": POSITIVE_INT,
    "moe_intermediate_size": POSITIVE_INT,
    "shared_expert_intermediate_size": POSITIVE_INT,
    "mlp_only_layers": LAYER_IDS,
    "norm_topk_prob": BOOLEAN,
    "full_attention_interval": POSITIVE_INT,
    "linear_num_key_heads": POSITIVE_INT,
    "linear_num_value_heads": POSITIVE_INT,
    "linear_key_head_dim": POSITIVE_INT,
    "linear_value_head_dim": POSITIVE_INT,
    "linear_conv_kernel_dim": POSITIVE_INT,
}
TARGET_FIELDS = _TEXT_FIELDS | {"text_config": _TEXT_FIELDS}
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
}
DRAFT_FIELDS = (
    _DECODER_FIELDS
    | {"num_target_layers": POSITIVE_INT, "is_causal": BOOLEAN}
    | _DFLASH_FIELDS
    | {"dflash_config": _DFLASH_FIELDS}
)
_JSON_NAMES = {bool: "a boolean", int: "an integer", float: "a float"}
_JSON_NAMES |= {str: "a string", list: "a list", dict: "an object"}


def _json_kind(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, float) and not math.isfinite(v):
        return "not a finite number"
    return _JSON_NAMES.get(type(v), type(v).__name__)


def check_field_types(cfg: dict, table: dict, path: Path, prefix: str = "") -> None:
    """Every field of `table` that `cfg` holds (not null) has its type, in table order; a
    nested table checks an object's fields, named `outer.inner`."""
    for key, kind in table.items():
        v = cfg.get(key)
        if v is None:
            continue
        name = prefix + key
        if isinstance(kind, dict):
            if not isinstance(v, dict):
                raise _field_error(path, name, v, _json_kind(v), "an object of fields")
            check_field_types(v, kind, path, name + ".")
            continue
        if not kind.ok(v):
            raise _field_error(path, name, v, _json_kind(v), kind.expected)
        if isinstance(v, list) and kind.item is not None:
            at = next((n for n, i in enumerate(v) if not kind.item(i)), None)
            if at is not None:
                found = f"element {at}, {json.dumps(v[at])}, is {_json_kind(v[at])}"
                raise _field_error(path, name, v, found, kind.expected)


def _field_error(path: Path, name: str, value, found: str, expected: str) -> CheckpointError:
    shown = json.dumps(value)
    if len(shown) > 120:
        shown = shown[:117] + "…"
    return CheckpointError(
        f"{path}: field `{name}` is {shown} ({found}); it must be {expected} (fix config.json)"
    )


def _require(cfg: dict, key: str, path: Path) -> object:
    if key not in cfg:
        raise CheckpointError(f"{path}: field `{key}` is missing")
    return cfg[key]


def _positive(cfg: dict, key: str, path: Path, default: int | None = None) -> int:
    """An integer field that must be ≥ 1; absent or null: `default` (None: an error)."""
    v = cfg.get(key)
    if v is None and default is not None:
        return default
    if key not in cfg:
        raise CheckpointError(f"{path}: field `{key}` is missing")
    if not POSITIVE_INT.ok(v):
        raise _field_error(path, key, v, _json_kind(v), POSITIVE_INT.expected)
    return v


@dataclass(frozen=True)
class TargetConfig:
    path: Path
    family: str  # "qwen3" | "llama" | "qwen3_moe"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    raw: dict = field(repr=False, compare=False)
    intermediate_size: int = 0
    moe: MoeSpec | None = None  # a mixture-of-experts target (family "qwen3_moe")
    # hybrids: where the text model's tensors live ("model." or, in the published multimodal
    # form, "model.language_model."), its config (raw, or raw's text_config), and the Gated
    # DeltaNet dims (`hybrid_dims`)
    prefix: str = "model."
    text: dict = field(default=None, repr=False, compare=False)
    hybrid: dict | None = field(default=None, compare=False)


@dataclass(frozen=True)
class MoeSpec:
    """The experts of a Qwen3-MoE target, from its config.json."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size, of each expert
    norm_topk_prob: bool
    sparse: tuple[bool, ...]  # per layer: experts (True) or the dense MLP (mlp_only_layers)
    shared_intermediate_size: int = 0  # Qwen3.5-MoE's shared expert (0: none)


def read_moe_spec(cfg: dict, cpath: Path, n_layers: int, family: str = "qwen3_moe") -> MoeSpec:
    """Hugging Face's rule: layer i has experts iff i is not in `mlp_only_layers` and
    (i + 1) % `decoder_sparse_step` == 0 (and there are experts at all). Qwen3.5-MoE: every
    layer, top-k always renormalised, plus a shared expert of
    `shared_expert_intermediate_size`."""
    # `num_experts` in the published configs; transformers 5.x writes `num_local_experts`
    key = "num_local_experts" if "num_experts" not in cfg and "num_local_experts" in cfg else ""
    key = key or "num_experts"
    experts = _positive(cfg, key, cpath)
    top_k = _positive(cfg, "num_experts_per_tok", cpath)
    if top_k > experts:
        raise CheckpointError(
            f"{cpath}: `num_experts_per_tok` {top_k} exceeds `{key}` {experts} (fix config.json)"
        )
    step = _positive(cfg, "decoder_sparse_step", cpath, 1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise CheckpointError(f"{cpath}: `mlp_only_layers` must be a list of layer ids")
    inter = _positive(cfg, "moe_intermediate_size", cpath)
    if family == "qwen3_5_moe":
        shared = _positive(cfg, "shared_expert_intermediate_size", cpath)
        return MoeSpec(experts, top_k, inter, True, (True,) * n_layers, shared)
    return MoeSpec(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=inter,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        sparse=tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers)),
    )


def hybrid_dims(cfg: dict, cpath: Path) -> dict:
    """The Gated DeltaNet fields of a hybrid text config, validated: layer_types (linear_attention
    and full_attention, at least one of each; Hugging Face's default when absent: every
    `full_attention_interval`-th layer full), the linear heads and dims, and the conv kernel."""
    n = _positive(cfg, "num_hidden_layers", cpath)
    types = cfg.get("layer_types")
    if types is None:
        every = _positive(cfg, "full_attention_interval", cpath, 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if (
        not isinstance(types, list)
        or len(types) != n
        or not set(types) <= {"linear_attention", "full_attention"}
        or "full_attention" not in types
    ):
        raise CheckpointError(
            f"{cpath}: `layer_types` must list {n} entries of linear_attention / full_attention "
            f"with at least one full_attention layer, got {types!r}"
        )
    dims = {
        k: _positive(cfg, k, cpath, dflt)
        for k, dflt in (
            ("linear_num_key_heads", 16),
            ("linear_num_value_heads", 32),
            ("linear_key_head_dim", 128),
            ("linear_value_head_dim", 128),
            ("linear_conv_kernel_dim", 4),
        )
    }
    if dims["linear_num_value_heads"] % dims["linear_num_key_heads"]:
        raise CheckpointError(
            f"{cpath}: `linear_num_value_heads` {dims['linear_num_value_heads']} must be a "
            f"multiple of `linear_num_key_heads` {dims['linear_num_key_heads']}"
        )
    return {"layer_types": list(types), **dims}


def read_target_config(directory: str | Path) -> TargetConfig:
    d = Path(directory)
    cfg = _read_config(d, "target")
    cpath = d / "config.json"
    check_field_types(cfg, {"architectures": STRINGS, "model_type": STRING}, cpath)
    arch = (cfg.get("architectures") or [None])[0]
    mtype = _TEXT_MODEL_TYPES.get(cfg.get("model_type"), cfg.get("model_type"))
    family = next(
        (f for f, archs in SUPPORTED_TARGETS.items() if arch in archs or mtype == f), None
    )
    if family is None:
        raise CheckpointError(
            f"{cpath}: `architectures` {cfg.get('architectures')} / `model_type` {mtype!r} is not "
            f"supported; supported targets: {', '.join(a for v in SUPPORTED_TARGETS.values() for a in v)}"
        )
    check_field_types(cfg, TARGET_FIELDS, cpath)
    text, prefix, hybrid = cfg, "model.", None
    if family in HYBRID_FAMILIES:
        if "text_config" in cfg:  # the published multimodal form
            text = cfg["text_config"]
            if not isinstance(text, dict):
                raise CheckpointError(f"{cpath}: `text_config` must be an object of config fields")
            prefix = "model.language_model."
        hybrid = hybrid_dims(text, cpath)
    elif family in kinds.KIND_TARGETS:
        try:
            text, prefix = kinds.text_config(cfg, cpath)
        except kinds.KindCheckpointError as e:
            raise CheckpointError(str(e)) from None
    heads = _positive(text, "num_attention_heads", cpath)
    hidden = _positive(text, "hidden_size", cpath)
    tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    n_layers = _positive(text, "num_hidden_layers", cpath)
    t = TargetConfig(
        path=d,
        family=family,
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=_positive(text, "num_key_value_heads", cpath, heads),
        head_dim=_positive(text, "head_dim", cpath, hidden // heads or 1),
        vocab_size=_positive(text, "vocab_size", cpath),
        rms_norm_eps=float(text.get("rms_norm_eps") or 1e-6),
        rope_theta=_rope_theta(text),
        tie_word_embeddings=bool(tied),
        raw=cfg,
        intermediate_size=_positive(
            text, "intermediate_size", cpath, 0 if family == "qwen3_5_moe" else None
        ),
        prefix=prefix,
        text=text,
        hybrid=hybrid,
        moe=read_moe_spec(text, cpath, n_layers, family) if family in MOE_FAMILIES else None,
    )
    _safetensors_files(d, "target")  # after the config: a config problem is reported first
    return t


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
    cfg = _read_config(d, "draft")
    cpath = d / "config.json"
    check_field_types(cfg, {"architectures": STRINGS}, cpath)
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in (DRAFT_ARCH, DRAFT2_ARCH):
        raise CheckpointError(
            f"{cpath}: `architectures` is {cfg.get('architectures')}, expected [{DRAFT_ARCH!r}] "
            f"or [{DRAFT2_ARCH!r}] (a DFlash draft checkpoint in the published z-lab format)"
        )
    check_field_types(cfg, DRAFT_FIELDS, cpath)
    heads = _positive(cfg, "num_attention_heads", cpath)
    hidden = _positive(cfg, "hidden_size", cpath)
    n_layers = _positive(cfg, "num_hidden_layers", cpath)
    n_target = _positive(cfg, "num_target_layers", cpath)
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
    _refuse_draft_knobs(cfg, d)
    softcap = _dflash_value(cfg, "final_logit_softcapping")
    dflash2 = _dflash2_fields(cfg, cpath, hidden) if arch == DRAFT2_ARCH else {}
    return DraftConfig(
        path=d,
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=_positive(cfg, "num_key_value_heads", cpath, heads),
        head_dim=_positive(cfg, "head_dim", cpath, hidden // heads or 1),
        intermediate_size=_positive(cfg, "intermediate_size", cpath),
        vocab_size=cfg.get("vocab_size"),
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        rope_theta=_rope_theta(cfg),
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
        raw=cfg,
    )


# Draft knobs of published drafts that the draft program does not build yet, each refused by its
# field (docs/DESIGN.md, Layer kinds): the value that would need it, and what it is.
_UNBUILT_DRAFT_KNOBS = {
    "attention_sink_bias": (lambda v: bool(v), "a learned per-head attention-sink logit"),
    "draft_vocab_size": (lambda v: v is not None, "a reduced draft vocabulary with its d2t map"),
    "mask_embedding": (lambda v: v is not None, "a separate mask-embedding file"),
    "is_neox_style": (lambda v: v is False, "the interleaved (GPT-J) RoPE layout"),
}


def _refuse_draft_knobs(cfg: dict, d: Path) -> None:
    for key, (used, what) in _UNBUILT_DRAFT_KNOBS.items():
        v = _dflash_value(cfg, key)
        if used(v):
            raise CheckpointError(
                f"{d / 'config.json'}: draft field `{key}` = {v!r} ({what}) is not supported by "
                "the draft program yet; export a draft without it"
            )
    if any(f.startswith("mask_embedding") for f in (p.name for p in d.glob("*.safetensors"))):
        raise CheckpointError(
            f"{d}: a separate mask-embedding file (a mask embedding replacing the target's "
            "embedding row of mask_token_id) is not supported by the draft program yet"
        )


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
    reference reads them), checked. A sliding layer's window is `sliding_window` as written:
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
    types = tuple(types) if "sliding_attention" in types else ()
    window = cfg.get("sliding_window") if types else None
    if types and (not isinstance(window, int) or isinstance(window, bool) or window < 2):
        raise CheckpointError(
            f"{cpath}: `sliding_attention` layers need an integer `sliding_window` of at least 2 "
            f"(the keys a query sees, itself included), got {window!r}"
        )
    causal = cfg.get("is_causal")
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
    _check_layout(where, shapes, expected_draft_shapes(c), set(), hint)
    return tensors


# ---------------------------------------------------------------- safetensors headers

# The dtypes a checkpoint may hold: widened to fp32 exactly on the way to the programs.
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
INDEX_NAME = "model.safetensors.index.json"
# MXFP4 expert weights (gpt-oss): uint8 codes and exponents, read only by dflash_qaic/mxfp4.py
MXFP4_SUFFIXES = ("_blocks", "_scales")
_HEADER_MAX = 100 * 1024 * 1024  # the safetensors format's own limit on the JSON header
# Tensors a checkpoint may carry that no program uses (Hugging Face ignores them too).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: `nbytes` at absolute `offset` of `file`."""

    file: Path
    name: str
    dtype: str  # a key of SAFETENSORS_DTYPES
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _corrupt(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a valid safetensors file: {why}. The file is truncated or corrupt; "
        "download or save it again"
    )


def _header_json(path: Path, size: int) -> tuple[dict, int]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _corrupt(path, f"it is {size} bytes long, shorter than the 8-byte header size")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, _HEADER_MAX):
            raise _corrupt(path, f"its header claims {n} bytes but the file has {size}")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(path, f"its header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise _corrupt(path, "its header is not a JSON object")
    return header, 8 + n


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo from the header alone (no tensor data is read), validated:
    a supported dtype, data_offsets that match the shape, and data inside the file."""
    path = Path(path)
    size = path.stat().st_size
    header, base = _header_json(path, size)
    out: dict[str, TensorInfo] = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
            numel = math.prod(int(d) for d in shape)
        except (KeyError, TypeError, ValueError) as err:
            raise _corrupt(path, f"the entry of tensor `{name}` is malformed ({err!r})") from err
        mxfp4 = dtype == "U8" and name.endswith(MXFP4_SUFFIXES)  # dflash_qaic/mxfp4.py
        if dtype not in SAFETENSORS_DTYPES and not mxfp4:
            raise CheckpointError(
                f"{path}: tensor `{name}` has dtype {dtype}; supported: "
                f"{', '.join(SAFETENSORS_DTYPES)} (convert the checkpoint to bf16, fp16 or fp32)"
            )
        itemsize = 1 if mxfp4 else SAFETENSORS_DTYPES[dtype].itemsize
        if not 0 <= begin <= end or end - begin != numel * itemsize:
            raise _corrupt(
                path, f"tensor `{name}` declares {end - begin} bytes for shape {list(shape)}"
            )
        if base + end > size:
            raise _corrupt(
                path,
                f"tensor `{name}` ends at byte {base + end} but the file has {size} (data is shorter than declared)",
            )
        out[name] = TensorInfo(path, name, dtype, shape, base + begin, end - begin)
    spans = sorted(out.values(), key=lambda i: (i.offset, i.nbytes))
    for a, b in zip(spans, spans[1:]):
        if b.offset < a.offset + a.nbytes:
            raise _corrupt(path, f"tensors `{a.name}` and `{b.name}` overlap")
    return out


def _read_index(index: Path) -> dict[str, str]:
    try:
        wm = json.loads(index.read_bytes().decode("utf-8")).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{index} is not a valid index ({e}); download it again") from e
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{index}: `weight_map` must map tensor names to shard file names")
    return wm


def checkpoint_tensors(directory: str | Path, what: str = "checkpoint") -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint directory: one model.safetensors, or shards named by
    model.safetensors.index.json (each shard must exist, hold exactly what the index says)."""
    d = Path(directory)
    files = _safetensors_files(d, what)
    index = d / INDEX_NAME
    if not index.is_file():
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            for name, info in read_safetensors_header(f).items():
                if name in tensors:
                    raise CheckpointError(
                        f"{what} {d}: tensor `{name}` is in both {tensors[name].file.name} and "
                        f"{f.name}; keep one copy (or add {INDEX_NAME})"
                    )
                tensors[name] = info
        return tensors
    wm = _read_index(index)
    shards = sorted(set(wm.values()))
    missing = [s for s in shards if not (d / s).is_file()]
    if missing:
        raise CheckpointError(
            f"{what} {d}: shard {missing[0]} named by {INDEX_NAME} is missing "
            f"({len(missing)} of {len(shards)} missing); download the complete checkpoint"
        )
    unlisted = [f.name for f in files if f.name not in shards]
    if unlisted:
        raise CheckpointError(
            f"{what} {d}: {unlisted[0]} is not listed in {INDEX_NAME}; remove it or add its "
            "tensors to the index"
        )
    tensors = {}
    for s in shards:
        for name, info in read_safetensors_header(d / s).items():
            if wm.get(name) != s:
                raise CheckpointError(
                    f"{what} {d / s}: tensor `{name}` is not listed for this shard in {INDEX_NAME}"
                )
            tensors[name] = info
    absent = sorted(set(wm) - set(tensors))
    if absent:
        raise CheckpointError(
            f"{what} {d}: {INDEX_NAME} names tensor `{absent[0]}` in {wm[absent[0]]}, which does "
            f"not hold it ({len(absent)} such tensors); the index and the shards do not match"
        )
    return tensors


def expert_shapes(t: TargetConfig, fused: bool) -> dict[str, list[int]]:
    """A sparse layer's MLP tensors (names under `model.layers.{i}.`): the router and the
    experts, per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, the published form) or
    fused (`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I], the form
    transformers 5.x holds in memory)."""
    m, H = t.moe, t.hidden_size
    E, inter = m.num_experts, m.intermediate_size
    out = {"mlp.gate.weight": [E, H]}
    if m.shared_intermediate_size:
        Is = m.shared_intermediate_size
        out |= {f"mlp.shared_expert.{p}_proj.weight": [Is, H] for p in ("gate", "up")}
        out |= {
            "mlp.shared_expert.down_proj.weight": [H, Is],
            "mlp.shared_expert_gate.weight": [1, H],
        }
    if fused:
        out |= {"mlp.experts.gate_up_proj": [E, 2 * inter, H]}
        return out | {"mlp.experts.down_proj": [E, H, inter]}
    for e in range(E):
        out |= {f"mlp.experts.{e}.{p}_proj.weight": [inter, H] for p in ("gate", "up")}
        out[f"mlp.experts.{e}.down_proj.weight"] = [H, inter]
    return out


def experts_fused(names) -> bool:
    """Whether a checkpoint stores its experts fused (see `expert_shapes`)."""
    return any(n.endswith("mlp.experts.gate_up_proj") for n in names)


def expected_target_shapes(t: TargetConfig, fused: bool = False) -> dict[str, list[int]]:
    """Every tensor the target architecture needs, with its shape (Hugging Face names);
    `fused`: a MoE target's experts in the fused form (see `expert_shapes`)."""
    if t.family in kinds.KIND_TARGETS:
        return kinds.gemma4_shapes(t.text, t.prefix, t.tie_word_embeddings)
    H, hd, inter, V = t.hidden_size, t.head_dim, t.intermediate_size, t.vocab_size
    q, kv = t.num_heads * hd, t.num_kv_heads * hd
    per_layer = {
        "self_attn.q_proj.weight": [q, H],
        "self_attn.k_proj.weight": [kv, H],
        "self_attn.v_proj.weight": [kv, H],
        "self_attn.o_proj.weight": [H, q],
        "mlp.gate_proj.weight": [inter, H],
        "mlp.up_proj.weight": [inter, H],
        "mlp.down_proj.weight": [H, inter],
        "input_layernorm.weight": [H],
        "post_attention_layernorm.weight": [H],
    }
    if t.family in ("qwen3", "qwen3_moe"):
        per_layer |= {"self_attn.q_norm.weight": [hd], "self_attn.k_norm.weight": [hd]}
    if t.raw.get("attention_bias"):
        per_layer |= {f"self_attn.{p}_proj.bias": [n] for p, n in zip("qkvo", (q, kv, kv, H))}
    if t.raw.get("mlp_bias"):
        per_layer |= {"mlp.gate_proj.bias": [inter], "mlp.up_proj.bias": [inter]}
        per_layer |= {"mlp.down_proj.bias": [H]}
    if t.hybrid is not None:
        return _hybrid_shapes(t, per_layer, fused)
    shapes = {"model.embed_tokens.weight": [V, H], "model.norm.weight": [H]}
    if not t.tie_word_embeddings:
        shapes["lm_head.weight"] = [V, H]
    sparse = {k: v for k, v in per_layer.items() if not k.startswith("mlp.")}
    if t.moe is not None:
        sparse |= expert_shapes(t, fused)
    for i in range(t.num_layers):
        layer = sparse if t.moe is not None and t.moe.sparse[i] else per_layer
        shapes.update({f"model.layers.{i}.{k}": s for k, s in layer.items()})
    return shapes


def _hybrid_shapes(t: TargetConfig, dense: dict, fused: bool = False) -> dict[str, list[int]]:
    """A hybrid's tensors (Hugging Face names, under t.prefix): Gated DeltaNet layers
    (`linear_attn.*`), gated full-attention layers (q_proj twice as wide: query and gate);
    a MoE hybrid's MLPs are its experts (`expert_shapes`)."""
    H, hd, V, h = t.hidden_size, t.head_dim, t.vocab_size, t.hybrid
    if t.moe is not None:
        dense = {k: v for k, v in dense.items() if not k.startswith("mlp.")}
        dense |= expert_shapes(t, fused)
    kd = h["linear_num_key_heads"] * h["linear_key_head_dim"]
    hv, vd = h["linear_num_value_heads"], h["linear_num_value_heads"] * h["linear_value_head_dim"]
    conv = 2 * kd + vd
    common = {k: v for k, v in dense.items() if not k.startswith("self_attn.")}
    full = {**dense, "self_attn.q_proj.weight": [2 * t.num_heads * hd, H]}
    full |= {"self_attn.q_norm.weight": [hd], "self_attn.k_norm.weight": [hd]}
    linear = {
        **common,
        "linear_attn.in_proj_qkv.weight": [conv, H],
        "linear_attn.in_proj_z.weight": [vd, H],
        "linear_attn.in_proj_b.weight": [hv, H],
        "linear_attn.in_proj_a.weight": [hv, H],
        "linear_attn.conv1d.weight": [conv, 1, h["linear_conv_kernel_dim"]],
        "linear_attn.A_log": [hv],
        "linear_attn.dt_bias": [hv],
        "linear_attn.norm.weight": [h["linear_value_head_dim"]],
        "linear_attn.out_proj.weight": [H, vd],
    }
    p = t.prefix
    shapes = {p + "embed_tokens.weight": [V, H], p + "norm.weight": [H]}
    if not t.tie_word_embeddings:
        shapes["lm_head.weight"] = [V, H]
    for i, kind in enumerate(h["layer_types"]):
        layer = linear if kind == "linear_attention" else full
        shapes.update({f"{p}layers.{i}.{k}": s for k, s in layer.items()})
    return shapes


def _check_layout(where, found: dict, expected: dict, ignored: set, hint: str) -> None:
    unknown = sorted(set(found) - set(expected) - ignored)
    if unknown:
        raise CheckpointError(
            f"{where}: unknown tensor keys {unknown[:6]}{' …' if len(unknown) > 6 else ''} "
            f"({len(unknown)} in all); {hint}. Unknown tensors are refused, not silently ignored"
        )
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(
            f"{where}: missing tensor keys {missing[:6]}{' …' if len(missing) > 6 else ''} "
            f"({len(missing)} in all); the checkpoint is incomplete for its config.json"
        )
    for name, shape in expected.items():
        if list(found[name]) != shape:
            raise CheckpointError(
                f"{where}: tensor `{name}` has shape {list(found[name])}, expected {shape} from "
                "config.json"
            )


def check_target_tensors(t: TargetConfig) -> dict[str, TensorInfo]:
    """Every tensor the target needs, with its shape; nothing unknown. Returns the tensors."""
    tensors = checkpoint_tensors(t.path, "target")
    ignored = {k for k in tensors if k.endswith(_IGNORED_SUFFIXES)}
    if t.hybrid is not None:
        ignored |= {k for k in tensors if k.startswith(_MULTIMODAL_IGNORED)}
    if t.family in kinds.KIND_TARGETS:
        ignored |= {k for k in tensors if k.startswith(kinds.GEMMA4_IGNORED)}
    if t.tie_word_embeddings:
        ignored.add("lm_head.weight")  # tied: the head is the embedding (as Hugging Face does)
    shapes = {k: list(v.shape) for k, v in tensors.items()}
    hint = f"not a {t.family} checkpoint with {t.num_layers} layers as config.json declares"
    expected = expected_target_shapes(t, fused=t.moe is not None and experts_fused(tensors))
    _check_layout(t.path, shapes, expected, ignored, hint)
    return tensors


def validate_pair(t: TargetConfig, d: DraftConfig) -> None:
    """One clear error per problem between a target and its draft."""
    dcfg = d.path / "config.json"
    # a hybrid's draft has its own attention shape (it borrows only the embedding and the head)
    own = t.hybrid is not None or t.family in kinds.KIND_TARGETS
    same = ("hidden_size",) if own else ("num_heads", "num_kv_heads", "head_dim")
    for fld in dict.fromkeys(("hidden_size", *same)):
        tv, dv = getattr(t, fld), getattr(d, fld)
        if tv != dv:
            raise CheckpointError(
                f"{dcfg}: `{_HF_NAME[fld]}` is {dv} but the target ({t.path / 'config.json'}) has "
                f"{tv}; this draft was not trained for this target"
            )
    if d.vocab_size is not None and int(d.vocab_size) != t.vocab_size:
        raise CheckpointError(
            f"{dcfg}: `vocab_size` is {d.vocab_size} but the target has {t.vocab_size}; the draft "
            "borrows the target's embedding and head, so they must match"
        )
    if d.num_target_layers != t.num_layers:
        raise CheckpointError(
            f"{dcfg}: `num_target_layers` is {d.num_target_layers} but the target has "
            f"{t.num_layers} layers (`num_hidden_layers` in {t.path / 'config.json'})"
        )
    bad = [i for i in d.target_layer_ids if not 0 <= i < t.num_layers]
    if bad or not d.target_layer_ids:
        raise CheckpointError(
            f"{dcfg}: `dflash_config.target_layer_ids` {list(d.target_layer_ids)} has ids out of "
            f"range {bad}; valid ids are 0 … {t.num_layers - 1} (the target's decoder layers)"
        )
    if not 0 <= d.mask_token_id < t.vocab_size:
        raise CheckpointError(
            f"{dcfg}: `dflash_config.mask_token_id` {d.mask_token_id} is outside the target's "
            f"vocabulary (0 … {t.vocab_size - 1})"
        )
    if d.block_size < 2:
        raise CheckpointError(
            f"{dcfg}: `block_size` is {d.block_size}; DFlash needs a block of at least 2 "
            "(an anchor and one proposal)"
        )


_HF_NAME = {
    "hidden_size": "hidden_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
}


@dataclass(frozen=True)
class Pair:
    target: TargetConfig
    draft: DraftConfig
    # name -> TensorInfo of each checkpoint (from the validated headers)
    target_tensors: dict = field(default_factory=dict, repr=False, compare=False)
    draft_tensors: dict = field(default_factory=dict, repr=False, compare=False)


def read_pair(target_dir: str | Path, draft_dir: str | Path) -> Pair:
    """Read and validate both configs and both tensor layouts (headers only; loads no weights).
    A directory argument may also be a Hugging Face model id (see `dflash_qaic.hub`).

    The checks run in the order that reports a root cause first: each config (field types, then
    values), the pair (a draft made for another target), what the modules support, then the
    tensor layouts against the configs; weight values come last (`check_weight_values`)."""
    from dflash_qaic.hub import resolve_checkpoint

    t = read_target_config(resolve_checkpoint(target_dir, "target"))
    d = read_draft_config(resolve_checkpoint(draft_dir, "draft"))
    validate_pair(t, d)
    check_supported(t, d)
    dt = check_draft_tensors(d)
    tt = check_target_tensors(t)
    return Pair(t, d, tt, dt)


def check_supported(t: TargetConfig, d: DraftConfig) -> None:
    """What the modeling code refuses, checked from the configs: silu MLPs, rope types whose
    tables do not depend on the sequence length, and no sliding-window layers in a dense target
    (a hybrid's layer_types are its linear / full attention layers)."""
    if t.family in kinds.KIND_TARGETS:  # its own activation and layer kinds
        try:
            kinds.check_supported(t.text, t.path / "config.json")
        except kinds.KindCheckpointError as e:
            raise CheckpointError(str(e)) from None
    checked = (
        ()
        if t.family in kinds.KIND_TARGETS
        else (("target", t.text or t.raw, t.path / "config.json"),)
    )
    for what, raw, path in (
        *checked,
        ("draft", d.raw or {}, d.path / "config.json"),
    ):
        act = raw.get("hidden_act") or "silu"
        if act != "silu":
            raise CheckpointError(
                f"{path}: hidden_act {act!r} is not supported (the {what} modules implement "
                "silu only)"
            )
        for key in ("rope_parameters", "rope_scaling"):
            _check_rope(raw.get(key) or {}, path)
    types = t.raw.get("layer_types") or []
    if t.family in kinds.KIND_TARGETS:
        types = []  # sliding layers built (modeling/kinds.py)
    if t.hybrid is None and any(k != "full_attention" for k in types):
        raise CheckpointError(
            f"{t.path / 'config.json'}: sliding-window layers are not supported "
            f"(layer_types {sorted(set(types))})"
        )


def _check_rope(rope: dict, where: Path) -> None:
    rtype = rope.get("rope_type") or rope.get("type") or "default"
    if rtype in UNSUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{where}: rope type {rtype!r} is not supported (it depends on the sequence "
            "length); supported: default and the static scalings (linear, llama3, yarn, …)"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rtype != "default" and rtype not in ROPE_INIT_FUNCTIONS:
        raise CheckpointError(f"{where}: unknown rope type {rtype!r}")


def load_target_model(t: TargetConfig | str | Path) -> torch.nn.Module:
    """The Hugging Face model in fp32, eval mode, from a local directory (never the hub)."""
    from transformers import AutoModelForCausalLM

    path = t.path if isinstance(t, TargetConfig) else Path(t)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, local_files_only=True, attn_implementation="eager"
    )
    return model.eval()


def load_draft_state(d: DraftConfig) -> dict[str, torch.Tensor]:
    """The draft's tensors in fp32 (checkpoints ship bf16)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(d.path, "draft"):
        state.update(load_file(str(f)))
    names = draft_tensor_names(state, d.path)
    return {names[k]: v.float() for k, v in state.items()}


def file_digest(directory: str | Path, *, chunk: int = 1 << 22) -> str:
    """sha256 over config.json and the safetensors files of a checkpoint directory."""
    import hashlib

    h = hashlib.sha256()
    d = Path(directory)
    for f in sorted([d / "config.json", *d.glob("*.safetensors")]):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while b := fh.read(chunk):
                h.update(b)
    return h.hexdigest()


# The tokenizer files a target directory may hold (copied into the artifacts when present).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
# Small files whose contents change a program or the runtime's behaviour.
FINGERPRINT_FILES = ("config.json", INDEX_NAME, "generation_config.json", *TOKENIZER_FILES)


def fingerprint(directory: str | Path) -> str:
    """A cheap identity of a checkpoint directory that reads no weight bytes: the contents of
    its config / index / tokenizer / generation-config files, and per safetensors file its
    name, size, mtime_ns and a hash of its header. A re-run decides "unchanged" in
    milliseconds; a rewritten weight file changes its mtime (and usually its header)."""
    import hashlib

    h = hashlib.sha256()
    d = Path(directory)
    for name in FINGERPRINT_FILES:
        f = d / name
        h.update(name.encode() + b"\0")
        h.update(f.read_bytes() if f.is_file() else b"<absent>")
    for f in sorted(d.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(n, _HEADER_MAX)))
    return h.hexdigest()


def fp16_fc_scale(fc_weight: torch.Tensor, where: TensorInfo | None = None) -> float:
    """QEfficient #995: divide fc by max(sqrt(in) · max_row_norm / 128, 1) so its output fits fp16.

    The scaled fc is what the card sees, at most 128 / sqrt(in) per element, so fc's raw weights
    may lie beyond fp16's range (docs/DESIGN.md, fp16). Only the scale must be a finite fp32
    number: a row norm whose squares overflow fp32 is taken in fp64; an fc that is not finite,
    or whose scale is beyond fp32's range, is refused (`where`: its checkpoint tensor)."""
    in_features = fc_weight.shape[1]
    row_norm = fc_weight.float().norm(dim=1).max().item()
    if math.isinf(row_norm):  # its squares overflowed fp32: the same norm in fp64
        row_norm = fc_weight.double().norm(dim=1).max().item()
    scale = max(math.sqrt(in_features) * row_norm / 128.0, 1.0)
    if not scale <= FP32_MAX:  # inf, NaN or too large for the fp32 division
        peak = fc_weight.abs().max().item()
        name = f"{where.file}: tensor `{where.name}`" if where else "the draft's `fc.weight`"
        if not math.isfinite(peak) or not math.isfinite(row_norm):
            raise _non_finite(name)
        raise CheckpointError(
            f"{name} holds values up to |x| = {peak:g}: the export divides fc by "
            f"max(sqrt(in) · max_row_norm / 128, 1) so the card's fc fits fp16, and that scale, "
            f"{scale:.3g}, is beyond fp32's range ({FP32_MAX:.4g}); the checkpoint is damaged, "
            "use a good copy"
        )
    return scale


# ---------------------------------------------------------------- weight values
#
# The card computes in fp16 (docs/DESIGN.md, fp16): a weight beyond fp16's largest finite value
# becomes inf there and the programs compute inf / NaN. `check_weight_values` reads every byte of
# both checkpoints once, before any tracing: the sha256 the manifest records (`file_digest`,
# which read them anyway) and, in the same pass, each used tensor's largest |value|.

FP16_MAX = 65504.0  # fp16's largest finite value
FP32_MAX = float(torch.finfo(torch.float32).max)
_SCAN_CHUNK = 16 << 20  # bytes read, hashed and checked at a time


def _non_finite(name: str) -> CheckpointError:
    return CheckpointError(
        f"{name} holds inf or NaN values; the checkpoint is damaged (a model with non-finite "
        "weights produces garbage); use a good copy"
    )


def beyond_fp16(info: TensorInfo, peak: float) -> CheckpointError:
    """The error for tensor `info` whose largest |value| `peak` does not fit fp16."""
    if not math.isfinite(peak):
        return _non_finite(f"{info.file}: tensor `{info.name}`")
    return CheckpointError(
        f"{info.file}: tensor `{info.name}` holds values up to |x| = {peak:g}, beyond 65,504, "
        "fp16's largest finite value: the AI100 computes in fp16, so this weight would be inf "
        "there and the programs would compute inf/NaN. The checkpoint is damaged or was not made "
        "for fp16 inference: use a good copy, or rescale the model so every weight fits fp16"
    )


def used_tensors(pair: Pair) -> dict[str, list[tuple[TensorInfo, float]]]:
    """Per checkpoint ("target", "draft"): every tensor a program uses with the largest |value|
    it may hold. The draft's fc is scaled into fp16's range by the export (`fp16_fc_scale`), so
    only its finiteness is checked here. Tensors no program uses (a tied lm_head, a vision
    tower, rotary inv_freq) are not checked."""
    t = pair.target
    fused = t.moe is not None and experts_fused(pair.target_tensors)
    names = expected_target_shapes(t, fused)
    target = [(i, FP16_MAX) for n, i in pair.target_tensors.items() if n in names]
    draft = [(i, math.inf if n == "fc.weight" else FP16_MAX) for n, i in pair.draft_tensors.items()]
    return {"target": target, "draft": draft}


def check_weight_values(pair: Pair) -> dict[str, str]:
    """Every used weight of both checkpoints finite and within fp16's range (`used_tensors`),
    refused by tensor, file and largest |value| otherwise; the draft is read first (small).
    Returns the `file_digest` of each directory, from the same read."""
    used = used_tensors(pair)
    digests = {}
    for what, directory in (("draft", pair.draft.path), ("target", pair.target.path)):
        digests[what] = _scan_directory(Path(directory), used[what])
    return {"target": digests["target"], "draft": digests["draft"]}


def _scan_directory(d: Path, checked: list[tuple[TensorInfo, float]]) -> str:
    """`file_digest(d)`, checking each tensor of `checked` against its limit on the way."""
    from concurrent.futures import ThreadPoolExecutor

    by_file: dict[Path, list] = {}
    for info, limit in checked:
        by_file.setdefault(info.file, []).append((info, limit))
    with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-sha256") as pool:
        scan = _Scan(pool)
        for f in sorted([d / "config.json", *d.glob("*.safetensors")]):
            scan.hash(f.name.encode())
            with open(f, "rb") as fh:
                pos = 0
                for info, limit in sorted(by_file.get(f, ()), key=lambda e: e[0].offset):
                    scan.skip(fh, info.offset - pos)  # header, gaps, unused tensors
                    peak = scan.tensor(fh, info)
                    if not (math.isfinite(peak) and peak <= limit):
                        raise beyond_fp16(info, peak)
                    pos = info.offset + info.nbytes
                scan.skip(fh, None)
        return scan.hexdigest()


def _bits_value(bits: int, unsigned: str, floating: str) -> float:
    import numpy as np

    return float(np.array([bits], unsigned).view(floating)[0])


# dtype -> (unsigned and signed integer view, sign bit, bits of inf, largest |value| of bits):
# one single-threaded integer max per view and block, whatever the float format
_PEAK_BITS = {
    "F32": ("<u4", "<i4", 1 << 31, 0x7F800000, lambda b: _bits_value(b, "<u4", "<f4")),
    "F16": ("<u2", "<i2", 1 << 15, 0x7C00, lambda b: _bits_value(b, "<u2", "<f2")),
    "BF16": ("<u2", "<i2", 1 << 15, 0x7F80, lambda b: _bits_value(b << 16, "<u4", "<f4")),
}


class _Scan:
    """Reads a file block by block into two alternating buffers; each block is hashed by a
    worker thread (hashlib and numpy release the GIL) while the caller checks it, so the check
    costs little beyond the hash the manifest needs anyway."""

    def __init__(self, pool):
        import hashlib

        self._h, self._pool, self._pending = hashlib.sha256(), pool, None
        self._bufs, self._k = [memoryview(bytearray(_SCAN_CHUNK)) for _ in range(2)], 0

    def hash(self, data) -> None:
        """Hash `data` after every block before it (a buffer in use is never refilled: the
        block two reads back is hashed before the next read)."""
        if self._pending is not None:
            self._pending.result()
        self._pending = self._pool.submit(self._h.update, data)

    def read(self, fh, n: int) -> memoryview:
        """Up to `n` bytes of `fh` (hashed in the background)."""
        buf = self._bufs[self._k]
        self._k ^= 1
        view = buf[: fh.readinto(buf[: min(n, len(buf))])]
        self.hash(view)
        return view

    def skip(self, fh, n: int | None) -> None:
        """Hash the next `n` bytes of `fh` (None: to its end)."""
        while n is None or n > 0:
            got = len(self.read(fh, _SCAN_CHUNK if n is None else n))
            if not got:
                return
            if n is not None:
                n -= got

    def tensor(self, fh, info: TensorInfo) -> float:
        """Hash tensor `info`'s bytes (`fh` is at its start) and return its largest |value|
        (inf or NaN when it holds a non-finite value)."""
        import numpy as np

        unsigned, signed, sign, inf, decode = _PEAK_BITS[info.dtype]
        size = np.dtype(unsigned).itemsize
        peak, left = 0, info.nbytes
        while left:
            block = self.read(fh, min(_SCAN_CHUNK - _SCAN_CHUNK % size, left))
            if not block or len(block) % size:
                raise CheckpointError(
                    f"{info.file}: tensor `{info.name}` is cut short; the file changed or is "
                    "truncated; download it again"
                )
            u = np.frombuffer(block, unsigned)
            # |x| orders as the bits without the sign: the largest negative magnitude is the
            # unsigned max (if any sign is set), the largest positive one the signed max
            top, pos = int(u.max()), int(u.view(signed).max())
            peak = max(peak, top - sign if top >= sign else 0, pos)
            left -= len(block)
        if peak > inf:
            return math.nan
        return math.inf if peak == inf else decode(peak)

    def hexdigest(self) -> str:
        if self._pending is not None:
            self._pending.result()
        return self._h.hexdigest()
