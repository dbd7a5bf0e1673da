"""Who am I in the job (rank, world, local rank, master address), from the launcher's variables.

Read from torchrun's variables first, then SLURM's, then Open MPI's / PMI's, so one script runs
unchanged under `torchrun`, `srun` and `mpirun`. Torch-free: the JAX backend reads the same
variables to call ``jax.distributed.initialize``.
"""

from __future__ import annotations

import os
import re
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
    launcher: str = "none"  # "torchrun" | "slurm" | "mpi" | "none"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


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


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Reads rank, world size, local rank and master address from the launcher's variables.

    Args:
        environ: the variables to read (default: ``os.environ``).

    Returns:
        A ``LaunchEnv``; one process (``launcher="none"``) when no launcher is found.
    """
    environ = os.environ if environ is None else environ
    addr = environ.get("MASTER_ADDR")
    port = _int(environ, "MASTER_PORT")
    if "RANK" in environ and "WORLD_SIZE" in environ:  # torchrun, or a user who set them by hand
        world = int(environ["WORLD_SIZE"])
        return LaunchEnv(
            rank=int(environ["RANK"]),
            world_size=world,
            local_rank=_int(environ, "LOCAL_RANK") or 0,
            local_world_size=_int(environ, "LOCAL_WORLD_SIZE") or world,
            master_addr=addr or "127.0.0.1",
            master_port=port or DEFAULT_PORT,
            launcher="torchrun",
        )
    # `srun python train.py`; a plain `sbatch` shell has SLURM_NTASKS but no SLURM_STEP_ID.
    if "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
        job_id = _int(environ, "SLURM_JOB_ID") or 0
        return LaunchEnv(
            rank=int(environ["SLURM_PROCID"]),
            world_size=_int(environ, "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS") or 1,
            local_rank=_int(environ, "SLURM_LOCALID") or 0,
            local_world_size=_int(environ, "SLURM_NTASKS_PER_NODE") or 1,
            master_addr=addr or (first_host(nodelist) if nodelist else "127.0.0.1"),
            # Lightning's rule: a port from the job id so two jobs on one node don't collide.
            master_port=port or 10000 + job_id % 10000,
            launcher="slurm",
        )
    rank = _int(environ, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    world = _int(environ, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    if rank is not None and world is not None:
        return LaunchEnv(
            rank=rank,
            world_size=world,
            local_rank=_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID") or 0,
            local_world_size=_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
            or world,
            master_addr=addr or "127.0.0.1",
            master_port=port or DEFAULT_PORT,
            launcher="mpi",
        )
    return LaunchEnv()
