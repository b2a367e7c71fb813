"""A checkpoint's config.json: reading it, the type of every field we read, and the refusals
every decoder config shares (hidden_act, rope type).

Every problem raises `CheckpointError` with one message that names the file, the field and the
fix. Which fields a family reads, and what it refuses beyond these, is the family's
(dflash_qaic/families/).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Rope types whose tables depend on the sequence length: the static RoPE tables cannot hold them.
UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")


class CheckpointError(ValueError):
    """A checkpoint directory is missing something or does not fit its partner."""


def read_config(directory: Path, what: str) -> dict:
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


def rope_theta(cfg: dict, default: float = 10000.0) -> float:
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
ROPE_FIELDS = {
    "rope_type": STRING,
    "type": STRING,  # the older spelling of rope_type
    "rope_theta": POSITIVE_NUMBER,
    "factor": POSITIVE_NUMBER,
    "partial_rotary_factor": POSITIVE_NUMBER,
}
# Fields of any decoder config: a target's (or its `text_config`) and a draft's. A family adds
# its own (families/*.py: `Family.fields`).
DECODER_FIELDS = {
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
    "rope_parameters": ROPE_FIELDS,
    "rope_scaling": ROPE_FIELDS,
    "hidden_act": STRING,
    "tie_word_embeddings": BOOLEAN,
    "attention_bias": BOOLEAN,
    "mlp_bias": BOOLEAN,
    "layer_types": STRINGS,
    "sliding_window": POSITIVE_INT,
    "use_sliding_window": BOOLEAN,
    "eos_token_id": TOKEN_IDS,
}
_JSON_NAMES = {bool: "a boolean", int: "an integer", float: "a float"}
_JSON_NAMES |= {str: "a string", list: "a list", dict: "an object"}


def json_kind(v) -> str:
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
                raise field_error(path, name, v, json_kind(v), "an object of fields")
            check_field_types(v, kind, path, name + ".")
            continue
        if not kind.ok(v):
            raise field_error(path, name, v, json_kind(v), kind.expected)
        if isinstance(v, list) and kind.item is not None:
            at = next((n for n, i in enumerate(v) if not kind.item(i)), None)
            if at is not None:
                found = f"element {at}, {json.dumps(v[at])}, is {json_kind(v[at])}"
                raise field_error(path, name, v, found, kind.expected)


def field_error(path: Path, name: str, value, found: str, expected: str) -> CheckpointError:
    shown = json.dumps(value)
    if len(shown) > 120:
        shown = shown[:117] + "…"
    return CheckpointError(
        f"{path}: field `{name}` is {shown} ({found}); it must be {expected} (fix config.json)"
    )


def positive(cfg: dict, key: str, path: Path, default: int | None = None) -> int:
    """An integer field that must be ≥ 1; absent or null: `default` (None: an error)."""
    v = cfg.get(key)
    if v is None and default is not None:
        return default
    if key not in cfg:
        raise CheckpointError(f"{path}: field `{key}` is missing")
    if not POSITIVE_INT.ok(v):
        raise field_error(path, key, v, json_kind(v), POSITIVE_INT.expected)
    return v


def check_decoder_supported(raw: dict, path: Path, what: str) -> None:
    """What the modules refuse in any decoder config (a target's text config or a draft's):
    an MLP activation other than silu, a rope type whose tables depend on the sequence length."""
    act = raw.get("hidden_act") or "silu"
    if act != "silu":
        raise CheckpointError(
            f"{path}: hidden_act {act!r} is not supported (the {what} modules implement silu only)"
        )
    for key in ("rope_parameters", "rope_scaling"):
        _check_rope(raw.get(key) or {}, path)


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
