"""Checkpoints under Ray Train: ``save_state`` hands each step directory to Ray, and a worker
that starts resumes from what Ray holds. Torch-free: both backends call it with their own
all-gather.

Saving (``hand_over``, after the step directory is written and published, every rank):

1. Each rank lists the files it sees in its step directory; the lists are all-gathered, and
   every file is assigned to exactly one rank that sees it, largest first, to the rank with the
   fewest bytes so far. On a shared filesystem the ranks split the upload; with a run directory
   per node each uploads what only it holds. No state travels to rank 0 (ray#44501).
2. Each rank hard-links its files into ``run_dir/.ray-step-N-<rank>`` (rank 0 adds
   ``accumix-ray.json``: the step, every rank's run directory, every file of the checkpoint
   with its size) and calls ``ray.train.report`` with it: Ray merges the ranks' directories into
   one checkpoint, ``<storage_path>/<name>/step-N``, and may delete the linked directory after
   the upload (``ASYNC``'s default): the step directory that ``latest`` names keeps its own links.
3. Rank 0 records the checkpoint's name in ``accumix-latest`` in Ray's experiment directory (the
   last few of each run directory): ``SYNC`` (the default) once every rank's upload returned,
   ``ASYNC`` at once. Ray's own list has only what its controller registered before a worker
   died: a SIGKILL right after a save restarted from step 0 (ray#41700's kind).

Resuming (``latest_checkpoint(run_dir)`` / ``load_state(run_dir)``, in a worker that has not saved
into ``run_dir`` yet, i.e. one Ray just started or restarted): of Ray's registered checkpoint
(``ray.train.get_checkpoint()``) and those ``accumix-latest`` records, the newest by step whose
``accumix-ray.json`` names this run directory and whose files are all in Ray's storage with
their sizes (an upload cut short is skipped: ray#41700). Every worker sees the same storage, so
all load one step (ray#35613, #46814: never an older or another run's). The copy in ``run_dir``
is used when it holds every file of Ray's, else Ray's is downloaded into ``run_dir`` (a worker on
a fresh node, or a node whose disk was lost). Nothing of this run directory at Ray: its own
``latest``, as outside Ray. Once a worker has saved into ``run_dir``, its ``latest`` is followed
again (nothing was lost since).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accumix.common import ray_train
from accumix.common import run_dir as layout
from accumix.common.agreed_failure import Gather, run_and_agree
from accumix.common.locations import AnyPath, RemotePath
from accumix.errors import CheckpointError, ConfigError

log = logging.getLogger("accumix")

POINTER = "accumix-latest"  # in Ray's experiment directory: each run directory's last saves
RUN_FILE = "accumix-ray.json"  # in each checkpoint handed to Ray: where it came from, its files
NAME = re.compile(r"^step-(\d+)(?:-\d+)?$")  # Ray's checkpoint names (a repeat save: step-N-k)
UPLOAD_MODES = ("sync", "async")
KEEP_NAMES = 3  # records per run directory: the newest complete one is the resume point

_saved: set[str] = set()  # run directories this process handed a checkpoint of to Ray
_cleaned: set[str] = set()  # run directories whose stale links of this rank were removed


def active() -> bool:
    """Checkpoints go to Ray: this is a Ray Train worker."""
    return ray_train.in_worker()


@dataclass(frozen=True, kw_only=True)
class Handoff:
    """What a save hands to Ray Train after its step directory is published."""

    metrics: dict[str, Any] | None
    mode: str  # "sync" | "async"

    def hand_over(self, run_dir: Any, step_dir: Any, *, rank: int, gather: Gather) -> None:
        """``hand_over`` for a local run directory; an object store's (durable already) sends
        Ray only the metrics."""
        if isinstance(run_dir, Path):
            hand_over(run_dir, step_dir, rank=rank, gather=gather, metrics=self.metrics,
                      mode=self.mode)
        else:
            import ray.train

            ray.train.report(self.metrics or {})


def checked(metrics: dict[str, Any] | None, mode: Any, *, background: bool) -> Handoff | None:
    """``save_state``'s Ray arguments, checked on every rank before anything is written: the
    hand-off to make (None outside Ray Train).

    Raises:
        ConfigError: ``metrics`` not JSON, an unknown upload mode, or ``background=True`` under
            Ray Train (Ray's report must come from the loop's thread: Ray pairs the workers'
            reports by their order).
    """
    if metrics is not None:
        metrics = layout.json_state(metrics, "save_state(metrics=...)")
    word = upload_mode(mode)
    if not active():
        return None
    if background:
        raise ConfigError("save_state(background=True) is not available under Ray Train; use "
                          "checkpoint_upload_mode='async' (Ray uploads behind the loop)")
    return Handoff(metrics=metrics, mode=word)


def upload_mode(value: Any) -> str:
    """``"sync"`` or ``"async"`` from a word or Ray's ``CheckpointUploadMode``.

    Raises:
        ConfigError: another value.
    """
    word = getattr(value, "value", value)
    if isinstance(word, str) and word.lower() in UPLOAD_MODES:
        return word.lower()
    raise ConfigError(f"checkpoint_upload_mode={value!r} is invalid; use 'sync' (Ray's "
                      "default: save_state returns once Ray holds the checkpoint) or 'async'")


# -- saving ------------------------------------------------------------------------------------
def hand_over(run_dir: Path, step_dir: Path, *, rank: int, gather: Gather,
              metrics: dict[str, Any] | None, mode: str) -> None:
    """Reports the step directory just saved to Ray Train; collective (see the module doc).

    Args:
        run_dir: the run directory ``save_state`` wrote into.
        step_dir: the step directory (``run_dir/step-N``).
        rank: this rank.
        gather: the backend's all-gather of Python objects.
        metrics: reported with the checkpoint (rank 0's become its metrics in Ray's result).
        mode: ``"sync"`` or ``"async"`` (Ray's checkpoint upload mode).

    Raises:
        CheckpointError: a rank failed to link or report its files (every rank raises).
    """
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    run_dir = run_dir.absolute()
    if str(run_dir) not in _cleaned:  # links a killed process left (none can be uploading)
        for stale in run_dir.glob(f".ray-step-*-{rank}"):
            shutil.rmtree(stale, ignore_errors=True)
        _cleaned.add(str(run_dir))
    source = step_dir
    everyone = gather([str(run_dir), _listing(source)])
    listings = [files for _, files in everyone]
    shares = assign(listings)
    link = run_dir / f".ray-{step_dir.name}-{rank}"
    name = step_dir.name

    def prepare() -> None:
        nonlocal name
        shutil.rmtree(link, ignore_errors=True)
        for relative in shares[rank]:
            _link(source / relative, link / relative)
        if rank == 0:
            files = {name: listings[r][name] for r, share in enumerate(shares) for name in share}
            link.mkdir(parents=True, exist_ok=True)
            layout.write_json(link / RUN_FILE, {
                "step": int(step_dir.name.split("-")[1]), "run_dirs": [d for d, _ in everyone],
                "files": files})
            name = _free_name(step_dir.name)

    run_and_agree(gather, prepare, f"linking {step_dir}'s files for Ray")
    checkpoint = Checkpoint.from_directory(str(link)) if link.is_dir() else None

    def report() -> None:
        # Ray takes rank 0's name for every rank (it broadcasts it).
        ray.train.report(metrics or {}, checkpoint=checkpoint, checkpoint_dir_name=name,
                         checkpoint_upload_mode=CheckpointUploadMode[mode.upper()],
                         delete_local_checkpoint_after_upload=True)

    run_and_agree(gather, report, f"handing {step_dir} to Ray Train")
    _saved.add(str(run_dir))
    if rank == 0:
        try:
            _record(everyone[0][0], name)
        except Exception as exc:  # noqa: BLE001 - Ray holds it anyway; its list still resumes
            log.warning("could not record %s in Ray's storage (%s: %s); a restart before Ray "
                        "registers it resumes from the one before", name, type(exc).__name__,
                        exc)


def assign(listings: list[dict[str, int]]) -> list[list[str]]:
    """Each file to one rank that sees it: largest first, to the rank with the fewest bytes
    assigned so far (ties: the lowest rank). Deterministic: every rank computes the same.

    Ranks that list the same files see one directory. A name that several directories hold
    (with a run directory per node, each node's ``meta.json``, DCP's ``.metadata``: each node's
    copy is whole, and points at its own files) comes from the lowest such directory only:
    Ray's merged copy is then that node's whole copy plus what only the others hold, never a
    mix of two nodes' versions of one file.

    Args:
        listings: per rank, the files it sees (relative path -> size).

    Returns:
        Per rank, the files it uploads.
    """
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for files in listings:
        for name, size in files.items():
            if name not in holders:  # the lowest rank that holds it; its directory's ranks
                holders[name] = [r for r, other in enumerate(listings) if other == files]
                sizes[name] = size
    load = [0] * len(listings)
    shares: list[list[str]] = [[] for _ in listings]
    for name in sorted(holders, key=lambda n: (-sizes[n], n)):
        rank = min(holders[name], key=lambda r: (load[r], r))
        shares[rank].append(name)
        load[rank] += sizes[name]
    return shares


def _listing(directory: Path) -> dict[str, int]:
    if not directory.is_dir():
        return {}
    return {p.relative_to(directory).as_posix(): p.stat().st_size
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _link(source: Path, target: Path) -> None:
    """A hard link (Ray may delete what it uploaded; the step directory keeps its files); a
    copy where the filesystem has none."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _storage() -> tuple[Any, str]:
    """Ray's storage filesystem (pyarrow) and the run's experiment directory in it."""
    context = ray_train.train_context()
    assert context is not None
    storage = context.get_storage()
    return storage.storage_filesystem, storage.experiment_fs_path


def _exists(fs: Any, path: str) -> bool:
    from pyarrow.fs import FileType

    return fs.get_file_info(path).type != FileType.NotFound


def _free_name(name: str) -> str:
    """``name``, or ``name-k`` when Ray's storage holds it already: a second save at one step
    (or after a restart) must not become a second entry for one directory in Ray's checkpoint
    list, whose pruning (``num_to_keep``) would then delete the newer save with the older."""
    fs, root = _storage()
    candidate, k = name, 0
    while _exists(fs, posixpath.join(root, candidate)):
        k += 1
        candidate = f"{name}-{k}"
    return candidate


def _records(fs: Any, root: str) -> dict[str, list[str]]:
    raw = _read(fs, posixpath.join(root, POINTER))
    try:
        runs = json.loads(raw)["runs"] if raw else {}
    except (ValueError, KeyError, TypeError):
        return {}
    return runs if isinstance(runs, dict) else {}


def _record(key: str, name: str) -> None:
    """Adds ``name`` to ``accumix-latest``'s records of the run directory ``key`` (rank 0's);
    replaced whole (a temporary object, then a move)."""
    fs, root = _storage()
    runs = _records(fs, root)
    runs[key] = [*[n for n in runs.get(key, []) if n != name], name][-KEEP_NAMES:]
    path = posixpath.join(root, POINTER)
    with fs.open_output_stream(path + ".tmp") as out:
        out.write(json.dumps({"runs": runs}).encode())
    fs.move(path + ".tmp", path)


def _read(fs: Any, path: str) -> bytes | None:
    try:
        with fs.open_input_stream(path) as stream:
            return stream.read()
    except OSError:  # FileNotFoundError included
        return None


# -- resuming ----------------------------------------------------------------------------------
def latest_checkpoint(run_dir: str | os.PathLike[str] | RemotePath) -> AnyPath | None:
    """The step directory to resume from: ``run_dir/latest``'s, or None when nothing was saved
    yet. Under Ray Train, in a worker that has not saved into ``run_dir`` yet (one Ray started
    or restarted), the newest checkpoint Ray holds of ``run_dir``, fetched into it where it
    lacks it (``accumix.common.ray_checkpoint``).

    For auto-resume: ``if latest_checkpoint(run_dir): acc.load_state(run_dir)``. After a crash
    in the middle of replacing a step directory this is the complete copy that survived.

    Args:
        run_dir: the directory ``save_state`` was given (a path or an object store URL).

    Returns:
        The step directory, or None.
    """
    # An object store URL is its own durable place: Ray's copy adds nothing.
    held = resume_dir(Path(run_dir)) if "://" not in str(run_dir) and resuming(run_dir) else None
    return held if held is not None else layout.latest_checkpoint(run_dir)


def resuming(run_dir: str | os.PathLike[str]) -> bool:
    """A Ray Train worker that has not handed a checkpoint of ``run_dir`` to Ray yet (one Ray
    just started or restarted)."""
    return str(Path(run_dir).absolute()) not in _saved and ray_train.in_worker()


def resume_dir(run_dir: Path) -> Path | None:
    """Ray's newest complete checkpoint of ``run_dir``, in ``run_dir`` (see the module doc);
    None when Ray holds none of it."""
    import ray.train

    fs, root = _storage()
    run_dir = run_dir.absolute()
    names = [name for names in _records(fs, root).values() for name in names]
    registered = ray.train.get_checkpoint()
    if registered is not None:
        names.append(posixpath.basename(registered.path.rstrip("/")))
    found: tuple[int, str, dict[str, int]] | None = None
    for name in set(names):
        match = NAME.match(name)
        info = _run_file(fs, posixpath.join(root, name)) if match else None
        if info is None or str(run_dir) not in info["run_dirs"]:
            continue  # not accumix's, pruned by Ray's num_to_keep, or another run directory's
        step = int(match.group(1))  # type: ignore[union-attr]
        if found is not None and (step, name) <= found[:2]:
            continue
        if not _complete(_remote_listing(fs, posixpath.join(root, name)), info["files"]):
            log.info("Ray's checkpoint %s lacks files (an upload cut short): skipped", name)
            continue
        found = (step, name, info["files"])
    if found is None:
        return None
    step, name, files = found
    local = layout.latest_checkpoint(run_dir)
    if local is not None and NAME.match(local.name) and int(local.name.split("-")[1]) > step:
        log.info("%s names %s, but the newest save that reached Ray from every worker is step "
                 "%d: resuming there", run_dir / layout.LATEST, local.name, step)
    return _fetch(fs, posixpath.join(root, name), run_dir, step, files)


def _run_file(fs: Any, checkpoint: str) -> dict[str, Any] | None:
    raw = _read(fs, posixpath.join(checkpoint, RUN_FILE))
    try:
        info = json.loads(raw) if raw else None
    except ValueError:
        return None
    if not (isinstance(info, dict) and isinstance(info.get("run_dirs"), list)
            and isinstance(info.get("files"), dict)):
        return None
    return info


def _remote_listing(fs: Any, path: str) -> dict[str, int]:
    from pyarrow.fs import FileSelector, FileType

    infos = fs.get_file_info(FileSelector(path, recursive=True, allow_not_found=True))
    return {posixpath.relpath(i.path, path): i.size for i in infos if i.type == FileType.File}


def _complete(present: dict[str, int], wanted: dict[str, int]) -> bool:
    return all(present.get(name) == size for name, size in wanted.items())


def _fetch(fs: Any, remote: str, run_dir: Path, step: int, files: dict[str, int]) -> Path:
    """``run_dir/step-N`` holding every file of Ray's copy: as it is when it does, else Ray's
    copy downloaded in its place. Always that name: every rank loads ``step-N`` of its own
    run directory (and agrees on it with the others as elsewhere)."""
    from pyarrow.fs import LocalFileSystem, copy_files

    local = run_dir / f"step-{step}"
    if _complete(_listing(local), files):
        return local
    rank = ray_train.train_context().get_world_rank()  # type: ignore[union-attr]
    part = run_dir / f".step-{step}.ray-{rank}.part"
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(part, ignore_errors=True)
    copy_files(remote, str(part), source_filesystem=fs, destination_filesystem=LocalFileSystem())
    (part / RUN_FILE).unlink(missing_ok=True)
    if not _complete(_listing(part), files):
        raise CheckpointError(f"downloading Ray's checkpoint {remote} into {part} left files "
                              "missing or short")
    # Other ranks on this disk may be doing the same: any complete copy in place will do.
    for _ in range(3):
        if _complete(_listing(local), files):
            break
        if local.exists():  # this node's part only (or another run's): set aside
            trash = run_dir / f".step-{step}.ray-{rank}.old"
            shutil.rmtree(trash, ignore_errors=True)
            try:
                os.rename(local, trash)
            except FileNotFoundError:
                pass  # another rank moved it
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(part, local)
            log.info("rank %d resumes from Ray's checkpoint %s, downloaded into %s", rank,
                     remote, local)
            break
        except OSError:  # another rank's copy got there first
            continue
    shutil.rmtree(part, ignore_errors=True)
    if not _complete(_listing(local), files):
        raise CheckpointError(f"could not put Ray's checkpoint {remote} into {local}")
    return local
