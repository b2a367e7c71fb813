"""Files that ship with the package: a small trained target + DFlash draft pair and held-out
prompts (see `pair/CARD.md` for how they were made and how to reproduce them).

    from dflash_qaic import assets
    target_dir, draft_dir = assets.default_pair()
    prompts = assets.heldout_prompts()
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def default_pair() -> tuple[Path, Path]:
    """(target directory, draft directory) of the committed pair."""
    return ROOT / "pair" / "target", ROOT / "pair" / "draft"


def heldout_prompts() -> list[str]:
    """Prompts cut from stdlib files that neither the target nor the draft trained on."""
    path = ROOT / "prompts" / "heldout.jsonl"
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
