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
  backward: every optimizer's step finalizes its own, whatever order the loop steps them in;
* whether its model's gradients are still each rank's own (its last backward ran with sync
  off): the boundary then reduces them once before anything reads them.

With one optimizer (the common case) every backward reaches it and nothing is inspected. With
several, the backward's reach is read from the gradients themselves: a gradient that appears
or whose version counter moves during the backward was reached (autograd accumulates in place).
Optimizers may share parameters (one over the whole model, one over its head): a gradient is
finalized once per backward that reached it, by whichever optimizer gets there first.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from accumix.errors import AccumixError, ConfigError
from accumix.step import window_end
from accumix.strategies.base import params_of

if TYPE_CHECKING:
    from accumix.step.accumulation import AccumulationWindow
    from accumix.step.optim import AcceleratedOptimizer
    from accumix.step.run_state import RunState
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
    holds_used: bool = False  # the gradients a step used are still there (no zero_grad since)
    num_items: Number | torch.Tensor = 0  # items of the backward calls that reached them
    backwards: int = 0  # those backward calls
    found_inf: torch.Tensor | None = None  # the agreed overflow flag of their last finalize
    unsynced: bool = False  # their last backward ran with their model's gradient sync off
    zero_request: bool | None = None  # a zero_grad(set_to_none) decided at the window's end
    reach: tuple[int, ...] = ()  # serials of those backward calls (several optimizers only)

    def renew(self, window: int) -> None:
        """Opens the next window's record (lazily, at the first event of that window)."""
        if self.window != window:
            self.window, self.first_micro_step, self.step_taken = window, 0, False
            self.clear()

    def clear(self) -> None:
        """The gradients were zeroed: nothing is held, nothing is counted."""
        self.first_micro_step, self.fresh, self.finalized = 0, False, False
        self.num_items, self.backwards, self.found_inf = 0, 0, None
        self.unsynced, self.zero_request, self.reach = False, None, ()
        self.holds_used = False

    def keeps(self, window: AccumulationWindow) -> bool:
        """Whether the gradients hold micro-steps of this window that its step has not used
        (``zero_grad`` must not simply clear them)."""
        return self.window == window.index and not self.step_taken and bool(
            self.first_micro_step)

    def awaits_step(self, window: int) -> bool:
        """A backward reached them in this window and neither a step nor a zero_grad followed
        (the window's loss-scale update waits for that step)."""
        return (self.window == window and self.backwards > 0 and not self.step_taken
                and self.zero_request is None)


@dataclass(slots=True)
class StepRecord:
    """What the step knows across optimizers within one window."""

    decided_window: int = -1  # the window whose first optimizer step has been taken
    counted_window: int = -1  # the window counted in optimizer_steps
    found_inf: torch.Tensor | None = None  # this window's overflow so far (finalize flags)
    # id(parameter) -> (window, overflow flag) of the pass that finalized its gradient since
    # the last backward that reached it; read only when several optimizers (which may share
    # parameters) are set up.
    # the serials of the backward calls its finalizer's count was taken over, and the finalizer.
    finalized: dict[int, tuple[int, torch.Tensor | None, tuple[int, ...], int]] = field(
        default_factory=dict)
    backward_serial: int = 0  # backward calls so far (several optimizers only)


def marks_before(optimizers: Sequence[AcceleratedOptimizer], strategy: Strategy
                 ) -> list[list[Any]] | None:
    """What each optimizer's gradients are before a backward; None when one optimizer (or none)
    is set up: then every backward reaches it and nothing needs reading."""
    if len(optimizers) < 2:
        return None
    return [strategy.grad_marks(list(params_of([o.optimizer]))) for o in optimizers]


def reached(optimizers: Sequence[AcceleratedOptimizer], before: list[list[Any]],
            strategy: Strategy) -> tuple[list[AcceleratedOptimizer], set[int]]:
    """The optimizers whose gradients the backward just run reached, and the ids of the
    parameters it reached."""
    out, touched = [], set()
    for opt, marks in zip(optimizers, before, strict=True):
        params = list(params_of([opt.optimizer]))
        now = strategy.grad_marks(params)
        hit = {id(p) for p, a, b in zip(params, marks, now, strict=True) if not _same(a, b)}
        if hit:
            out.append(opt)
            touched |= hit
    return out, touched


def record_backward(run: RunState, before: list[list[Any]] | None,
                    num_items: Number | torch.Tensor | None) -> None:
    """Books one backward on the optimizers it reached (``before``: ``marks_before``)."""
    window = run.window
    if before is None:
        optimizers = list(run.optimizers)
    else:
        optimizers, touched = reached(run.optimizers, before, run.strategy)
        run.step.backward_serial += 1
        finalized = run.step.finalized
        for pid in touched:  # raw gradient added: to be finalized again
            finalized.pop(pid, None)
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
        # Each rank's own until the boundary reduces them: sync was off, or the backend's
        # backward left them unreduced (DDP: a second backward through one forward).
        state.unsynced = _sync_off(run, opt) or not run.strategy.backward_reduced(opt.model)
        state.zero_request = None  # an earlier zero_grad of this micro-step was the loop's top
        state.backwards += 1
        if before is not None:
            state.reach = (*state.reach, run.step.backward_serial)
        if num_items is not None:
            state.num_items = state.num_items + (
                num_items.detach().to(torch.float64) if isinstance(num_items, torch.Tensor)
                else num_items)


def _sync_off(run: RunState, optimizer: AcceleratedOptimizer) -> bool:
    """Whether its model's gradient sync is off in this micro-step (``accumulate()`` turns it
    off off the boundary, for the models it was given or for every model)."""
    if run.window.is_boundary:
        return False
    models = run.micro_step_models
    return not models or any(m is optimizer.model for m in models)


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


def finalize(run: RunState, optimizers: Sequence[AcceleratedOptimizer]) -> None:
    """Unscale + normalise + non-finite check in one pass, agreed, for each optimizer whose
    gradients got a backward since their last finalize (each with its own item count); a
    gradient another optimizer already finalized since its last backward is left as it is
    (its overflow flag counts for this optimizer too)."""
    scaler, strategy, window = run.strategy.scaler, run.strategy, run.window
    due = [o for o in optimizers
           if o.window_grads.window == window.index and o.window_grads.fresh]
    if not due:
        return
    _reduce_deferred(run, due)
    # With one optimizer nothing is shared, and the per-parameter record is not kept.
    ledger = run.step.finalized if len(run.optimizers) > 1 else None
    for opt in due:
        state = opt.window_grads
        params = list(params_of([opt.optimizer]))
        flags: list[torch.Tensor] = []
        if ledger is not None:
            params = _unfinalized(params, ledger, window, (state.reach, id(opt)), flags)
        if params or ledger is None:
            factor = window.boundary_factor(
                num_items=state.num_items,
                backwards=state.backwards,
                loss_scale=scaler.scale,
                grad_divisor=strategy.grad_divisor,
                all_reduce=strategy.all_reduce,
                dynamic_scale=scaler.enabled,
                device=run.device,
            )
            found_inf = strategy.finalize_gradients(params, factor)
            if found_inf is not None:
                flags.append(found_inf)
            if ledger is not None:
                ledger.update((id(p), (window.index, found_inf, state.reach, id(opt)))
                              for p in params)
        state.found_inf = sum(flags[1:], flags[0]) if flags else None
        state.fresh, state.finalized, state.zero_request = False, True, None
        if state.found_inf is not None:  # the window's update sees every finalize's flag
            record = run.step
            record.found_inf = state.found_inf if record.found_inf is None else (
                record.found_inf + state.found_inf)


def _unfinalized(params: list[torch.Tensor], ledger: dict[int, tuple[int, Any, Any, int]],
                 window: AccumulationWindow, who: tuple[tuple[int, ...], int],
                 flags: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters whose gradients no pass finalized since their last backward; the flags
    of the passes that finalized the others are appended to ``flags`` (each once). ``who``:
    this optimizer's backward serials (``WindowGrads.reach``) and ``id``.

    Raises:
        ConfigError: item mode, and a shared gradient was divided by the item count of other
            backward calls than this optimizer's (a backward reached one of the optimizers
            sharing it but not the other): its value would depend on which stepped first.
    """
    out = []
    for p in params:
        done = ledger.get(id(p))
        if done is None or done[0] != window.index:
            out.append(p)
            continue
        # Another optimizer's pass over other backward calls (its own earlier pass is not).
        if window.mode == "items" and done[3] != who[1] and done[2] != who[0]:
            raise ConfigError(
                "num_items=: optimizers sharing parameters were reached by different backward "
                "calls in one window, so the shared gradients have no single item count; give "
                "the shared parameters to one optimizer (param groups), or pass no num_items")
        if done[1] is not None and all(f is not done[1] for f in flags):
            flags.append(done[1])
    return out


def _reduce_deferred(run: RunState, due: Sequence[AcceleratedOptimizer]) -> None:
    """One reduction per model whose last backward ran with its gradient sync off (a model
    unused on the boundary micro-step): its gradients are each rank's own until then."""
    models: list[Any] = []
    for opt in due:
        if opt.window_grads.unsynced and all(m is not opt.model for m in models):
            models.append(opt.model)
    for model in models:
        run.strategy.reduce_deferred_grads(model)
        for opt in run.optimizers:
            if opt.model is model:
                opt.window_grads.unsynced = False


def optimizer_step(run: RunState, optimizer: AcceleratedOptimizer, closure: Any) -> Any:
    """One optimizer's step at the boundary: its own gradients finalized (each closure
    evaluation's), its own overflow decision; the window's counters recorded.

    Returns:
        The closure's first loss (what torch's ``step(closure)`` returns), else None.
    """
    if closure is not None:
        check_closure(run.grad_accum_steps, run.strategy.scaler.enabled)
        if not run.in_micro_step:  # before any window it was a silent no-op (None, no update)
            raise AccumixError(
                "optimizer.step(closure) must be called inside `with acc.accumulate():` "
                "(the closure's backward is that window's micro-step)")
    if not run.is_boundary:
        return None
    state = optimizer.window_grads
    state.renew(run.window.index)
    finalizing: FinalizingClosure | None = None
    if closure is None:
        finalize(run, [optimizer])
    else:  # each evaluation's gradients are finalized before the optimizer reads them
        finalizing = FinalizingClosure(closure, lambda: finalize(run, [optimizer]))
    # fp16 only: one host sync to read the agreed overflow flag (GradScaler does too).
    skip = state.found_inf is not None and bool(state.found_inf.item())
    stepped = run.strategy.optimizer_step(optimizer.optimizer, skip=skip, closure=finalizing)
    index, record = run.window.index, run.step
    first = record.decided_window != index
    record.decided_window = index
    # The strategy's answer: an engine may find the overflow in its own step.
    run.step_was_skipped = (not stepped) or (not first and run.step_was_skipped)
    if stepped and record.counted_window != index:
        record.counted_window = index
        run.optimizer_steps += 1
    # Applied or skipped, the step used this window's gradients: zero_grad may clear them.
    state.step_taken, state.zero_request, state.holds_used = True, None, True
    if stepped:
        optimizer.stepped_window = index
    if not run.in_micro_step:  # stepped after the window's block: maybe its last step
        window_end.update_loss_scale(run)
    return finalizing.first_loss if finalizing is not None else None


def clip_grad_norm(run: RunState, max_norm: float, norm_type: float, parameters: Any
                   ) -> torch.Tensor | None:
    """``acc.clip_grad_norm_``: finalizes the gradients it reads first, then the strategy clips."""
    # numbers.Real: a numpy float32 from a config is a number too (not a float subclass)
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or max_norm <= 0:
        raise ConfigError(f"clip_grad_norm_(max_norm={max_norm!r}) needs a number > 0")
    if not run.is_boundary:
        return None
    if parameters is None:
        finalize(run, run.optimizers)
        params = _trained_params(run)
    else:
        params = list(parameters)
        finalize(run, owners(run.optimizers, params))
    return run.strategy.clip_grad_norm_(params, float(max_norm), float(norm_type))


def _trained_params(run: RunState) -> list[torch.nn.Parameter]:
    """Every set-up optimizer's parameters, once each (read anew: groups may change)."""
    return list(params_of(o.optimizer for o in run.optimizers))
