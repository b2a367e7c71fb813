"""Corpora, the byte-level tokenizer, and held-out prompts.

The corpus every machine has is the Python standard library: the `*.py` files under
`sysconfig.get_paths()["stdlib"]`, minus test suites, generated tables and site-packages. A file
is *held out* when the sha256 of its path relative to the stdlib root is ≡ 0 mod 16; training
(target and draft) never reads held-out files, and benchmark prompts come only from them. The
split depends on file names alone, so it is the same on every machine with the same Python minor
version (the card records which one).

The tokenizer is byte-level: token id b (0 … 255) is byte b, then `<|endoftext|>` (EOS, 256) and
`<|mask|>` (257, reserved for the draft's MASK rows; the target never sees it). It is a Hugging
Face `tokenizers` BPE with the 256 byte-level symbols and no merges, wrapped in
`PreTrainedTokenizerFast`, so `AutoTokenizer.from_pretrained(dir)` loads it and `decode(encode(s))`
gives back any UTF-8 string s.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sysconfig
from pathlib import Path

EOS_TOKEN, MASK_TOKEN = "<|endoftext|>", "<|mask|>"
EOS_ID, MASK_ID = 256, 257
BYTE_VOCAB_SIZE = 258

HELDOUT_MODULUS = 16
# Directory names skipped anywhere in the tree, and top-level names skipped in the stdlib root.
_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
_SKIP_TOP = {"pydoc_data", "lib-dynload"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    return int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


def stdlib_files(split: str = "train") -> list[Path]:
    """Sorted `*.py` files of the stdlib for `split` in {"train", "heldout", "all"}."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be train, heldout or all, not {split!r}")
    root = stdlib_root()
    rels = []
    for d, dirs, files in os.walk(root):
        rel_dir = Path(d).relative_to(root)
        dirs[:] = [  # prune instead of walking site-packages and the test suites
            x
            for x in dirs
            if x not in _SKIP_DIRS
            and not (rel_dir == Path(".") and (x in _SKIP_TOP or x.startswith("config-")))
        ]
        rels += [(rel_dir / f).as_posix() for f in files if f.endswith(".py")]
    out = []
    for rel in sorted(rels):
        if Path(rel).name.startswith("_sysconfigdata"):
            continue
        held = is_heldout(rel)
        if split == "all" or held == (split == "heldout"):
            out.append(root / rel)
    return out


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def read_corpus(specs: list[str], glob: str = "*.py") -> list[tuple[str, str]]:
    """(name, text) documents, in a deterministic order.

    Each spec is `stdlib` (the training split; also `stdlib:train`, `stdlib:heldout`), a file,
    or a directory (its files matching `glob`, recursively, sorted). Files that are not UTF-8
    text are skipped."""
    docs: list[tuple[str, str]] = []
    for spec in specs:
        if spec.startswith("stdlib") and not Path(spec).exists():
            split = spec.partition(":")[2] or "train"
            root = stdlib_root()
            files = [(p.relative_to(root).as_posix(), p) for p in stdlib_files(split)]
        else:
            path = Path(spec)
            if path.is_dir():
                files = [(p.as_posix(), p) for p in sorted(path.rglob(glob)) if p.is_file()]
            elif path.is_file():
                files = [(path.as_posix(), path)]
            else:
                raise FileNotFoundError(f"corpus {spec!r}: no such file or directory")
        for name, p in files:
            text = _read_text(p)
            if text:
                docs.append((name, text))
    if not docs:
        raise ValueError(f"corpus {specs} holds no readable text")
    return docs


def corpus_digest(docs: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for name, text in docs:
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# The byte-level tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode symbols (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_byte_tokenizer():
    """A `PreTrainedTokenizerFast` where token id == byte value, plus EOS (256) and MASK (257)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(EOS_TOKEN, special=True), AddedToken(MASK_TOKEN, special=True)]
    )
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID and tok.token_to_id(MASK_TOKEN) == MASK_ID
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )


def byte_ids(text: str) -> list[int]:
    """What the byte tokenizer gives for `text` (without special tokens), computed directly."""
    return list(text.encode("utf-8"))


# ---------------------------------------------------------------------------------------------
# Held-out prompts


def cut_prompts(
    docs: list[tuple[str, str]], n: int, min_bytes: int = 100, max_bytes: int = 300, seed: int = 0
) -> list[dict]:
    """`n` prompts of whole lines (min_bytes … max_bytes UTF-8 bytes), one file after another,
    each starting at a random non-blank line. Deterministic in (docs, n, sizes, seed)."""
    rng = random.Random(seed)
    prompts: list[dict] = []
    order = list(range(len(docs)))
    rng.shuffle(order)
    for attempt in range(50 * n):
        if len(prompts) == n:
            break
        name, text = docs[order[attempt % len(order)]]
        lines = text.splitlines(keepends=True)
        if len(lines) < 4:
            continue
        start = rng.randrange(len(lines))
        if not lines[start].strip():
            continue
        size, end = 0, start
        while end < len(lines) and size + len(lines[end].encode()) <= max_bytes:
            size += len(lines[end].encode())
            end += 1
        if size < min_bytes:
            continue
        prompts.append({"prompt": "".join(lines[start:end]), "source": f"{name}:{start + 1}"})
    if len(prompts) < n:
        raise ValueError(f"could cut only {len(prompts)} of {n} prompts from {len(docs)} files")
    return prompts


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Write held-out prompts cut from held-out stdlib files")
    p.add_argument("--out", required=True, help="JSONL file to write ({'prompt', 'source'} rows)")
    p.add_argument("-n", type=int, default=24)
    p.add_argument("--min-bytes", type=int, default=100)
    p.add_argument("--max-bytes", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    docs = read_corpus(["stdlib:heldout"])
    write_jsonl(a.out, cut_prompts(docs, a.n, a.min_bytes, a.max_bytes, a.seed))
    print(f"{a.n} prompts from {len(docs)} held-out files -> {a.out}")


if __name__ == "__main__":
    main()
