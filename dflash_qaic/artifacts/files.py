"""File helpers of the artifacts: atomic JSON, umask modes, paths that stay inside a directory,
and the integrity check (sha256 with a cache of checked files).

Integrity (docs/DESIGN.md, Artifacts): a file is trusted when its sha256 equals the manifest's.
Hashing a multi-GB weight file costs seconds, so a successful check is remembered against the
file's identity, `(device, inode, size, mtime_ns, ctime_ns)`, in a small cache
(`$DFLASH_QAIC_CACHE_DIR`, else `$XDG_CACHE_HOME/dflash-qaic`, else `~/.cache/dflash-qaic`,
file `verified.json`). Any write to a file changes its mtime and ctime (ctime cannot be set back
from user space), so a changed file always misses the cache and is hashed again; a file merely
touched is hashed again and accepted. The exporter remembers the files it hashes as it writes
them, so the first load after an export is instant too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

log = logging.getLogger(__name__)

CACHE_ENV = "DFLASH_QAIC_CACHE_DIR"
CACHE_FILE = "verified.json"
CACHE_VERSION = 1
CACHE_MAX_ENTRIES = 4096
HASH_BUFFER = 16 << 20  # bytes per read: large reads keep hashlib (which drops the GIL) busy
HASH_THREADS = 4  # files hashed at once (hashlib drops the GIL; one file is one thread)
#: "fast": every size, and every sha256 (from the cache of checked files when the file is
#: unchanged since it was last hashed); "full": every sha256 hashed now; "none": existence only
CHECK_MODES = ("fast", "full", "none")


class ArtifactsError(ValueError):
    """An artifacts directory is missing, incomplete, damaged or from another version."""


def umask() -> int:
    """The process umask (read without changing it for longer than a call)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fix_mode(path: str | os.PathLike, directory: bool = False) -> None:
    """Give a file made by `tempfile` (0600 / 0700) the mode a plain `open` would have given."""
    os.chmod(path, (0o777 if directory else 0o666) & ~umask())


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write JSON to a temp file beside `path` (umask permissions), fsync, then rename over it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        fix_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sha256_file(path: str | os.PathLike, chunk: int = HASH_BUFFER) -> str:
    """The sha256 of a file, read `chunk` bytes at a time into one reused buffer."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def plain(rel: str) -> bool:
    """A plain relative path: not absolute, no `..`, no backslash."""
    p = PurePosixPath(rel)
    return bool(rel) and not p.is_absolute() and ".." not in p.parts and "\\" not in rel


def inside(root: str | os.PathLike, rel: str, what: str = "path", manifest: str = "manifest.json"):
    """`root/rel`, refusing anything that leaves `root` (absolute, `..`, symlinks out)."""
    root = Path(root)
    if not isinstance(rel, str) or not plain(rel):
        raise ArtifactsError(
            f"{root / manifest}: {what} {rel!r} is not a plain relative path inside the "
            "artifacts directory; refusing it (re-run dflash-export to write a clean manifest)"
        )
    full = root / rel
    real_root = root.resolve()
    if not full.resolve().is_relative_to(real_root):
        raise ArtifactsError(
            f"{root / manifest}: {what} {rel!r} resolves to {full.resolve()}, outside "
            f"{real_root} (a symlink out of the artifacts directory); refusing it"
        )
    return full


# ---------------------------------------------------------------------------------------------
# the cache of checked files


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash-qaic"


def identity(st: os.stat_result) -> list[int]:
    """What changes whenever the file's bytes may have: size, mtime and ctime (ns)."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class CheckedFiles:
    """The cache of files whose sha256 was checked: `dev:inode` -> [size, mtime_ns, ctime_ns,
    sha256]. A lost or unreadable cache only costs a re-hash; it never lets a file through."""

    _lock = threading.Lock()

    def __init__(self, directory: Path | None = None):
        self.path = (directory or cache_dir()) / CACHE_FILE
        self.entries: dict[str, list] = {}
        self.dirty = False
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") == CACHE_VERSION and isinstance(data.get("entries"), dict):
                self.entries = data["entries"]
        except (OSError, ValueError, AttributeError):
            pass

    @staticmethod
    def _key(st: os.stat_result) -> str:
        return f"{st.st_dev}:{st.st_ino}"

    def checked(self, st: os.stat_result, sha256: str) -> bool:
        return self.entries.get(self._key(st)) == [*identity(st), sha256]

    def remember(self, st: os.stat_result, sha256: str) -> None:
        with self._lock:
            key = self._key(st)
            self.entries.pop(key, None)  # re-inserted last: the newest survive trimming
            self.entries[key] = [*identity(st), sha256]
            self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        entries = dict(list(self.entries.items())[-CACHE_MAX_ENTRIES:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path, {"version": CACHE_VERSION, "entries": entries})
            self.dirty = False
        except OSError as e:  # a read-only home: every load hashes again, nothing else changes
            log.warning("cannot write the checked-files cache %s (%s)", self.path, e)


def check_sha256(path: Path, sha256: str, cache: CheckedFiles | None, use_cache: bool) -> bool:
    """Whether `path` has this sha256: from the cache when its identity is recorded there with
    this digest (and `use_cache`), else by hashing it (and remembering a match)."""
    st = os.stat(path)
    if use_cache and cache is not None and cache.checked(st, sha256):
        return True
    if st.st_size > HASH_BUFFER:
        log.info("checking %s (%.1f GB)", path, st.st_size / 1e9)
    if sha256_file(path) != sha256:
        return False
    if cache is not None:
        after = os.stat(path)
        if identity(after) == identity(st):  # unchanged while it was read
            cache.remember(after, sha256)
    return True


def remember(paths_and_digests, cache: CheckedFiles | None = None) -> None:
    """Record files just hashed by their writer (the exporter) as checked."""
    cache = cache or CheckedFiles()
    for path, digest in paths_and_digests:
        cache.remember(os.stat(path), digest)
    cache.save()


def check_files(root: Path, records, mode: str) -> None:
    """Every recorded file exists with its size (all of them first: a truncation fails at
    once), then its sha256 (mode "fast": cached when unchanged; "full": hashed), several files
    at a time. ArtifactsError naming the first damaged file."""
    fix = f"re-run `dflash-export --out {root}` (it rebuilds damaged programs)"
    for rec in records:
        f = inside(root, rec.path, "file")
        if not f.is_file():
            raise ArtifactsError(f"{root} is damaged: {rec.path} is missing; {fix}")
        if mode == "none":
            continue
        size = f.stat().st_size
        if size != rec.size:
            raise ArtifactsError(
                f"{root} is damaged: {rec.path} has {size} bytes, the manifest recorded "
                f"{rec.size} (truncated or replaced); {fix}"
            )
    if mode == "none":
        return
    cache = CheckedFiles()
    big_first = sorted(records, key=lambda r: -r.size)
    with ThreadPoolExecutor(min(HASH_THREADS, os.cpu_count() or 1)) as pool:
        ok = pool.map(
            lambda r: check_sha256(root / r.path, r.sha256, cache, mode == "fast"), big_first
        )
        bad = [r.path for r, good in zip(big_first, ok) if not good]
    cache.save()
    if bad:
        raise ArtifactsError(
            f"{root} is damaged: {', '.join(sorted(bad))} "
            f"{'does not match its' if len(bad) == 1 else 'do not match their'} recorded sha256 "
            f"(the bytes changed after export); {fix}"
        )
