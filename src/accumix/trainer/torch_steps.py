"""The Trainer's PyTorch backend: micro-steps through the Accelerator, one window at a time.

The Trainer's loop (``trainer.py``) is backend-free: it asks a steps object to run an epoch and
is called back at every optimizer step. This one runs the plain loop of DESIGN.md::

    with acc.accumulate():
        loss = step_fn(model, batch)            # mean loss, or (loss_sum, num_items)
        acc.backward(loss)                      # or acc.backward(loss_sum, num_items=n)
        norm = acc.clip_grad_norm_(grad_clip)   # boundary only
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
    at the boundary: one all_gather of the window's metrics -> trainer.end_window(metrics)

Nothing reaches around the Accelerator: K, the boundary, skipped steps and the loss scale are
its own; this only reads them.
"""

from __future__ import annotations

import logging
import math
import signal
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from accumix.accelerator import Accelerator
from accumix.common.micro_batch_search import is_auto
from accumix.data.loader import AcceleratedDataLoader
from accumix.errors import ConfigError
from accumix.memory.probe_batch import batch_maker
from accumix.runtime.fault import PreemptionHandler
from accumix.step.optim import AcceleratedOptimizer
from accumix.trainer.evaluation import evaluate, shard_for_eval
from accumix.trainer.metrics import (
    WindowMeter,
    batch_samples,
    split_loss,
    torch_system_sampler,
)

if TYPE_CHECKING:
    from accumix.trainer.trainer import Trainer

log = logging.getLogger("accumix")

StepFn = Callable[[nn.Module, Any], Any]


def default_step(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a Mapping (a dict, a tokenizer's ``BatchEncoding``, which is a
    ``UserDict``), ``model(*batch)`` for a tuple or list, else ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


class TorchSteps:
    """Sets up the torch objects and runs their micro-steps for the Trainer.

    Args: as ``Trainer``'s of the same names.
    """

    backend = "torch"

    def __init__(self, *, model: nn.Module, optimizer: Optimizer,
                 train_loader: DataLoader | AcceleratedDataLoader,
                 accelerator: Accelerator | None, scheduler: Any, val_loader: DataLoader | None,
                 step_fn: StepFn | None, val_step_fn: StepFn | None) -> None:
        self.accelerator = acc = accelerator if accelerator is not None else Accelerator()
        if isinstance(optimizer, AcceleratedOptimizer):  # the user set everything up already
            self.model, self.optimizer, self.train_loader = model, optimizer, train_loader
            self.scheduler = scheduler
        else:
            objects = [model, optimizer, train_loader] + ([scheduler] if scheduler else [])
            if is_auto(acc.micro_batch_size):  # chosen before the loader is set up
                model, optimizer = acc.setup(model, optimizer)
                step = step_fn or default_step
                acc.find_micro_batch_size(lambda batch: step(model, batch),
                                          batch_maker(train_loader))
                rest = acc.setup(*objects[2:])
                prepared = [model, optimizer, *(rest if isinstance(rest, tuple) else (rest,))]
            else:
                prepared = acc.setup(*objects)
            self.model, self.optimizer, self.train_loader = prepared[:3]
            self.scheduler = prepared[3] if scheduler else None
        if not isinstance(self.train_loader, AcceleratedDataLoader):
            raise ConfigError("train_loader must be a DataLoader (set up by the Accelerator)")
        self.step_fn = step_fn or default_step
        self.val_step_fn = val_step_fn or self.step_fn
        self.val_loader = val_loader
        # This rank's share, built once (a sampler that cannot be split is refused here)
        self._val_shard = shard_for_eval(val_loader, acc.rank, acc.world_size) \
            if val_loader is not None else None
        self._meter: WindowMeter | None = None
        self._preemption: PreemptionHandler | None = None

    # -- what the loop reads -------------------------------------------------------------------
    @property
    def optimizer_steps(self) -> int:
        return self.accelerator.optimizer_steps

    @property
    def epoch(self) -> int:
        return self.train_loader.epoch

    @property
    def batches_per_epoch(self) -> int | None:
        try:
            return len(self.train_loader)
        except TypeError:
            return None

    @property
    def grad_accum_steps(self) -> int:
        return self.accelerator.grad_accum_steps

    @property
    def micro_batch_size(self) -> int | None:
        return self.train_loader.batch_size

    # -- the epoch ------------------------------------------------------------------------------
    def run_epoch(self, trainer: Trainer) -> bool:
        """One pass over the loader, calling ``trainer.end_window`` at every boundary; returns
        early when the trainer is done after a window. Returns whether any batch came."""
        if self._meter is None:
            self._meter = WindowMeter(self.accelerator, torch_system_sampler(
                self.accelerator.device, trainer.system_metrics_every))
        got_batch = False
        for batch in self.train_loader:
            if self._preempted():  # agreed and saved between the last window and this batch
                trainer.stop_preempted()
            got_batch = True
            trainer.epoch = self.train_loader.epoch
            self._micro_step(trainer, batch)
            if trainer.micro_step == 0 and trainer.done():
                break
        if self._preempted():  # agreed after the epoch's last window
            trainer.stop_preempted()
        return got_batch

    def watch_preemption(self, trainer: Trainer) -> None:
        """SIGTERM (or ``trainer.preemption_signals``) on any rank: every rank saves the
        Trainer's checkpoint at the next window boundary (``acc.handle_preemption``, one
        scalar all-reduce per window), then the loop stops (``trainer.stop_preempted``). Off,
        with a warning, where a save mid-epoch is impossible (a loader that cannot resume
        mid-epoch). Off the main thread (Ray Train) signals cannot be caught:
        ``accumix.request_preemption()`` and the added checks (``accumix.common.preemption``)
        still are."""
        try:
            self._preemption = self.accelerator.handle_preemption(
                trainer.checkpoint_dir, signals=trainer.preemption_signals or (signal.SIGTERM,),
                keep_last=trainer.keep_checkpoints, exit=False,
                save=trainer.save_for_preemption)
        except ConfigError as exc:
            if self.accelerator.is_main_process:
                log.warning("a pre-emption signal (SIGTERM) will not be saved: %s", exc)

    def _preempted(self) -> bool:
        return self._preemption is not None and self._preemption.triggered

    def close(self) -> None:
        """Puts the signal handlers back (the Trainer calls it when ``fit`` ends)."""
        if self._preemption is not None:
            self._preemption.close()
            self._preemption = None

    def first_error(self, message: str | None) -> str | None:
        """The first rank's error message, on every rank (collective)."""
        messages = self.accelerator.strategy.all_gather_object(message)
        return next((m for m in messages if m is not None), None)

    def _micro_step(self, trainer: Trainer, batch: Any) -> None:
        acc, optimizer, meter = self.accelerator, self.optimizer, self._meter
        assert meter is not None
        trainer.dispatch("on_train_batch_start", batch)
        with acc.accumulate():
            if acc.world_size == 1 or acc.micro_batch_choice is not None:
                # The forward and backward, split into pieces of this micro-step if out of
                # memory (a batch longer than micro_batch_size="auto" probed).
                loss, num_items = split_loss(acc.run_micro_batch(
                    lambda part: self._forward(trainer, part), batch))
            else:
                # A micro-batch the user sized: no safety net, so no agreement collective (and
                # host sync) per micro-step in a distributed run.
                loss, num_items = split_loss(self._forward(trainer, batch))
                if num_items is None:
                    acc.backward(loss)
                else:
                    acc.backward(loss, num_items=num_items)
            meter.add(loss, num_items,
                      batch_samples(batch, self.train_loader.rows_of(batch)))
            trainer.dispatch("on_after_backward")
            if acc.sync_gradients:
                grad_norm = acc.clip_grad_norm_(trainer.grad_clip or math.inf)
                trainer.dispatch("on_before_optimizer_step", grad_norm)
                lrs = [float(group["lr"]) for group in optimizer.param_groups]
                loss_scale = acc.loss_scale
                optimizer.step()
                if self.scheduler is not None:
                    self.scheduler.step()
                optimizer.zero_grad()
        if acc.sync_gradients:
            metrics = meter.finish(step=acc.optimizer_steps, epoch=trainer.epoch, lrs=lrs,
                                   grad_norm=grad_norm, loss_scale=loss_scale,
                                   skipped=acc.step_was_skipped)
            trainer.end_window(metrics)
            meter.reset()  # evaluation and checkpoint time is not the next window's
        else:
            trainer.micro_step += 1
        trainer.dispatch("on_train_batch_end", batch)

    def _forward(self, trainer: Trainer, batch: Any) -> Any:
        output = self.step_fn(self.model, batch)
        trainer.dispatch("on_before_backward", split_loss(output)[0])
        if self.accelerator.sync_gradients:
            assert self._meter is not None
            self._meter.mark_ready()  # this rank's boundary backward comes next
        return output

    # -- evaluation and checkpoints --------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """The validation loss over all ranks (collective); ``{}`` without a val_loader."""
        if self._val_shard is None:
            return {}
        loader, max_batches = self._val_shard
        return evaluate(self.model, loader, self.val_step_fn, self.accelerator,
                        max_batches=max_batches, sharded=max_batches >= 0)

    def save(self, run_dir: Any, keep_last: int | None, extra_state: dict[str, Any],
             before_publish: Callable[[Any], None] | None = None, *,
             background: bool = False) -> Any:
        # The callbacks' files are written before ``latest`` moves (a crash in between must
        # not publish a checkpoint without them).
        return self.accelerator.save_state(run_dir, keep_last=keep_last or None,
                                           extra_state=extra_state, before_publish=before_publish,
                                           background=background)

    def wait_for_save(self) -> None:
        """Waits for a background save in flight (its error, if it failed, is raised)."""
        self.accelerator.wait_for_save()

    def load(self, path: Any) -> None:
        self.accelerator.load_state(path)
