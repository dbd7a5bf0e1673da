"""How the ranks of a ``micro_batch_size="auto"`` probe stop together (``micro_batch_probe``'s
docstring has the protocol): a checkpoint, one small all-gather of ``[flag, peak, limit]``,
before every place the strategy may communicate; a rank that fails makes exactly one more
gather with its flag raised, and the others stop at the checkpoint that meets it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from accumix.step.run_state import RunState


class PeerFailed(Exception):
    """Another rank could not run this probe; this rank stops it at its checkpoint."""


class ProbeError(Exception):
    """A rank's step raised something other than out-of-memory in a tolerant probe (every
    rank raises it, after the same gathers)."""


OOM, ERROR = 1.0, 2.0  # what a failed rank's flag says


class Agreement:
    """The checkpoints of one probe (``micro_batch_probe``'s docstring): one gather each.
    ``kind`` is the highest failure flag seen (0: none, ``OOM``, ``ERROR``), the same on every
    rank."""

    def __init__(self, run: RunState) -> None:
        self.run = run
        self.stopped = False
        self.kind = 0.0

    def gather(self, flag: float = 0.0, peak: int = 0, limit: int = 0) -> list[list[float]]:
        row = torch.tensor([flag, float(peak), float(limit)], dtype=torch.float64,
                           device=self.run.device)
        rows = [r.tolist() for r in self.run.strategy.all_gather(row)]
        self.kind = max(row[0] for row in rows)
        return rows

    def checkpoint(self) -> None:
        if self.stopped:  # hooks firing after the stop make no more gathers
            return
        self.gather()
        if self.kind:
            self.stopped = True
            raise PeerFailed

    def fail(self, kind: float) -> None:
        if not self.stopped:
            self.stopped = True
            self.gather(kind)

    def final(self, peak: int, limit: int) -> list[list[float]] | None:
        """The last gather: every rank's peak and limit, or None when one failed."""
        if self.stopped:
            return None
        rows = self.gather(peak=peak, limit=limit)
        self.stopped = True
        return None if self.kind else rows


@contextmanager
def checkpoint_hooks(run: RunState, agreement: Agreement) -> Iterator[None]:
    """A checkpoint before each communicating unit's forward, after it and before its
    backward."""

    def before_forward(_module: nn.Module, _args: Any) -> None:
        agreement.checkpoint()

    def after_forward(_module: nn.Module, _args: Any, output: Any) -> None:
        # Prepended: before a strategy's own post-forward hook, which may communicate (fsdp and
        # deepspeed broadcast rank 0's BatchNorm buffers there, strategies/norm_layers.py).
        agreement.checkpoint()
        tensors = [t for t in tree_leaves(output)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        for tensor in tensors:
            # Registered before the strategy's own hook (this forward hook is prepended), so
            # it runs first when the gradient arrives.
            tensor.register_hook(lambda grad: (agreement.checkpoint(), grad)[1])

    handles = []
    for model in run.models:
        for unit in run.strategy.probe_units(model):
            handles.append(unit.register_forward_pre_hook(before_forward, prepend=True))
            handles.append(unit.register_forward_hook(after_forward, prepend=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
