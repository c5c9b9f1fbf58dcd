"""A checkpoint directory replaced in one step, so that a reader (a server watching it) never sees
half of one save and half of the next.

Each save is written into a sibling staging directory, the files of the current directory that the
save does not write (the loss plot, the sample, anything the user put there) are hard-linked into
it, and the two directories are exchanged with Linux's renameat2(RENAME_EXCHANGE): one atomic step.
Where that call is missing (another OS, an old kernel or a filesystem without it) the old directory
is renamed aside and the new one into place, leaving the path absent for an instant but never
holding a mixture.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where the system cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _carry_over(old: Path, new: Path) -> None:
    """Hard-link (or copy) into `new` each entry of `old` that `new` does not have."""
    for entry in old.iterdir():
        target = new / entry.name
        if target.exists() or entry.name.startswith(".write-test"):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(target))


def _fsync_dir(path: Path) -> None:
    for file in path.iterdir():
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())


@contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """Yield an empty directory beside `target`; on a clean exit it becomes `target` in one step
    (on an exception it is removed and `target` is left as it was)."""
    target = target.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=target.parent))
    try:
        yield stage
        if target.is_dir():
            _carry_over(target, stage)
        _fsync_dir(stage)  # the data on disk before the rename makes it visible
        stage.chmod(0o755 & ~_umask())
        if not target.exists():
            stage.rename(target)
        elif _exchange(stage, target):
            shutil.rmtree(stage)  # now the previous save
        else:
            aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.previous-", dir=target.parent))
            aside.rmdir()
            target.rename(aside)
            stage.rename(target)
            shutil.rmtree(aside)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
