"""How ``WeightAveraging`` holds its average like the model, per strategy, and saves it.

Each averaged parameter ``p`` has a *local* tensor, the part of the weights this rank holds, and
the average is a clone of it, updated in place:

- single, ddp, zero1, deepspeed ZeRO 1/2: the parameter itself (replicated on every rank);
- fsdp: the DTensor's local shard (``p.to_local()``, a view of the live shard);
- deepspeed ZeRO-3: the rank's flat partition ``p.ds_tensor`` (padded to the same size on every
  rank). The module's parameters are gathered from these partitions at each forward, and small
  ones are kept gathered ("persistent"): writing partitions is wrapped in the optimizer's
  checkpoint prologue and epilogue, which release the gathered copies and gather them again.

A checkpoint holds the average as the model's checkpoint holds the weights, through
``torch.distributed.checkpoint`` under the plain module's parameter names (``ema.<fqn>``): fsdp's
shards as DTensor shards, replicated averages once, ZeRO-3's partitions gathered into full tensors
(as ``strategy='deepspeed'`` saves its fp32 masters). It loads on another world size and into
another strategy: DCP reshards DTensors, and a ZeRO-3 rank takes its partition out of the full
tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PREFIX = "ema."


class Holder:
    """The average's per-parameter operations for one set-up model (see the module docstring).

    Args:
        strategy: the Accelerator's strategy (its collectives gather ZeRO-3 partitions).
        zero: DeepSpeed's ZeRO-3 optimizer when the model is partitioned by it, else None.
    """

    def __init__(self, strategy: Any, zero: Any = None) -> None:
        self.strategy, self.zero = strategy, zero

    def local(self, p: torch.Tensor) -> torch.Tensor:
        """The part of ``p``'s weights this rank holds (a view: writing it writes the model)."""
        if hasattr(p, "ds_tensor"):
            return p.ds_tensor
        return p.to_local() if hasattr(p, "to_local") else p

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Around writes into the local tensors: ZeRO-3 releases every gathered parameter first
        and gathers the persistent ones from the new partitions after (collective)."""
        if self.zero is None:
            yield
            return
        self.zero.checkpoint_event_prologue()
        try:
            yield
        finally:
            self.zero.checkpoint_event_epilogue()

    def saved(self, avg: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """What the checkpoint stores for ``p``'s average: a DTensor for a DTensor parameter,
        the full tensor otherwise (ZeRO-3: gathered, collective)."""
        if hasattr(p, "ds_tensor"):
            return self.full(avg, p)
        if hasattr(p, "device_mesh"):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(avg, p.device_mesh, p.placements, shape=p.shape,
                                      stride=p.stride(), run_check=False)
        return avg

    def full(self, avg: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """``p``'s whole average, on every rank (collective where the average is sharded)."""
        if hasattr(p, "ds_tensor"):
            parts = self.strategy.all_gather(avg)  # equal, padded partitions in rank order
            return torch.cat(parts)[:p.ds_numel].reshape(p.ds_shape)
        saved = self.saved(avg, p)
        return saved.full_tensor() if hasattr(saved, "full_tensor") else saved

    def template(self, avg: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """An empty tensor shaped like ``saved`` for DCP to load into."""
        if hasattr(p, "ds_tensor"):
            return torch.empty(p.ds_shape, dtype=avg.dtype, device=avg.device)
        return self.saved(torch.empty_like(avg), p)

    def loaded(self, value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """This rank's part of a loaded ``template``."""
        if hasattr(p, "ds_tensor"):
            size = p.ds_tensor.numel()
            start = size * _partition_rank(p)
            chunk = value.flatten()[start:start + size]
            return F.pad(chunk, (0, size - chunk.numel()))  # DeepSpeed's padding is zeros
        return value.to_local() if hasattr(value, "to_local") else value


def named_floating(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The module's floating-point parameters by their state-dict name (a tied one once)."""
    return [(name, p) for name, p in module.named_parameters() if p.is_floating_point()]


def _partition_rank(p: torch.Tensor) -> int:
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0
    return dist.get_rank(group=getattr(p, "ds_process_group", None))
