"""The Trainer: the loop of DESIGN.md run for you, through the Accelerator, with callbacks.

Each micro-step is the user's plain loop; the Trainer only adds what a run needs around it::

    with acc.accumulate():
        loss = step_fn(model, batch)            # mean loss, or (loss_sum, num_items)
        acc.backward(loss)                      # or acc.backward(loss_sum, num_items=n)
        norm = acc.clip_grad_norm_(grad_clip)   # boundary only
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
    at the boundary: one all_gather of the window's metrics -> callbacks -> evaluation ->
    the logged row -> checkpoint

Nothing reaches around the Accelerator: K, the boundary, skipped steps and the loss scale are
its own; the Trainer reads them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from accumix.accelerator import Accelerator
from accumix.data import AcceleratedDataLoader
from accumix.errors import ConfigError
from accumix.optim import AcceleratedOptimizer
from accumix.trainer.callbacks import LossGuard
from accumix.trainer.evaluation import evaluate, shard_for_eval
from accumix.trainer.events import Callback
from accumix.trainer.loggers import MetricLogger, resolve_loggers
from accumix.trainer.metrics import StepMetrics, WindowMeter, batch_samples, split_loss
from accumix.trainer.progress import ProgressBar

log = logging.getLogger("accumix")

StepFn = Callable[[nn.Module, Any], Any]


def default_step(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a dict, ``model(*batch)`` for a tuple or list, else
    ``model(batch)``."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


@dataclass(kw_only=True, frozen=True, slots=True)
class FitResult:
    """What ``Trainer.fit`` did.

    Attributes:
        step: real optimizer steps at the end (including those before a resume).
        epoch: the epoch the run ended in.
        loss: the last window loss (NaN if no step ran).
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
        max_steps: stop after this many real optimizer steps.
        max_epochs: stop after this many epochs (whichever of the two comes first).
        eval_every: evaluate every this many steps (and at the end); None: only at the end.
        checkpoint_every: save ``acc.save_state(run_dir)`` every this many steps and at the end;
            None: no checkpoints.
        run_dir: where metrics, checkpoints and plots go; None: no files at all.
        resume: continue from ``run_dir/latest`` when it exists.
        keep_checkpoints: keep only this many newest checkpoints (None: all).
        grad_clip: the max gradient norm; None: no clipping (the norm is still logged).
        callbacks: more callbacks, called after the built-in ones in this order.
        loggers: logger words (``"csv"``, ``"jsonl"``, ``"tensorboard"``) or ``MetricLogger``
            objects; default csv + jsonl (+ tensorboard when installed). Need ``run_dir``.
        progress_bar: show the progress bar on rank 0.

    Raises:
        ConfigError: neither ``max_steps`` nor ``max_epochs``, a count below 1, or an empty loader.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: Optimizer,
        train_loader: DataLoader | AcceleratedDataLoader,
        accelerator: Accelerator | None = None,
        scheduler: Any = None,
        val_loader: DataLoader | None = None,
        step_fn: StepFn | None = None,
        val_step_fn: StepFn | None = None,
        max_steps: int | None = None,
        max_epochs: int | None = None,
        eval_every: int | None = None,
        checkpoint_every: int | None = None,
        run_dir: str | Path | None = None,
        resume: bool = True,
        keep_checkpoints: int | None = None,
        grad_clip: float | None = 1.0,
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[str | MetricLogger] | None = None,
        progress_bar: bool = True,
    ) -> None:
        if max_steps is None and max_epochs is None:
            raise ConfigError("give max_steps or max_epochs (or both); the run needs an end")
        for name, value in (("max_steps", max_steps), ("max_epochs", max_epochs),
                            ("eval_every", eval_every), ("checkpoint_every", checkpoint_every)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigError(f"{name}={value!r} is invalid; use an integer >= 1 or None")
        if grad_clip is not None and not grad_clip > 0:
            raise ConfigError(f"grad_clip={grad_clip!r} is invalid; use a number > 0 or None")
        self.accelerator = acc = accelerator if accelerator is not None else Accelerator()
        if isinstance(optimizer, AcceleratedOptimizer):  # the user set everything up already
            self.model, self.optimizer, self.train_loader = model, optimizer, train_loader
            self.scheduler = scheduler
        else:
            objects = [model, optimizer, train_loader] + ([scheduler] if scheduler else [])
            prepared = acc.setup(*objects)
            self.model, self.optimizer, self.train_loader = prepared[:3]
            self.scheduler = prepared[3] if scheduler else None
        if not isinstance(self.train_loader, AcceleratedDataLoader):
            raise ConfigError("train_loader must be a DataLoader (set up by the Accelerator)")
        self.step_fn = step_fn or default_step
        self.val_step_fn = val_step_fn or self.step_fn
        self.val_loader = val_loader
        self.max_steps, self.max_epochs = max_steps, max_epochs
        self.eval_every, self.checkpoint_every = eval_every, checkpoint_every
        self.run_dir = Path(run_dir) if run_dir is not None else None
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
        self.loggers = resolve_loggers(loggers) if self.run_dir is not None else []
        # State that callbacks read.
        self.step = acc.optimizer_steps
        self.epoch = 0
        self.micro_step = 0  # micro-steps done in the current window
        self.should_stop = False
        self.last_metrics: StepMetrics | None = None
        self.last_val: dict[str, float] = {}
        self.resumed_from: Path | None = None
        self._saved_step = -1
        self._evaluated_step = -1
        self._warned_no_checkpoint = False

    # -- state -------------------------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps in one epoch (the last window may be short), if the loader has a
        length and K stays fixed."""
        try:
            batches = len(self.train_loader)
        except TypeError:
            return None
        return math.ceil(batches / self.accelerator.grad_accum_steps)

    @property
    def total_steps(self) -> int | None:
        """The step the run will end at, as far as it is known in advance."""
        per_epoch = self.steps_per_epoch
        by_epochs = self.max_epochs * per_epoch if self.max_epochs and per_epoch else None
        candidates = [s for s in (self.max_steps, by_epochs) if s is not None]
        return min(candidates) if candidates else None

    def _dispatch(self, event: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, event)(self, *args)

    # -- the run -----------------------------------------------------------------------------
    def fit(self) -> FitResult:
        """Trains until ``max_steps`` / ``max_epochs`` or a callback stops the run.

        Returns:
            What was done (steps, last losses, where it resumed from).

        Raises:
            Whatever the loop raised, after every callback's ``on_exception``.
        """
        started = time.perf_counter()
        acc = self.accelerator
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._dispatch("on_fit_start")
            if self.resume and self.run_dir is not None:
                self.load_checkpoint(self.run_dir, missing_ok=True)
            if acc.is_main_process:
                for logger in self.loggers:
                    logger.open(self.run_dir, resume_step=self.step)  # type: ignore[arg-type]
            self._train()
            if self.val_loader is not None and self._evaluated_step != self.step:
                self.validate()
            if self.checkpoint_every is not None and self._saved_step != self.step:
                self.save_checkpoint()
        except BaseException as exc:
            self._dispatch("on_exception", exc)
            raise
        finally:
            for logger in self.loggers if acc.is_main_process else ():
                logger.close()
        self._dispatch("on_fit_end")
        last = self.last_metrics
        return FitResult(step=self.step, epoch=self.epoch,
                         loss=last.loss if last is not None else math.nan,
                         val_loss=self.last_val.get("val_loss"), resumed_from=self.resumed_from,
                         seconds=time.perf_counter() - started)

    def _done(self) -> bool:
        return self.should_stop or (self.max_steps is not None and self.step >= self.max_steps)

    def _train(self) -> None:
        loader = self.train_loader
        self._meter = WindowMeter(self.accelerator)
        empty_epochs = 0
        while not self._done():
            got_batch = False
            for batch in loader:
                got_batch = True
                self.epoch = loader.epoch
                self._micro_step(batch)
                if self.micro_step == 0 and self._done():
                    return
            self.epoch = loader.epoch
            # A resume at an epoch's very end yields nothing once; twice means no data at all.
            empty_epochs = 0 if got_batch else empty_epochs + 1
            if empty_epochs > 1:
                raise ConfigError("train_loader yields no batches; check the dataset and "
                                  "batch_size (drop_last with fewer samples than a batch?)")
            if self.max_epochs is not None and self.epoch + 1 >= self.max_epochs:
                return

    def _micro_step(self, batch: Any) -> None:
        acc, optimizer = self.accelerator, self.optimizer
        self._dispatch("on_train_batch_start", batch)
        with acc.accumulate():
            loss, num_items = split_loss(self.step_fn(self.model, batch))
            self._meter.add(loss, num_items, batch_samples(batch))
            self._dispatch("on_before_backward", loss)
            if acc.sync_gradients:
                self._meter.mark_ready()
            if num_items is None:
                acc.backward(loss)
            else:
                acc.backward(loss, num_items=num_items)
            self._dispatch("on_after_backward")
            if acc.sync_gradients:
                grad_norm = acc.clip_grad_norm_(self.grad_clip or math.inf)
                self._dispatch("on_before_optimizer_step", grad_norm)
                lrs = [float(group["lr"]) for group in optimizer.param_groups]
                loss_scale = acc.loss_scale
                optimizer.step()
                if self.scheduler is not None:
                    self.scheduler.step()
                optimizer.zero_grad()
        if acc.sync_gradients:
            self._end_window(grad_norm, lrs, loss_scale)
        else:
            self.micro_step += 1
        self._dispatch("on_train_batch_end", batch)

    def _end_window(self, grad_norm: torch.Tensor | None, lrs: list[float],
                    loss_scale: float | None) -> None:
        acc = self.accelerator
        metrics = self._meter.finish(step=acc.optimizer_steps, epoch=self.epoch, lrs=lrs,
                                     grad_norm=grad_norm, loss_scale=loss_scale,
                                     skipped=acc.step_was_skipped)
        self.step, self.micro_step, self.last_metrics = acc.optimizer_steps, 0, metrics
        self._dispatch("on_optimizer_step", metrics)
        stepped = not metrics.skipped
        if stepped and self.eval_every and self.step % self.eval_every == 0:
            metrics.extra.update(self.validate())
        if acc.is_main_process:
            row = metrics.as_row()
            for logger in self.loggers:
                logger.log(row)
        if stepped and self.checkpoint_every and self.step % self.checkpoint_every == 0:
            self.save_checkpoint()
        self._meter.reset()  # evaluation and checkpoint time is not the next window's

    # -- evaluation and checkpoints ------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """Evaluates on ``val_loader`` over all ranks (collective: every rank calls it).

        Returns:
            ``{"val_loss", "val_items"}``, the same on every rank; ``{}`` without a val_loader.
        """
        if self.val_loader is None:
            return {}
        acc = self.accelerator
        loader, max_batches = shard_for_eval(self.val_loader, acc.rank, acc.world_size)
        result = evaluate(self.model, loader, self.val_step_fn, acc, max_batches=max_batches,
                          sharded=max_batches >= 0)
        self.last_val, self._evaluated_step = result, self.step
        self._dispatch("on_validation_end", result)
        return result

    def save_checkpoint(self) -> Path | None:
        """Saves the run with ``acc.save_state(run_dir)`` (collective).

        Returns:
            The step directory written, or None without a run directory or without checkpoint
            support in this accumix (then a warning says so, once).
        """
        save = getattr(self.accelerator, "save_state", None)
        if self.run_dir is None or save is None:
            if not self._warned_no_checkpoint and self.accelerator.is_main_process:
                why = ("no run_dir was given" if self.run_dir is None else
                       "this accumix has no Accelerator.save_state (accumix.checkpoint)")
                log.warning("checkpoints are off: %s", why)
            self._warned_no_checkpoint = True
            return None
        kwargs = {"keep_last": self.keep_checkpoints} if self.keep_checkpoints else {}
        written = save(self.run_dir, **kwargs)
        path = (Path(written) if isinstance(written, (str, Path))
                else self.run_dir / f"step-{self.accelerator.optimizer_steps}")
        self._saved_step = self.step
        self._dispatch("on_save_checkpoint", path)
        return path

    def load_checkpoint(self, path: str | Path, *, missing_ok: bool = False) -> Path | None:
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
        path = Path(path)
        if not (path / "latest").exists() and not path.name.startswith("step-"):
            if missing_ok:
                return None
            raise ConfigError(f"no checkpoint at {str(path)!r}: it has no 'latest'")
        load = getattr(self.accelerator, "load_state", None)
        if load is None:
            raise ConfigError(f"{str(path)!r} holds a checkpoint, but this accumix has no "
                              "Accelerator.load_state; use resume=False or another run_dir")
        load(path)
        self.step = self.accelerator.optimizer_steps
        self._saved_step = self.step
        self.resumed_from = path
        self.epoch = self.train_loader.epoch
        if self.accelerator.is_main_process:
            log.info("resumed from %s at step %d", path, self.step)
        self._dispatch("on_load_checkpoint", path)
        return path
