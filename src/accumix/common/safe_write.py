"""Files accumix writes in a run directory, never through a link planted there (torch-free).

Anyone who can write into a run directory (a shared team folder, a run directory handed over
for resuming, an ``output_dir`` under /tmp) could plant ``run_dir/.lock -> ~/.bashrc``: a plain
``open(path, "w")`` follows the link and overwrites the training user's file. Every writer goes
through one of these instead:

* ``replace_text`` / ``replace_bytes``: a fresh file created exclusively (``O_CREAT |
  O_EXCL``: a name that exists, a link included, is never opened) then renamed over the name
  (a rename replaces a link itself, never its target);
* ``replace_with``: the same for a library that writes by path (safetensors, matplotlib);
* ``open_in_place``: a file kept open and rewritten or appended to (``metrics.csv``, the lock):
  opened with ``O_NOFOLLOW`` and refused unless it is a regular file with one link (a planted
  hard link to another file of the user's would be written through too), truncated only after
  those checks;
* ``make_dir``: a directory accumix writes into, refused when it is a link.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from accumix.errors import ConfigError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # not on Windows, where links need privileges


def _refusal(path: Path, what: str) -> ConfigError:
    return ConfigError(
        f"{path} is {what}; accumix never writes through it (someone with write access to the "
        "run directory may have planted it to overwrite another file): remove it, or give "
        "this job a run directory only you can write")


def _check_regular(path: Path, fd: int) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise _refusal(path, "not a regular file")
    if info.st_nlink > 1:
        raise _refusal(path, f"a hard link ({info.st_nlink} names for one file)")


def open_fd(path: str | os.PathLike[str], *, read: bool = False, append: bool = False,
            truncate: bool = False, permissions: int = 0o666) -> int:
    """A descriptor of ``path`` opened for writing (created if absent), without following a
    link at ``path`` and only on a regular file with one name; truncated (``truncate``) only
    after those checks.

    Raises:
        ConfigError: ``path`` is a symbolic link, a hard link, or not a regular file.
        OSError: the file cannot be opened (permissions, a missing directory).
    """
    path = Path(path)
    flags = os.O_CREAT | _NOFOLLOW | (os.O_RDWR if read else os.O_WRONLY)
    if append:
        flags |= os.O_APPEND
    try:
        fd = os.open(path, flags, permissions)
    except OSError:
        if path.is_symlink():
            raise _refusal(path, f"a symbolic link (to {os.readlink(path)})") from None
        raise
    try:
        _check_regular(path, fd)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_in_place(path: str | os.PathLike[str], mode: str = "w", *,
                  newline: str | None = None) -> IO[Any]:
    """``open(path, mode)`` for ``"w"`` or ``"a"`` (``"wb"``, ``"ab"``), through ``open_fd``:
    never through a link.

    Raises:
        ConfigError: ``path`` is a symbolic link, a hard link, or not a regular file.
    """
    fd = open_fd(path, append=mode.startswith("a"), truncate=mode.startswith("w"))
    return os.fdopen(fd, mode, newline=newline)


def replace_bytes(path: str | os.PathLike[str], data: bytes, *, durable: bool = True,
                  tmp: str | os.PathLike[str] | None = None) -> None:
    """Replaces ``path`` with ``data`` atomically: a temporary name (default ``.<name>.tmp``
    beside it) created exclusively (a leftover, or a link planted under that name, is removed
    first, never followed), flushed (``durable``: to disk), then renamed over ``path``; its
    permissions are what ``open(path, "w")`` would give (the umask's)."""
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # removes a planted link itself, not its target
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync(path.parent)


def replace_text(path: str | os.PathLike[str], text: str, *, durable: bool = True,
                 tmp: str | os.PathLike[str] | None = None) -> None:
    """``replace_bytes`` for text (UTF-8)."""
    replace_bytes(path, text.encode(), durable=durable, tmp=tmp)


def replace_with(path: str | os.PathLike[str], write: Callable[[str], Any]) -> None:
    """Replaces ``path`` with what ``write(tmp)`` writes to a fresh temporary name beside it
    (a library that takes a path: ``safetensors.save_file``, ``Figure.savefig``), then renames
    it over ``path``; the temporary name is removed if ``write`` fails. Permissions as
    ``open(path, "w")`` would give (``mkstemp``'s 0600 would hide the file from a team)."""
    path = Path(path)
    tmp = str(path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp"))
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666))
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def refuse_link(path: str | os.PathLike[str]) -> Path:
    """``path``, after refusing it when it is a symbolic link (a file accumix reads back from
    the run directory and then rewrites, or sends on to a tracker).

    Raises:
        ConfigError: ``path`` is a symbolic link.
    """
    path = Path(path)
    if path.is_symlink():
        raise _refusal(path, f"a symbolic link (to {os.readlink(path)})")
    return path


def make_dir(path: str | os.PathLike[str]) -> Path:
    """``mkdir -p path``, refusing a ``path`` that is a symbolic link (to write into).

    Raises:
        ConfigError: ``path`` is a link or not a directory.
    """
    path = refuse_link(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def fsync(path: str | os.PathLike[str]) -> None:
    """Flushes a file or directory to disk (a directory: the names in it); where the file
    system refuses, nothing."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)
