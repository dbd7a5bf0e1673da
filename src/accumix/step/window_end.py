"""The end of a window, wherever the loop writes its steps: one loss-scale update after all of
its steps, and ``zero_grad`` calls whose meaning shows only at the window's end.

A loop may step its optimizers inside the ``with acc.accumulate():`` block of the boundary or
after it (the GAN form), and may skip a window's step itself (a non-finite norm). The loss
scale moves once per window, after every optimizer that a backward reached was stepped or
zeroed, from the overflow flags of every finalize of the window (GradScaler's ``update()``
after its ``step`` calls). A ``zero_grad()`` on the boundary micro-step, before the window's
step, is either the loop's top or the end of a window the loop did not step; the next window
begins (``close_window``) only after the latter is carried out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from accumix.strategies.base import params_of

if TYPE_CHECKING:
    from accumix.step.optim import AcceleratedOptimizer
    from accumix.step.run_state import RunState


def zero_grad(run: RunState, optimizer: AcceleratedOptimizer, set_to_none: bool) -> None:
    """``optimizer.zero_grad()``: clears, as torch does, unless the gradients hold micro-steps
    of a window that its step has not used yet.

    Off the boundary those are kept (the window is unfinished). On the boundary micro-step,
    gradients that only this micro-step produced are cleared as torch clears them (a GAN zeroes
    D after G's backward went through it); for earlier micro-steps' the call is either the
    loop's top (the window's last backward and its step are still to come) or the end of a
    window whose step the loop skipped. Which one shows later: a backward, a finalize or a step
    of the optimizer in this window means the former; otherwise the gradients are cleared when
    the window ends (``close_window``), so a skipped window never leaks into the next. After
    the boundary's block the window is over: it clears at once.
    """
    state, window = optimizer.window_grads, run.window
    if state.keeps(window):
        if not window.is_boundary:
            return
        if run.in_micro_step and state.first_micro_step < window.micro_step:
            state.zero_request = set_to_none
            return
    run.strategy.zero_grad(optimizer.optimizer, set_to_none)
    state.clear()
    if not run.in_micro_step and window.is_boundary:  # maybe what the scale update awaited
        update_loss_scale(run)


def drop_used_grads(run: RunState) -> None:
    """Before a backward, with several optimizers: gradients that a step of an earlier window
    used and that no ``zero_grad()`` has cleared since are dropped (set to None, as torch's
    ``zero_grad`` does), so a backward of another model's loss never adds to them.

    The GAN stepping G first, with K > 1: G's backward reaches D before ``opt_d.zero_grad()``,
    which, off the boundary, keeps what D holds (it holds this window's micro-step now). D's
    last step's gradients, already divided by that window's count, were kept with it and
    stepped again in the next window. A parameter that an optimizer with unused gradients
    also holds keeps its gradient (that optimizer's window is not over).
    """
    if len(run.optimizers) < 2:
        return
    index = run.window.index
    used = [o for o in run.optimizers
            if o.window_grads.holds_used and o.window_grads.window != index]
    if not used:
        return
    kept = {id(p) for o in run.optimizers if o not in used for p in params_of([o.optimizer])}
    for opt in used:
        for param in params_of([opt.optimizer]):
            if id(param) not in kept:
                param.grad = None
        opt.window_grads.holds_used = False


def update_loss_scale(run: RunState, *, window_over: bool = False) -> None:
    """Moves the loss scale once per window, after all of its steps: every backward and every
    finalize of a window use one scale, however many optimizers step, in whichever order,
    inside the ``with acc.accumulate():`` block or after it (GradScaler's ``update()`` after
    every ``step``). The overflow flags are those of every finalize of the window, as
    GradScaler's update reads every unscale, stepped or not.

    Args:
        window_over: the next window begins (or a checkpoint is loaded over this state):
            update even if an optimizer that a backward reached was neither stepped nor zeroed.
    """
    record = run.step
    if record.found_inf is None:
        return
    index = run.window.index
    if not window_over and any(o.window_grads.awaits_step(index) for o in run.optimizers):
        return
    found_inf, record.found_inf = record.found_inf, None
    run.strategy.scaler.update(bool(found_inf.item()))


def close_window(run: RunState, *, window_over: bool = True) -> None:
    """Ends the window that ended last, before the next one begins: its loss-scale update, and
    the zero_grad calls left to its end (``zero_grad``).

    Args:
        window_over: False before a checkpoint is written: a step may still follow the save,
            so the scale moves only if no optimizer awaits one (saving never changes training).
    """
    update_loss_scale(run, window_over=window_over)
    for opt in run.optimizers:
        state = opt.window_grads
        if state.zero_request is not None:
            run.strategy.zero_grad(opt.optimizer, state.zero_request)
            state.clear()


def pending_overflow(run: RunState) -> bool | None:
    """The overflow of a window whose scale update has not been made yet (None: none pending),
    as a checkpoint stores it."""
    found_inf = run.step.found_inf
    return None if found_inf is None else bool(found_inf.item())


def set_pending_overflow(run: RunState, overflow: bool | None) -> None:
    """Restores ``pending_overflow``: the update is made before the next window begins."""
    run.step.found_inf = None if overflow is None else torch.tensor([float(overflow)],
                                                                     device=run.device)
