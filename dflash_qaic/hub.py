"""Hugging Face model ids where a checkpoint directory is expected (`--target Qwen/Qwen3-4B`).

Resolved the way `from_pretrained` resolves them, through `huggingface_hub`: a complete snapshot
in the local cache (`HF_HUB_CACHE`, default ~/.cache/huggingface/hub) is used as is; otherwise,
when the machine may go online (`HF_HUB_OFFLINE` unset), the files an export needs are
downloaded into that cache. An existing local path always wins over an id.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What an export reads from a model repository: configs, index, weights, tokenizer files.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _cache_dir() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE


def _offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE")
    return (
        env.upper() in ("1", "ON", "YES", "TRUE") if env is not None else constants.HF_HUB_OFFLINE
    )


def looks_like_model_id(arg: str | os.PathLike) -> bool:
    s = str(arg)
    return bool(_REPO_ID.match(s)) and ".." not in s and not Path(s).exists()


def resolve_checkpoint(arg: str | os.PathLike, what: str = "checkpoint") -> Path:
    """A local directory as given, or the snapshot directory of a Hugging Face model id."""
    from dflash_qaic.checkpoint_files.config import CheckpointError

    if not looks_like_model_id(arg):
        return Path(arg)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo_id, cache = str(arg), _cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if _offline():
        raise CheckpointError(
            f"{what} {repo_id!r} is not a local directory, and the model id is not in the Hugging "
            f"Face cache {cache} (HF_HUB_OFFLINE is set, so nothing is downloaded); download it "
            f"first (`hf download {repo_id}`) or pass a local directory"
        )
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=ALLOW_PATTERNS))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        raise CheckpointError(
            f"{what} {repo_id!r} is not a local directory, not in the Hugging Face cache {cache}, "
            f"and could not be downloaded ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            "check the id and the network, or pass a local directory"
        ) from e
