"""The Trainer's JAX backend: one jitted call per window, metrics read every few steps.

``Trainer(steps=JaxSteps(...))`` runs accumix.jax under the same loop as torch (callbacks,
loggers, progress, evaluation, checkpoints, auto-resume). The step never syncs with the host:
its metrics stay on the device in a buffer that is read (one transfer for all of them) every
``read_every`` steps, at the end of an epoch, and wherever the loop acts on an exact step
(evaluation, checkpoint, ``max_steps``). Rows are logged for every step all the same; a
callback that stops the run (early stopping, a NaN guard) acts at the next read.

A SIGTERM (or another of ``preemption_signals``) on any process is agreed at the next read
(one tiny host collective): every process saves at the same window, then the Trainer stops as
pre-empted (``accumix.Preempted``: trackers closed as pre-empted, exit status 143).
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from accumix.common.preemption import PreemptionWatch
from accumix.jax.accelerator import Accelerator
from accumix.jax.data import WindowLoader, to_numpy
from accumix.jax.state import TrainState
from accumix.jax.step import LossFn, is_item_mode
from accumix.trainer.metrics import StepMetrics, peak_memory_mb
from accumix.trainer.system_metrics import SystemSampler, system_columns

if TYPE_CHECKING:
    from accumix.trainer.trainer import Trainer

class JaxSteps:
    """accumix.jax's training for the Trainer.

    Args:
        accelerator: the ``accumix.jax.Accelerator``.
        state: the set-up ``TrainState``.
        train_windows: the ``WindowLoader`` from ``acc.setup(params, optimizer, loader)``.
        loss_fn: ``loss_fn(params, batch, rng)`` (mean, or ``(loss_sum, num_items)``).
        val_loader: an unsharded torch DataLoader for validation (each process takes every
            P-th sample), or None.
        val_loss_fn: the loss for validation (default: ``loss_fn``; called with ``rng=None``).
        lr: the learning rate at an optimizer step, for the logged row (``schedule(step)``).
        read_every: read the buffered metrics every this many steps.
        preemption_signals: signals that mean "save at the next read and stop" (exit 143).
    """

    backend = "jax"

    def __init__(self, *, accelerator: Accelerator, state: TrainState,
                 train_windows: WindowLoader, loss_fn: LossFn, val_loader: Any = None,
                 val_loss_fn: LossFn | None = None, lr: Callable[[int], float] | None = None,
                 read_every: int = 10,
                 preemption_signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        self.accelerator = accelerator
        self.state = state
        self.train_loader = train_windows
        self.val_loader = val_loader
        self._val_shard: tuple[Any, int] | None = None
        if val_loader is not None:  # a sampler that cannot be split is refused here
            from accumix.trainer.evaluation import shard_for_eval

            self._val_shard = shard_for_eval(val_loader, accelerator.rank,
                                             accelerator.world_size)
        self.loss_fn, self.val_loss_fn = loss_fn, val_loss_fn or loss_fn
        self.lr = lr or (lambda _: math.nan)
        self.read_every = read_every
        self._step_fn: Any = None
        self._item_mode: bool | None = None
        self._eval_fn: Any = None
        self._host_step = 0  # optimizer steps as last read from the device
        self._system: SystemSampler | None = None
        # Off the main thread (Ray Train's worker thread) no handler can be installed: then
        # only accumix.request_preemption() and the added checks stop the run.
        self._watch = PreemptionWatch(preemption_signals, rank=accelerator.rank)

    def watch_preemption(self, trainer: Trainer) -> None:
        """The Trainer's ``preemption_signals``, when it was given some, replace these
        steps' own (the Trainer calls it as ``fit`` starts)."""
        if trainer.preemption_signals is not None:
            self._watch.close()
            self._watch = PreemptionWatch(trainer.preemption_signals,
                                          rank=self.accelerator.rank)

    def close(self) -> None:
        """Puts the signal handlers back (the Trainer calls it when ``fit`` ends)."""
        self._watch.close()

    # -- what the loop reads -------------------------------------------------------------------
    @property
    def optimizer_steps(self) -> int:
        return self._host_step

    @property
    def epoch(self) -> int:
        return self.train_loader.epoch

    @property
    def batches_per_epoch(self) -> int | None:
        return self.train_loader.batches_per_epoch

    @property
    def grad_accum_steps(self) -> int:
        return self.accelerator.grad_accum_steps

    @property
    def micro_batch_size(self) -> int | None:
        return self.train_loader.loader.batch_size

    # -- the epoch ------------------------------------------------------------------------------
    def run_epoch(self, trainer: Trainer) -> bool:
        """One pass over the windows; ``trainer.end_window`` for every step, in bursts."""
        if self._step_fn is None:
            self._step_fn = self.accelerator.train_step(self.loss_fn, clip_norm=trainer.grad_clip)
            every = trainer.system_metrics_every
            self._system = SystemSampler(every, device_memory=_device_memory_mb) \
                if every is not None else None
        pending: list[tuple[dict[str, jax.Array], int]] = []
        started = time.perf_counter()
        got_window = False
        for window in self.train_loader:
            got_window = True
            trainer.epoch = self.train_loader.epoch
            if self._item_mode is None:
                self._item_mode = is_item_mode(self.loss_fn, self.state.params, window,
                                               self.accelerator.num_devices)
            self.state, metrics = self._step_fn(self.state, window)
            pending.append((metrics, self.train_loader.last_samples))
            due = self._host_step + len(pending)  # exact unless an fp16 window was skipped
            if len(pending) >= self.read_every or _due(trainer, due):
                signalled, system = self._agree(len(pending), started)
                started = self._flush(trainer, pending, started, system)
                pending = []
                if trainer.done():
                    return True
                if signalled:
                    self._save_and_exit(trainer)
        if pending:
            self._flush(trainer, pending, started)
        return got_window

    def _flush(self, trainer: Trainer, pending: list[tuple[dict[str, jax.Array], int]],
               started: float, system: dict[str, float] | None = None) -> float:
        """Reads the buffered metrics (one transfer) and hands each step to the loop; the
        read's system metrics (``system/rank<r>/...``) go into the last step's row."""
        values = jax.device_get([m for m, _ in pending])
        elapsed = time.perf_counter() - started
        per_step = elapsed / len(pending)
        scaled = self.accelerator.scaler.enabled
        processes = self.accelerator.world_size
        memory = _peak_memory_mb()
        for (_, samples), m in zip(pending, values, strict=True):
            skipped = bool(m["skipped"])
            lr = float(self.lr(self._host_step))  # optax's count: the steps taken before
            self._host_step += 0 if skipped else 1
            metrics = StepMetrics(
                step=self._host_step, epoch=trainer.epoch, loss=float(m["loss"]), lrs=[lr],
                grad_norm=float(m["grad_norm"]),
                loss_scale=float(m["loss_scale"]) if scaled else None, skipped=skipped,
                samples=samples * processes,
                items=int(m["num_items"]) if self._item_mode else None,
                step_time_s=per_step, rank_busy_s=[per_step], max_mem_mb=memory)
            if system and m is values[-1]:
                metrics.extra.update(system)
            trainer.end_window(metrics)
        if self.accelerator.scaler.enabled:
            self.accelerator.check(self.state)
        return time.perf_counter()

    def _agree(self, count: int, started: float) -> tuple[bool, dict[str, float]]:
        """The one host gather of a read: whether any process was signalled, and every
        process's system metrics when a step of this read is due for them."""
        first = self._host_step + 1
        sampled = self._system is not None and any(
            self._system.due(step) for step in range(first, first + count))
        system = (self._system.sample((time.perf_counter() - started) / count) if sampled
                  else self._system.empty()) if self._system is not None else []
        rows = np.asarray([[float(self._watch.requested()), *system]], np.float64)
        if self.accelerator.world_size > 1:
            from jax.experimental import multihost_utils

            rows = np.asarray(multihost_utils.process_allgather(rows)).reshape(-1, rows.shape[1])
        return bool(rows[:, 0].any()), system_columns(rows[:, 1:].tolist()) if sampled else {}

    def _save_and_exit(self, trainer: Trainer) -> None:
        """Some process was signalled: save here and stop as pre-empted (every process)."""
        self._watch.served()
        trainer.stop_preempted()

    def first_error(self, message: str | None) -> str | None:
        """The first process's error message, on every process (one host gather)."""
        from jax.experimental import multihost_utils

        text = (message or "").encode()[:1000].ljust(1000)
        every = multihost_utils.process_allgather(np.frombuffer(text, np.uint8))
        texts = [bytes(row).decode(errors="replace").rstrip() for row in np.asarray(every)]
        return next((t for t in texts if t), None)

    # -- evaluation and checkpoints --------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """The validation loss over every process (collective), read once."""
        acc = self.accelerator
        if self._eval_fn is None:
            self._eval_fn = acc.eval_step(self.val_loss_fn)
        assert self._val_shard is not None
        loader, max_batches = self._val_shard
        total = None
        last = None
        iterator = iter(loader)
        count = 0
        while max_batches < 0 or count < max_batches:
            batch = next(iterator, None)
            weight = 1.0
            if batch is None:
                if max_batches < 0 or last is None:
                    break
                batch, weight = last, 0.0
            last = batch
            sums = self._eval_fn(self.state, to_numpy(batch), weight)
            total = sums if total is None else jax.tree.map(jnp.add, total, sums)
            count += 1
        if total is None:
            return {"val_loss": math.nan, "val_items": 0.0}
        loss_sum, items = (float(x) for x in jax.device_get(total))
        return {"val_loss": loss_sum / items if items > 0 else math.nan, "val_items": items}

    def save(self, run_dir: Any, keep_last: int | None, extra_state: dict[str, Any],
             before_publish: Callable[[Any], None] | None = None, *,
             background: bool = False) -> Any:
        return self.accelerator.save_state(run_dir, self.state, keep_last=keep_last,
                                           extra_state=extra_state,
                                           before_publish=before_publish,
                                           background=background)

    def wait_for_save(self) -> None:
        """Waits for a background save in flight (its error, if it failed, is raised)."""
        self.accelerator.wait_for_save()

    def load(self, path: Any) -> None:
        self.state = self.accelerator.load_state(path, self.state)
        self._host_step = int(jax.device_get(self.state.step))


def _due(trainer: Trainer, step: int) -> bool:
    """Whether the loop acts on this exact step (evaluation, checkpoint, the end)."""
    return any(every and step % every == 0 for every in (
        trainer.eval_every, trainer.checkpoint_every)) or (
        trainer.max_steps is not None and step >= trainer.max_steps)


def _device_memory_mb() -> tuple[float, float] | None:
    """The first local device's bytes in use and peak, in MiB (None where JAX has no stats)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_in_use" not in stats:
        return None
    return stats["bytes_in_use"] / 2**20, stats.get("peak_bytes_in_use", math.nan) / 2**20


def _peak_memory_mb() -> float:
    """The first local device's peak bytes in use (GPU, TPU), else the process's peak RSS."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**20
    return peak_memory_mb(SimpleNamespace(type="cpu"))
