"""The run directory on disk: step directories, the ``latest`` pointer, durable writes, safe reads.

A save is written to ``.step-N.tmp`` and renamed to ``step-N``; ``latest`` follows. A second save
at the same step moves the first aside to ``.step-N.old`` before its rename, so a crash between
those two renames leaves ``latest`` naming a directory that is, for a moment, not there: the
complete ``.step-N.tmp`` (the newer save; its ``meta.json`` is written before any rename) or
``.step-N.old`` then stands in for it, and the next save renames it back into place before it
clears leftovers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from accumix.errors import AccumixError

LATEST = "latest"
META = "meta.json"
MODEL_DIR = "model"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(AccumixError):
    """A checkpoint that is missing, torn, corrupt or does not fit this run; names the file."""


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The step directory ``run_dir/latest`` points to, or None when nothing was saved yet.

    For auto-resume: ``if latest_checkpoint(run_dir): acc.load_state(run_dir)``. After a crash
    in the middle of replacing a step directory this is the complete copy that survived.
    """
    pointer = Path(run_dir) / LATEST
    if not pointer.is_file():
        return None
    target = Path(run_dir) / pointer.read_text().strip()
    if target.is_dir():
        return target
    return _stand_in(target) or target


def _stand_in(target: Path) -> Path | None:
    """The complete leftover of an interrupted replacement of ``target``, newest first."""
    for suffix in (".tmp", ".old"):
        candidate = target.with_name(f".{target.name}{suffix}")
        if (candidate / META).is_file():
            return candidate
    return None


def recover(run_dir: Path) -> None:
    """Renames the stand-in of a missing ``latest`` target back into place (rank 0, before a
    save clears leftovers: else ``latest`` would point at nothing until the save publishes)."""
    pointer = run_dir / LATEST
    if not pointer.is_file():
        return
    target = run_dir / pointer.read_text().strip()
    if not target.is_dir() and (found := _stand_in(target)) is not None:
        os.rename(found, target)
        fsync(run_dir)


def resolve(path: str | os.PathLike[str]) -> Path:
    """A step directory from a run directory (following ``latest``) or a step directory.

    Raises:
        CheckpointError: neither ``latest`` nor ``meta.json`` is there, or ``latest`` points
            to a directory that does not exist.
    """
    path = Path(path)
    if (path / META).is_file():
        return path
    target = latest_checkpoint(path)
    if target is None:
        raise CheckpointError(
            f"no checkpoint at {path}: it has neither {LATEST} nor {META}; pass a run "
            "directory written by acc.save_state or one of its step-N directories"
        )
    if not target.is_dir():
        raise CheckpointError(
            f"{path / LATEST} points to {target.name}, which does not exist; "
            f"load one of {step_dirs(path) or 'no other checkpoints'} explicitly"
        )
    return target


def step_dirs(run_dir: Path) -> list[str]:
    found = [(int(m.group(1)), p.name) for p in run_dir.iterdir()
             if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [name for _, name in sorted(found)]


def alternatives(step_dir: Path) -> str:
    others = [n for n in step_dirs(step_dir.parent) if n != step_dir.name]
    if not others:
        return "the checkpoint is unusable and there is no other in its run directory"
    return f"the checkpoint is unusable; load an earlier one: {', '.join(others)}"


def prune(run_dir: Path, current: int, keep_last: int) -> None:
    older = [name for name in step_dirs(run_dir) if int(name[5:]) < current]
    for name in older[: max(len(older) - (keep_last - 1), 0)]:
        shutil.rmtree(run_dir / name)


def manifest(directory: Path) -> dict[str, int]:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    for path in files:  # ranks wrote them; make them durable before the rename publishes
        fsync(path)
    return {p.relative_to(directory).as_posix(): p.stat().st_size for p in files}


# -- durable writes --------------------------------------------------------------------------
def fsync(path: Path) -> None:
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


def write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync(path.parent)


def write_json(path: Path, obj: Any) -> None:
    try:
        text = json.dumps(obj, indent=1, allow_nan=True)
    except TypeError as exc:
        raise CheckpointError(
            f"training state for {path} is not JSON (a scaler state_dict holds a {exc}); keep "
            "such state to numbers, strings, lists and dicts"
        ) from exc
    write_text(path, text)


def write_tensors(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def read_tensors(path: Path) -> Any:
    """``torch.load(weights_only=True)``: tensors, numbers, strings, containers; no classes."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - zip errors, EOF, refused globals
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc}); "
                              f"{alternatives(path.parent)}") from exc
