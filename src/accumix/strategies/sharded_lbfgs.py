"""torch's L-BFGS over FSDP2's sharded (DTensor) parameters, exact.

L-BFGS is not element-wise: its direction comes from dot products and norms over *all* the
parameters (the two-loop recursion, the curvature pairs, the line search's tolerances), so each
rank stepping with its own shards' dot products would move the ranks apart. And torch's
``LBFGS`` flattens gradients with ``p.grad.view(-1)`` and ``torch.cat``, which DTensor cannot
propagate over FSDP2's uneven shards (``Sharding propagation failed for aten.view``).

So its two flattening helpers are replaced on the instance: the flat gradient is gathered whole
(``full_tensor()``, one all-gather per parameter, the same on every rank), every rank runs the
same L-BFGS arithmetic on the same full vectors (bitwise the same decisions: no rank can take
another branch of the line search), and an update is applied by each rank to its own shard
only (``distribute_tensor(..., src_data_rank=None)``: sliced locally, no communication). The
parameters stay sharded; L-BFGS's history (``history_size`` pairs of full vectors) is held
whole on every rank, as it is under ddp. Everything else (``step``, the line search, cloning
and restoring parameters: DTensor ops on matching shards) is torch's own.
"""

from __future__ import annotations

import types

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import LBFGS, Optimizer


def adapt_lbfgs(optimizer: Optimizer) -> Optimizer:
    """Makes a ``torch.optim.LBFGS`` over DTensor parameters exact (see the module); any other
    optimizer is returned unchanged.

    Args:
        optimizer: the user's optimizer, already pointed at the sharded parameters.

    Returns:
        The same object.
    """
    if isinstance(optimizer, LBFGS):
        optimizer._gather_flat_grad = types.MethodType(_gather_flat_grad, optimizer)
        optimizer._add_grad = types.MethodType(_add_grad, optimizer)
        optimizer._numel_cache = None
    return optimizer


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _gather_flat_grad(self: LBFGS) -> torch.Tensor:
    """torch's ``LBFGS._gather_flat_grad`` over the whole gradients (collective)."""
    views = []
    for p in self._params:
        if p.grad is None:
            view = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        else:
            grad = _whole(p.grad)
            view = (grad.to_dense() if grad.is_sparse else grad).reshape(-1)
        if torch.is_complex(view):
            view = torch.view_as_real(view).view(-1)
        views.append(view)
    return torch.cat(views, 0)


def _add_grad(self: LBFGS, step_size: float, update: torch.Tensor) -> None:
    """torch's ``LBFGS._add_grad``: ``update`` is whole (the same on every rank); each rank
    adds its own shard of each parameter's slice."""
    offset = 0
    for p in self._params:
        numel = 2 * p.numel() if torch.is_complex(p) else p.numel()
        piece = update[offset:offset + numel]
        piece = torch.view_as_complex(piece.view(*p.shape, 2)) if torch.is_complex(p) else (
            piece.view(p.shape))
        if isinstance(p, DTensor):
            piece = distribute_tensor(piece, p.device_mesh, p.placements, src_data_rank=None)
        p.add_(piece, alpha=step_size)
        offset += numel
    if offset != self._numel():
        raise AssertionError(f"Expected offset {offset} to equal {self._numel()}")
