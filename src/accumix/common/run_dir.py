"""The run directory's layout, shared by the torch and JAX checkpoints (torch-free)::

    run_dir/
      latest          "step-120": written last, atomically replaced
      step-120/       one save; its meta.json is written last and lists every file's size
      .step-121.tmp   a save in progress (removed by the next save)

A save writes ``.step-N.tmp``, flushes, renames it to ``step-N`` and then replaces ``latest``:
a crash at any moment leaves the previous checkpoint complete and pointed to. A second save at
the same step moves the first aside to ``.step-N.old`` before its rename: a crash between those
two renames leaves ``latest`` naming a directory that is, for a moment, not there; the complete
``.step-N.tmp`` (the newer save: its ``meta.json`` is written before any rename) or
``.step-N.old`` stands in for it, and the next save renames it back into place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from accumix.common import remote_publish
from accumix.common.locations import AnyPath, RemotePath, location
from accumix.common.safe_paths import inside, step_pointer
from accumix.common.safe_write import fsync as fsync  # re-exported: where it was
from accumix.common.safe_write import replace_text
from accumix.common.shared_dir import remove_leftover_probes
from accumix.errors import CheckpointError

LATEST = "latest"
META = "meta.json"
STEP_DIR = re.compile(r"^step-(\d+)$")


def latest_checkpoint(run_dir: str | os.PathLike[str] | RemotePath) -> AnyPath | None:
    """The step directory ``run_dir/latest`` points to, or None when nothing was saved yet.

    For auto-resume: ``if latest_checkpoint(run_dir): acc.load_state(run_dir)``. After a crash
    in the middle of replacing a step directory this is the complete copy that survived.

    Args:
        run_dir: the directory ``save_state`` was given.

    Raises:
        CheckpointError: ``latest`` names anything but a ``step-N`` directory of ``run_dir``
            itself (``../other/step-0``, a path, a symbolic link), or is a link itself.
    """
    run_dir = location(run_dir)
    pointer = run_dir / LATEST
    if not pointer.is_file():
        return None
    if isinstance(run_dir, RemotePath):  # published in place: no stand-ins, no links
        name = pointer.read_text().strip()
        if not STEP_DIR.match(name):
            raise CheckpointError(f"{pointer} holds {name[:40]!r}, not a step-N name; it was "
                                  "not written by save_state")
        return run_dir / name
    target = step_pointer(run_dir, pointer)
    if target.is_dir():
        return target
    return _stand_in(target) or target


def _stand_in(target: Path) -> Path | None:
    """The complete leftover of an interrupted replacement of ``target``, newest first."""
    for suffix in (".tmp", ".old"):
        candidate = target.with_name(f".{target.name}{suffix}")
        if not candidate.is_symlink() and (candidate / META).is_file():
            return candidate
    return None


def _recover(run_dir: Path) -> None:
    # Before leftovers are cleared: else latest would point at nothing until the save publishes.
    try:
        target = latest_checkpoint(run_dir)
    except CheckpointError:  # a latest naming no step-N of its own: nothing to recover; the
        return  # save replaces it (never renames anything it names)
    if target is not None and target.name.startswith("."):
        os.rename(target, step_pointer(run_dir, run_dir / LATEST))
        fsync(run_dir)


def step_dirs(run_dir: AnyPath) -> list[str]:
    """The published ``step-N`` directories of ``run_dir``, oldest first (on an object store
    the ones with their ``meta.json``: a save writes its objects in place, that file last)."""
    if isinstance(run_dir, RemotePath):
        names = [p.parent.name for p in run_dir.glob(f"step-*/{META}")]
    else:
        names = [p.name for p in run_dir.iterdir() if p.is_dir()] if run_dir.is_dir() else []
    found = [(int(m.group(1)), name) for name in names if (m := STEP_DIR.match(name))]
    return [name for _, name in sorted(found)]


def resolve(path: str | os.PathLike[str] | RemotePath) -> AnyPath:
    """A step directory from a run directory (following ``latest``) or a step directory.

    A crash while a second save of the same step swapped directories can leave ``latest``
    pointing at a name that is briefly absent; the complete copy (``.step-N.tmp`` or
    ``.step-N.old`` with its ``meta.json``) is then used (``latest_checkpoint``).

    Args:
        path: a run directory or one ``step-N`` directory.

    Returns:
        The step directory.

    Raises:
        CheckpointError: neither ``latest`` nor ``meta.json`` is there, or ``latest`` points
            to a directory that does not exist.
    """
    path = location(path)
    if (path / META).is_file():
        return path
    from accumix.common.ray_checkpoint import latest_checkpoint as resume_point  # Ray's too

    target = resume_point(path)
    if target is None:
        raise CheckpointError(
            f"no checkpoint at {path}: it has neither {LATEST} nor {META}; pass a run "
            "directory written by save_state or one of its step-N directories")
    if not target.is_dir():
        raise CheckpointError(
            f"{path / LATEST} points to {target.name}, which does not exist; "
            f"load one of {step_dirs(path) or 'no other checkpoints'} explicitly")
    return target


def alternatives(step_dir: AnyPath) -> str:
    """The advice after a refusal: the other step directories of the run, if any."""
    others = [n for n in step_dirs(step_dir.parent) if n != step_dir.name]
    if not others:
        return "the checkpoint is unusable and there is no other in its run directory"
    return f"the checkpoint is unusable; load an earlier one: {', '.join(others)}"


def write_text(path: AnyPath, text: str) -> None:
    """Replaces ``path`` atomically with ``text``, durably (an object: one whole write), never
    through a link planted at ``path`` or at its temporary name (``common.safe_write``)."""
    if isinstance(path, RemotePath):
        path.write_text(text)
        return
    replace_text(path, text)


def write_json(path: AnyPath, obj: Any) -> None:
    try:
        text = json.dumps(obj, indent=1, allow_nan=True)
    except TypeError as exc:
        raise CheckpointError(f"training state for {path} is not JSON ({exc}); keep such state "
                              "to numbers, strings, lists and dicts") from exc
    write_text(path, text)


def json_state(state: Any, what: str) -> dict[str, Any]:
    """``state`` as ``meta.json`` holds it: a dict, numpy scalars as Python numbers.

    Raises:
        ConfigError: not a dict, or not JSON (numbers, strings, lists, dicts, None); the
            message names ``what``.
    """
    from accumix.errors import ConfigError

    try:
        if not isinstance(state, dict):
            raise TypeError(f"a {type(state).__name__}, not a dict")
        return json.loads(json.dumps(state, allow_nan=True, default=_numpy_number))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} is not JSON ({exc}); keep it to numbers, strings, lists "
                          "and dicts") from None


def _numpy_number(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.generic) and value.shape == ():
        return value.item()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def extra_state(step_dir: AnyPath) -> dict[str, Any]:
    """What ``save_state(extra_state=...)`` stored in ``step_dir`` ({} if nothing).

    Args:
        step_dir: a ``step-N`` directory (``resolve(run_dir)`` gives the latest).
    """
    return read_meta(step_dir).get("extra_state") or {}


def manifest(directory: AnyPath) -> dict[str, int]:
    """Every file under ``directory`` with its size, flushed to disk first."""
    if isinstance(directory, RemotePath):  # one listing; objects are durable once written
        return {n: size for n, size in sorted(directory.sizes().items()) if n != META}
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    for file in files:
        fsync(file)
    return {p.relative_to(directory).as_posix(): p.stat().st_size for p in files}


def check_manifest(step_dir: AnyPath, files: dict[str, int]) -> None:
    """Refuses a torn checkpoint: a listed file missing or of another size.

    Raises:
        CheckpointError: naming the first file that does not match.
    """
    for name, size in files.items():
        file = inside(step_dir, name, f"{META}'s file list")
        if not file.is_file():
            raise CheckpointError(f"checkpoint {step_dir} is torn: {file} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"checkpoint {step_dir} is torn: {file} has "
                                  f"{file.stat().st_size} bytes, {size} were written")


def read_meta(step_dir: AnyPath) -> dict[str, Any]:
    """``step_dir/meta.json``, or a CheckpointError naming it."""
    meta_path = step_dir / META
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {meta_path}: {exc}; the checkpoint is incomplete "
                              "or not accumix's") from exc
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path} is not an accumix checkpoint's metadata")
    return meta


def prepare(run_dir: AnyPath, tmp: AnyPath) -> None:
    """Creates ``run_dir`` and an empty ``tmp``, removing what crashed saves left (after putting
    the stand-in of a missing ``latest`` target back in place). On an object store ``tmp`` is
    the step directory itself (``remote_publish.prepare``)."""
    if isinstance(run_dir, RemotePath):
        assert isinstance(tmp, RemotePath)
        remote_publish.prepare(run_dir, tmp)
        return
    assert isinstance(tmp, Path)
    run_dir.mkdir(parents=True, exist_ok=True)
    _recover(run_dir)
    for leftover in run_dir.glob(".step-*.*"):
        shutil.rmtree(leftover, ignore_errors=True)
    remove_leftover_probes(run_dir)
    tmp.mkdir()


def publish(run_dir: AnyPath, tmp: AnyPath, final: AnyPath, meta: dict[str, Any],
            keep_last: int | None) -> None:
    """Writes ``meta.json`` (with the manifest) into ``tmp``, renames it to ``final``, points
    ``latest`` at it and prunes to ``keep_last`` step directories. On an object store the
    objects are in ``final`` already: ``meta.json``, then ``latest``."""
    if isinstance(final, RemotePath):
        meta["files"] = manifest(final)
        write_json(final / META, meta)
        point_latest(run_dir, final, keep_last)
        return
    assert isinstance(run_dir, Path) and isinstance(tmp, Path)
    publish_step(run_dir, tmp, final, meta)
    point_latest(run_dir, final, keep_last)


def publish_step(run_dir: Path, tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Writes ``meta.json`` (with the manifest) into ``tmp`` and renames it to ``final``;
    ``latest`` is left as it was (``point_latest`` follows once every node has published)."""
    meta["files"] = manifest(tmp)
    write_json(tmp / META, meta)
    fsync(tmp)
    if final.exists():  # a second save at the same step replaces the first
        trash = run_dir / f".{final.name}.old"
        shutil.rmtree(trash, ignore_errors=True)
        # A crash between these renames: latest_checkpoint finds the complete .tmp (or .old).
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash)
    else:
        os.rename(tmp, final)
    fsync(run_dir)


def point_latest(run_dir: AnyPath, final: AnyPath, keep_last: int | None) -> None:
    """Points ``latest`` at the published ``final`` and prunes to ``keep_last`` steps."""
    write_text(run_dir / LATEST, final.name + "\n")
    if keep_last is not None:
        current = int(final.name.split("-")[1])
        older = [n for n in step_dirs(run_dir) if int(n.split("-")[1]) < current]
        for name in older[: max(len(older) - (keep_last - 1), 0)]:
            if isinstance(run_dir, RemotePath):
                remote_publish.remove_step(run_dir / name)
            else:
                shutil.rmtree(run_dir / name)
