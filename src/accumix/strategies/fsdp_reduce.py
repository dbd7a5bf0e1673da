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

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

# The interface ``FSDPModule.set_custom_reduce_scatter`` takes; torch 2.13 exports it from no
# public module.
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter


class PreDividedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter with each rank's share divided by ``divide_by`` first, summed."""

    def __init__(self, divide_by: int) -> None:
        self.divide_by = divide_by

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
        input_tensor.div_(self.divide_by)
        return dist.reduce_scatter_single(output_tensor, input_tensor, group=group,
                                          op=dist.ReduceOp.SUM, async_op=async_op)


def narrow_reduction(root: nn.Module, units: list[FSDPModule], wire: torch.dtype,
                     dp_world_size: int) -> None:
    """Makes ``units`` (the FSDP units of ``root``) reduce in ``wire``; the window stays in the
    dtype their ``MixedPrecisionPolicy`` accumulates in. Call right after ``fully_shard``."""
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # no division by FSDP2: the custom comm divides
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_custom_reduce_scatter(PreDividedReduceScatter(dp_world_size))

    def after_first_forward(*_: Any) -> None:
        for unit in units:
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                group._reduce_dtype = wire
        handle.remove()

    # FSDP2 initialises the groups' dtypes lazily, in the root's first forward (before any
    # backward); a forward hook on the root runs right after it.
    handle = root.register_forward_hook(after_first_forward)
