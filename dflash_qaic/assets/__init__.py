"""Files that ship with the package: a small trained target with two drafts trained for it (DFlash
and DFlash-2) and held-out prompts (see `pair/CARD.md` for how they were made and how to
reproduce them).

    from dflash_qaic import assets
    target_dir, draft_dir = assets.default_pair()
    target_dir, draft2_dir = assets.default_pair(draft="dflash2")
    prompts = assets.heldout_prompts()
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent
# the committed drafts of the built-in target, by draft form: their directories under pair/
DRAFTS = {"dflash": "draft", "dflash2": "draft-dflash2"}


def default_pair(draft: str = "dflash") -> tuple[Path, Path]:
    """(target directory, draft directory) of the committed pair; `draft`: "dflash" (the
    DFlash b16-form draft) or "dflash2" (the DFlash-2 draft of the same target)."""
    if draft not in DRAFTS:
        raise ValueError(f"draft must be one of {', '.join(map(repr, DRAFTS))}, got {draft!r}")
    return ROOT / "pair" / "target", ROOT / "pair" / DRAFTS[draft]


def heldout_prompts() -> list[str]:
    """Prompts cut from stdlib files that neither the target nor the draft trained on."""
    path = ROOT / "prompts" / "heldout.jsonl"
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
