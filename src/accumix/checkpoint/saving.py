"""``acc.save_state``: a step directory written, then published, in the loop or behind it.

The steps, on every rank (``_agree`` after each: every rank learns whether any failed, and none
is left waiting in a collective a failed one never reaches):

1. where: a local path, whose ranks may not share it (``common/shared_dir.py`` finds the groups
   of ranks on one filesystem and each group's leader), or an object store URL (one group);
2. the leaders prepare ``.step-N.tmp`` (on an object store: ``step-N`` itself, written in place);
3. the models and optimizers through the strategy (DCP; a whole copy per node when the ranks'
   directories differ, ``node_copies.py``), each rank's RNG file, the schedulers, the
   callbacks' files (``before_publish``);
4. publish: one shared directory: rank 0 writes ``meta.json`` (the manifest), renames and moves
   ``latest``; a directory per node: every leader publishes its node's step (rank 0's
   ``meta.json`` with its own manifest), and only once all have does any move ``latest``.

With ``background=True`` steps 1-2, the callbacks and the staging of the state (a host-memory
copy, DCP's ``async_save``) run in the loop; the write and the publish run in a thread
(``background.py``) that agrees with the other ranks over its own process group.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from accumix.checkpoint import background, node_copies, rng_state
from accumix.checkpoint import meta as checkpoint_meta
from accumix.checkpoint.plain_values import numpy_floats, plain
from accumix.common import ray_checkpoint, shared_dir
from accumix.common import run_dir as layout
from accumix.common.agreed_failure import run_and_agree
from accumix.common.locations import AnyPath, RemotePath, location
from accumix.common.shared_dir import NodeLayout
from accumix.errors import AccumixError, CheckpointError, ConfigError
from accumix.runtime import fault
from accumix.step import window_end

if TYPE_CHECKING:
    from accumix.step.run_state import RunState

log = logging.getLogger("accumix")

MODEL_DIR = "model"
SCHEDULERS = "schedulers.pt"


@dataclass(kw_only=True)
class _Save:
    """One save: where it goes and who does what."""

    run: RunState
    run_dir: AnyPath
    final: AnyPath
    tmp: AnyPath
    nodes: NodeLayout
    keep_last: int | None
    background: bool = False  # written by the background thread (over ``group``)
    group: Any = None  # that thread's process group (None: one process)

    def agree(self, fn: Callable[[], None] | None, what: str) -> None:
        _agree(self.run, fn, what, background=self.background, group=self.group)


def save_state(run: RunState, run_dir: str | os.PathLike[str] | RemotePath,
               keep_last: int | None = None, *, extra_state: dict[str, Any] | None = None,
               before_publish: Callable[[Any], None] | None = None,
               background_write: bool = False, metrics: dict[str, Any] | None = None,
               checkpoint_upload_mode: Any = "sync") -> AnyPath:
    """Writes ``run_dir/step-<optimizer_steps>/`` atomically, then points ``latest`` at it.

    Collective. ``acc.save_state`` calls it; see ``Accelerator.save_state``.

    Args:
        run: the Accelerator's run state (what it set up, its counters and strategy).
        run_dir: the run directory: a path or an fsspec URL.
        keep_last: delete all but the newest N step directories after publishing.
        extra_state: a JSON-able dict stored in ``meta.json`` (``extra_state(step_dir)``).
        before_publish: ``before_publish(tmp)`` (every rank, in the loop) writes more files
            into the step directory before it is published: they are listed in its manifest
            and published with it (the Trainer's ``on_write_checkpoint``).
        background_write: stage the state and return; the write and the publish run behind
            the loop (``Accelerator.save_state(background=True)``).
        metrics: under Ray Train, reported to Ray with the checkpoint.
        checkpoint_upload_mode: under Ray Train, Ray's upload: ``"sync"`` or ``"async"``.

    Under Ray Train the published step directory is then handed to Ray
    (``common/ray_checkpoint.py``).

    Returns:
        The step directory (published, or to be published by the background write).
    """
    check_between_windows(run, "save_state")
    if extra_state is not None:
        extra_state = layout.json_state(extra_state, "save_state(extra_state=...)")
    to_ray = ray_checkpoint.checked(metrics, checkpoint_upload_mode, background=background_write)
    window_end.close_window(run, window_over=False)  # the scale the next window uses
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                  or keep_last < 1):
        raise ConfigError(f"keep_last={keep_last!r} is invalid; use an integer >= 1 or None")
    where = location(run_dir)
    # Refusals that every rank reaches alike, before anything is written: a checkpoint that
    # could not be loaded must not replace one that can.
    for index, loader in enumerate(run.loaders):
        loader.check_savable(f"DataLoader {index}")
    if background_write:
        check_background(run)
    background.finish(run, "acc.save_state")
    schedulers = _scheduler_states(run)
    job = _prepare(run, where, keep_last)
    optimizers = [o.optimizer for o in run.optimizers]
    empty = [not o.state for o in optimizers]
    model_dir = str(job.tmp / MODEL_DIR)
    if background_write:
        from accumix.checkpoint import dcp_state

        job.background, job.group = True, background.process_group(run)
        with fault.phase(run, "acc.save_state, copying the state to host memory"):
            state = run.strategy.checkpoint_state(run.models, optimizers)
            if run.staging_buffers is None:
                run.staging_buffers = dcp_state.StagingBuffers()
            written = dcp_state.stage(state, model_dir, nodes=job.nodes, group=job.group,
                                      buffers=run.staging_buffers)
            del state
    else:
        with fault.phase(run, "acc.save_state, writing the models and optimizers"), \
                node_copies.per_node(job.nodes) as record:
            try:
                run.strategy.save_checkpoint(model_dir, run.models, optimizers)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException included
                raise _write_failed(model_dir, exc) from exc
        _refuse_own_hooks(job, record)
    try:
        _reset_unstepped(optimizers, empty)
        rng = rng_state.capture(run)
        with node_copies.per_node(job.nodes):
            if before_publish is not None:
                _agree(run, lambda: before_publish(job.tmp),
                       f"writing the callbacks' files into {job.tmp}")
        meta = checkpoint_meta.metadata(run, empty)
        if extra_state is not None:
            meta["extra_state"] = extra_state
        if not job.nodes.shared:  # every node writes rank 0's meta.json (its own manifest)
            meta = run.strategy.all_gather_object(meta if run.rank == 0 else None)[0]
            meta["nodes"] = [list(g) for g in job.nodes.groups]
            meta["ranks_here"] = list(job.nodes.group)
    except BaseException:
        if background_write:  # DCP's thread must be done before another save uses its group
            written.abandon()
        raise

    def finish() -> None:
        if background_write:
            try:
                written.finish()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException included
                raise _write_failed(model_dir, exc) from exc
        _write_rank_files(job, rng, schedulers)
        _publish(job, meta)

    if background_write:
        background.start(run, job.final, finish)
    else:
        finish()
        if to_ray is not None:
            to_ray.hand_over(job.run_dir, job.final, rank=run.rank,
                             gather=run.strategy.all_gather_object)
    return job.final


def check_background(run: RunState) -> None:
    """Refuses ``background=True`` where it cannot be honoured (before anything is written)."""
    from accumix.strategies.base import Strategy

    strategy = type(run.strategy)
    if (strategy.save_checkpoint is not Strategy.save_checkpoint
            and strategy.checkpoint_state is Strategy.checkpoint_state):
        raise ConfigError(
            f"save_state(background=True): strategy {run.strategy.name!r} writes its "
            "checkpoint with a save_checkpoint of its own; give it a checkpoint_state (the "
            "state dict to stage) too, or save with background=False")


def _prepare(run: RunState, where: AnyPath, keep_last: int | None) -> _Save:
    """Where the save goes and who writes what; the leaders prepare the temporary step
    directory (collective)."""
    step, rank = run.optimizer_steps, run.rank
    final = where / f"step-{step}"
    if isinstance(where, RemotePath):  # one store every rank reaches; written in place
        tmp, nodes = final, shared_dir.one_group(run.world_size, rank)
    else:
        tmp = where / f".step-{step}.tmp"
        phase = f"acc.save_state, finding which ranks share the run directory {where}"
        with fault.phase(run, phase):
            nodes = shared_dir.probe(where, rank=rank, world_size=run.world_size,
                                     all_gather=run.strategy.all_gather_object)
    job = _Save(run=run, run_dir=where, final=final, tmp=tmp, nodes=nodes, keep_last=keep_last)
    job.agree(lambda: layout.prepare(where, tmp) if nodes.is_leader else None,
              f"preparing {tmp}")
    return job


def _write_failed(directory: str, exc: BaseException) -> BaseException:
    """A clear error for a failed write of the models (every rank raises it: DCP gathers the
    ranks' failures); an error of accumix's own passes as it is."""
    cause = first_failure(exc)
    if isinstance(cause, AccumixError):
        return cause
    text = " ".join(str(cause).split())[:300]
    return CheckpointError(f"writing the models and optimizers into {directory} failed "
                           f"({type(cause).__name__}: {text}); the checkpoint was not "
                           "published and the previous one is still the latest")


def first_failure(exc: BaseException) -> BaseException:
    """The exception inside DCP's per-rank ``CheckpointException`` (its message is a
    traceback per rank), else ``exc``."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return exc


def _refuse_own_hooks(job: _Save, record: node_copies.PerNode) -> None:
    if not job.nodes.shared and not record.written:
        raise CheckpointError(
            f"strategy {job.run.strategy.name!r} writes its checkpoint with hooks of its own, "
            "which a run directory per node cannot take (each node needs a whole copy of what "
            f"its ranks hold; ranks {[list(g) for g in job.nodes.groups]} see different "
            f"directories at {job.run_dir}); give a run_dir on a filesystem every rank shares "
            "or an object store URL (s3://...)")


def _write_rank_files(job: _Save, rng: dict[str, Any], schedulers: list[dict[str, Any]]
                      ) -> None:
    def write() -> None:
        write_tensors(job.tmp / f"rank-{job.run.rank}.pt", rng)
        # Every node's leader writes its own: the schedulers step in lockstep on every rank.
        if job.nodes.is_leader and schedulers:
            write_tensors(job.tmp / SCHEDULERS, schedulers)

    job.agree(write, f"writing {job.tmp}/rank-*.pt")


def _publish(job: _Save, meta: dict[str, Any]) -> None:
    run_dir, tmp, final, nodes = job.run_dir, job.tmp, job.final, job.nodes
    if nodes.shared:
        job.agree(lambda: layout.publish(run_dir, tmp, final, meta, job.keep_last)
                  if job.run.rank == 0 else None, f"publishing {final}")
        return
    # A run directory per node: latest moves on a node only once every node has published.
    assert isinstance(run_dir, os.PathLike) and isinstance(tmp, os.PathLike)
    job.agree(lambda: layout.publish_step(run_dir, tmp, final, meta)  # type: ignore[arg-type]
              if nodes.is_leader else None, f"publishing {final} on every node")
    job.agree(lambda: layout.point_latest(run_dir, final, job.keep_last)
              if nodes.is_leader else None,
              f"pointing {run_dir}/latest at {final.name} on every node")


def check_between_windows(run: RunState, what: str) -> None:
    if run.in_micro_step or run.window.micro_step:
        raise AccumixError(
            f"acc.{what}() was called inside an accumulation window (micro-step "
            f"{run.window.micro_step} of {run.grad_accum_steps}), whose gradients a checkpoint "
            "does not hold; call it after the `with acc.accumulate():` block of a boundary "
            "(when acc.sync_gradients is True)"
        )


def _agree(run: RunState, fn: Callable[[], None] | None, what: str, *,
           background: bool = False, group: Any = None) -> None:
    """Runs ``fn`` here, then every rank learns whether any rank failed (no rank left waiting
    in a collective the failed one never reaches). ``background``: in the background thread,
    over its ``group`` (no watchdog phases there: the watchdog follows the loop)."""
    def gather(error: str | None) -> list[str | None]:
        if not background:
            with fault.phase(run, f"acc.save_state, {what}"):
                return run.strategy.all_gather_object(error)
        if group is None:  # one process
            return [error]
        errors: list[str | None] = [None] * run.world_size
        dist.all_gather_object(errors, error, group=group)
        return errors

    run_and_agree(gather, fn, what)


def reset_unstepped(optimizers: list[Optimizer], empty: list[bool]) -> None:
    """Undoes the zero-grad step with which torch's get/set_state_dict initialise an optimizer
    that has not stepped (Adam's step count becomes 1): saving or loading changes nothing."""
    for opt, was_empty in zip(optimizers, empty, strict=True):
        if was_empty and opt.state:
            opt.state.clear()


_reset_unstepped = reset_unstepped


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


def write_tensors(path: AnyPath, obj: Any) -> None:
    """``torch.save`` of ``obj`` into ``path``, flushed (an object: written whole)."""
    if isinstance(path, RemotePath):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        path.write_bytes(buffer.getvalue())
        return
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
