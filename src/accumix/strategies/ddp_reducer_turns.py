"""Which backward calls DDP's reducer reduced: one per forward run with gradient sync on.

DDP arms its reducer in each forward that runs with gradient sync on (``prepare_for_backward``
at the end of ``DistributedDataParallel.forward``) and disarms it when the first backward that
reaches the module afterwards has reduced its buckets. A second backward through the module
before its next synced forward adds its gradients to ``param.grad`` unreduced: the reducer's
hooks return early. A GAN's discriminator forwarded on the real and on the fake batch, then
``acc.backward(real_part)`` and ``acc.backward(fake_part)`` on the boundary micro-step, is that
pattern: the fake half stayed each rank's own, the ranks stepped different gradients (1e-2 off
plain PyTorch, and off each other). A forward, backward, forward, backward sequence is reduced
twice and is right: DDP's average is linear, and the second reduction averages the total.

This records, per DDP module, whether the last backward that reached it was reduced, so the
boundary reduces a model whose last backward was not (``Strategy.backward_reduced`` ->
``reduce_deferred_grads``: one more all-reduce in that window, none otherwise). Which backward
reached which module is read from tensor hooks on the outputs of synced forwards (a hook runs
when a backward computes that output's gradient); off-boundary forwards, under ``no_sync``,
register nothing. A module whose output holds no tensor that requires grad is never marked, and
counts as reduced (DDP's own assumption: one backward per forward).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves


class ReducerTurns:
    """Per DDP module: is its reducer armed, and did the last backward reaching it reduce?"""

    def __init__(self) -> None:
        self._armed: set[int] = set()  # ids of modules whose reducer awaits a backward
        self._reached: set[int] = set()  # ids of modules the running backward reached
        self._unreduced: set[int] = set()  # ids whose last reaching backward was not reduced

    def watch(self, model: nn.Module) -> None:
        """Follows ``model`` (a ``DistributedDataParallel``) from its next forward on."""
        model.register_forward_hook(self._after_forward)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        # DDP's own condition for prepare_for_backward (its _post_forward)
        if not (torch.is_grad_enabled() and module.require_backward_grad_sync):
            return
        key = id(module)
        self._armed.add(key)
        hook = functools.partial(self._on_output_grad, key)
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(hook)

    def _on_output_grad(self, key: int, grad: torch.Tensor) -> None:
        self._reached.add(key)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, then books which modules it reached and whether DDP reduced."""
        self._reached.clear()
        loss.backward()
        for key in self._reached:
            if key in self._armed:
                self._armed.discard(key)
                self._unreduced.discard(key)
            else:
                self._unreduced.add(key)
        self._reached.clear()

    def reduced(self, model: nn.Module | None) -> bool:
        """Whether the last synced backward that reached ``model`` was reduced by DDP."""
        return id(model) not in self._unreduced

    def mark_reduced(self, model: nn.Module) -> None:
        """``model``'s gradients were averaged outside a backward (the boundary's reduction)."""
        self._unreduced.discard(id(model))
