"""Load a Hugging Face target directory and a DFlash draft directory (local paths only), and
validate them against each other.

Every problem raises `CheckpointError` with one message that names the file, the field and the fix.
Validation reads only `config.json` files and safetensors headers, so it is cheap and runs before
any heavy work. The pieces: config.json fields (checkpoint_files/config.py), safetensors headers
(checkpoint_files/safetensors.py), weight values and digests (checkpoint_files/values.py), the
target's family (families/), the draft (drafts.py); here, the pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_qaic import families
from dflash_qaic.checkpoint_files.config import (  # noqa: F401 (re-exported)
    UNSUPPORTED_ROPE_TYPES,
    CheckpointError,
    check_decoder_supported,
    check_field_types,
    read_config,
)
from dflash_qaic.checkpoint_files.quantized import (  # noqa: F401 (re-exported)
    QuantizedTensor,
    published_tensors,
    quant_form,
)
from dflash_qaic.checkpoint_files.safetensors import (  # noqa: F401 (re-exported)
    IGNORED_SUFFIXES,
    INDEX_NAME,
    SAFETENSORS_DTYPES,
    TensorInfo,
    check_layout,
    checkpoint_tensors,
    read_safetensors_header,
    safetensors_files,
)
from dflash_qaic.checkpoint_files.values import (  # noqa: F401 (re-exported)
    FP16_MAX,
    FP32_MAX,
    TOKENIZER_FILES,
    _Scan,
    beyond_fp16,
    file_digest,
    fingerprint,
    fp16_fc_scale,
    scan_directory,
)
from dflash_qaic.drafts import (  # noqa: F401 (re-exported)
    DRAFT2_FIELDS,
    DraftConfig,
    check_draft_tensors,
    default_target_layer_ids,
    draft_tensor_names,
    read_draft_config,
)
from dflash_qaic.families.base import MoeSpec, TargetConfig  # noqa: F401 (re-exported)
from dflash_qaic.families.qwen3_moe import experts_fused  # noqa: F401 (re-exported)


def read_target_config(directory: str | Path) -> TargetConfig:
    """The target's config.json, read by its family (families/)."""
    d = Path(directory)
    cfg = read_config(d, "target")
    cpath = d / "config.json"
    family = families.for_config(cfg, cpath)
    check_field_types(cfg, families.target_fields(), cpath)
    t = family.read(d, cfg)
    safetensors_files(d, "target")  # after the config: a config problem is reported first
    return t


def expected_target_shapes(t: TargetConfig, fused: bool = False) -> dict[str, list[int]]:
    """Every tensor the target programs read, with its shape (the family's)."""
    return t.spec.expected_shapes(t, fused)


def mtp_prefixes(t: TargetConfig) -> tuple[str, ...]:
    """The multi-token-prediction layers a DeepSeek-V3-shaped checkpoint carries after its
    decoder (`num_nextn_predict_layers` of them, stored as layers num_hidden_layers, …): no
    program reads them, as no Hugging Face model does."""
    n = (t.text or t.raw).get("num_nextn_predict_layers") or 0
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0
    return tuple(f"{t.prefix}layers.{t.num_layers + i}." for i in range(n))


def target_weights(t: TargetConfig) -> dict[str, TensorInfo]:
    """The target's tensors as the weights they stand for: quantized ones (FP8, INT4) as
    `QuantizedTensor`s of their dequantized names and shapes (checkpoint_files/quantized.py),
    the multi-token-prediction layers left out."""
    tensors = checkpoint_tensors(t.path, "target", quantized=True)
    mtp = mtp_prefixes(t)
    tensors = {k: v for k, v in tensors.items() if not (mtp and k.startswith(mtp))}
    form = quant_form(t.raw, t.text, t.path / "config.json")
    return published_tensors(tensors, form, t.path)


def check_target_tensors(t: TargetConfig) -> dict[str, TensorInfo]:
    """Every tensor the target needs, with its shape; nothing unknown. Returns the tensors."""
    tensors = target_weights(t)
    ignored = {k for k in tensors if k.endswith(IGNORED_SUFFIXES)}
    if t.spec.ignored_prefixes:
        ignored |= {k for k in tensors if k.startswith(t.spec.ignored_prefixes)}
    ignored |= t.spec.ignored_tensors(t, tensors)
    if t.tie_word_embeddings:
        ignored.add(t.spec.head)  # tied: the head is the embedding (as Hugging Face does)
    shapes = {k: list(v.shape) for k, v in tensors.items()}
    hint = f"not a {t.family} checkpoint with {t.num_layers} layers as config.json declares"
    expected = expected_target_shapes(t, fused=t.spec.experts_fused(tensors))
    check_layout(t.path, shapes, expected, ignored, hint)
    return tensors


def validate_pair(t: TargetConfig, d: DraftConfig) -> None:
    """One clear error per problem between a target and its draft."""
    dcfg = d.path / "config.json"
    # a hybrid's draft has its own attention shape (it borrows only the embedding and the head)
    own = t.hybrid or t.spec.own_draft_attention
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
    """What the modeling code refuses, checked from the configs: the target's family decides
    for the target (families/), the draft shares the decoder refusals."""
    t.spec.check_supported(t.text or t.raw, t.path / "config.json")
    check_decoder_supported(d.raw or {}, d.path / "config.json", "draft")


def load_target_model(t: TargetConfig | str | Path) -> torch.nn.Module:
    """The Hugging Face model in fp32, eval mode, from a local directory (never the hub)."""
    from transformers import AutoModelForCausalLM

    path = t.path if isinstance(t, TargetConfig) else Path(t)
    cfg = read_config(path, "target")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    quant = (cfg.get("quantization_config") or text.get("quantization_config") or {}).get(
        "quant_method"
    )
    if not isinstance(t, TargetConfig) and (text or quant in ("fp8", "compressed-tensors")):
        t = read_target_config(path)
    if isinstance(t, TargetConfig) and t.spec.text_model:  # a wrapper: its text model
        return _load_text_model(t)
    if quant in ("fp8", "compressed-tensors"):
        return _load_dequantized(t)
    extra = {}
    if quant == "mxfp4":  # gpt-oss's MXFP4 experts, dequantized on load (exact: mxfp4.py)
        from transformers import Mxfp4Config

        extra["quantization_config"] = Mxfp4Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, local_files_only=True, attn_implementation="eager", **extra
    )
    return model.float().eval()


def _fp32_state(t: TargetConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the target in fp32 under its checkpoint name, quantized ones (FP8,
    INT4) dequantized exactly (checkpoint_files/quantized.py)."""
    from safetensors import safe_open

    from dflash_qaic.checkpoint_files import quantized

    state, plain = {}, {}
    for name, info in target_weights(t).items():
        if isinstance(info, QuantizedTensor):
            state[name] = quantized.dequantize(info)
        elif info.dtype in SAFETENSORS_DTYPES:
            plain.setdefault(info.file, []).append(name)
    for file, names in plain.items():
        with safe_open(str(file), "pt") as f:
            state.update({n: f.get_tensor(n).float() for n in names})
    return state


def _load_text_model(t: TargetConfig) -> torch.nn.Module:
    """The text model of a wrapper (Kimi K2.5's) in fp32: its text config and its tensors
    (from under the family's prefix and head name; the vision tower's left out) copied to a
    temporary directory, loaded as a text-only checkpoint."""
    import json
    import tempfile

    from safetensors.torch import save_file

    text = t.spec.text_model_config(t.text)
    names = {t.spec.head: "lm_head.weight"}
    state = {}
    for k, v in _fp32_state(t).items():
        if k.startswith(t.prefix) or k in names:
            state[names.get(k) or "model." + k[len(t.prefix) :]] = v
    with tempfile.TemporaryDirectory(prefix="dflash-text-model-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(text))
        save_file(state, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        del state
        return load_target_model(Path(tmp))


def _load_dequantized(t: TargetConfig) -> torch.nn.Module:
    """A FP8 / INT4 target in fp32, its weights dequantized here (exactly: checkpoint_files/
    quantized.py), not by transformers (whose FP8 path mis-sizes partial edge blocks): an
    unquantized copy of the checkpoint in a temporary directory, loaded as any other."""
    import json
    import tempfile

    from safetensors.torch import save_file

    cfg = read_config(t.path, "target")
    cfg.pop("quantization_config", None)
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"].pop("quantization_config", None)
    state = _fp32_state(t)
    with tempfile.TemporaryDirectory(prefix="dflash-dequantized-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        save_file(state, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        del state
        return load_target_model(Path(tmp))


def load_draft_state(d: DraftConfig) -> dict[str, torch.Tensor]:
    """The draft's tensors in fp32 (checkpoints ship bf16)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(d.path, "draft"):
        state.update(load_file(str(f)))
    names = draft_tensor_names(state, d.path)
    return {names[k]: v.float() for k, v in state.items()}


# ---------------------------------------------------------------- weight values
#
# The card computes in fp16 (docs/DESIGN.md, fp16): a weight beyond fp16's largest finite value
# becomes inf there and the programs compute inf / NaN. `check_weight_values` reads every byte of
# both checkpoints once, before any tracing: the sha256 the manifest records (`file_digest`,
# which read them anyway) and, in the same pass, each used tensor's largest |value|.


def used_tensors(pair: Pair) -> dict[str, list[tuple[TensorInfo, float]]]:
    """Per checkpoint ("target", "draft"): every tensor a program uses with the largest |value|
    it may hold. The draft's fc is scaled into fp16's range by the export (`fp16_fc_scale`), so
    only its finiteness is checked here. Tensors no program uses (a tied lm_head, a vision
    tower, rotary inv_freq) are not checked."""
    t = pair.target
    fused = t.spec.experts_fused(pair.target_tensors)
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
        digests[what] = scan_directory(Path(directory), used[what])
    return {"target": digests["target"], "draft": digests["draft"]}
