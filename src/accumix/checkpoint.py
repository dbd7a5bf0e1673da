"""Checkpoints: ``save_state`` / ``load_state``, atomic on disk and exact on resume.

A run directory holds one directory per save and a pointer to the newest::

    run_dir/
      latest              "step-120": written last, atomically replaced
      step-120/
        model/            models + optimizers, by the strategy's checkpoint hooks (default:
                          torch.distributed.checkpoint, sharded where the backend shards, so it
                          loads on another world size)
        rank-0.pt ...     each rank's RNG states: tensors and numbers, read with weights_only=True
        meta.json         written last: versions, world, strategy, precision, the training state
                          (plain JSON) and the size of every other file

A save is written to ``.step-N.tmp``, flushed and renamed; ``latest`` follows, so a crash at any
moment leaves the previous checkpoint complete and pointed to. A load checks ``meta.json`` and
every file's size before reading, and never unpickles arbitrary objects: JSON, ``weights_only``
tensors, and torch.distributed.checkpoint's metadata through a whitelist of its own classes.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.optim import Optimizer

# CheckpointError lives in accumix.errors (one class for both backends); re-exported here.
from accumix.errors import AccumixError, CheckpointError, ConfigError

if TYPE_CHECKING:
    from accumix.accelerator import Accelerator

log = logging.getLogger("accumix")

FORMAT = 1
LATEST = "latest"
META = "meta.json"
MODEL_DIR = "model"
_STEP_DIR = re.compile(r"^step-(\d+)$")


# -- the run directory -----------------------------------------------------------------------
def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The step directory ``run_dir/latest`` points to, or None when nothing was saved yet.

    For auto-resume: ``if latest_checkpoint(run_dir): acc.load_state(run_dir)``.
    """
    pointer = Path(run_dir) / LATEST
    if not pointer.is_file():
        return None
    return Path(run_dir) / pointer.read_text().strip()


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
            f"load one of {_step_dirs(path) or 'no other checkpoints'} explicitly"
        )
    return target


def _step_dirs(run_dir: Path) -> list[str]:
    found = [(int(m.group(1)), p.name) for p in run_dir.iterdir()
             if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [name for _, name in sorted(found)]


# -- save ------------------------------------------------------------------------------------
def save_state(acc: Accelerator, run_dir: str | os.PathLike[str], keep_last: int | None = None
               ) -> Path:
    """Writes ``run_dir/step-<optimizer_steps>/`` atomically, then points ``latest`` at it.

    Collective. See ``Accelerator.save_state``.
    """
    _check_between_windows(acc, "save_state")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                  or keep_last < 1):
        raise ConfigError(f"keep_last={keep_last!r} is invalid; use an integer >= 1 or None")
    run_dir = Path(run_dir)
    step = acc.optimizer_steps
    final, tmp = run_dir / f"step-{step}", run_dir / f".step-{step}.tmp"
    strategy, rank = acc.strategy, acc.rank

    def prepare() -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        for leftover in run_dir.glob(".step-*.*"):  # of saves that crashed half-way
            shutil.rmtree(leftover, ignore_errors=True)
        tmp.mkdir()

    _agree(acc, prepare if rank == 0 else None, f"preparing {tmp}")
    optimizers = [o.optimizer for o in acc._optimizers]
    empty = [not o.state for o in optimizers]
    strategy.save_checkpoint(str(tmp / MODEL_DIR), acc._models, optimizers)
    _reset_unstepped(optimizers, empty)
    _agree(acc, lambda: _write_tensors(tmp / f"rank-{rank}.pt", _rng_state(acc)),
           f"writing {tmp}/rank-*.pt")
    meta = _metadata(acc, empty)

    def publish() -> None:
        meta["files"] = _manifest(tmp)
        _write_json(tmp / META, meta)
        _fsync(tmp)
        if final.exists():  # a second save at the same step replaces the first
            trash = run_dir / f".step-{step}.old"
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash)
        else:
            os.rename(tmp, final)
        _fsync(run_dir)
        _write_text(run_dir / LATEST, final.name + "\n")
        if keep_last is not None:
            _prune(run_dir, step, keep_last)

    _agree(acc, publish if rank == 0 else None, f"publishing {final}")
    return final


def _check_between_windows(acc: Accelerator, what: str) -> None:
    if acc._in_micro_step or acc._window.micro_step:
        raise AccumixError(
            f"acc.{what}() was called inside an accumulation window (micro-step "
            f"{acc._window.micro_step} of {acc.grad_accum_steps}), whose gradients a checkpoint "
            "does not hold; call it after the `with acc.accumulate():` block of a boundary "
            "(when acc.sync_gradients is True)"
        )


def _agree(acc: Accelerator, fn: Callable[[], None] | None, what: str) -> None:
    """Runs ``fn`` here, then every rank learns whether any rank failed (no rank left waiting
    in a collective the failed one never reaches)."""
    error = None
    if fn is not None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = f"{type(exc).__name__}: {exc}"
    errors = acc.strategy.all_gather_object(error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {message}")


def _reset_unstepped(optimizers: list[Optimizer], empty: list[bool]) -> None:
    # torch's get/set_state_dict initialise an optimizer that has not stepped with a zero-grad
    # step (Adam's step count becomes 1); undo it so saving or loading changes nothing.
    for opt, was_empty in zip(optimizers, empty, strict=True):
        if was_empty and opt.state:
            opt.state.clear()


def _metadata(acc: Accelerator, empty: list[bool]) -> dict[str, Any]:
    from accumix import __version__

    loaders = [{**loader.state_dict(), **loader.sampling_state()} for loader in acc._loaders]
    return {
        "format": FORMAT,
        "accumix_version": __version__,
        "torch_version": torch.__version__,
        "step": acc.optimizer_steps,
        "epoch": loaders[0]["epoch"] if loaders else None,
        "position": loaders[0]["position"] if loaders else None,
        "world_size": acc.world_size,
        "strategy": acc.strategy.name,
        "checkpoint_format": acc.strategy.checkpoint_format,
        "precision": acc.policy.name,
        "grad_accum_steps": acc.grad_accum_steps,
        "state": {
            "optimizer_steps": acc.optimizer_steps,
            "step_was_skipped": acc.step_was_skipped,
            "window": acc._window.state_dict(),
            "scaler": acc.strategy.scaler.state_dict(),
            "models": len(acc._models),
            "optimizers": [{"stepped_window": o.stepped_window, "empty": e}
                           for o, e in zip(acc._optimizers, empty, strict=True)],
            "schedulers": [{"state": s.state_dict(), "stepped_window": s._stepped_window}
                           for s in acc._schedulers],
            "loaders": loaders,
        },
    }


def _manifest(directory: Path) -> dict[str, int]:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    for path in files:  # ranks wrote them; make them durable before the rename publishes
        _fsync(path)
    return {p.relative_to(directory).as_posix(): p.stat().st_size for p in files}


def _prune(run_dir: Path, current: int, keep_last: int) -> None:
    older = [name for name in _step_dirs(run_dir) if int(name[5:]) < current]
    for name in older[: max(len(older) - (keep_last - 1), 0)]:
        shutil.rmtree(run_dir / name)


# -- durable writes --------------------------------------------------------------------------
def _fsync(path: Path) -> None:
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


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def _write_json(path: Path, obj: Any) -> None:
    try:
        text = json.dumps(obj, indent=1, allow_nan=True)
    except TypeError as exc:
        raise CheckpointError(
            f"training state for {path} is not JSON (a scheduler or scaler state_dict holds "
            f"a {exc}); keep such state to numbers, strings, lists and dicts"
        ) from exc
    _write_text(path, text)


def _write_tensors(path: Path, obj: dict[str, Any]) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


# -- RNG -------------------------------------------------------------------------------------
def _rng_state(acc: Accelerator) -> dict[str, Any]:
    version, mt_state, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(mt_state, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "loaders": [loader.loader.generator.get_state()
                    if loader.loader.generator is not None else None
                    for loader in acc._loaders],
    }
    return state


def _set_rng_state(acc: Accelerator, state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
    for loader, gen_state in zip(acc._loaders, state["loaders"], strict=False):
        if gen_state is not None and loader.loader.generator is not None:
            loader.loader.generator.set_state(gen_state)


# -- load ------------------------------------------------------------------------------------
def load_state(acc: Accelerator, path: str | os.PathLike[str]) -> Path:
    """Restores what ``save_state`` wrote; collective. See ``Accelerator.load_state``."""
    _check_between_windows(acc, "load_state")
    step_dir: Path | None = None
    meta: dict[str, Any] = {}
    rng: dict[str, Any] = {}
    error: str | None = None
    try:  # everything that can be checked before anything is changed
        step_dir = resolve(path)
        meta = _validate(acc, step_dir)
        rng = _read_tensors(step_dir / f"rank-{acc.rank % meta['world_size']}.pt")
    except CheckpointError as exc:
        error = str(exc)
    errors = acc.strategy.all_gather_object(error)  # every rank refuses, or none does
    if any(errors):
        raise CheckpointError(next(e for e in errors if e))
    assert step_dir is not None
    optimizers = [o.optimizer for o in acc._optimizers]
    try:
        acc.strategy.load_checkpoint(str(step_dir / MODEL_DIR), acc._models, optimizers)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        cause = _first_failure(exc)
        if isinstance(cause, AccumixError):  # our own clear refusal, raised inside DCP
            raise cause from exc
        raise CheckpointError(
            f"{step_dir / MODEL_DIR} does not fit the set-up models and optimizers "
            f"(a different model or optimizer?): {type(cause).__name__}: {cause}"
        ) from exc
    state = meta["state"]
    _reset_unstepped(optimizers, [o["empty"] for o in state["optimizers"]])
    for opt, saved in zip(acc._optimizers, state["optimizers"], strict=True):
        opt.stepped_window = saved["stepped_window"]
    for sched, saved in zip(acc._schedulers, state["schedulers"], strict=True):
        sched.load_state_dict(saved["state"])
        sched._stepped_window = saved["stepped_window"]
    acc.strategy.scaler.load_state_dict(state["scaler"])
    acc._window.load_state_dict(state["window"])
    acc.optimizer_steps = state["optimizer_steps"]
    acc.step_was_skipped = state["step_was_skipped"]
    for loader, saved in zip(acc._loaders, state["loaders"], strict=True):
        loader.load_state_dict(saved)
    # Last: nothing above may draw from the generators once they hold the saved streams.
    _set_rng_state(acc, rng)
    saved_world = meta["world_size"]
    if saved_world != acc.world_size:
        log.info("loaded %s saved on %d ranks into %d; ranks >= %d took the RNG streams of "
                 "rank (rank %% %d)", step_dir, saved_world, acc.world_size, saved_world,
                 saved_world)
    return step_dir


def _first_failure(exc: BaseException) -> BaseException:
    """The exception inside DCP's per-rank ``CheckpointException`` (its message is a
    traceback per rank), else ``exc``."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return exc


def _validate(acc: Accelerator, step_dir: Path) -> dict[str, Any]:
    meta_path = step_dir / META
    try:
        meta = json.loads(meta_path.read_text())
        state = meta["state"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{meta_path} is unreadable or incomplete ({exc}); "
                              f"{_alternatives(step_dir)}") from exc
    for name, size in meta.get("files", {}).items():
        file = step_dir / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing; {_alternatives(step_dir)}")
        if file.stat().st_size != size:
            raise CheckpointError(
                f"{file} has {file.stat().st_size} bytes where {size} were written (truncated "
                f"or overwritten); {_alternatives(step_dir)}"
            )
    expected = {
        "format": FORMAT,
        "checkpoint_format": acc.strategy.checkpoint_format,
        "precision": acc.policy.name,
    }
    for key, mine in expected.items():
        if meta.get(key) != mine:
            raise CheckpointError(
                f"{meta_path} has {key}={meta.get(key)!r} but this run has {mine!r} "
                f"(strategy {acc.strategy.name!r}); resume with the settings it was saved with"
            )
    counts = {
        "models": (state["models"], len(acc._models)),
        "optimizers": (len(state["optimizers"]), len(acc._optimizers)),
        "LR schedulers": (len(state["schedulers"]), len(acc._schedulers)),
        "DataLoaders": (len(state["loaders"]), len(acc._loaders)),
    }
    for what, (saved, mine) in counts.items():
        if saved != mine:
            raise CheckpointError(
                f"{meta_path} holds {saved} {what} but this run set up {mine}; "
                "call acc.setup with the same objects before acc.load_state"
            )
    if not (step_dir / f"rank-{acc.rank % meta['world_size']}.pt").is_file():
        raise CheckpointError(f"{step_dir}/rank-{acc.rank % meta['world_size']}.pt is missing")
    return meta


def _alternatives(step_dir: Path) -> str:
    others = [n for n in _step_dirs(step_dir.parent) if n != step_dir.name]
    if not others:
        return "the checkpoint is unusable and there is no other in its run directory"
    return f"the checkpoint is unusable; load an earlier one: {', '.join(others)}"


def _read_tensors(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - zip errors, EOF, refused globals
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc}); "
                              f"{_alternatives(path.parent)}") from exc
