"""What one ``fit`` writes besides checkpoints: the run directory's lock and the loggers.

The main process holds ``run_dir/.lock`` for the whole fit (``run_lock.py``), opens the loggers
once the checkpoint (if any) is loaded, and closes them at the end. A setup error there (the
lock held by a live job, a tracker that cannot start) is agreed over the ranks first, so every
rank raises the same one-line ``ConfigError`` instead of the other ranks failing later in a
collective (a gloo traceback).

Parameters are logged with the first row of each attempt, so the batch geometry they state is
the one the steps ran with (a ``GradientAccumulationScheduler`` sets K when the first window
starts, after the loggers opened); a later change of K or of the global batch is a column of
the row where it took effect (``grad_accum_steps``, ``global_batch_size``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accumix.errors import ConfigError
from accumix.trainer.run_facts import batch_geometry, run_facts
from accumix.trainer.run_lock import RunDirLock, lock_run_dir

if TYPE_CHECKING:
    from accumix.trainer.metrics import StepMetrics
    from accumix.trainer.trainer import Trainer


def agreed_error(message: str) -> ConfigError:
    """The ``ConfigError`` every rank raises for one rank's setup error; marked, so that the
    command line prints it once (rank 0) rather than once per rank."""
    error = ConfigError(message)
    error.every_rank = True  # type: ignore[attr-defined]
    return error


class RunOutputs:
    """The lock and the loggers of one ``fit`` (collective where it says so)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._lock: RunDirLock | None = None
        self._params_logged = False
        self._geometry: dict[str, Any] | None = None

    def _agree(self, action: Callable[[], None]) -> None:
        """Runs ``action`` on the main process; then every rank raises its ConfigError, or
        none does (collective)."""
        trainer = self.trainer
        message = None
        if trainer.accelerator.is_main_process:
            try:
                action()
            except ConfigError as exc:
                message = str(exc)
        first_error = getattr(trainer.steps, "first_error", None)
        if first_error is not None and trainer.accelerator.world_size > 1:
            message = first_error(message)
        if message is not None:
            raise agreed_error(message)

    def lock(self) -> None:
        """Takes the run directory's lock before anything there is read (collective).

        Raises:
            ConfigError: a live job holds it.
        """
        run_dir = self.trainer.run_dir
        if run_dir is None:
            return

        def take() -> None:
            self._lock = lock_run_dir(run_dir)

        self._agree(take)

    def open(self) -> None:
        """Opens the loggers at the step the run resumed from (collective); a fresh start
        (``resume=False``) makes the trackers open new runs.

        Raises:
            ConfigError: a logger cannot start.
        """
        trainer = self.trainer
        self._params_logged, self._geometry = False, None

        def open_loggers() -> None:
            from accumix.trainer.trackers.base import forget_runs

            if trainer.run_dir is None:
                return
            if not trainer.resume:
                forget_runs(trainer.run_dir)
            for logger in trainer.loggers:
                # None: a fresh run (the file loggers keep no row, not even a step-0 one).
                logger.open(trainer.run_dir, resume_step=trainer.step or None)

        self._agree(open_loggers)

    def note_geometry(self, metrics: StepMetrics) -> None:
        """Adds the K and global batch of this window to its row when they changed since the
        last window (every rank, before the callbacks see the row)."""
        geometry = batch_geometry(self.trainer)
        geometry.pop("micro_batch_size")
        if self._geometry is not None and geometry != self._geometry:
            metrics.extra.update(geometry)
        self._geometry = geometry

    def log(self, row: dict[str, Any]) -> None:
        """One row to every logger (main process), after this attempt's params."""
        if not self._params_logged:
            self._log_params()
        for logger in self.trainer.loggers:
            logger.log(row)

    def _log_params(self) -> None:
        trainer = self.trainer
        self._params_logged = True
        if trainer.run_dir is None:
            return
        name = trainer.run_name or trainer.run_dir.resolve().name
        facts = run_facts(trainer)
        params = {**facts, "config": trainer.config} if trainer.config else facts
        for logger in trainer.loggers:
            logger.log_params(params, tags={"job": name})

    def close(self) -> None:
        """Closes the loggers (main process; an attempt without a row logs its params first)
        and frees the lock."""
        trainer = self.trainer
        try:
            if trainer.accelerator.is_main_process:
                if not self._params_logged:
                    self._log_params()
                for logger in trainer.loggers:
                    logger.close()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None
