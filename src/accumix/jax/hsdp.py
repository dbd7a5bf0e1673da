"""Hybrid sharding on JAX: sharded inside a node, replicated across nodes, the slow link between
nodes crossed once per optimizer step.

The mesh has two axes, ``("replica", "fsdp")``: a row of the mesh is one node's devices (a
process per host: ``replicas`` is the process count by default), a column the same shard on
every node. It is fsdp (``strategies.FSDPStrategy``) with ``shard_axis="fsdp"`` and the rows of
a window split over both axes:

    params, optimizer state   sharded on "fsdp", replicated over "replica"
    per-use gathers           all-gather over "fsdp" (inside a node), in the scan body
    gradients (default)       reduce-scatter over "fsdp" every micro-step, in the backward,
                              into sharded float32 accumulators; after the scan ONE all-reduce
                              of the shards over "replica" (across nodes)
    defer_reduce_scatter      full-size float32 accumulators during the window (fsdp's default
                              mode); after the scan one reduce-scatter over "fsdp", then the
                              all-reduce over "replica"

so no collective whose devices span nodes runs inside the scan, and the bytes crossing nodes
per optimizer step (one shard per device) do not grow with K. (A leaf that no shard size
divides, a bias of 1, stays replicated and is all-reduced over every device after the scan.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.sharding import AxisType, Mesh

from accumix.errors import ConfigError
from accumix.jax.strategies import FSDPStrategy

REPLICA, FSDP = "replica", "fsdp"


class HSDPStrategy(FSDPStrategy):
    """fsdp over the devices of a node, replicated over ``replicas`` nodes (the torch side's
    ``ax.HSDPStrategy``: the same words, the same once-per-step crossing).

    Per-device memory is fsdp's over one node's devices. Both gradient modes give the same
    result; the default keeps 1/S of the gradients during the window (S devices per node).

    Args:
        devices: the mesh's devices, node by node (default: every device of every process, in
            process order); each row of ``replicas`` rows must lie in one process.
        replicas: the nodes to replicate over; None: the number of processes (a process per
            host, as ``accumix launch --nnodes`` starts them). In one process with several
            devices it must be given (the devices of one host are then split into
            ``replicas`` simulated nodes).
        defer_reduce_scatter: hold full-size float32 gradients during the window and
            reduce-scatter them once after it (less traffic inside a node, ddp's gradient
            memory).

    Raises:
        ConfigError: a ``replicas`` that is not an integer >= 1 (here); when the mesh is built
            (at ``Accelerator`` creation): ``replicas`` not dividing the devices, one replica
            (that is ``"fsdp"``), shards of one device (that is ``"ddp"``), a shard group
            spanning processes, or ``replicas=None`` in one process.
    """

    name = "hsdp"
    data_axes = (REPLICA, FSDP)
    shard_axis = FSDP

    def __init__(self, devices: list[Any] | None = None, *, replicas: int | None = None,
                 defer_reduce_scatter: bool = False) -> None:
        if replicas is not None and (
                isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
            raise ConfigError(f"HSDPStrategy(replicas={replicas!r}) is invalid; use the number "
                              "of nodes to replicate over (an integer >= 2), or None for the "
                              "processes")
        if not isinstance(defer_reduce_scatter, bool):
            raise ConfigError(f"HSDPStrategy(defer_reduce_scatter={defer_reduce_scatter!r}) is "
                              "invalid; use True or False")
        super().__init__(devices, sync_each_microstep=not defer_reduce_scatter)
        self.requested_replicas = replicas
        self.defer_reduce_scatter = defer_reduce_scatter

    def __repr__(self) -> str:
        return (f"HSDPStrategy(replicas={self.requested_replicas}, "
                f"defer_reduce_scatter={self.defer_reduce_scatter})")

    @property
    def replicas(self) -> int:
        """Rows of the mesh's ``"replica"`` axis: the nodes (or simulated nodes)."""
        return int(self.mesh.shape[REPLICA])

    @property
    def shard_size(self) -> int:
        """Devices per shard group (per node)."""
        return int(self.mesh.shape[FSDP])

    def build_mesh(self, devices: list[Any]) -> Mesh:
        """The ``(replicas, shard)`` mesh: row r is devices ``r*S .. r*S+S-1`` of ``devices``,
        checked to lie in one process."""
        replicas, shard = hsdp_shape(self.requested_replicas, devices)
        grid = np.array(devices).reshape(replicas, shard)
        return Mesh(grid, (REPLICA, FSDP), axis_types=(AxisType.Auto, AxisType.Auto))

    def reductions(self) -> str:
        if self.defer_reduce_scatter:
            return ("once per optimizer step (reduce-scatter inside a node, all-reduce across "
                    "nodes)")
        return ("reduce-scatter inside a node every micro-step (the shards sum in float32), "
                "all-reduce across nodes once per optimizer step")


def hsdp_shape(replicas: int | None, devices: list[Any]) -> tuple[int, int]:
    """``(replicas, devices per shard group)`` of hsdp over ``devices``.

    Raises:
        ConfigError: a degenerate or impossible mesh, in one line naming what works.
    """
    count = len(devices)
    processes = sorted({d.process_index for d in devices})
    given = replicas is not None
    if replicas is None:
        if len(processes) == 1:
            raise ConfigError(
                f"strategy='hsdp' in one process of {count} devices needs "
                f"HSDPStrategy(replicas=N): the nodes to split them into (replicas=None is "
                "the process count, a process per host); or use strategy='fsdp'")
        replicas = len(processes)
    what = f"replicas={replicas}" if given else f"the {replicas} processes"
    fits = [r for r in range(2, count) if count % r == 0 and _within_processes(devices, r)]
    if count % replicas:
        raise ConfigError(
            f"strategy='hsdp' with {what} does not divide the {count} devices; use replicas "
            f"in {fits}" if fits else f"strategy='hsdp' with {what} does not divide the "
            f"{count} devices and no hybrid mesh fits them; use strategy='fsdp' or 'ddp'")
    if replicas == 1:
        raise ConfigError(
            f"strategy='hsdp' with {what} has one replica of {count} devices: that is "
            "strategy='fsdp'; use it, or give replicas >= 2")
    shard = count // replicas
    if shard == 1:
        raise ConfigError(
            f"strategy='hsdp' with {what} makes shard groups of one device: that is "
            "strategy='ddp'; use it, or fewer replicas")
    if not _within_processes(devices, replicas):
        raise ConfigError(
            f"strategy='hsdp' with {what} makes shard groups of {shard} devices that span "
            f"processes (nodes): every micro-step's gathers would cross nodes; use replicas "
            f"in {fits}" if fits else f"strategy='hsdp' with {what} makes shard groups that "
            "span processes; use strategy='fsdp'")
    return replicas, shard


def _within_processes(devices: list[Any], replicas: int) -> bool:
    """Whether each of ``replicas`` consecutive groups of ``devices`` lies in one process."""
    shard = len(devices) // replicas
    return shard > 1 and all(
        len({d.process_index for d in devices[r * shard:(r + 1) * shard]}) == 1
        for r in range(replicas))

