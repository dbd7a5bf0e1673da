"""Checkpoints: ``save_state`` / ``load_state``, atomic on disk and exact on resume.

A run directory holds one directory per save and a pointer to the newest::

    run_dir/
      latest              "step-120": written last, atomically replaced
      step-120/
        model/            models + optimizers, by the strategy's checkpoint hooks (default:
                          torch.distributed.checkpoint, sharded where the backend shards, so it
                          loads on another world size)
        rank-0.pt ...     each rank's RNG states: tensors and numbers, read with weights_only=True
        schedulers.pt     the LR schedulers' state_dicts as they are (a MultiStepLR's Counter of
                          int milestones stays one: JSON would make its keys strings)
        meta.json         written last: versions, world, strategy, precision, the training state
                          (plain JSON) and the size of every other file

A save is written to ``.step-N.tmp``, flushed and renamed; ``latest`` follows, so a crash at any
moment leaves the previous checkpoint complete and pointed to (``accumix.common.run_dir``: the
layout the JAX backend shares). A load checks everything it can before it changes anything
(``meta.json``, every file's size, the loaders' positions, the schedulers' types, the models'
keys) and never unpickles arbitrary objects: JSON, ``weights_only`` tensors, and
torch.distributed.checkpoint's metadata through a whitelist. ``checkpoint_meta.py`` writes and
checks ``meta.json``.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from accumix.checkpoint import load_limits, rng_state
from accumix.checkpoint import meta as checkpoint_meta
from accumix.checkpoint.meta import FORMAT as FORMAT  # re-exported: where it was
from accumix.checkpoint.plain_values import numpy_floats, plain
from accumix.common import run_dir as layout
from accumix.common.batch_sizes import resumed_grad_accum_steps
from accumix.common.run_dir import alternatives, latest_checkpoint, resolve
from accumix.errors import AccumixError, CheckpointError, ConfigError
from accumix.runtime import fault
from accumix.step import accum_steps, window_end

if TYPE_CHECKING:
    from accumix.step.run_state import RunState

__all__ = ["CheckpointError", "latest_checkpoint", "load_state", "resolve", "save_state"]

log = logging.getLogger("accumix")

MODEL_DIR = "model"
SCHEDULERS = "schedulers.pt"


# -- save ------------------------------------------------------------------------------------
def save_state(run: RunState, run_dir: str | os.PathLike[str], keep_last: int | None = None,
               *, extra_state: dict[str, Any] | None = None,
               before_publish: Callable[[Path], None] | None = None) -> Path:
    """Writes ``run_dir/step-<optimizer_steps>/`` atomically, then points ``latest`` at it.

    Collective. See ``Accelerator.save_state``. ``before_publish(tmp)`` (every rank) writes more
    files into the temporary step directory: they are listed in its manifest and published with
    it (the Trainer's ``on_write_checkpoint``).
    """
    _check_between_windows(run, "save_state")
    if extra_state is not None:
        extra_state = layout.json_state(extra_state, "save_state(extra_state=...)")
    window_end.close_window(run, window_over=False)  # the scale the next window uses
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                  or keep_last < 1):
        raise ConfigError(f"keep_last={keep_last!r} is invalid; use an integer >= 1 or None")
    # Refusals that every rank reaches alike, before anything is written: a checkpoint that
    # could not be loaded must not replace one that can.
    for index, loader in enumerate(run.loaders):
        loader.check_savable(f"DataLoader {index}")
    schedulers = _scheduler_states(run)
    run_dir = Path(run_dir)
    step = run.optimizer_steps
    final, tmp = run_dir / f"step-{step}", run_dir / f".step-{step}.tmp"
    strategy, rank = run.strategy, run.rank

    def prepare() -> None:
        layout.prepare(run_dir, tmp)

    _agree(run, prepare if rank == 0 else None, f"preparing {tmp}")
    optimizers = [o.optimizer for o in run.optimizers]
    empty = [not o.state for o in optimizers]
    with fault.phase(run, "acc.save_state, writing the models and optimizers"):
        strategy.save_checkpoint(str(tmp / MODEL_DIR), run.models, optimizers)
    _reset_unstepped(optimizers, empty)

    def write_rank_files() -> None:
        _write_tensors(tmp / f"rank-{rank}.pt", rng_state.capture(run))
        if rank == 0 and schedulers:
            _write_tensors(tmp / SCHEDULERS, schedulers)

    _agree(run, write_rank_files, f"writing {tmp}/rank-*.pt")
    if before_publish is not None:
        _agree(run, lambda: before_publish(tmp), f"writing the callbacks' files into {tmp}")
    meta = checkpoint_meta.metadata(run, empty)
    if extra_state is not None:
        meta["extra_state"] = extra_state

    def publish() -> None:
        layout.publish(run_dir, tmp, final, meta, keep_last)

    _agree(run, publish if rank == 0 else None, f"publishing {final}")
    return final


def _check_between_windows(run: RunState, what: str) -> None:
    if run.in_micro_step or run.window.micro_step:
        raise AccumixError(
            f"acc.{what}() was called inside an accumulation window (micro-step "
            f"{run.window.micro_step} of {run.grad_accum_steps}), whose gradients a checkpoint "
            "does not hold; call it after the `with acc.accumulate():` block of a boundary "
            "(when acc.sync_gradients is True)"
        )


def _agree(run: RunState, fn: Callable[[], None] | None, what: str) -> None:
    """Runs ``fn`` here, then every rank learns whether any rank failed (no rank left waiting
    in a collective the failed one never reaches)."""
    error = None
    if fn is not None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = f"{type(exc).__name__}: {exc}"
    with fault.phase(run, f"acc.save_state, {what}"):
        errors = run.strategy.all_gather_object(error)
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


def _scheduler_states(run: RunState) -> list[dict[str, Any]]:
    """Every scheduler's state_dict, checked to load back with ``weights_only=True``."""
    # base_lrs copied from a numpy learning rate are numpy scalars: stored as Python numbers.
    states = [plain(s.state_dict(), f"LR scheduler {i}'s state_dict")
              for i, s in enumerate(run.schedulers)]
    buffer = io.BytesIO()
    for index, (sched, state) in enumerate(zip(run.schedulers, states, strict=True)):
        buffer.seek(0)
        buffer.truncate()
        try:
            torch.save(state, buffer)
            buffer.seek(0)
            with numpy_floats():
                torch.load(buffer, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - pickling errors, refused globals
            raise CheckpointError(
                f"LR scheduler {index} ({type(sched.scheduler).__name__}) has a state_dict "
                f"that cannot be loaded safely ({type(exc).__name__}: {str(exc)[:200]}); keep "
                "its state to tensors, numbers, strings and containers (a lambda is fine, an "
                "object holding other objects is not)"
            ) from exc
    return states


# -- load ------------------------------------------------------------------------------------
def load_state(run: RunState, path: str | os.PathLike[str], strict: bool = True) -> Path:
    """Restores what ``save_state`` wrote; collective. See ``Accelerator.load_state``."""
    _check_between_windows(run, "load_state")
    window_end.close_window(run)  # nothing of the last window applies to the loaded state
    step_dir: Path | None = None
    meta: dict[str, Any] = {}
    rng: dict[str, Any] = {}
    schedulers: list[dict[str, Any]] = []
    steps = run.grad_accum_steps
    error: tuple[bool, str] | None = None
    try:  # everything that can be checked before anything is changed
        step_dir = resolve(path)
        meta = checkpoint_meta.validate(run, step_dir)
        rng = _read_tensors(step_dir / f"rank-{run.rank % meta['world_size']}.pt")
        schedulers = _saved_scheduler_states(step_dir, meta)
        for index, (loader, saved) in enumerate(zip(run.loaders, meta["state"]["loaders"],
                                                    strict=True)):
            loader.check_state(saved, f"DataLoader {index}")
    except (CheckpointError, ConfigError) as exc:
        error = (False, str(exc))
    if error is None and "grad_accum" in meta:  # older checkpoints did not record K's source
        try:
            steps = resumed_grad_accum_steps(
                meta["grad_accum"], accum_steps.geometry(run),
                global_batch_size=run.batch_sizes[1], assigned=run.steps_assigned)
        except ConfigError as exc:
            error = (True, f"acc.load_state({str(path)!r}): {exc}")
    with fault.phase(run, "acc.load_state, checking the checkpoint"):
        errors = run.strategy.all_gather_object(error)  # every rank refuses, or none does
    if any(errors):
        is_config, message = next(e for e in errors if e)
        raise (ConfigError if is_config else CheckpointError)(message)
    assert step_dir is not None
    optimizers = [o.optimizer for o in run.optimizers]
    empty_before = [not o.state for o in optimizers]
    try:
        with fault.phase(run, "acc.load_state, reading the models and optimizers"):
            # strict=False only when asked: a Strategy of the user's may not take the keyword.
            run.strategy.load_checkpoint(str(step_dir / MODEL_DIR), run.models, optimizers,
                                         **({} if strict else {"strict": False}))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        _reset_unstepped(optimizers, empty_before)  # a refusal leaves no zero-step state
        cause = _first_failure(exc)
        if isinstance(cause, AccumixError):  # our own clear refusal, raised inside DCP
            raise cause from exc
        raise CheckpointError(
            f"{step_dir / MODEL_DIR} does not fit the set-up models and optimizers "
            f"(a different model or optimizer?): {type(cause).__name__}: {cause}"
        ) from exc
    state = meta["state"]
    _reset_unstepped(optimizers, [o["empty"] for o in state["optimizers"]])
    for opt, saved in zip(run.optimizers, state["optimizers"], strict=True):
        opt.stepped_window = saved["stepped_window"]
    for sched, saved, sched_state in zip(run.schedulers, state["schedulers"], schedulers,
                                         strict=True):
        sched.load_state_dict(sched_state)
        sched._stepped_window = saved["stepped_window"]
    run.strategy.scaler.load_state_dict(state["scaler"])
    window_end.set_pending_overflow(run, state.get("pending_scale_update"))
    run.window.load_state_dict(state["window"])
    if steps != run.grad_accum_steps:
        log.info("grad_accum_steps=%d restored from %s (this run was set up with %d)", steps,
                 step_dir, run.grad_accum_steps)
        run.window.grad_accum_steps = steps
    run.optimizer_steps = state["optimizer_steps"]
    run.step_was_skipped = state["step_was_skipped"]
    for loader, saved in zip(run.loaders, state["loaders"], strict=True):
        loader.load_state_dict(saved)
    # Last: nothing above may draw from the generators once they hold the saved streams.
    rng_state.restore(run, rng)
    saved_world = meta["world_size"]
    if saved_world != run.world_size:
        log.info("loaded %s saved on %d ranks into %d; ranks >= %d took the RNG streams of "
                 "rank (rank %% %d)", step_dir, saved_world, run.world_size, saved_world,
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


def _saved_scheduler_states(step_dir: Path, meta: dict[str, Any]) -> list[dict[str, Any]]:
    saved = meta["state"]["schedulers"]
    if not saved:
        return []
    if all("state" in s for s in saved):  # written before schedulers.pt existed
        return [s["state"] for s in saved]
    states = _read_tensors(step_dir / SCHEDULERS)
    if not isinstance(states, list) or len(states) != len(saved):
        raise CheckpointError(f"{step_dir / SCHEDULERS} does not hold {len(saved)} LR "
                              f"scheduler states; {alternatives(step_dir)}")
    return states


def _write_tensors(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _read_tensors(path: Path) -> Any:
    """``torch.load(weights_only=True)``: tensors, numbers, strings, containers; no classes;
    a small file that would inflate, or hold more than such a file does, is refused first."""
    load_limits.check_torch_zip(path, load_limits.SMALL_FILE_LIMIT, str(path))
    try:
        with numpy_floats():
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - zip errors, EOF, refused globals
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc}); "
                              f"{alternatives(path.parent)}") from exc
