"""Hybrid sharding (HSDP) on FSDP2: sharded inside a node, replicated across nodes, the slow
link between nodes crossed once per optimizer step.

FSDP2's ``fully_shard`` on a 2-D ``DeviceMesh`` ("replicate", "shard") does the sharding:
each unit's parameters are all-gathered inside the shard group (one node's ranks), and its
gradients reduce-scattered there, then all-reduced across the replicate group (the same shard
on every node). Accumulation decides when the all-reduce runs: off the boundary
``set_requires_all_reduce(False)`` keeps each micro-step's reduce-scattered shard in FSDP2's
partial accumulator, and the boundary's backward adds it and all-reduces the sum once
(torchtitan #1929 re-ran it on every micro-batch). Everything else is ``FSDPStrategy``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from accumix.common.launch_env import LaunchEnv
from accumix.errors import ConfigError
from accumix.precision import LossScaler, Policy
from accumix.precision.reduce_dtype import EffectiveDtypes
from accumix.strategies.base import grad_mark
from accumix.strategies.fsdp import FSDPStrategy, ParallelizeFn, _gradient_sync_off
from accumix.strategies.node_groups import check_groups_within_nodes, mesh_shape

MESH_DIMS = ("replicate", "shard")


class HSDPStrategy(FSDPStrategy):
    """FSDP2 sharded over the ranks of a node and replicated over ``replicas`` nodes.

    Per-device memory is fsdp's over the ranks of one node; the parameters' all-gathers and
    the gradients' reduce-scatters stay inside a node on every micro-step, and the only
    collective whose group spans nodes is one all-reduce of each rank's gradient shard per
    optimizer step, whatever the number of micro-steps K.

    Gradients within a window: by default each micro-step reduce-scatters inside the node
    (the window holds sharded gradients, as ZeRO-2/3 promises) and the shards are all-reduced
    across nodes at the boundary. ``defer_reduce_scatter=True`` keeps the full-size gradients
    of each rank during the window (fsdp's default; less intra-node traffic, DDP's gradient
    memory) and reduces once at the boundary. Both give the same result.

    The ranks of a node must be numbered consecutively (torchrun's agents do; under SLURM
    ``srun --distribution=block``): the shard groups are consecutive ranks.

    Args:
        replicas: the nodes to replicate over; None: the number of nodes of the launch
            (torchrun's ``GROUP_WORLD_SIZE``, i.e. the world over ``LOCAL_WORLD_SIZE``;
            SLURM's nodes of the step). Shard groups are then the ranks of one node; a larger
            ``replicas`` (a multiple of the nodes) shards over part of a node.
        sharding: ``"full"`` or ``"grad_op"``, as for ``FSDPStrategy``.
        wrap: module classes to make FSDP units, as for ``FSDPStrategy``.
        parallelize_fn: ``fn(model, mesh) -> model`` applying ``fully_shard`` itself; ``mesh``
            is the 2-D ("replicate", "shard") mesh, which makes ``fully_shard`` hybrid.
        reduce_dtype: dtype of the gradient reduction, as for ``FSDPStrategy``.
        defer_reduce_scatter: hold full-size gradients during the window and reduce-scatter
            and all-reduce them once at the boundary (see above).
        activation_checkpointing: recompute each wrapped block's activations in backward.

    Raises:
        ConfigError: a ``replicas`` that is not an integer >= 1 (here); at ``Accelerator``
            creation, a mesh that does not fit the launch: ``replicas`` not dividing the
            world, one replica (that is ``"fsdp"``), shard groups of one rank (that is
            ``"ddp"``) or wider than a node; at setup, ranks not numbered node by node.
    """

    name = "hsdp"

    def __init__(
        self,
        *,
        replicas: int | None = None,
        sharding: str = "full",
        wrap: list[type[nn.Module]] | None = None,
        parallelize_fn: ParallelizeFn | None = None,
        reduce_dtype: torch.dtype | None = None,
        defer_reduce_scatter: bool = False,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__(sharding=sharding, wrap=wrap, parallelize_fn=parallelize_fn,
                         reduce_dtype=reduce_dtype,
                         activation_checkpointing=activation_checkpointing)
        if replicas is not None and (
                isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
            raise ConfigError(f"HSDPStrategy(replicas={replicas!r}) is invalid; use the number "
                              "of nodes to replicate over (an integer >= 2), or None for the "
                              "nodes of the launch")
        self.requested_replicas = replicas
        self.defer_reduce_scatter = defer_reduce_scatter
        self.replicas, self.shard_size = 1, 1

    @override
    def connect(self, *, launch: LaunchEnv, device: torch.device, policy: Policy,
                scaler: LossScaler) -> None:
        super().connect(launch=launch, device=device, policy=policy, scaler=scaler)
        self.replicas, self.shard_size = mesh_shape(self.requested_replicas, launch)

    @override
    def device_mesh(self) -> DeviceMesh:
        """The (replicas, shard) mesh over consecutive ranks, after checking that each shard
        group's ranks share a node (one small all-gather)."""
        check_groups_within_nodes(self.all_gather_object(self.launch.node_rank),
                                  self.shard_size, "strategy='hsdp' shards")
        return init_device_mesh(self.device.type, (self.replicas, self.shard_size),
                                mesh_dim_names=MESH_DIMS)

    # -- the step ------------------------------------------------------------------------------
    @override
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        units = self._units.get(id(model))
        if not units:
            return contextlib.nullcontext()
        if self.defer_reduce_scatter:
            return _gradient_sync_off(units)
        narrowed = self._narrowed.get(id(model))
        if narrowed is None:
            return _all_reduce_off(units)
        stack = contextlib.ExitStack()  # a 16-bit wire: the partial shards sum in float32
        stack.enter_context(_all_reduce_off(units))
        stack.enter_context(narrowed.partial_sums())
        return stack

    @override
    def backward(self, loss: torch.Tensor, model: nn.Module | None) -> None:
        # A unit the window's earlier micro-steps reached holds their reduce-scattered shard
        # in FSDP2's partial accumulator, which only the unit's own post-backward with the
        # all-reduce on adds and sends across nodes; a boundary backward that does not reach
        # the unit (LayerDrop, an MoE expert no token picked, a skipped branch) runs that
        # post-backward with no gradient and returns early, so the shard was never
        # all-reduced nor stepped (and leaked into the next window). FSDP2's
        # ``reduce_scatter_unused_params`` makes it reduce-scatter zeros for such a unit's
        # parameters, to which the partial shard is added and all-reduced as usual: only
        # units holding a partial shard get it (a parameter unused in the whole window keeps
        # no gradient, as on one process). Every rank holds the same partials (the
        # off-boundary reduce-scatters are collectives), so every rank joins the same ones.
        pending = [group for units in self._units.values() for unit in units
                   for group in unit._get_fsdp_state()._fsdp_param_groups
                   if group.all_reduce_grads and group._partial_reduce_output is not None
                   and not group.reduce_scatter_unused_params]
        for group in pending:
            group.reduce_scatter_unused_params = True
        try:
            super().backward(loss, model)
        finally:
            for group in pending:
                group.reduce_scatter_unused_params = False

    @override
    def effective_dtypes(self) -> EffectiveDtypes:
        """fsdp's, and where the intra-node reduce-scatter runs every micro-step (the
        default), said so: its shards are summed in float32 and the cross-node all-reduce
        runs once per optimizer step."""
        dtypes = super().effective_dtypes()
        if self.defer_reduce_scatter or self.world_size == 1:
            return dtypes
        return dataclasses.replace(dtypes, reductions="reduce-scatter inside a node every "
                                   "micro-step, all-reduce across nodes once per optimizer step")

    @override
    def piece_sync(self, model: nn.Module | None, *, boundary: bool, last: bool
                   ) -> contextlib.AbstractContextManager[Any]:
        # Pieces of an out-of-memory split at the boundary: only the last crosses nodes.
        if model is None or not boundary or last:
            return contextlib.nullcontext()
        return self.no_sync(model)

    @override
    def reduce_deferred_grads(self, model: nn.Module) -> None:
        # FSDP2 all-reduces the window (and, deferred, reduce-scatters it) only inside a
        # backward with sync on.
        if self._units.get(id(model)):
            raise ConfigError(
                "strategy='hsdp' reduces gradients only inside a backward, and a model's last "
                "backward of this window ran on an earlier micro-step with its cross-node "
                "reduction off; run a backward through every trained model on each window's "
                "last micro-step (a zero loss works)")

    @override
    def grad_marks(self, params: list[nn.Parameter]) -> list[Any]:
        # Off the boundary the reduce-scattered shard goes to the unit's partial accumulator,
        # not to any gradient: a backward that reached the unit moves it.
        partial = {id(fp.sharded_param): group for units in self._units.values()
                   for unit in units for group in unit._get_fsdp_state()._fsdp_param_groups
                   for fp in group.fsdp_params}
        marks = super().grad_marks(params)
        return [(*mark, *grad_mark(getattr(partial.get(id(p)), "_partial_reduce_output", None)))
                for p, mark in zip(params, marks, strict=True)]

    @override
    def probe_settings(self) -> dict[str, Any]:
        return {**super().probe_settings(), "mesh": [self.replicas, self.shard_size],
                "defer_reduce_scatter": self.defer_reduce_scatter}


@contextlib.contextmanager
def _all_reduce_off(units: list[FSDPModule]) -> Iterator[None]:
    for unit in units:
        unit.set_requires_all_reduce(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_all_reduce(True, recurse=False)
