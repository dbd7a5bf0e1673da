"""The Trainer: the loop of DESIGN.md run for you, with evaluation, checkpoints, logs, callbacks.

The loop is backend-free. A *steps* object runs the training itself and calls
``trainer.end_window(metrics)`` after every optimizer step, where the loop does the rest::

    while not done:
        steps.run_epoch(trainer)       # torch: micro-steps through the Accelerator
                                       # (torch_steps.py); JAX: one jitted call per window
                                       # (jax_steps.py)
        per optimizer step: end_window -> callbacks -> evaluation -> the logged row ->
                            checkpoint

``Trainer(model=, optimizer=, train_loader=, ...)`` builds the torch steps;
``Trainer(steps=...)`` takes any other backend's (``accumix.trainer.jax_steps.JaxSteps``). The
steps object provides ``accelerator``, ``optimizer_steps``, ``epoch``, ``batches_per_epoch``,
``grad_accum_steps``, ``run_epoch(trainer)``, ``validate()``, ``save(run_dir, keep_last,
extra_state)`` (``extra_state``: the loop's and callbacks' JSON state, kept in the checkpoint's
``meta.json``; ``background=True`` when ``checkpoint_background`` asks), ``load(path)`` and
optionally ``close()`` (called when ``fit`` ends) and ``wait_for_save()``.

A checkpoint holds the loop's own state too: whether a callback stopped the run, the last
losses, and every callback's ``state_dict()``. A finished run (``max_steps``, ``max_epochs`` or
a callback's stop) that is run again loads it and does nothing more: ``fit`` reports the saved
result.

Pre-emption: with a run directory, a SIGTERM (or one of ``preemption_signals``) on any rank is
agreed at the next window boundary (torch: ``acc.handle_preemption``; JAX: at the next metrics
read), every rank saves there, with ``requeue=True`` rank 0 asks SLURM to requeue the job, the
trackers close as pre-empted and ``fit`` raises ``accumix.Preempted`` (a ``SystemExit`` with
status 143, which schedulers retry); the requeued job resumes from that checkpoint.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from accumix.common.preemption import parse_signals
from accumix.common.slurm_requeue import requeue_target
from accumix.errors import ConfigError
from accumix.trainer import checkpointing, run_state
from accumix.trainer.callbacks import LossGuard
from accumix.trainer.events import Callback
from accumix.trainer.loggers import MetricLogger, resolve_loggers
from accumix.trainer.metrics import StepMetrics
from accumix.trainer.progress import ProgressBar
from accumix.trainer.run_outputs import RunOutputs


@dataclass(kw_only=True, frozen=True, slots=True)
class FitResult:
    """What ``Trainer.fit`` did.

    Attributes:
        step: real optimizer steps at the end (including those before a resume).
        epoch: the epoch the run ended in.
        loss: the last window loss (a finished run run again: the saved one; NaN if no step
            ever ran).
        val_loss: the last validation loss, or None.
        resumed_from: the checkpoint the run resumed from, or None.
        seconds: wall time of ``fit``.
    """

    step: int
    epoch: int
    loss: float
    val_loss: float | None
    resumed_from: Path | None
    seconds: float


class Trainer:
    """Runs training through an Accelerator: steps, evaluation, checkpoints, logs, callbacks.

    Args:
        model: the plain model (or one already set up by ``accelerator``).
        optimizer: its optimizer.
        train_loader: the training DataLoader (sharded over ranks by the Accelerator).
        accelerator: the Accelerator; default ``ax.Accelerator()``.
        scheduler: an LR scheduler stepped once per real optimizer step.
        val_loader: an unsharded validation DataLoader; each rank evaluates every W-th sample.
        step_fn: ``fn(model, batch)`` returning a 0-dim mean loss or ``(loss_sum, num_items)``;
            default ``model(**batch)`` / ``model(*batch)``.
        val_step_fn: the same for validation (default: ``step_fn``).
        steps: instead of the torch objects above, another backend's steps object (e.g.
            ``accumix.trainer.jax_steps.JaxSteps``), which owns the model, optimizer and data.
        max_steps: stop after this many real optimizer steps.
        max_epochs: stop after this many epochs (whichever of the two comes first).
        eval_every: evaluate every this many steps (and at the end); None: only at the end.
        checkpoint_every: save ``acc.save_state(run_dir)`` every this many steps and at the end;
            None: no checkpoints.
        run_dir: where metrics, checkpoints and plots go; None: no files at all. One live
            job per run directory: a second one is refused while the first runs. An object
            store URL (``s3://bucket/job``) holds the checkpoints; the rest stays local.
        local_dir: with a URL ``run_dir``, the local directory of the metrics, plots and
            lock (default ``runs/<the URL's last part>``).
        checkpoint_background: periodic saves write behind the loop (``acc.save_state(...,
            background=True)``); pre-emption saves and the last one stay synchronous.
        resume: continue from ``run_dir/latest`` when it exists; False starts afresh (metric
            files restarted, new tracker runs).
        keep_checkpoints: keep only this many newest checkpoints (None: all).
        grad_clip: the max gradient norm; None: no clipping (the norm is still logged).
        callbacks: more callbacks, called after the built-in ones in this order.
        loggers: logger words (``"csv"``, ``"jsonl"``, ``"tensorboard"``, ``"mlflow"``,
            ``"wandb"``, ``"clearml"``; each once) or ``MetricLogger`` objects; default csv +
            jsonl (+ tensorboard when installed). Need ``run_dir``.
        log_model: trackers named by word upload the final ``run_dir/model.safetensors``
            when it was written before they close (after ``on_fit_end``).
        run_name: trackers' run name and ``job`` tag (default: the run directory's name).
        config: the resolved configuration, logged (with the derived facts) as trackers'
            parameters.
        system_metrics_every: every rank's CPU %, memory, device memory, GPU use and step
            time every this many steps, as ``system/rank<r>/<name>`` columns (None: off).
        progress_bar: show the progress bar on rank 0.
        preemption_signals: the signals saved as a pre-emption, names or numbers (``SIGUSR1``
            for ``sbatch --signal=USR1@90``); None: SIGTERM (JAX steps: their own).
        requeue: after a pre-emption's save, rank 0 runs ``scontrol requeue`` (SLURM).

    Raises:
        ConfigError: neither ``max_steps`` nor ``max_epochs``, a count below 1, or an empty loader.
        Preempted: from ``fit``, after a pre-emption signal was saved (see the module doc).
    """

    def __init__(
        self,
        *,
        model: Any = None,
        optimizer: Any = None,
        train_loader: Any = None,
        accelerator: Any = None,
        scheduler: Any = None,
        val_loader: Any = None,
        step_fn: Any = None,
        val_step_fn: Any = None,
        steps: Any = None,
        max_steps: int | None = None,
        max_epochs: int | None = None,
        eval_every: int | None = None,
        checkpoint_every: int | None = None,
        run_dir: str | Path | None = None,
        local_dir: str | Path | None = None,
        checkpoint_background: bool = False,
        resume: bool = True,
        keep_checkpoints: int | None = None,
        grad_clip: float | None = 1.0,
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[str | MetricLogger] | None = None,
        log_model: bool = False,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        system_metrics_every: int | None = 10,
        progress_bar: bool = True,
        preemption_signals: Sequence[int | str] | None = None,
        requeue: bool = False,
    ) -> None:
        if max_steps is None and max_epochs is None:
            raise ConfigError("give max_steps or max_epochs (or both); the run needs an end")
        for name, value in (("max_steps", max_steps), ("max_epochs", max_epochs),
                            ("eval_every", eval_every), ("checkpoint_every", checkpoint_every),
                            ("system_metrics_every", system_metrics_every)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigError(f"{name}={value!r} is invalid; use an integer >= 1 or None")
        if grad_clip is not None and not grad_clip > 0:
            raise ConfigError(f"grad_clip={grad_clip!r} is invalid; use a number > 0 or None")
        if steps is None:
            if model is None or optimizer is None or train_loader is None:
                raise ConfigError("give model=, optimizer= and train_loader= (or steps=)")
            from accumix.trainer.torch_steps import TorchSteps

            steps = TorchSteps(model=model, optimizer=optimizer, train_loader=train_loader,
                               accelerator=accelerator, scheduler=scheduler,
                               val_loader=val_loader, step_fn=step_fn, val_step_fn=val_step_fn)
        self.steps = steps
        self.accelerator = acc = steps.accelerator
        self.max_steps, self.max_epochs = max_steps, max_epochs
        self.eval_every, self.checkpoint_every = eval_every, checkpoint_every
        self.run_dir, self.checkpoint_dir = checkpointing.run_dirs(run_dir, local_dir)
        self.checkpoint_background = bool(checkpoint_background)
        self.resume, self.grad_clip = resume, grad_clip
        if keep_checkpoints is not None and (not isinstance(keep_checkpoints, int)
                                             or keep_checkpoints < 1):
            raise ConfigError(f"keep_checkpoints={keep_checkpoints!r} is invalid; use an "
                              "integer >= 1 or None")
        self.keep_checkpoints = keep_checkpoints
        builtins: list[Callback] = []
        if progress_bar and not any(isinstance(c, ProgressBar) for c in callbacks):
            builtins.append(ProgressBar())
        if not any(isinstance(c, LossGuard) for c in callbacks):
            builtins.append(LossGuard())
        self.callbacks: list[Callback] = [*builtins, *callbacks]
        if loggers and self.run_dir is None:
            raise ConfigError("loggers need run_dir=; give a run directory or loggers=[]")
        self.loggers = resolve_loggers(loggers, log_model=log_model, run_name=run_name) \
            if self.run_dir is not None else []
        self.run_name, self.config = run_name, dict(config or {})
        self.system_metrics_every = system_metrics_every
        self.preemption_signals = None if preemption_signals is None else parse_signals(
            preemption_signals, key="preemption_signals")
        self.requeue_target = requeue_target() if requeue else None  # checked now, not later
        # State that callbacks read.
        self.step = steps.optimizer_steps
        self.epoch = 0
        self.micro_step = 0  # micro-steps done in the current window
        self.should_stop = False
        self.last_metrics: StepMetrics | None = None
        self.last_val: dict[str, float] = {}
        self.resumed_from: Path | None = None
        self._saved_step = -1
        self._saved_path: Path | None = None
        self._outputs = RunOutputs(self)
        self._evaluated_step = -1
        self._warned_no_checkpoint = False
        self._stopped_by: str | None = None  # the key of the callback that stopped the run
        self._saved_result: dict[str, Any] = {}  # the loaded checkpoint's loss and epoch
        del acc

    # -- the backend's objects, for callbacks ----------------------------------------------------
    @property
    def model(self) -> Any:
        """The set-up model, what ``acc.setup`` returned (None on JAX: the params are in the
        train state)."""
        return getattr(self.steps, "model", None)

    @property
    def optimizer(self) -> Any:
        """The set-up optimizer (None on JAX)."""
        return getattr(self.steps, "optimizer", None)

    @property
    def scheduler(self) -> Any:
        """The set-up LR scheduler (None without one, and on JAX)."""
        return getattr(self.steps, "scheduler", None)

    @property
    def train_loader(self) -> Any:
        """The set-up training loader (sharded per rank, resumable; on JAX its windows)."""
        return getattr(self.steps, "train_loader", None)

    @property
    def val_loader(self) -> Any:
        """The validation loader (None without one)."""
        return getattr(self.steps, "val_loader", None)

    # -- state -------------------------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps in one epoch (the last window may be short), if the loader has a
        length and K stays fixed."""
        batches = self.steps.batches_per_epoch
        if batches is None:
            return None
        return math.ceil(batches / self.steps.grad_accum_steps)

    @property
    def total_steps(self) -> int | None:
        """The step the run will end at, as far as it is known in advance."""
        per_epoch = self.steps_per_epoch
        by_epochs = self.max_epochs * per_epoch if self.max_epochs and per_epoch else None
        candidates = [s for s in (self.max_steps, by_epochs) if s is not None]
        return min(candidates) if candidates else None

    def dispatch(self, event: str, *args: Any) -> None:
        """Calls ``event`` on every callback, in order."""
        for callback in self.callbacks:
            stopped = self.should_stop
            getattr(callback, event)(self, *args)
            if self.should_stop and not stopped:  # who stopped the run, for a resume
                self._stopped_by = run_state.key_of(self.callbacks, callback)

    # -- the run -----------------------------------------------------------------------------
    def fit(self) -> FitResult:
        """Trains until ``max_steps`` / ``max_epochs`` or a callback stops the run.

        Returns:
            What was done (steps, last losses, where it resumed from).

        Raises:
            Preempted: a pre-emption signal arrived; the step was saved (exit status 143).
            Exception: whatever the loop raised, after every callback's ``on_exception``.
        """
        started = time.perf_counter()
        outputs = self._outputs = RunOutputs(self)
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        outputs.lock()  # before anything in the run directory is read (collective)
        try:
            watch = getattr(self.steps, "watch_preemption", None)
            if watch is not None and self.run_dir is not None:
                watch(self)  # from here a SIGTERM is saved at the next window boundary
            self.dispatch("on_fit_start")
            if self.resume and self.checkpoint_dir is not None:
                self.load_checkpoint(self.checkpoint_dir, missing_ok=True)
            outputs.open()
            self._train()
            if self.val_loader is not None and self._evaluated_step != self.step:
                self.validate()
            if self.checkpoint_every is not None and self._saved_step != self.step:
                self.save_checkpoint()
            checkpointing.wait_for_save(self)  # the last save, if it went in the background
        except BaseException as exc:  # a Preempted too: the trackers close as pre-empted
            self.dispatch("on_exception", exc)
            outputs.close()
            raise
        finally:
            close = getattr(self.steps, "close", None)
            if close is not None:
                close()
        try:
            self.dispatch("on_fit_end")  # may write model.safetensors for log_model
        finally:
            outputs.close()
        last, saved = self.last_metrics, self._saved_result
        if last is None and saved:  # a finished run run again: what it reported then
            loss, epoch = saved["loss"], saved["epoch"]
        else:
            loss, epoch = last.loss if last is not None else math.nan, self.epoch
        return FitResult(step=self.step, epoch=epoch, loss=loss,
                         val_loss=self.last_val.get("val_loss"), resumed_from=self.resumed_from,
                         seconds=time.perf_counter() - started)

    def stop_preempted(self) -> NoReturn:
        """Every rank agreed on a pre-emption signal at this window boundary (the steps object
        calls it): saves here unless this step is saved, and raises ``Preempted``
        (collective)."""
        checkpointing.stop_preempted(self)

    def save_for_preemption(self) -> Path | None:
        """The checkpoint of this step: saved now, or the one already saved at it."""
        return checkpointing.save_for_preemption(self)

    def done(self) -> bool:
        """The run has reached its end (max_steps, max_epochs, or a callback's
        ``should_stop``)."""
        # The loader's epoch passes max_epochs only in a checkpoint saved at the last epoch's
        # end (its next epoch); during a run the loop below stops after the last epoch.
        return self.should_stop or (self.max_steps is not None and self.step >= self.max_steps
                                    ) or (self.max_epochs is not None
                                          and self.steps.epoch >= self.max_epochs)

    def _train(self) -> None:
        empty_epochs = 0
        while not self.done():
            got_batch = self.steps.run_epoch(self)
            if self.done():
                return
            self.epoch = self.steps.epoch
            # A resume at an epoch's very end yields nothing once; twice means no data at all.
            empty_epochs = 0 if got_batch else empty_epochs + 1
            if empty_epochs > 1:
                raise ConfigError("train_loader yields no batches; check the dataset and "
                                  "batch_size (drop_last with fewer samples than a batch?)")
            if self.max_epochs is not None and self.epoch + 1 >= self.max_epochs:
                return

    def end_window(self, metrics: StepMetrics) -> None:
        """After an optimizer step (called by the steps object with the window's ``metrics``):
        callbacks, evaluation, the logged row, the checkpoint."""
        self.step, self.micro_step, self.last_metrics = metrics.step, 0, metrics
        self._outputs.note_geometry(metrics)
        self.dispatch("on_optimizer_step", metrics)
        stepped = not metrics.skipped
        if stepped and self.eval_every and self.step % self.eval_every == 0:
            metrics.extra.update(self.validate())
        if self.accelerator.is_main_process:
            self._outputs.log(metrics.as_row())
        if stepped and self.checkpoint_every and self.step % self.checkpoint_every == 0:
            self.save_checkpoint(background=self.checkpoint_background)

    # -- evaluation and checkpoints (trainer/checkpointing.py) ---------------------------------
    def validate(self) -> dict[str, float]:
        """Evaluates on the validation data over all ranks (collective: every rank calls it).

        Returns:
            ``{"val_loss", "val_items"}``, the same on every rank; ``{}`` without validation data.
        """
        if self.val_loader is None:
            return {}
        self.dispatch("on_validation_start")
        result = self.steps.validate()
        self.last_val, self._evaluated_step = result, self.step
        self.dispatch("on_validation_end", result)
        return result

    def save_checkpoint(self, *, background: bool = False) -> Path | None:
        """Saves the run (``acc.save_state(run_dir, background=...)``; collective).

        Returns:
            The step directory written (with ``background``: being written), or None without
            a run directory (a warning says so, once).
        """
        return checkpointing.save_checkpoint(self, background=background)

    def load_checkpoint(self, path: Any, *, missing_ok: bool = False) -> Path | None:
        """Restores the run from ``path`` (a run directory, whose ``latest`` is followed, or a
        step directory) with ``acc.load_state`` (collective).

        Args:
            path: where to load from.
            missing_ok: a run directory without ``latest`` is a fresh run, not an error.

        Returns:
            The path loaded, or None when nothing was there to load.

        Raises:
            ConfigError: no checkpoint at ``path`` (unless ``missing_ok``), or this accumix
                cannot load checkpoints.
        """
        return checkpointing.load_checkpoint(self, path, missing_ok=missing_ok)

    # -- the loop's state in the checkpoint (trainer/run_state.py) -------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The loop's state and every callback's ``state_dict()`` (JSON), saved with each
        checkpoint.

        Raises:
            ConfigError: a callback's state is not JSON (named).
        """
        return run_state.state_of(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores ``state``, what ``state_dict()`` returned, callbacks matched by class name
        and order."""
        run_state.restore(self, state)
