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
    from accumix.step.run_state import RunState


class _MicroStep:
    """The context of ``acc.accumulate()``; a class rather than a generator for speed."""

    __slots__ = ("run", "models", "stack")

    def __init__(self, run: RunState, models: tuple[nn.Module, ...]) -> None:
        self.run, self.models, self.stack = run, models, []

    def __enter__(self) -> None:
        run = self.run
        begin_micro_step(run)
        run.micro_step_models = self.models
        if not run.window.is_boundary:
            for model in self.models or run.models:
                ctx = run.strategy.no_sync(model)
                ctx.__enter__()
                self.stack.append(ctx)

    def __exit__(self, *exc: Any) -> None:
        while self.stack:
            self.stack.pop().__exit__(*exc)
        run = self.run
        run.in_micro_step = False
        if run.window.is_boundary:
            window_end.update_loss_scale(run)
        run.window.end()


def on_batch(run: RunState, is_last: bool) -> None:
    """A set-up loader yields a batch: whether it is the epoch's last (a window ends there)."""
    run.window.end_of_data = is_last


def between_batches(run: RunState) -> None:
    """A set-up loader is about to fetch: the place where the ranks agree on a pre-emption."""
    if run.preemption is not None:
        run.preemption.at_batch()


def begin_micro_step(run: RunState) -> None:
    """Checks that a micro-step may start here, closes the last window if it ended, begins."""
    if run.in_micro_step:
        raise AccumixError("acc.accumulate() was entered twice; micro-steps do not nest")
    if is_auto(run.batch_sizes[2]):
        raise ConfigError("micro_batch_size='auto' is not chosen yet; call "
                          "acc.find_micro_batch_size(step, make_batch) before the loop")
    if not run.steps_known:
        raise ConfigError(
            "global_batch_size was given without micro_batch_size and no DataLoader was "
            "set up to take it from; pass micro_batch_size="
        )
    if run.preemption is not None and not run.loaders:
        run.preemption.at_batch()  # no set-up loader calls it between batches
    if not run.window.micro_step:  # a new window: the last one's end comes first
        window_end.close_window(run)
    run.in_micro_step = True
    run.window.begin()


def backward(run: RunState, loss: torch.Tensor,
             num_items: int | float | torch.Tensor | None = None) -> None:
    """``acc.backward``: scales the loss, runs the strategy's backward, marks what it reached."""
    if not run.in_micro_step:
        raise AccumixError(
            "acc.backward() must be called inside `with acc.accumulate():`"
        )
    window, scaler = run.window, run.strategy.scaler
    if window.needs_first_hint(num_items, scaler.enabled):
        window.set_first_hint(boundary.agreed_count(num_items, run.strategy, run.device))
    multiplier = window.loss_multiplier(num_items) * scaler.scale
    window_end.drop_used_grads(run)
    before = boundary.marks_before(run.optimizers, run.strategy)
    run.strategy.backward(loss * multiplier if multiplier != 1.0 else loss,
                          run.models[0] if run.models else None)
    boundary.record_backward(run, before, num_items)
