"""Load a Hugging Face target directory and a DFlash draft directory (local paths only), and
validate them against each other.

Every problem raises `CheckpointError` with one message that names the file, the field and the fix.
Validation reads only `config.json` files and safetensors headers, so it is cheap and runs before
any heavy work.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_TARGETS = {
    "qwen3": ("Qwen3ForCausalLM",),
    "llama": ("LlamaForCausalLM",),
}
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


class CheckpointError(ValueError):
    """A checkpoint directory is missing something or does not fit its partner."""


def _read_config(directory: Path, what: str) -> dict:
    if not directory.is_dir():
        raise CheckpointError(
            f"{what} directory {directory} does not exist: pass a local directory holding "
            "config.json and *.safetensors"
        )
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{what} {path} is missing: a checkpoint directory needs config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{what} {path} is not valid JSON ({e})") from e


def _safetensors_files(directory: Path, what: str) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{what} {directory} holds no *.safetensors weights (expected model.safetensors "
            "or sharded model-0000x-of-0000y.safetensors)"
        )
    return files


def _safetensors_header(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, read from the safetensors header without loading the data."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def _rope_theta(cfg: dict, default: float = 10000.0) -> float:
    """transformers 5.x writes `rope_parameters`; older checkpoints a top-level `rope_theta`."""
    rp = cfg.get("rope_parameters") or {}
    return float(rp.get("rope_theta", cfg.get("rope_theta", default)))


def _require(cfg: dict, key: str, path: Path) -> object:
    if key not in cfg:
        raise CheckpointError(f"{path}: field `{key}` is missing")
    return cfg[key]


@dataclass(frozen=True)
class TargetConfig:
    path: Path
    family: str  # "qwen3" | "llama"
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


def read_target_config(directory: str | Path) -> TargetConfig:
    d = Path(directory)
    cfg = _read_config(d, "target")
    cpath = d / "config.json"
    arch = (cfg.get("architectures") or [None])[0]
    mtype = cfg.get("model_type")
    family = next(
        (f for f, archs in SUPPORTED_TARGETS.items() if arch in archs or mtype == f), None
    )
    if family is None:
        raise CheckpointError(
            f"{cpath}: `architectures` {cfg.get('architectures')} / `model_type` {mtype!r} is not "
            f"supported; supported targets: {', '.join(a for v in SUPPORTED_TARGETS.values() for a in v)}"
        )
    _safetensors_files(d, "target")
    heads = int(_require(cfg, "num_attention_heads", cpath))
    hidden = int(_require(cfg, "hidden_size", cpath))
    return TargetConfig(
        path=d,
        family=family,
        hidden_size=hidden,
        num_layers=int(_require(cfg, "num_hidden_layers", cpath)),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(_require(cfg, "vocab_size", cpath)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        raw=cfg,
    )


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
    raw: dict = field(default=None, repr=False, compare=False)


def _dflash_value(cfg: dict, key: str, default=None):
    """DFlash fields live in `dflash_config` in newer checkpoints and at top level in older ones."""
    return (cfg.get("dflash_config") or {}).get(key, cfg.get(key, default))


def read_draft_config(directory: str | Path) -> DraftConfig:
    d = Path(directory)
    cfg = _read_config(d, "draft")
    cpath = d / "config.json"
    arch = (cfg.get("architectures") or [None])[0]
    if arch != DRAFT_ARCH:
        raise CheckpointError(
            f"{cpath}: `architectures` is {cfg.get('architectures')}, expected [{DRAFT_ARCH!r}] "
            "(a DFlash draft checkpoint in the published z-lab format)"
        )
    if (
        bool(_dflash_value(cfg, "is_causal", False))
        or cfg.get("layer_types")
        and any(t != "full_attention" for t in cfg["layer_types"])
    ):
        raise CheckpointError(
            f"{cpath}: `is_causal` / sliding-window `layer_types` drafts are not supported; "
            "use a bidirectional (b16-style) DFlash draft"
        )
    heads = int(_require(cfg, "num_attention_heads", cpath))
    hidden = int(_require(cfg, "hidden_size", cpath))
    n_layers = int(_require(cfg, "num_hidden_layers", cpath))
    n_target = int(_require(cfg, "num_target_layers", cpath))
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
    softcap = _dflash_value(cfg, "final_logit_softcapping")
    return DraftConfig(
        path=d,
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(_require(cfg, "intermediate_size", cpath)),
        vocab_size=cfg.get("vocab_size"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        block_size=int(block),
        target_layer_ids=tuple(int(i) for i in layer_ids),
        mask_token_id=int(mask_id),
        num_target_layers=n_target,
        input_embedding_scale=float(_dflash_value(cfg, "input_embedding_scale", 1.0)),
        output_multiplier=float(_dflash_value(cfg, "output_multiplier", 1.0)),
        final_logit_softcapping=None if softcap in (None, 0) else float(softcap),
        raw=cfg,
    )


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
    for i in range(c.num_layers):
        shapes.update({f"layers.{i}.{name}": s for name, s in per_layer.items()})
    return shapes


def check_draft_tensors(c: DraftConfig) -> None:
    """The 3 + 11·L tensor layout, exactly: unknown keys mean an unsupported (e.g. DFlash-2) draft."""
    files = _safetensors_files(c.path, "draft")
    found: dict[str, list[int]] = {}
    for f in files:
        found.update(_safetensors_header(f))
    where = files[0] if len(files) == 1 else c.path
    expected = expected_draft_shapes(c)
    unknown = sorted(set(found) - set(expected))
    if unknown:
        raise CheckpointError(
            f"{where}: unknown tensor keys {unknown[:6]}{' …' if len(unknown) > 6 else ''} "
            f"({len(unknown)} in all). This is not a DFlash (b16) draft with "
            f"{c.num_layers} layers (e.g. a DFlash-2 checkpoint with attention_conv / "
            "candidate_selector); unsupported checkpoints are refused, not silently ignored"
        )
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(
            f"{where}: missing tensor keys {missing[:6]}{' …' if len(missing) > 6 else ''} "
            f"({len(missing)} in all); config.json declares {c.num_layers} layers and "
            f"{len(c.target_layer_ids)} target layer ids"
        )
    for name, shape in expected.items():
        if list(found[name]) != shape:
            raise CheckpointError(
                f"{where}: tensor `{name}` has shape {list(found[name])}, expected {shape} from "
                f"{c.path / 'config.json'}"
            )


def validate_pair(t: TargetConfig, d: DraftConfig) -> None:
    """One clear error per problem between a target and its draft."""
    dcfg = d.path / "config.json"
    for fld in ("hidden_size", "num_heads", "num_kv_heads", "head_dim"):
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


def read_pair(target_dir: str | Path, draft_dir: str | Path) -> Pair:
    """Read and validate both configs and the draft's tensor layout; loads no weights."""
    t = read_target_config(target_dir)
    d = read_draft_config(draft_dir)
    check_draft_tensors(d)
    validate_pair(t, d)
    return Pair(t, d)


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
    return {k: v.float() for k, v in state.items()}


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


def fp16_fc_scale(fc_weight: torch.Tensor) -> float:
    """QEfficient #995: divide fc by max(sqrt(in) · max_row_norm / 128, 1) so its output fits fp16."""
    in_features = fc_weight.shape[1]
    row_norm = fc_weight.float().norm(dim=1).max().item()
    return max(math.sqrt(in_features) * row_norm / 128.0, 1.0)
