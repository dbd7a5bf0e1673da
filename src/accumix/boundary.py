"""Per-optimizer boundary bookkeeping: what each optimizer's gradients hold in this window.

One window may feed several models (a GAN's generator and discriminator, two independent
models, a closure optimizer evaluating its loss several times), so the state of the step is
kept per optimizer rather than once per window:

* which backward calls reached its parameters (a backward through D and G marks both; one
  through D alone marks D) and the item counts those calls carried: item-weighted gradients are
  divided by *their own* count, not by the count pooled over models;
* whether its gradients still hold an unfinished window (``zero_grad`` must keep them) or may
  be cleared as torch would (on the boundary micro-step, gradients of this micro-step only);
* whether they were finalized (unscaled, normalised, checked for inf) since their last
  backward: every optimizer's step finalizes its own, whatever order the loop steps them in.

With one optimizer (the common case) every backward reaches it and nothing is inspected. With
several, the backward's reach is read from the gradients themselves: a gradient that appears
or whose version counter moves during the backward was reached (autograd accumulates in place).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from accumix.errors import AccumixError, ConfigError
from accumix.strategies.base import params_of

if TYPE_CHECKING:
    from accumix.accelerator import Accelerator
    from accumix.accumulation import AccumulationWindow
    from accumix.optim import AcceleratedOptimizer
    from accumix.strategies.base import Strategy

Number = int | float


@dataclass(slots=True)
class WindowGrads:
    """One optimizer's gradients in the current window."""

    window: int = -1  # index of the window these gradients belong to
    first_micro_step: int = 0  # micro-step of the first backward that reached them (1-based)
    fresh: bool = False  # a backward reached them since they were last finalized
    finalized: bool = False  # the boundary pass ran on them (and nothing was added since)
    step_taken: bool = False  # its step ran at this boundary (applied or skipped on overflow)
    num_items: Number | torch.Tensor = 0  # items of the backward calls that reached them
    backwards: int = 0  # those backward calls
    found_inf: torch.Tensor | None = None  # the agreed overflow flag of their last finalize

    def renew(self, window: int) -> None:
        """Opens the next window's record (lazily, at the first event of that window)."""
        if self.window != window:
            self.window, self.first_micro_step, self.step_taken = window, 0, False
            self.clear()

    def clear(self) -> None:
        """The gradients were zeroed: nothing is held, nothing is counted."""
        self.first_micro_step, self.fresh, self.finalized = 0, False, False
        self.num_items, self.backwards, self.found_inf = 0, 0, None

    def keeps(self, window: AccumulationWindow) -> bool:
        """Whether ``zero_grad`` must leave the gradients alone: they hold micro-steps of a
        window that has not reached its step. On the boundary micro-step, gradients that only
        this micro-step produced are cleared as torch clears them (a GAN zeroes D after G's
        backward went through it)."""
        if self.window != window.index or self.step_taken or not self.first_micro_step:
            return False
        if not window.is_boundary:
            return True
        return self.first_micro_step < window.micro_step


def marks_before(optimizers: Sequence[AcceleratedOptimizer], strategy: Strategy
                 ) -> list[list[Any]] | None:
    """What each optimizer's gradients are before a backward; None when one optimizer (or none)
    is set up: then every backward reaches it and nothing needs reading."""
    if len(optimizers) < 2:
        return None
    return [strategy.grad_marks(list(params_of([o.optimizer]))) for o in optimizers]


def reached(optimizers: Sequence[AcceleratedOptimizer], before: list[list[Any]] | None,
            strategy: Strategy) -> list[AcceleratedOptimizer]:
    """The optimizers whose gradients the backward just run reached."""
    if before is None:
        return list(optimizers)
    out = []
    for opt, marks in zip(optimizers, before, strict=True):
        now = strategy.grad_marks(list(params_of([opt.optimizer])))
        if any(not _same(a, b) for a, b in zip(marks, now, strict=True)):
            out.append(opt)
    return out


def record_backward(optimizers: Sequence[AcceleratedOptimizer], window: AccumulationWindow,
                    num_items: Number | torch.Tensor | None) -> None:
    """Books one backward on the optimizers it reached."""
    for opt in optimizers:
        state = opt.window_grads
        state.renew(window.index)
        if state.finalized and not state.step_taken:
            # The boundary pass already multiplied these gradients; raw ones added now could
            # never be told apart from them, and the step would get a mixture.
            raise AccumixError(
                "acc.backward() reached the parameters of an optimizer whose gradients were "
                "already finalized in this step (by clip_grad_norm_() or a closure's previous "
                "evaluation); clip after the last backward, or zero_grad() that optimizer first"
            )
        if not state.first_micro_step:
            state.first_micro_step = window.micro_step
        state.fresh, state.finalized = True, False
        state.backwards += 1
        if num_items is not None:
            state.num_items = state.num_items + (
                num_items.detach().to(torch.float64) if isinstance(num_items, torch.Tensor)
                else num_items)


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Marks (``Strategy.grad_marks``) alike: the same tensors at the same versions."""
    return len(a) == len(b) and all(
        x == y if isinstance(x, int) else x is y for x, y in zip(a, b, strict=True))


def owners(optimizers: Sequence[AcceleratedOptimizer], params: list[torch.Tensor]
           ) -> list[AcceleratedOptimizer]:
    """The optimizers holding any of ``params`` (those ``clip_grad_norm_(parameters=)`` needs
    finalized)."""
    wanted = {id(p) for p in params}
    return [o for o in optimizers if any(id(p) in wanted for p in params_of([o.optimizer]))]


def agreed_count(num_items: Number | torch.Tensor, strategy: Strategy, device: torch.device
                 ) -> float:
    """The first window's fp16 item hint: the largest first count over the ranks (once per run,
    one scalar all-reduce; every rank must divide its loss by the same number)."""
    count = torch.tensor(float(num_items), dtype=torch.float64, device=device).reshape(1)
    return float(strategy.all_reduce(count, "max")[0])


def check_closure(grad_accum_steps: int, dynamic_scale: bool) -> None:
    """A closure re-evaluates the loss inside the step: only meaningful in a one-micro-step
    window, and GradScaler's per-step overflow decision cannot follow its evaluations."""
    if grad_accum_steps > 1:
        raise ConfigError(
            f"optimizer.step(closure) needs grad_accum_steps=1, not {grad_accum_steps}: the "
            "closure re-evaluates the whole batch inside the step; accumulate inside the "
            "closure, or call optimizer.step() without one"
        )
    if dynamic_scale:
        raise ConfigError(
            "optimizer.step(closure) cannot run under precision='fp16-mixed' (an overflow in "
            "one of the closure's evaluations has no step to skip); use 'bf16-mixed' or 'fp32'"
        )


class FinalizingClosure:
    """The user's closure, followed by the boundary pass over its optimizer's gradients (each
    evaluation's), so the optimizer reads true gradients however often it evaluates.

    ``first_loss`` is the first evaluation's result: what torch's optimizers return from
    ``step(closure)`` (LBFGS returns its ``orig_loss``, the others their only evaluation).
    """

    def __init__(self, closure: Callable[[], Any], finalize: Callable[[], None]) -> None:
        self.closure, self.finalize = closure, finalize
        self.first_loss: Any = None
        self._called = False

    def __call__(self) -> Any:
        # torch calls closures under enable_grad (its optimizers step under no_grad)
        with torch.enable_grad():
            loss = self.closure()
        self.finalize()
        if not self._called:
            self.first_loss, self._called = loss, True
        return loss


def finalize(acc: Accelerator, optimizers: Sequence[AcceleratedOptimizer]) -> None:
    """Unscale + normalise + non-finite check in one pass, agreed, for each optimizer whose
    gradients got a backward since their last finalize (each with its own item count)."""
    scaler, strategy, window = acc.strategy.scaler, acc.strategy, acc._window
    for opt in optimizers:
        state = opt.window_grads
        if state.window != window.index or not state.fresh:
            continue
        factor = window.boundary_factor(
            num_items=state.num_items,
            backwards=state.backwards,
            loss_scale=scaler.scale,
            grad_divisor=strategy.grad_divisor,
            all_reduce=strategy.all_reduce,
            dynamic_scale=scaler.enabled,
            device=acc.device,
        )
        state.found_inf = strategy.finalize_gradients(list(params_of([opt.optimizer])), factor)
        state.fresh, state.finalized = False, True


def optimizer_step(acc: Accelerator, optimizer: AcceleratedOptimizer, closure: Any) -> Any:
    """One optimizer's step at the boundary: its own gradients finalized (each closure
    evaluation's), its own overflow decision; the window's counters and overflow recorded.

    Returns:
        The closure's first loss (what torch's ``step(closure)`` returns), else None.
    """
    if closure is not None:
        check_closure(acc.grad_accum_steps, acc.strategy.scaler.enabled)
    if not acc.sync_gradients:
        return None
    state = optimizer.window_grads
    state.renew(acc._window.index)
    finalizing: FinalizingClosure | None = None
    if closure is None:
        finalize(acc, [optimizer])
    else:  # each evaluation's gradients are finalized before the optimizer reads them
        finalizing = FinalizingClosure(closure, lambda: finalize(acc, [optimizer]))
    # fp16 only: one host sync to read the agreed overflow flag (GradScaler does too).
    skip = state.found_inf is not None and bool(state.found_inf.item())
    stepped = acc.strategy.optimizer_step(optimizer.optimizer, skip=skip, closure=finalizing)
    index = acc._window.index
    first = acc._decided_window != index
    acc._decided_window = index
    # The strategy's answer: an engine may find the overflow in its own step.
    acc.step_was_skipped = (not stepped) or (not first and acc.step_was_skipped)
    acc._window_found_inf = skip or (not first and bool(acc._window_found_inf))
    if stepped and acc._counted_window != index:
        acc._counted_window = index
        acc.optimizer_steps += 1
    # Applied or skipped, the step used this window's gradients: zero_grad may clear them.
    state.step_taken = True
    if stepped:
        optimizer.stepped_window = index
    if not acc._in_micro_step:  # stepped after the window's block: no later flush
        acc._update_loss_scale()
    return finalizing.first_loss if finalizing is not None else None
