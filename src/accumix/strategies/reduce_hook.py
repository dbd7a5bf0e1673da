"""Gradients reduced in another dtype than their own: DDP's communication hook, and the same cast
for a flat buffer accumix all-reduces itself.

The window's gradients stay where autograd summed them (``param.grad``, in the parameters'
dtype: float32 under the mixed precisions); only the one reduction at the boundary casts, so a
16-bit reduction rounds once per optimizer step whatever K is (DeepSpeed #2768 accumulated in
bf16 and diverged). Each rank's share is divided by the world *before* the cast, in the wider
dtype: a sum of W values that each fit the wire's range then fits too (fp16's 65504), and the
division rounds nothing a narrowing cast would not. torch's ``bf16_compress_hook`` and
``fp16_compress_hook`` cast first and divide in 16 bits: a float32 gradient between 65504 and
W x 65504 becomes inf although its share fits, and the division rounds a second time.

An overflow that still happens (a rank's value beyond fp16's range) comes back as inf and is
found by the boundary's non-finite check under ``fp16-mixed``: every rank receives the same
reduced buffer, so every rank skips (``policy.with_reduce_dtype`` refuses fp16 where no loss
scale runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class _HookState:
    dtype: torch.dtype
    world_size: int
    group: dist.ProcessGroup | None = None


def to_wire(flat: torch.Tensor, dtype: torch.dtype, world_size: int) -> torch.Tensor:
    """``flat / world_size`` in ``dtype``, divided in the wider of the two dtypes (``flat`` is
    overwritten when it is the wider: the reduced values replace it afterwards anyway)."""
    if flat.element_size() >= torch.empty((), dtype=dtype).element_size():
        return flat.div_(world_size).to(dtype)
    return flat.to(dtype).div_(world_size)


def reduce_in_dtype_(flat: torch.Tensor, dtype: torch.dtype, world_size: int,
                     group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Averages ``flat`` over the ranks in place, the sum taken in ``dtype``."""
    if flat.dtype == dtype:
        dist.all_reduce(flat.div_(world_size), group=group)
        return flat
    wire = to_wire(flat, dtype, world_size)
    dist.all_reduce(wire, group=group)
    return flat.copy_(wire)


def _reduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    # (_HookState, dist.GradBucket) -> Future[Tensor]. No annotations: DDP compares them with
    # the real classes, and this module's are strings (``from __future__ import annotations``).
    buffer = bucket.buffer()
    wire = to_wire(buffer, state.dtype, state.world_size)
    # dist.all_reduce looked up at call time: accumix.testing.CollectiveLog counts it.
    future = dist.all_reduce(wire, group=state.group, async_op=True).get_future()

    def back(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return buffer.copy_(done.value()[0])

    return future.then(back)


def register_reduce_dtype_hook(model: DistributedDataParallel, dtype: torch.dtype,
                               world_size: int) -> None:
    """Makes ``model``'s gradient buckets travel in ``dtype`` (pre-divided, cast back after).
    Call before the first backward."""
    model.register_comm_hook(_HookState(dtype, world_size), _reduce_hook)
