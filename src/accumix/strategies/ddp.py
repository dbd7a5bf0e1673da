"""DistributedDataParallel: the model replicated, gradients all-reduced in buckets."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from accumix.errors import ConfigError
from accumix.step.compile import Compiler
from accumix.strategies.base import Strategy
from accumix.strategies.ddp_reducer_turns import ReducerTurns
from accumix.strategies.reduce_hook import reduce_in_dtype_, register_reduce_dtype_hook


class DDPStrategy(Strategy):
    """``torch.nn.parallel.DistributedDataParallel`` over all ranks.

    Off-boundary micro-steps run under ``DDP.no_sync()``, so a window of K micro-steps costs one
    all-reduce of the gradients. On one process the model is not wrapped (same maths, no DDP).
    Gradients travel in the policy's ``reduce_dtype``: where it differs from theirs, a
    communication hook casts each bucket for the all-reduce and back (``reduce_hook``); the
    window is summed in ``param.grad`` before, in the parameters' dtype.

    Args:
        find_unused_parameters: DDP's flag, for models whose forward skips parameters.
        static_graph: DDP's flag, for graphs that do not change between iterations.
        bucket_cap_mb: DDP's bucket size; None keeps torch's default.
        gradient_as_bucket_view: DDP's flag: gradients alias the buckets (saves a copy).
        sync_batchnorm: BatchNorm layers normalise with the statistics of the batch over all
            ranks (``torch.nn.SyncBatchNorm``, which torch runs on CUDA only).

    Raises:
        ConfigError: ``sync_batchnorm=True`` on a device other than CUDA (at setup).
    """

    name = "ddp"
    honours_reduce_dtype = True

    def __init__(
        self,
        *,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        bucket_cap_mb: float | None = None,
        gradient_as_bucket_view: bool = False,
        sync_batchnorm: bool = False,
    ) -> None:
        super().__init__()
        self.sync_batchnorm = sync_batchnorm
        self.ddp_kwargs: dict[str, Any] = {
            "find_unused_parameters": find_unused_parameters,
            "static_graph": static_graph,
            "gradient_as_bucket_view": gradient_as_bucket_view,
        }
        if bucket_cap_mb is not None:
            self.ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        self._wrapped: set[int] = set()  # ids of the parameters inside a DDP-wrapped model
        self._turns = ReducerTurns()  # which backward calls DDP's reducer reduced

    def probe_settings(self) -> dict[str, Any]:
        return {**self.ddp_kwargs, "sync_batchnorm": self.sync_batchnorm}

    def setup(
        self, model: nn.Module, optimizers: list[Optimizer]
    ) -> tuple[nn.Module, list[Optimizer]]:
        if self.sync_batchnorm:
            if self.device.type != "cuda":
                raise ConfigError(f"sync_batchnorm=True needs CUDA (torch's SyncBatchNorm), not "
                                  f"{self.device.type}; use sync_batchnorm=False on this device")
            # The same Parameter objects move into the new layers: optimizers still hold them.
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = self.prepare_module(model)
        if self.world_size > 1:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=device_ids, **self.ddp_kwargs)
            self._wrapped.update(id(p) for p in model.parameters())
            if self._wire_dtype(model) is not None:
                register_reduce_dtype_hook(model, self._wire_dtype(model), self.world_size)
            self._turns.watch(model)
        return model, optimizers

    def _wire_dtype(self, model: nn.Module) -> torch.dtype | None:
        """The reduce dtype where it differs from the gradients' (the parameters'), else None:
        then DDP's own C++ all-reduce runs, exactly as without accumix."""
        assert self.policy is not None
        grads = {p.dtype for p in model.parameters() if p.requires_grad}
        wire = self.policy.reduce_dtype
        return None if grads <= {wire} else wire

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def compile_module(self, model: nn.Module, compiler: Compiler) -> nn.Module:
        """The module inside DDP compiled in place, DDP's forward left eager: DDP calls it inside
        ``_inside_ddp_forward``, so dynamo still splits the graph at DDP's buckets (DDPOptimizer,
        as for ``torch.compile(ddp_model)``), while DDP's Python (which reads the ``no_sync``
        flag and takes another branch at boundaries) never becomes dynamo frames of its own."""
        compiler.compile_in_place(self.unwrap(model))
        return model

    def before_uneven_forwards(self, models: list[nn.Module], *, start: bool) -> None:
        """DDP broadcasts rank 0's buffers (BatchNorm's running statistics) in the first forward
        after a training one: in an uneven evaluation a rank with no batch never joins, and the
        others wait in it until the timeout. Here every rank takes rank 0's buffers at the
        loop's start (each rank iterates the loader, batches or not: DDP's own broadcast), and
        no forward of the loop broadcasts again: every rank evaluates with rank 0's
        statistics, as under plain DDP, and none waits."""
        for model in models:
            if (isinstance(model, DistributedDataParallel) and model.broadcast_buffers
                    and model.modules_buffers):  # the same on every rank: all broadcast or none
                if start:
                    model._sync_buffers()
                # DDP's flag for "broadcast the buffers in the next forward" (a training forward
                # sets it; torch has no public switch)
                model.require_forward_param_sync = False

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        if self.ddp_kwargs["static_graph"]:  # on any world size: the same job fails on two
            raise ConfigError(
                f"{type(self).__name__}(static_graph=True) cannot run a micro-step without its "
                "all-reduce (grad_accum_steps > 1, micro_batch_size='auto'): torch's reducer "
                "asserts under no_sync (pytorch#143580); use static_graph=False")
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def finalize_gradients(self, params: list[nn.Parameter], factor: float | torch.Tensor
                           ) -> torch.Tensor | None:
        """Also averages the gradients of the optimizer's parameters that no DDP model holds
        (a loss weight or temperature kept outside the model): DDP never reduces them, and each
        rank would step its own."""
        if self._wrapped:
            assert self.policy is not None
            outside = [p for p in params if p.requires_grad and id(p) not in self._wrapped]
            if outside:
                average_grads_(outside, self.world_size, self.policy.reduce_dtype)
        return super().finalize_gradients(params, factor)

    def backward(self, loss: torch.Tensor, model: nn.Module | None) -> None:
        self._turns.backward(loss)

    def backward_reduced(self, model: nn.Module | None) -> bool:
        """False after a second backward through one synced forward of ``model`` (DDP's
        reducer reduces once per forward; ``ddp_reducer_turns``)."""
        return self._turns.reduced(model)

    def reduce_deferred_grads(self, model: nn.Module) -> None:
        """What DDP's synced backward would have done, once: every gradient of the model
        averaged over the ranks, in one flat all-reduce per gradient dtype, in the wire dtype
        the hook uses (after a second backward through one synced forward, the part the hook
        reduced already is averaged again: exact, DDP's average being linear, but with a
        16-bit wire it rounds twice in that window)."""
        if isinstance(model, DistributedDataParallel):
            average_grads_([p for p in model.parameters() if p.requires_grad], self.world_size,
                           self._wire_dtype(model))
            self._turns.mark_reduced(model)


def average_grads_(params: list[nn.Parameter], world_size: int,
                   wire_dtype: torch.dtype | None = None) -> None:
    """Averages the parameters' gradients over the ranks in place, as DDP's default hook does
    (each rank's divided by the world, then summed), in one all-reduce per (device, dtype);
    the sum taken in ``wire_dtype`` when given (as the communication hook takes it).

    A gradient that some rank lacks (a parameter unused there) counts as zero, as in DDP with
    ``find_unused_parameters``; one that no rank has stays None. Which ranks had it travels in
    the same buffer (a presence count after the gradients), so no second collective is needed.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = defaultdict(list)
    for p in params:
        groups[(p.device, p.dtype if p.grad is None else p.grad.dtype)].append(p)
    for (device, dtype), group in groups.items():
        parts = [(p.grad if p.grad is not None else torch.zeros_like(p, dtype=dtype)
                  ).reshape(-1) for p in group]
        present = torch.tensor([float(p.grad is not None) for p in group], dtype=dtype,
                               device=device)
        flat = reduce_in_dtype_(torch.cat([*parts, present]), wire_dtype or dtype, world_size)
        values = flat[:-len(group)].split([part.numel() for part in parts])
        for p, value, anywhere in zip(group, values, flat[-len(group):].tolist(), strict=True):
            if p.grad is not None:
                p.grad.copy_(value.view_as(p.grad))
            elif anywhere > 0:
                p.grad = value.view_as(p).clone()
