"""Output files: checked before the work that fills them, written atomically (a reader sees
the old file or the complete new one, never half of it), with the mode any new file gets.
Input files someone else made (a release, a checkpoint): opened without following a link.

Nothing here creates an output's directory: it must exist, so that a typo in ``--out`` (or
one run as root) fails at once instead of leaving a directory tree behind. An input path a
command is given is checked as its arguments are parsed (:func:`existing_path`), as early."""

from __future__ import annotations

import argparse
import errno
import os
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

#: A new output's mode before the umask: 0644 under the usual 022, as ``open()`` would make it.
OUTPUT_MODE = 0o666


def existing_path(value: str) -> Path:
    """An argparse ``type`` for an input file or directory: one that does not exist is refused
    naming it, with the command's usage, before the command imports its frameworks (a typo
    is told in a fraction of a second, not after seconds of imports)."""
    path = Path(value)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{value}: not found")
    return path


def check_output(path: Path, suffix: str, flag: str) -> None:
    """Fail before any work if ``path`` (given as ``flag``) cannot be written: the wrong
    suffix, a directory, or a directory that does not exist."""
    if path.suffix != suffix:
        raise ValueError(f"{flag} must name a {suffix} file, got {path}")
    if path.is_dir():
        raise IsADirectoryError(f"{flag} {path} is a directory")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{flag} {path}: directory {path.parent} does not exist "
                                "(create it first)")


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a new empty file beside ``path``; on success it replaces ``path``, else vanishes."""
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"output {target} is a directory")
    if not target.parent.is_dir():
        raise FileNotFoundError(f"cannot write {target}: directory {target.parent} does not "
                                "exist (create it first)")
    tmp = target.parent / f".{target.name}.{secrets.token_hex(6)}{target.suffix}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, OUTPUT_MODE)  # umask applies
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, mode)  # a writer may have replaced it by a private file: see share_as_new
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def staging_directory(target: Path) -> Path:
    """A new empty directory beside ``target``, renamed to it once complete. Made by ``mkdir``,
    not ``mkdtemp``: a server running as another user must read what it holds, so it gets the
    mode the umask gives any new directory, not a temporary's 0700 (nor a fixed 0755)."""
    staging = target.parent / f".{target.name}.{secrets.token_hex(6)}"
    staging.mkdir()
    return staging


def share_as_new(directory: Path) -> None:
    """Give every file under ``directory`` (made by ``mkdir``, so the umask applied) the mode
    the umask gives a new file. Some writers go through a private temporary (safetensors'
    ``save_file`` leaves its file 0600, even over an existing one): a server running as another
    user (the images' uid 10001) could not read those weights."""
    mode = stat.S_IMODE(directory.stat().st_mode) & OUTPUT_MODE
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """``path`` opened for reading if it is a regular file itself: not a symbolic link (which
    could name any file this process may read: ``/proc/self/environ``), nor a FIFO or device
    (which would block or never end). ``O_NONBLOCK`` so that opening a FIFO does not wait for
    a writer; it changes nothing for a regular file. Raises ``ValueError`` naming the path."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symbolic link; only regular files are read") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file")
    return os.fdopen(fd, "rb")
