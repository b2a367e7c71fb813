"""Target model families, one module each (docs/DESIGN.md, Seams): a family holds its config
reading, what it refuses, its layers' kinds, its tensors' shapes and checkpoint names, and its
tiny preset. Adding a family is adding a module here and registering it in `FAMILIES`.

    families.all()                   every family, in registry order
    families.names()                 their names ("qwen3", "llama", …)
    families.get(name)               one by name
    families.for_config(cfg, path)   the family of a config.json (a CheckpointError listing the
                                     supported targets for any other)
    families.for_hf(config)          the family of a loaded transformers model's config
"""

from __future__ import annotations

from pathlib import Path

from dflash_qaic.checkpoint_files.config import (
    DECODER_FIELDS,
    STRING,
    STRINGS,
    CheckpointError,
    check_field_types,
)
from dflash_qaic.families.base import (  # noqa: F401
    Family,
    MoeSpec,
    TargetConfig,  # noqa: F401 (the families' config type)
)
from dflash_qaic.families.deepseek_v3 import DEEPSEEK_V3, GLM4_MOE_LITE
from dflash_qaic.families.dense import LLAMA, QWEN3
from dflash_qaic.families.gemma4 import GEMMA4, GEMMA4_MOE
from dflash_qaic.families.gpt_oss import GPT_OSS
from dflash_qaic.families.kimi_k25 import KIMI_K25
from dflash_qaic.families.minimax_m2 import MINIMAX_M2
from dflash_qaic.families.qwen3_5 import QWEN3_5
from dflash_qaic.families.qwen3_5_moe import QWEN3_5_MOE
from dflash_qaic.families.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        QWEN3, LLAMA, QWEN3_5, QWEN3_MOE, QWEN3_5_MOE, GEMMA4, GEMMA4_MOE, GPT_OSS, DEEPSEEK_V3,
        GLM4_MOE_LITE, MINIMAX_M2, KIMI_K25,
    )
}  # fmt: skip


def all() -> list[Family]:  # noqa: A001 (families.all(), as the registry reads)
    return list(FAMILIES.values())


def names() -> list[str]:
    return list(FAMILIES)


def get(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(
            f"unknown target family {name!r}: supported families are {', '.join(FAMILIES)}"
        )
    return FAMILIES[name]


def supported_architectures() -> list[str]:
    return [a for f in FAMILIES.values() for a in f.architectures]


def target_fields() -> dict:
    """Every config field any family reads, with its type: a target's config (and its
    `text_config`) is checked against all of them, so a field is never coerced whichever family
    the config turns out to be."""
    text = dict(DECODER_FIELDS)
    for f in FAMILIES.values():
        text |= f.fields
    return text | {"text_config": text}


def for_config(cfg: dict, cpath: Path) -> Family:
    """The family of config.json `cfg` (at `cpath`), by its first architecture or model_type."""
    check_field_types(cfg, {"architectures": STRINGS, "model_type": STRING}, cpath)
    arch = (cfg.get("architectures") or [None])[0]
    mtype = cfg.get("model_type")
    family = next((f for f in FAMILIES.values() if f.matches(arch, mtype)), None)
    if family is None:
        raise CheckpointError(
            f"{cpath}: `architectures` {cfg.get('architectures')} / `model_type` {mtype!r} is not "
            f"supported; supported targets: {', '.join(supported_architectures())} (families: "
            f"{', '.join(FAMILIES)})"
        )
    return family


def for_hf(config) -> Family:
    """The family of a loaded transformers model's config (its model_type)."""
    return for_config(config.to_dict(), Path(getattr(config, "name_or_path", "") or "<model>"))
