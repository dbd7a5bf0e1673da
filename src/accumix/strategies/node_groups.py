"""Groups of ranks inside one node, from the launch: hsdp's shard groups and DeepSpeed ZeRO++'s
secondary partitions are consecutive ranks, which must share a machine for the slow link
between machines to be crossed only by the collectives meant to cross it.
"""

from __future__ import annotations

from accumix.common.launch_env import LaunchEnv
from accumix.errors import ConfigError


def mesh_shape(replicas: int | None, launch: LaunchEnv) -> tuple[int, int]:
    """(replicas, ranks per shard group) of hsdp in ``launch``.

    Raises:
        ConfigError: a degenerate or impossible mesh, with the strategy or value that works.
    """
    world, per_node = launch.world_size, launch.local_world_size
    given = replicas is not None
    replicas = launch.num_nodes if replicas is None else replicas
    what = f"replicas={replicas}" if given else f"the launch's {replicas} node(s)"
    if world % replicas:
        fits = [r for r in range(2, world) if world % r == 0 and (world // r) > 1
                and per_node % (world // r) == 0]
        raise ConfigError(
            f"strategy='hsdp' with {what} does not divide the world of {world} ranks; use "
            f"replicas in {fits} or None (the nodes)" if fits else
            f"strategy='hsdp' with {what} does not divide the world of {world} ranks and no "
            "hybrid mesh fits it; use strategy='fsdp' or 'ddp'")
    shard = world // replicas
    if replicas == 1:
        raise ConfigError(
            f"strategy='hsdp' with {what} has one replica of {world} ranks: that is "
            "strategy='fsdp'; use it, or launch on several nodes (accumix launch --nnodes N)")
    if shard == 1:
        raise ConfigError(
            f"strategy='hsdp' with {what} makes shard groups of one rank: that is "
            "strategy='ddp'; use it, or launch several ranks per node")
    if per_node % shard:
        raise ConfigError(
            f"strategy='hsdp' with {what} makes shard groups of {shard} ranks, which do not fit "
            f"in the {per_node} ranks of a node: every micro-step's gathers would cross nodes; "
            f"use replicas={world // per_node} (the nodes) or a multiple of it, or "
            "strategy='fsdp'")
    return replicas, shard


def check_groups_within_nodes(nodes: list[int], size: int, what: str) -> None:
    """Checks that each group of ``size`` consecutive ranks is on one node.

    Args:
        nodes: every rank's node index (``LaunchEnv.node_rank``), gathered, rank order.
        size: ranks per group.
        what: the subject of the message, e.g. ``"strategy='hsdp' shards"``.

    Raises:
        ConfigError: a group spans nodes (ranks numbered round-robin over the nodes).
    """
    for first in range(0, len(nodes), size):
        group = nodes[first:first + size]
        if len(set(group)) > 1:
            raise ConfigError(
                f"{what} over consecutive ranks, but ranks {first}..{first + size - 1} are on "
                f"nodes {sorted(set(group))} (node of each rank: {nodes}); number each node's "
                "ranks consecutively (torchrun does; srun --distribution=block)")


def hpz_partition_size(hpz: str | int, launch: LaunchEnv) -> int:
    """DeepSpeed ZeRO++'s ``zero_hpz_partition_size`` for ``DeepSpeedStrategy(hpz=...)``:
    ``"node"`` is the ranks of a node; an integer must fit in a node.

    Raises:
        ConfigError: a partition of one rank, of the whole world (plain ZeRO-3) or not within a
            node, named with what works.
    """
    world, per_node = launch.world_size, launch.local_world_size
    size = per_node if hpz == "node" else int(hpz)
    what = f"DeepSpeedStrategy(hpz={hpz!r})"
    if size == world:
        raise ConfigError(
            f"{what} keeps its secondary partition over all {world} ranks (one node): that is "
            "plain ZeRO-3; leave hpz out, or launch on several nodes (accumix launch --nnodes N)")
    if size < 2 or world % size or per_node % size:
        raise ConfigError(
            f"{what} makes secondary partitions of {size} rank(s), which do not divide the "
            f"{per_node} ranks of a node; use hpz='node' or a divisor of {per_node} above 1")
    return size
