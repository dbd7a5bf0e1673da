"""Multi-process JAX from the launcher's variables: ``jax.distributed.initialize``, nothing else.

Under ``accumix launch`` / torchrun the coordinator is ``MASTER_ADDR`` at ``MASTER_PORT + 1``
(torchrun's own store holds ``MASTER_PORT``); ``ACCUMIX_JAX_COORDINATOR=host:port`` overrides it.
Under Slurm or Open MPI, JAX finds the cluster itself. On CPU the cross-process collectives are
gloo.
"""

from __future__ import annotations

import logging
import os

import jax

from accumix.common.launch_env import LaunchEnv, detect_launch_env

log = logging.getLogger("accumix")


def coordinator_address(launch: LaunchEnv) -> str:
    """Where process 0 serves JAX's coordination service."""
    return os.environ.get("ACCUMIX_JAX_COORDINATOR") or (
        f"{launch.master_addr}:{launch.master_port + 1}")


def initialize(launch: LaunchEnv | None = None) -> LaunchEnv:
    """Joins the job's processes into one JAX world (a no-op for one process or when done).

    Returns:
        The launch environment read.
    """
    launch = launch or detect_launch_env()
    if launch.world_size <= 1 or jax.distributed.is_initialized():
        return launch
    if launch.launcher in ("slurm", "mpi") and "ACCUMIX_JAX_COORDINATOR" not in os.environ:
        jax.distributed.initialize()  # JAX's own cluster detection
    else:
        jax.distributed.initialize(coordinator_address=coordinator_address(launch),
                                   num_processes=launch.world_size, process_id=launch.rank)
    log.info("jax.distributed: process %d of %d, %d local devices", jax.process_index(),
             jax.process_count(), jax.local_device_count())
    return launch
