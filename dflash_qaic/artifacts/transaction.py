"""An artifacts directory written as a transaction (docs/DESIGN.md, Artifacts).

    with Transaction(out) as tx:        # lock `.OUT.lock` beside OUT, check OUT is ours,
        build into tx.staging           # recover what a killed run left; stage `.OUT.staging-*`
        tx.commit()                     # swap staging and OUT in one step, drop the old one

- **Lock.** `fcntl.flock` on `.<name>.lock` beside OUT, taken without waiting: a second export
  (or compile) on the same OUT refuses with the first one's pid. The lock file is never deleted
  (deleting it would let two processes lock two different files).
- **Staging.** Everything is built in `.<name>.staging-*` beside OUT (same filesystem); files a
  reuse keeps are hard links to OUT's (never written through: every writer replaces files).
- **Commit.** `renameat2(RENAME_EXCHANGE)` swaps the two directories atomically: at every instant
  OUT is either the old directory or the new one, byte for byte, whatever kills the process.
  Where the filesystem cannot exchange, OUT is renamed to `.<name>.old-*` and staging to OUT;
  a run killed between the two renames leaves no OUT, and the next run renames the old one back.
- **Ownership.** OUT is replaced only when it is empty or holds exactly what an export writes
  (manifest.json of this tool, target/, draft/, and tokenizer/ when the manifest names it, as
  real directories). Anything else is refused by name: the tool never empties a directory it
  did not create.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from dflash_qaic import contract
from dflash_qaic.artifacts.files import fix_mode
from dflash_qaic.artifacts.manifest import FORMAT, NAME

try:
    import fcntl
except ImportError:  # pragma: no cover - Linux only
    fcntl = None  # type: ignore[assignment]

RENAME_EXCHANGE = 2  # linux/fs.h
AT_FDCWD = -100
LAYOUT = ("manifest.json", *contract.ROLE_NAMES, "tokenizer")  # a directory per program role


class TransactionError(ValueError):
    """OUT cannot be written: busy, not ours, read-only. Says what and how to fix it."""


def _names(entries: list[str], n: int = 6) -> str:
    more = f" and {len(entries) - n} more" if len(entries) > n else ""
    return ", ".join(entries[:n]) + more


def check_ours(out: Path) -> None:
    """Refuse an OUT this tool did not create (naming what is there), or cannot replace."""
    if out.is_symlink() and not out.is_dir():
        raise TransactionError(f"--out {out} is a dangling symlink: remove it or pick another path")
    if not out.exists():
        return
    if not out.is_dir():
        raise TransactionError(f"--out {out} exists and is not a directory: choose another path")
    mode = out.stat().st_mode
    if not mode & stat.S_IWUSR or not os.access(out, os.W_OK):
        raise TransactionError(
            f"--out {out} is read-only (mode {stat.S_IMODE(mode):o}): make it writable "
            f"(chmod u+w {out}) or choose another --out"
        )
    entries = sorted(os.listdir(out))
    if not entries:
        return
    manifest = _manifest_json(out)
    if manifest is None and set(entries) <= set(LAYOUT) | {".compile.lock"}:
        raise TransactionError(
            f"--out {out} holds {_names(entries)} but no dflash-qaic manifest: it looks like an "
            f"export an older version left unfinished; delete it (rm -r {out}) and run again"
        )
    if manifest is None:
        raise TransactionError(
            f"--out {out} is not empty and is not a dflash-qaic artifacts directory (it holds "
            f"{_names(entries)}): dflash-export never empties a directory it did not create; "
            "choose a new or empty --out"
        )
    allowed = set(LAYOUT[:3]) | ({"tokenizer"} if manifest.get("tokenizer") else set())
    # top-level files the manifest records (config.json, the target's, for vLLM)
    records = manifest.get("files") if isinstance(manifest.get("files"), list) else []
    allowed |= {r.get("path") for r in records if isinstance(r, dict)} & {"config.json"}
    links = [e for e in entries if (out / e).is_symlink()]
    foreign = [e for e in entries if e not in allowed and e not in links]
    if foreign or links:
        what = [f"{e} (a symlink to {os.readlink(out / e)})" for e in links]
        what += [f"{e} (not written by dflash-export)" for e in foreign]
        raise TransactionError(
            f"--out {out} holds {_names(what)}; dflash-export replaces the whole directory and "
            "will not delete them: move them out of the way, or choose another --out"
        )


def _manifest_json(out: Path) -> dict | None:
    """The raw manifest when it is this tool's (any version, even an invalid one), else None."""
    try:
        data = json.loads((out / NAME).read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def link_tree(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    """Recreate `src` under `dst` with hard links (copies where linking fails). Directories
    get the umask's mode; no file of `src` is ever opened for writing."""

    def link(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    def ignore(dirpath: str, names: list[str]) -> list[str]:
        return [n for n in names if Path(dirpath) == src and n in skip]

    shutil.copytree(src, dst, symlinks=True, copy_function=link, ignore=ignore, dirs_exist_ok=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False when the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Transaction:
    """Lock OUT, stage beside it, and swap the staged directory in (see the module docstring)."""

    def __init__(self, out: str | os.PathLike):
        out = Path(os.path.abspath(out))
        if out.is_symlink() and out.is_dir():
            out = out.resolve()  # replace the directory the link points to, keep the link
        if not out.name or out == out.parent:
            raise TransactionError(f"--out {out} must name a directory below another one")
        self.out = out
        self.parent = out.parent
        self.staging: Path | None = None
        self._lock_fd: int | None = None
        self.committed = False

    def _hidden(self, what: str) -> str:
        return f".{self.out.name}.{what}"

    def __enter__(self) -> Transaction:
        check_ours(self.out)
        self.parent.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._recover()
            check_ours(self.out)  # again: another run may have changed it before we locked
            staging = tempfile.mkdtemp(prefix=self._hidden("staging-"), dir=self.parent)
            fix_mode(staging, directory=True)
            self.staging = Path(staging)
        except BaseException:
            self._unlock()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.staging is not None and self.staging.exists():
                shutil.rmtree(self.staging, ignore_errors=True)
        finally:
            self._unlock()

    def _lock(self) -> None:
        path = self.parent / self._hidden("lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise TransactionError(
                    f"another dflash-export (pid {holder}) is writing {self.out}: wait for it "
                    "to finish, or use another --out"
                ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def _recover(self) -> None:
        """Undo what a killed run left: staging directories, and an OUT moved aside by the
        two-rename fallback (restored when OUT is missing)."""
        olds = sorted(self.parent.glob(self._hidden("old-*")))
        if not self.out.exists() and olds and (olds[-1] / "x").is_dir():
            os.rename(olds[-1] / "x", self.out)
        for leftover in olds + sorted(self.parent.glob(self._hidden("staging-*"))):
            shutil.rmtree(leftover, ignore_errors=True)

    def commit(self) -> None:
        """Swap the finished staging directory in; the old OUT (if any) is deleted after."""
        assert self.staging is not None
        _fsync_dir(self.staging)
        old: Path | None = None
        if not self.out.exists():
            os.rename(self.staging, self.out)
        elif _exchange(self.staging, self.out):
            old = self.staging  # holds the previous OUT now
        else:
            old = Path(tempfile.mkdtemp(prefix=self._hidden("old-"), dir=self.parent))
            os.rename(self.out, old / "x")  # the manifest of the new OUT is the commit point
            os.rename(self.staging, self.out)
        _fsync_dir(self.parent)
        self.committed = True
        self.staging = None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
