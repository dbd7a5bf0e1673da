"""Paths read from a checkpoint stay inside it (torch-free).

A checkpoint names files: ``latest`` names a step directory, ``meta.json`` lists the files of
its step, DCP's ``.metadata`` gives each entry's file as a ``relative_path``. Whoever supplies
the checkpoint chooses those names; used as given, ``../../x`` or ``/abs/x`` (or a symbolic link
planted inside the checkpoint) would make a load read another file of the loading user's, a
private one, into the model, from where it leaks when the model is shared. Each name is checked
here before anything is read.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from accumix.errors import CheckpointError

STEP_NAME = re.compile(r"^step-(\d+)$")


def inside(base: Any, name: str, what: str) -> Any:
    """``base / name``, checked to stay inside ``base``.

    ``name`` must be relative, without ``..`` parts; on a local ``base`` it must also resolve
    (symbolic links followed) inside ``base`` resolved: a link planted in a checkpoint that
    points elsewhere is refused like ``../``. (An object store's ``base``, which has no links,
    gets the first check.)

    Args:
        base: the directory the name is relative to (a checkpoint or step directory: a local
            path, or an object store's ``RemotePath`` / URL).
        name: the name as the checkpoint gives it.
        what: where the name was read, for the message (``"meta.json"``, ``".metadata"``).

    Returns:
        The path (not resolved: messages show it as the checkpoint names it).

    Raises:
        CheckpointError: the name leaves ``base``.
    """
    if (not isinstance(name, str) or not name or "\x00" in name
            or PurePosixPath(name).is_absolute() or PureWindowsPath(name).drive
            or PureWindowsPath(name).is_absolute()
            or ".." in PurePosixPath(name).parts or ".." in PureWindowsPath(name).parts):
        raise CheckpointError(_outside(base, name, what))
    if not isinstance(base, (str, os.PathLike)):  # a RemotePath
        return base / name
    if "://" in os.fspath(base):  # an object store's URL
        return f"{os.fspath(base).rstrip('/')}/{name}"
    path = Path(base) / name
    root = os.path.realpath(base)
    resolved = os.path.realpath(path)
    if resolved != root and not resolved.startswith(root.rstrip(os.sep) + os.sep):
        raise CheckpointError(_outside(base, name, what, f" (it resolves to {resolved})"))
    return path


def _outside(base: Any, name: object, what: str, detail: str = "") -> str:
    return (f"{what} in {base} names the file {name!r}{detail}, outside the checkpoint; a "
            "checkpoint only reads its own files: refused before anything was read (was the "
            "checkpoint tampered with?)")


def step_pointer(run_dir: str | os.PathLike[str], pointer: str | os.PathLike[str]) -> Path:
    """The step directory the file ``pointer`` (``run_dir/latest``) names, which must be a
    ``step-N`` of ``run_dir`` itself (a real directory there, not a link to elsewhere, when
    it exists). ``pointer`` itself must not be a symbolic link.

    Raises:
        CheckpointError: anything else (``../other/step-0``, an absolute path, a link).
    """
    pointer = Path(pointer)
    if pointer.is_symlink():
        raise CheckpointError(
            f"{pointer} is a symbolic link (to {os.readlink(pointer)}); refused: accumix writes "
            "latest as a file naming a step-N directory of its run directory")
    with open(pointer, "rb") as f:
        raw = f.read(256)  # a step name is short; never read a planted large file whole
    name = raw.decode("utf-8", errors="replace").strip()
    if not STEP_NAME.match(name):
        shown = name if len(name) <= 60 and name.isprintable() else f"{len(raw)}+ bytes"
        raise CheckpointError(
            f"{pointer} holds {shown!r}, not the name of a step-N directory of {run_dir}; "
            "refused (a checkpoint is only loaded from its own run directory); load a step "
            "directory explicitly, or write its name (e.g. step-120) into latest")
    target = Path(run_dir) / name
    if target.is_symlink():
        raise CheckpointError(
            f"{target} is a symbolic link (to {os.readlink(target)}); refused: latest must name "
            "a step directory of the run directory itself; load the target explicitly if you "
            "trust it")
    return target
