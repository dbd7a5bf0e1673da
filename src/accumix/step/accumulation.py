"""The accumulation window: where it ends, how big it really was, and how gradients are divided.

Gradients of K micro-steps are summed by autograd; at the window's boundary they are divided by
what the large batch would have divided by, in one fused pass with fp16 unscaling:

* mean mode, ``backward(loss)``: each micro-step's loss is multiplied by ``scale / K`` before
  backward; a window that ends early (the short last window of an epoch) is corrected by
  ``K / k`` at the boundary, so it is divided by its true size k (Lightning #19987 divides by K).
* item mode, ``backward(loss_sum, num_items=n)``: the boundary factor is ``W / N`` where N is the
  item count summed over micro-steps and ranks (one scalar all-reduce) and W undoes the backend's
  average over ranks: the full-batch mean over items, which HF Trainer got wrong until PR #34191.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from accumix.common.batch_sizes import derive_grad_accum_steps
from accumix.errors import ConfigError

Number = int | float

__all__ = ["AccumulationWindow", "derive_grad_accum_steps"]


class AccumulationWindow:
    """Counts micro-steps, finds boundaries, and computes the boundary's gradient factor.

    Args:
        grad_accum_steps: K, the micro-steps of a full window.
    """

    def __init__(self, grad_accum_steps: int) -> None:
        self.grad_accum_steps = grad_accum_steps
        self.micro_step = 0  # micro-steps begun in the current window
        self.size = 0  # micro-steps of the current window, or of the last one once it ended
        self.index = -1  # windows begun so far, minus one
        self.is_boundary = False
        self.end_of_data = False  # set by a set-up loader when it yields its last batch
        self.mode: str | None = None  # "mean" | "items", fixed per window
        self.num_items: Number | torch.Tensor = 0
        # Item mode under fp16: the loss is divided by the last window's mean item count per
        # backward and by K, so a summed loss does not overflow fp16 and the window's sum is
        # about its mean, as in mean mode (divided by the count alone, the window carried K
        # times mean mode's gradient to a 16-bit wire: K=4 skipped 3 of 10 steps where mean
        # mode skipped none, issue 38); undone exactly at the boundary. ``items_hint`` is the
        # next window's count per backward (0: no count seen yet, then the first backward's
        # count is used: issue 15 item 8); ``window_hint`` (with K) stays fixed within a
        # window, since every backward and every finalize of the window must use the same one.
        self.items_hint = 0.0
        self.window_hint = 1.0

    def begin(self) -> bool:
        """Starts a micro-step; returns whether it ends the window."""
        if self.micro_step == 0:
            self.index += 1
            self.mode = None
            self.num_items = 0
            self.window_hint = self._hint_of_window()
        self.micro_step += 1
        self.size = self.micro_step
        self.is_boundary = self.micro_step >= self.grad_accum_steps or self.end_of_data
        return self.is_boundary

    def end(self) -> None:
        """Ends the micro-step begun last; after a boundary the next one opens a new window."""
        if self.is_boundary:
            self.micro_step = 0

    def state_dict(self) -> dict[str, Any]:
        """The counters as plain numbers (an item count held as a tensor becomes a float)."""
        items = self.num_items
        return {
            "micro_step": self.micro_step,
            "index": self.index,
            "mode": self.mode,
            "num_items": float(items) if isinstance(items, torch.Tensor) else items,
            "num_items_is_tensor": isinstance(items, torch.Tensor),
            "items_hint": self.items_hint,
            "is_boundary": self.is_boundary,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the counters; ``grad_accum_steps`` stays this run's setting."""
        self.micro_step, self.index, self.mode = state["micro_step"], state["index"], state["mode"]
        self.size = self.micro_step
        items = state["num_items"]
        self.num_items = (torch.tensor(items, dtype=torch.float64)
                          if state["num_items_is_tensor"] else items)
        self.items_hint = float(state["items_hint"])
        self.window_hint = self._hint_of_window()
        self.is_boundary, self.end_of_data = bool(state["is_boundary"]), False

    def needs_first_hint(self, num_items: Number | torch.Tensor | None, dynamic_scale: bool
                         ) -> bool:
        """Whether this backward is fp16's first item-weighted one: no earlier window gave a
        count to divide summed losses by, so the caller agrees one from this backward's."""
        return dynamic_scale and num_items is not None and not self.items_hint

    def set_first_hint(self, items: float) -> None:
        """The first window's hint (the same on every rank: the caller agrees it)."""
        self.items_hint = max(float(items), 1.0)
        self.window_hint = self._hint_of_window()

    def _hint_of_window(self) -> float:
        """What every item-weighted loss of a window is divided by: the count per backward
        times K under fp16 (``items_hint``), else 1 (nothing to keep from overflowing)."""
        return self.items_hint * self.grad_accum_steps if self.items_hint else 1.0

    def loss_multiplier(self, num_items: Number | torch.Tensor | None) -> float:
        """Records one backward; returns what its loss is multiplied by before the loss scale."""
        mode = "mean" if num_items is None else "items"
        if self.mode is None:
            self.mode = mode
        elif self.mode != mode:
            raise ConfigError(
                "backward() mixed a mean loss and num_items= within one accumulation window; "
                "pass num_items on every micro-step or on none"
            )
        if num_items is None:
            return 1.0 / self.grad_accum_steps
        if isinstance(num_items, torch.Tensor):
            num_items = num_items.detach().to(torch.float64)
        self.num_items = self.num_items + num_items
        return 1.0 / self.window_hint

    def boundary_factor(
        self, *, num_items: Number | torch.Tensor, backwards: int, loss_scale: float,
        grad_divisor: int, all_reduce, dynamic_scale: bool, device: torch.device,
    ) -> float | torch.Tensor:
        """What one optimizer's summed gradients are multiplied by at the boundary.

        Args:
            num_items: the items of the backward calls that reached these gradients (item
                mode), on this rank.
            backwards: how many backward calls reached them (the next fp16 hint's divisor).
            loss_scale: the scale the losses of this window were multiplied by.
            grad_divisor: the number of ranks the backend averaged gradients over.
            all_reduce: ``fn(tensor, op) -> tensor`` summing over data-parallel ranks.
            dynamic_scale: fp16 is on (then the next window's item hint is refreshed).
            device: where an item count that came as a number is put for the all-reduce.

        Returns:
            A float in mean mode (no device work), a 0-dim tensor in item mode.
        """
        if self.mode != "items":
            # ``size``, not ``micro_step``: an optimizer stepped after the boundary's block
            # finalizes after the counter was reset for the next window.
            return self.grad_accum_steps / (self.size * loss_scale)
        items = num_items
        if grad_divisor > 1:
            if isinstance(items, torch.Tensor):
                items = items.to(device=device, copy=True)
            else:
                items = torch.tensor(float(items), dtype=torch.float64, device=device)
            items = all_reduce(items, "sum")
        hint = self.window_hint
        if dynamic_scale:  # the host sync rides on the found_inf read that fp16 does anyway
            self.items_hint = max(float(items) / (grad_divisor * max(backwards, 1)), 1.0)
        if isinstance(items, torch.Tensor):
            # All padding gives zero gradients: any finite factor is right, inf would poison.
            return (grad_divisor * hint / loss_scale) / items.clamp_min(1e-30)
        return grad_divisor * hint / (loss_scale * max(items, 1e-30))


def rescale_grads_(
    grads: list[torch.Tensor], factor: float | torch.Tensor, check_finite: bool
) -> torch.Tensor | None:
    """Multiplies gradients by ``factor`` in one pass; with ``check_finite`` also finds inf/NaN.

    The check uses torch's fused ``_amp_foreach_non_finite_check_and_unscale_`` (GradScaler's
    kernel), so unscaling, the accumulation rescale and the overflow check read each gradient
    once.

    Returns:
        A 1-element float tensor, > 0 where a gradient was not finite; None without the check.
    """
    if not grads:
        return torch.zeros(1) if check_finite else None
    if not check_finite:
        if isinstance(factor, torch.Tensor):  # stays on the device: no host sync
            torch._foreach_mul_(grads, factor.to(grads[0].device, torch.float32))
        elif factor != 1.0:
            torch._foreach_mul_(grads, factor)
        return None
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[(g.device, g.dtype)].append(g)
    device = grads[0].device
    found_inf = torch.zeros(1, device=device)
    for (dev, _), group in groups.items():
        inv = (factor.reshape(1) if isinstance(factor, torch.Tensor) else torch.tensor([factor]))
        inv = inv.to(device=dev, dtype=torch.float32)
        found_here = torch.zeros(1, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_here, inv)
        found_inf += found_here.to(device)
    return found_inf
