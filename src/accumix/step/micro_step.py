"""One micro-step: the context of ``acc.accumulate()``, its entry checks and ``acc.backward``.

The window it belongs to is ``accumulation.py``; what each optimizer's gradients hold is
``boundary.py``; the window's end is ``window_end.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from accumix.common.micro_batch_search import is_auto
from accumix.errors import AccumixError, ConfigError
from accumix.step import boundary, window_end

if TYPE_CHECKING:
    from accumix.accelerator import Accelerator


class _MicroStep:
    """The context of ``acc.accumulate()``; a class rather than a generator for speed."""

    __slots__ = ("acc", "models", "stack")

    def __init__(self, acc: Accelerator, models: tuple[nn.Module, ...]) -> None:
        self.acc, self.models, self.stack = acc, models, []

    def __enter__(self) -> None:
        acc = self.acc
        begin_micro_step(acc)
        acc._micro_step_models = self.models
        if not acc._window.is_boundary:
            for model in self.models or acc._models:
                ctx = acc.strategy.no_sync(model)
                ctx.__enter__()
                self.stack.append(ctx)

    def __exit__(self, *exc: Any) -> None:
        while self.stack:
            self.stack.pop().__exit__(*exc)
        acc = self.acc
        acc._in_micro_step = False
        if acc._window.is_boundary:
            window_end.update_loss_scale(acc)
        acc._window.end()


def begin_micro_step(acc: Accelerator) -> None:
    """Checks that a micro-step may start here, closes the last window if it ended, begins."""
    if acc._in_micro_step:
        raise AccumixError("acc.accumulate() was entered twice; micro-steps do not nest")
    if is_auto(acc._batch_sizes[2]):
        raise ConfigError("micro_batch_size='auto' is not chosen yet; call "
                          "acc.find_micro_batch_size(step, make_batch) before the loop")
    if not acc._steps_known:
        raise ConfigError(
            "global_batch_size was given without micro_batch_size and no DataLoader was "
            "set up to take it from; pass micro_batch_size="
        )
    if acc._preemption is not None and not acc._loaders:
        acc._preemption.at_batch()  # no set-up loader calls it between batches
    if not acc._window.micro_step:  # a new window: the last one's end comes first
        window_end.close_window(acc)
    acc._in_micro_step = True
    acc._window.begin()


def backward(acc: Accelerator, loss: torch.Tensor,
             num_items: int | float | torch.Tensor | None = None) -> None:
    """``acc.backward``: scales the loss, runs the strategy's backward, marks what it reached."""
    if not acc._in_micro_step:
        raise AccumixError(
            "acc.backward() must be called inside `with acc.accumulate():`"
        )
    window, scaler = acc._window, acc.strategy.scaler
    if window.needs_first_hint(num_items, scaler.enabled):
        window.set_first_hint(boundary.agreed_count(num_items, acc.strategy, acc.device))
    multiplier = window.loss_multiplier(num_items) * scaler.scale
    before = boundary.marks_before(acc._optimizers, acc.strategy)
    acc.strategy.backward(loss * multiplier if multiplier != 1.0 else loss,
                          acc._models[0] if acc._models else None)
    boundary.record_backward(acc, before, num_items)
