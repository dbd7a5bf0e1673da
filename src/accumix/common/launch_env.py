"""Who am I in the job (rank, world, local rank, master address), from the launcher's variables.

Read from torchrun's variables first, then SLURM's, then Open MPI's / PMI's, so one script runs
unchanged under `torchrun`, `srun` and `mpirun`; a Kubernetes pod given ``RANK`` and
``WORLD_SIZE`` but no local rank (PyTorchJob's ``python train.py`` in each pod) is one node.
Torch-free: the JAX backend reads the same variables to call ``jax.distributed.initialize``.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from accumix.errors import ConfigError

DEFAULT_PORT = 29500


@dataclass(kw_only=True, frozen=True, slots=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    # "torchrun" | "slurm" | "mpi" | "kubernetes" | "skypilot" | "jax" | "none"; torchrun's
    # ranks inside a Kubeflow pod or on a SkyPilot node say the engine's name.
    launcher: str = "none"
    # The machines: this one's index and how many (hsdp replicates across them).
    node_rank: int = 0
    num_nodes: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, bracketed IPv6 too, or ``localhost``) is this machine's
    loopback."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if name in environ and environ[name] != "":
            return int(environ[name])
    return None


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``"gpu[03-05,09],cpu1"`` -> ``"gpu03"``.

    Args:
        nodelist: the value of ``SLURM_JOB_NODELIST`` / ``SLURM_NODELIST``.

    Returns:
        The first host name, with its zero padding kept.
    """
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    match = re.match(r"([^\[,]+)(?:\[([^\]]+)\])?", head.strip())
    if match is None:
        raise ConfigError(f"cannot read a host from SLURM node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def slurm_tasks_per_node(value: str, node: int) -> int | None:
    """Node ``node``'s task count from SLURM's compressed list: ``"4(x2),2"`` -> 4, 4, 2.

    Returns:
        The count, or None when the list cannot be read or has no such node.
    """
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None


def _either(value: int | None, default: int) -> int:
    return default if value is None else value


def _nodes(world: int, local_world: int) -> int:
    # Launchers that do not say: nodes of equal size (what torchrun and mpirun -N start).
    return max(world // max(local_world, 1), 1)


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Reads rank, world size, local rank and master address from the launcher's variables.

    Args:
        environ: the variables to read (default: ``os.environ``).

    Returns:
        A ``LaunchEnv``; one process (``launcher="none"``) when no launcher is found.
    """
    from accumix.common.engine_env import engine_name, is_pytorchjob_pod

    environ = os.environ if environ is None else environ
    addr = environ.get("MASTER_ADDR")
    port = _int(environ, "MASTER_PORT")
    if "RANK" in environ and "WORLD_SIZE" in environ:  # torchrun, or a user who set them by hand
        world = int(environ["WORLD_SIZE"])
        rank = int(environ["RANK"])
        if is_pytorchjob_pod(environ):  # `python train.py` in each pod: the pod is a node
            return LaunchEnv(rank=rank, world_size=world, master_addr=addr or "127.0.0.1",
                             master_port=port or DEFAULT_PORT, launcher="kubernetes",
                             node_rank=rank, num_nodes=world)
        local_world = _int(environ, "LOCAL_WORLD_SIZE") or world
        # torchrun's agent per node: GROUP_RANK is the node's index, GROUP_WORLD_SIZE the nodes.
        return LaunchEnv(
            rank=rank,
            world_size=world,
            local_rank=_int(environ, "LOCAL_RANK") or 0,
            local_world_size=local_world,
            master_addr=addr or "127.0.0.1",
            master_port=port or DEFAULT_PORT,
            launcher=engine_name(environ) or "torchrun",
            node_rank=_either(_int(environ, "GROUP_RANK"), rank // max(local_world, 1)),
            num_nodes=_either(_int(environ, "GROUP_WORLD_SIZE"), _nodes(world, local_world)),
        )
    # `srun python train.py`; a plain `sbatch` shell has SLURM_NTASKS but no SLURM_STEP_ID.
    if "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
        job_id = _int(environ, "SLURM_JOB_ID") or 0
        node = _either(_int(environ, "SLURM_NODEID"), 0)
        # SLURM_NTASKS_PER_NODE is set only when --ntasks-per-node was given; the step's
        # compressed list ("4(x2)") always is.
        per_node = next((count for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                                            "SLURM_NTASKS_PER_NODE")
                         if (count := slurm_tasks_per_node(environ.get(name, ""), node))), 1)
        world = _int(environ, "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS") or 1
        return LaunchEnv(
            rank=int(environ["SLURM_PROCID"]),
            world_size=world,
            local_rank=_int(environ, "SLURM_LOCALID") or 0,
            local_world_size=per_node,
            node_rank=node,
            num_nodes=_int(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
            or _nodes(world, per_node),
            master_addr=addr or (first_host(nodelist) if nodelist else "127.0.0.1"),
            # Lightning's rule: a port from the job id so two jobs on one node don't collide.
            master_port=port or 10000 + job_id % 10000,
            launcher="slurm",
        )
    rank = _int(environ, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    world = _int(environ, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    if rank is not None and world is not None:
        local_world = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS") or world
        return LaunchEnv(
            rank=rank,
            world_size=world,
            local_rank=_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID") or 0,
            local_world_size=local_world,
            master_addr=addr or "127.0.0.1",
            master_port=port or DEFAULT_PORT,
            launcher="mpi",
            # MPI names no node index: nodes in rank order (mpirun's default --map-by slot).
            node_rank=rank // max(local_world, 1),
            num_nodes=_nodes(world, local_world),
        )
    return LaunchEnv()


def process_rank() -> int:
    """This process's rank in the job: JAX's process index once jax.distributed runs, else
    torch.distributed's rank once its process group is up (a plain loop may start it with
    ``rank=`` and no launcher variables), else the launcher's (torchrun, SLURM, MPI) variables;
    0 when nothing was launched.

    Never asks JAX for its process count unless jax.distributed was initialised: that call
    starts JAX's backends (on a GPU, JAX then takes most of its memory) in a torch job that
    merely imported jax, and would make a later ``jax.distributed.initialize`` fail.
    """
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            if jax.distributed.is_initialized():
                return int(jax.process_index())
        except Exception:  # an odd jax: the other sources decide
            pass
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return detect_launch_env().rank
