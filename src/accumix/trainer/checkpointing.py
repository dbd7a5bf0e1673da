"""The Trainer's checkpoints: ``save_checkpoint`` writes the run through the steps object with
the loop's own state (``run_state.py``) in ``meta.json``; ``load_checkpoint`` resumes from a run
directory's ``latest`` or a step directory and puts that state back; a pre-emption saves the
step it was agreed at (once) and stops the fit with ``Preempted``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from accumix.common import run_dir as layout
from accumix.common.locations import AnyPath, RemotePath, location
from accumix.common.slurm_requeue import requeue
from accumix.errors import PREEMPTED_EXIT_CODE, ConfigError, Preempted

if TYPE_CHECKING:
    from accumix.trainer.trainer import Trainer

log = logging.getLogger("accumix")


def run_dirs(run_dir: str | Path | None, local_dir: str | Path | None
             ) -> tuple[Path | None, AnyPath | None]:
    """The Trainer's (local directory, checkpoint directory): the same local path, or the
    local directory of a URL ``run_dir`` (metrics, plots and the lock stay on this machine).

    Raises:
        ConfigError: ``local_dir`` without a URL ``run_dir``, or a URL that cannot be used.
    """
    if run_dir is None:
        if local_dir is not None:
            raise ConfigError("local_dir= needs run_dir=; give both or neither")
        return None, None
    where = location(run_dir)
    if isinstance(where, RemotePath):
        return (Path(local_dir) if local_dir is not None else Path("runs") / where.name), where
    if local_dir is not None:
        raise ConfigError(f"local_dir={str(local_dir)!r} is for a run_dir on an object store "
                          f"(s3://...); run_dir={str(run_dir)!r} is local and holds everything")
    return where, where


def save_checkpoint(trainer: Trainer, *, background: bool = False) -> Path | None:
    """``trainer.save_checkpoint()``: collective; None (a warning, once) without a run
    directory."""
    if trainer.checkpoint_dir is None:
        if not trainer._warned_no_checkpoint and trainer.accelerator.is_main_process:
            log.warning("checkpoints are off: no run_dir was given")
        trainer._warned_no_checkpoint = True
        return None
    path = trainer.steps.save(trainer.checkpoint_dir, trainer.keep_checkpoints,
                              trainer.state_dict(),
                              lambda tmp: trainer.dispatch("on_write_checkpoint", tmp),
                              **({"background": True} if background else {}))
    trainer._saved_step, trainer._saved_path = trainer.step, path
    trainer.dispatch("on_save_checkpoint", path)
    return path


def load_checkpoint(trainer: Trainer, path: Any, *, missing_ok: bool) -> Any:
    """``trainer.load_checkpoint(path)``: collective; None when ``missing_ok`` and nothing is
    there."""
    path = location(path)
    if not (path / "latest").exists() and not path.name.startswith("step-"):
        if missing_ok:
            return None
        raise ConfigError(f"no checkpoint at {str(path)!r}: it has no 'latest'")
    trainer.steps.load(path)
    trainer.step = trainer.steps.optimizer_steps
    trainer._saved_step, trainer._saved_path = trainer.step, layout.resolve(path)
    trainer.resumed_from = path
    trainer.epoch = trainer.steps.epoch
    trainer.load_state_dict(layout.extra_state(layout.resolve(path)))
    if trainer.accelerator.is_main_process:
        log.info("resumed from %s at step %d", path, trainer.step)
    trainer.dispatch("on_load_checkpoint", path)
    return path


def save_for_preemption(trainer: Trainer) -> Path | None:
    """``trainer.save_for_preemption()``: the checkpoint of this step, saved now or already
    (a signal during that step's own save needs no second one)."""
    if trainer._saved_step == trainer.step and trainer._saved_path is not None:
        wait_for_save(trainer)  # it may still be writing behind the loop
        return trainer._saved_path
    return save_checkpoint(trainer)


def wait_for_save(trainer: Trainer) -> None:
    """Waits for a background save in flight (collective), raising its error."""
    wait = getattr(trainer.steps, "wait_for_save", None)
    if wait is not None:
        wait()


def stop_preempted(trainer: Trainer) -> NoReturn:
    """``trainer.stop_preempted()``: saves (collective), asks SLURM to requeue the job when
    the Trainer was given ``requeue=True`` (rank 0), and raises ``Preempted``."""
    path = save_for_preemption(trainer)  # published when it returns
    if trainer.accelerator.is_main_process:
        log.warning("pre-empted: saved %s at step %d; stopping (exit status %d: requeue the "
                    "job to resume)", path, trainer.step, PREEMPTED_EXIT_CODE)
        if trainer.requeue_target is not None:
            requeue(trainer.requeue_target)
    raise Preempted(trainer.step, path)
