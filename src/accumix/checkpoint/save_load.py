"""Checkpoints: ``save_state`` / ``load_state``, atomic and exact on resume.

A run directory (a local path, or an object store URL: ``accumix.common.locations``) holds one
directory per save and a pointer to the newest::

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

``saving.py`` writes it (in the loop or behind it; on a shared disk, a disk per node, or an
object store); a crash at any moment leaves the previous checkpoint complete and pointed to
(``accumix.common.run_dir``: the layout the JAX backend shares). A load here checks everything
it can before it changes anything (``meta.json``, every file's size, the loaders' positions, the
schedulers' types, the models' keys), agrees with the other ranks on the step when their
directories differ, and never unpickles arbitrary objects: JSON, ``weights_only`` tensors, and
torch.distributed.checkpoint's metadata through a whitelist. ``checkpoint_meta.py`` writes and
checks ``meta.json``.
"""

from __future__ import annotations

import io
import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from accumix.checkpoint import background, load_limits, rng_state, saving
from accumix.checkpoint import meta as checkpoint_meta
from accumix.checkpoint.meta import FORMAT as FORMAT  # re-exported: where it was
from accumix.checkpoint.plain_values import numpy_floats
from accumix.common import run_dir as layout
from accumix.common.batch_sizes import resumed_grad_accum_steps, world_change
from accumix.common.locations import AnyPath, RemotePath, location
from accumix.common.ray_checkpoint import latest_checkpoint  # Ray Train's too
from accumix.common.run_dir import alternatives, resolve
from accumix.errors import AccumixError, CheckpointError, ConfigError
from accumix.runtime import fault
from accumix.step import accum_steps, window_end

if TYPE_CHECKING:
    from accumix.step.run_state import RunState

__all__ = ["CheckpointError", "latest_checkpoint", "load_state", "resolve", "save_state"]

log = logging.getLogger("accumix")

MODEL_DIR, SCHEDULERS = saving.MODEL_DIR, saving.SCHEDULERS
save_state = saving.save_state


# -- load ------------------------------------------------------------------------------------
def load_state(run: RunState, path: str | os.PathLike[str], strict: bool = True) -> AnyPath:
    """Restores what ``save_state`` wrote; collective. See ``Accelerator.load_state``.

    Args:
        run: the Accelerator's run state.
        path: a run directory (its ``latest``) or one step directory; a path or an fsspec URL.
        strict: a model must have exactly the checkpoint's keys (False: the keys both have).

    Returns:
        The step directory loaded.
    """
    saving.check_between_windows(run, "load_state")
    window_end.close_window(run)  # nothing of the last window applies to the loaded state
    step_dir: AnyPath | None = None
    meta: dict[str, Any] = {}
    rng: dict[str, Any] = {}
    schedulers: list[dict[str, Any]] = []
    steps = run.grad_accum_steps
    error: tuple[bool, str] | None = None
    background.finish(run, "acc.load_state")
    agreed = _agreed_step(run, path)
    try:  # everything that can be checked before anything is changed
        step_dir = agreed or resolve(path)
        meta = checkpoint_meta.validate(run, step_dir)
        rng = _read_tensors(step_dir / f"rank-{run.rank % meta['world_size']}.pt")
        schedulers = _saved_scheduler_states(step_dir, meta)
        for index, (loader, saved) in enumerate(zip(run.loaders, meta["state"]["loaders"],
                                                    strict=True)):
            loader.check_state(saved, f"DataLoader {index}")
    except (CheckpointError, ConfigError) as exc:
        error = (False, str(exc))
    world_line = None
    if error is None and "grad_accum" in meta:  # older checkpoints did not record K's source
        try:
            mine = accum_steps.geometry(run)
            steps = resumed_grad_accum_steps(
                meta["grad_accum"], mine, global_batch_size=run.batch_sizes[1],
                assigned=run.steps_assigned)
            # An elastic job restarted on fewer or more nodes: what K and the global batch did.
            world_line = world_change(meta["grad_accum"], mine, steps)
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
        saving.reset_unstepped(optimizers, empty_before)  # a refusal leaves no zero-step state
        cause = saving.first_failure(exc)
        if isinstance(cause, AccumixError):  # our own clear refusal, raised inside DCP
            raise cause from exc
        raise CheckpointError(
            f"{step_dir / MODEL_DIR} does not fit the set-up models and optimizers "
            f"(a different model or optimizer?): {type(cause).__name__}: {cause}"
        ) from exc
    state = meta["state"]
    saving.reset_unstepped(optimizers, [o["empty"] for o in state["optimizers"]])
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
    if world_line is not None and run.rank == 0:  # once, whatever the logging set-up
        log.warning("%s (resumed from %s)", world_line, step_dir)
    saved_world = meta["world_size"]
    if saved_world != run.world_size:
        log.info("loaded %s saved on %d ranks into %d; ranks >= %d took the RNG streams of "
                 "rank (rank %% %d)", step_dir, saved_world, run.world_size, saved_world,
                 saved_world)
    return step_dir


def _agreed_step(run: RunState, path: str | os.PathLike[str]) -> AnyPath | None:
    """The step every rank loads from a run directory (collective), or None to resolve
    ``path`` as it is.

    With a run directory per node, a crash between the nodes' ``latest`` writes leaves them
    naming different steps (every node published both before the first ``latest`` moved): the
    newest step named is loaded when every node has it.

    Raises:
        CheckpointError: the ranks' directories name steps that not every rank has.
    """
    path = location(path)
    try:
        named = resolve(path).name
    except CheckpointError:
        named = None
    have = layout.step_dirs(path) if path.is_dir() and not (path / layout.META).is_file() else []
    with fault.phase(run, "acc.load_state, agreeing on the step"):
        views = run.strategy.all_gather_object((named, have))
    names = {n for n, _ in views}
    if len(names) == 1:
        return None
    steps = [n for n in names if n is not None and layout.STEP_DIR.match(n)]
    target = max(steps, key=lambda n: int(n.split("-")[1]), default=None)
    if target is None or not all(target in h for _, h in views):
        shown = "; ".join(f"rank {r}: {n or 'none'}" for r, (n, _) in enumerate(views))
        raise CheckpointError(
            f"the ranks' run directories {path} name different checkpoints ({shown}) and not "
            f"every rank has {target or 'any of them'}; load a step directory every rank has "
            "explicitly")
    if run.is_main_process:
        log.info("the ranks' directories %s named %s; loading %s, which every rank has", path,
                 sorted(n or "none" for n in names), target)
    return path / target


def _saved_scheduler_states(step_dir: AnyPath, meta: dict[str, Any]) -> list[dict[str, Any]]:
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


def _read_tensors(path: AnyPath) -> Any:
    """``torch.load(weights_only=True)``: tensors, numbers, strings, containers; no classes;
    a small file that would inflate, or hold more than such a file does, is refused first."""
    if isinstance(path, RemotePath):  # its size first: the object is read whole
        if path.is_file():
            load_limits.check_size(path.stat().st_size, load_limits.SMALL_FILE_LIMIT, str(path))
        source: Any = io.BytesIO(path.read_bytes())
    else:
        source = path
    load_limits.check_torch_zip(source, load_limits.SMALL_FILE_LIMIT, str(path))
    try:
        if isinstance(source, io.BytesIO):
            source.seek(0)
        with numpy_floats():
            return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - zip errors, EOF, refused globals
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc}); "
                              f"{alternatives(path.parent)}") from exc
