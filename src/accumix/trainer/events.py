"""The Trainer's callback events: a base class whose methods are all no-ops.

Subclass ``Callback`` and override the events you need. Every rank calls every event in the same
order, so a callback may run collectives or change ``trainer.should_stop`` (decide from values
that are the same on every rank, such as the logged loss, or every rank must agree).

One optimizer step with K micro-steps fires, in order::

    on_train_batch_start, on_before_backward, on_after_backward, on_train_batch_end  (K-1 times)
    on_train_batch_start, on_before_backward, on_after_backward,
    on_before_optimizer_step, on_optimizer_step, [on_validation_start, on_validation_end],
    [on_write_checkpoint, on_save_checkpoint], on_train_batch_end

wrapped once in ``on_fit_start`` ... ``on_fit_end`` (``on_load_checkpoint`` right after
``on_fit_start`` when a run resumes; ``on_exception`` instead of ``on_fit_end`` on an error).

A callback that counts or remembers (a patience counter, recent losses) returns that from
``state_dict()``; the Trainer saves it in each checkpoint (JSON: numbers, strings, lists,
dicts; no pickles) and hands it to ``load_state_dict`` when the run resumes, before
``on_load_checkpoint``. Callbacks are matched by class name and order.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from accumix.trainer.metrics import StepMetrics
    from accumix.trainer.trainer import Trainer

EVENTS = (
    "on_fit_start",
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_optimizer_step",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_end",
    "on_write_checkpoint",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "on_exception",
    "on_fit_end",
)


class Callback:
    """Hooks into the Trainer's loop; every method is an optional no-op.

    Every event receives the ``trainer`` first: ``trainer.step``, ``trainer.epoch``,
    ``trainer.accelerator``, ``trainer.should_stop``, the set-up ``trainer.model``, ...

    Example:
        ```python
        import accumix as ax


        class StopAtLoss(ax.Callback):
            def __init__(self, target: float) -> None:
                self.target = target

            def on_optimizer_step(self, trainer, metrics):
                if metrics.loss < self.target:  # the window's loss: the same on every rank
                    trainer.should_stop = True
        ```
    """

    def on_fit_start(self, trainer: Trainer) -> None:
        """Before the first batch (the run directory exists, nothing is resumed yet)."""

    def on_train_batch_start(self, trainer: Trainer, batch: Any) -> None:
        """Before a micro-step's forward (``batch``: its micro-batch, as the loader gave it);
        ``trainer.micro_step`` is 0 at a window's start."""

    def on_before_backward(self, trainer: Trainer, loss: torch.Tensor) -> None:
        """After the forward: ``loss`` is the micro-batch's mean loss or its loss sum."""

    def on_after_backward(self, trainer: Trainer) -> None:
        """After the micro-step's backward (gradients are still scaled and summed)."""

    def on_before_optimizer_step(self, trainer: Trainer, grad_norm: torch.Tensor | None
                                 ) -> None:
        """At the boundary, gradients final (unscaled, normalised, clipped), before the step.

        Args:
            trainer: the trainer.
            grad_norm: the total gradient norm before clipping, still on the device (reading it
                is a host sync; the Trainer reads it once, after the step, with the loss).
        """

    def on_optimizer_step(self, trainer: Trainer, metrics: StepMetrics) -> None:
        """After the optimizer step (or its fp16 skip: ``metrics.skipped``), with the window's
        ``metrics`` (a ``StepMetrics``); callbacks may add columns to ``metrics.extra`` before
        loggers write the row."""

    def on_train_batch_end(self, trainer: Trainer, batch: Any) -> None:
        """After a micro-step on ``batch`` (and after the step, the evaluation and the row at a
        boundary)."""

    def on_validation_start(self, trainer: Trainer) -> None:
        """Before an evaluation (``WeightAveraging`` swaps its average in here)."""

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After an evaluation; ``metrics`` holds ``val_loss`` (the same on every rank),
        ``val_items`` and the named sums (``val_<name>``)."""

    def on_write_checkpoint(self, trainer: Trainer, directory: Path) -> None:
        """While a checkpoint is written, before it is published: files written under
        ``directory`` (the temporary step directory) are part of the checkpoint, which
        ``latest`` names only once they are complete (``WeightAveraging`` writes its average
        here). Collective: every rank calls it, in the loop's thread (a background save
        waits for it). On an object store ``directory`` is an
        ``accumix.common.locations.RemotePath`` (``/``, ``write_bytes``, ``open``; its
        ``str()`` is the URL, which ``torch.distributed.checkpoint`` writes through fsspec)."""

    def on_save_checkpoint(self, trainer: Trainer, path: Path) -> None:
        """After ``Accelerator.save_state`` wrote ``path`` (a ``step-<n>`` directory)."""

    def on_load_checkpoint(self, trainer: Trainer, path: Path) -> None:
        """After ``Accelerator.load_state`` restored the run from ``path``."""

    def on_exception(self, trainer: Trainer, exception: BaseException) -> None:
        """The loop raised ``exception``; it is re-raised after every callback saw it."""

    def on_fit_end(self, trainer: Trainer) -> None:
        """After the last step (and the final checkpoint, if checkpoints are on)."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs of this callback, JSON-safe (numbers, strings, lists,
        dicts); saved in every checkpoint. Default: nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes back ``state``, what ``state_dict()`` returned when the checkpoint was saved."""
