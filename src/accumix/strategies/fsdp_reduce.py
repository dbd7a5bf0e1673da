"""FSDP2 reducing gradients in a narrower dtype than it accumulates them in.

FSDP2's ``MixedPrecisionPolicy(reduce_dtype=)`` names one dtype for two things: what a unit's
unsharded gradients are summed in between reductions (off the boundary, with gradient sync off:
they are *cast down* to it and added there) and what the reduce-scatter moves. With a 16-bit
``reduce_dtype`` the window would be summed in 16 bits, rounding K times (DeepSpeed #2768's
divergence); under ``bf16-mixed`` (gathered parameters in bf16, ``reduce_dtype == param_dtype``)
FSDP2 even drops the cast and autograd sums the window in bf16.

So the policy handed to ``fully_shard`` keeps ``reduce_dtype`` = the accumulation dtype (the
stored parameters', float32), and each parameter group's reduction is narrowed afterwards: its
reduce-scatter input is allocated in the wire dtype, into which FSDP2 copies (casts) the
float32 window once at the boundary; the reduced shard is cast back to float32 into the sharded
gradient. hsdp's cross-node all-reduce of that shard (FSDP2's 2-D mesh) runs in the wire dtype
too. Each rank's share is divided by the data-parallel world before the sum (a custom
reduce-scatter, FSDP2's own division turned off): W values that each fit fp16 sum without
overflow, where FSDP2's fp16 default divides by about sqrt(W) before and after.

Private to torch 2.13: the module of the ``ReduceScatter`` interface, and each parameter group's
``_reduce_dtype``, set once after FSDP2's lazy initialisation (the root's first forward), which
computes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

# The interface ``FSDPModule.set_custom_reduce_scatter`` takes; torch 2.13 exports it from no
# public module.
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter


class PreDividedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter in ``wire``, each rank's share divided by ``divide_by`` first,
    summed. An input FSDP2 allocated in a wider dtype (hsdp's off-boundary micro-steps, see
    ``NarrowedReduction.partial_sums``) is divided there, cast for the collective, and the
    reduced shard cast back into the wider output."""

    def __init__(self, wire: torch.dtype, divide_by: int) -> None:
        self.wire, self.divide_by = wire, divide_by

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
        input_tensor.div_(self.divide_by)
        if input_tensor.dtype == self.wire:
            return dist.reduce_scatter_single(output_tensor, input_tensor, group=group,
                                              op=dist.ReduceOp.SUM, async_op=async_op)
        reduced = torch.empty_like(output_tensor, dtype=self.wire)
        dist.reduce_scatter_single(reduced, input_tensor.to(self.wire), group=group,
                                   op=dist.ReduceOp.SUM)
        output_tensor.copy_(reduced)
        return None


class NarrowedReduction:
    """The units of one root reducing in ``wire`` while their window sums in ``accumulation``.

    Args:
        root: the model ``fully_shard`` was applied to last.
        units: its FSDP units.
        wire: the reduce dtype.
        accumulation: the dtype their ``MixedPrecisionPolicy`` sums the window in.
        dp_world_size: the ranks each rank's share is divided by.
    """

    def __init__(self, root: nn.Module, units: list[FSDPModule], wire: torch.dtype,
                 accumulation: torch.dtype, dp_world_size: int) -> None:
        self.units, self.wire, self.accumulation = units, wire, accumulation
        self.current = wire  # what the groups' reduce-scatters allocate in now
        self.initialised = False
        for unit in units:
            unit.set_gradient_divide_factor(1.0)  # no division by FSDP2: the comm divides
            unit.set_force_sum_reduction_for_comms(True)
            unit.set_custom_reduce_scatter(PreDividedReduceScatter(wire, dp_world_size))
        # FSDP2 initialises the groups' dtypes lazily, in the root's first forward (before any
        # backward); a forward hook on the root runs right after it.
        self._handle = root.register_forward_hook(self._after_first_forward)

    def _after_first_forward(self, *_: Any) -> None:
        self.initialised = True
        self._apply(self.current)
        self._handle.remove()

    def _apply(self, dtype: torch.dtype) -> None:
        self.current = dtype
        if not self.initialised:
            return
        for unit in self.units:
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                group._reduce_dtype = dtype

    @contextlib.contextmanager
    def partial_sums(self) -> Iterator[None]:
        """An off-boundary micro-step whose reduce-scatter FSDP2 keeps for later (hsdp's
        partial accumulator): allocated in the accumulation dtype, so the window's partial sums
        add in float32; the reduce-scatter itself still travels in ``wire``. The boundary's
        adds its own shard (``wire``) to them, rounding the sum once for the cross-node
        all-reduce."""
        self._apply(self.accumulation)
        try:
            yield
        finally:
            self._apply(self.wire)
