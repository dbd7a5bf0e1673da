"""Multi-process JAX from the launcher's variables: ``jax.distributed.initialize``, and the check
that every process was launched with the same settings.

The coordinator is ``ACCUMIX_JAX_COORDINATOR=host:port`` when set (``accumix launch`` on one
node sets it to a loopback port it holds for the job), else, under torchrun, ``MASTER_ADDR`` at
``MASTER_PORT + 1`` (torchrun's own store holds ``MASTER_PORT``). A loopback coordinator listens
on its own address only (JAX's default is every interface; ``JAX_COORDINATOR_BIND_ADDRESS``
still overrides).
Under Slurm or Open MPI, JAX finds the cluster itself. Under Kubeflow's JAX runtime (one
process per pod) the coordinator is ``JAX_COORDINATOR_ADDRESS``, the processes
``JAX_NUM_PROCESSES`` and this one ``JAX_PROCESS_ID``. On CPU the cross-process collectives are
gloo.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any

import jax
import numpy as np

from accumix.common.engine_env import check_joined, jax_runtime_env
from accumix.common.launch_env import LaunchEnv, detect_launch_env, is_loopback
from accumix.errors import ConfigError

log = logging.getLogger("accumix")


def coordinator_address(launch: LaunchEnv) -> str:
    """Where process 0 serves JAX's coordination service."""
    return os.environ.get("ACCUMIX_JAX_COORDINATOR") or (
        f"{launch.master_addr}:{launch.master_port + 1}")


def bind_address(coordinator: str) -> str | None:
    """Where process 0's service listens: the coordinator's address itself when that is a
    loopback one (a one-machine job serves nothing beyond it), else JAX's choice (None)."""
    if os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        return None  # JAX reads it
    return coordinator if is_loopback(coordinator.rsplit(":", 1)[0]) else None


def initialize(launch: LaunchEnv | None = None) -> LaunchEnv:
    """Joins the job's processes into one JAX world (a no-op for one process or when done).

    Returns:
        The launch environment read.
    """
    launch = launch or detect_launch_env()
    runtime = jax_runtime_env(os.environ) if launch.launcher == "none" else None
    if runtime is not None:  # Kubeflow's JAX runtime: one process per pod
        launch = runtime[0]
    check_joined(launch, os.environ, backend="jax")  # never a silent world 1
    if launch.world_size <= 1 or jax.distributed.is_initialized():
        return launch
    if launch.launcher == "ray":  # Ray's JaxTrainer starts JAX itself only on GPUs and TPUs
        return _initialize_from_ray(launch)
    if launch.launcher in ("slurm", "mpi") and "ACCUMIX_JAX_COORDINATOR" not in os.environ:
        jax.distributed.initialize()  # JAX's own cluster detection
    else:
        address = runtime[1] if runtime is not None else coordinator_address(launch)
        jax.distributed.initialize(coordinator_address=address, num_processes=launch.world_size,
                                   process_id=launch.rank,
                                   coordinator_bind_address=bind_address(address))
        if bind_address(address) is not None:
            _loopback_cpu_collectives(address.rsplit(":", 1)[0].strip("[]"))
    log.info("jax.distributed: process %d of %d, %d local devices", jax.process_index(),
             jax.process_count(), jax.local_device_count())
    return launch


def _initialize_from_ray(launch: LaunchEnv) -> LaunchEnv:
    """``jax.distributed`` from Ray's context: rank 0 names the coordinator on its node's
    address and Ray broadcasts it; the service listens on that address only."""
    from accumix.common.ray_train import jax_coordinator

    address, held = jax_coordinator(launch)
    with held:
        jax.distributed.initialize(coordinator_address=address, num_processes=launch.world_size,
                                   process_id=launch.rank, coordinator_bind_address=address)
    host = address.rsplit(":", 1)[0].strip("[]")
    if is_loopback(host):  # a one-machine Ray cluster: gloo serves on loopback too
        _loopback_cpu_collectives(host)
    log.info("jax.distributed from Ray Train: process %d of %d, %d local devices",
             jax.process_index(), jax.process_count(), jax.local_device_count())
    return launch


def _loopback_cpu_collectives(host: str) -> None:
    """JAX's CPU collectives (gloo) listen on ``host`` (a loopback address) instead of the
    address of this machine's name. JAX has no setting for it: its CPU backend is registered
    again with gloo told the address, before any backend starts (``jax.distributed.initialize``
    requires that). Where this JAX's internals differ, a warning says what listens where."""
    try:
        from jax._src import config as jax_config
        from jax._src import distributed as jax_distributed
        from jax._src import xla_bridge
        from jax._src.lib import _jax

        if jax_config.cpu_collectives_implementation.value != "gloo":
            return  # MPI, or no cross-process CPU collectives: no gloo sockets
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=jax_distributed.global_state.client, hostname=host)
        xla_bridge.register_backend_factory(
            "cpu", partial(xla_bridge.make_cpu_client, collectives=collectives), priority=0,
            fail_quietly=False)
    except Exception as exc:  # noqa: BLE001 - another JAX: gloo keeps its default address
        log.warning("jax: could not keep the CPU collectives (gloo) on %s (%s: %s); they "
                    "listen on the address of this machine's name while the job runs", host,
                    type(exc).__name__, exc)


def check_same_config(mine: tuple[Any, ...]) -> None:
    """Processes launched with different settings stop here, naming both, instead of
    training apart (or hanging in a collective of another shape)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    text = repr(mine).encode()[:512].ljust(512)
    every = multihost_utils.process_allgather(np.frombuffer(text, np.uint8))
    texts = [bytes(row).decode(errors="replace").rstrip() for row in np.asarray(every)]
    if len(set(texts)) > 1:
        others = {i: s for i, s in enumerate(texts) if s != texts[0]}
        raise ConfigError(
            f"processes disagree on (precision, batch sizes, seed, loss scale) or on the "
            f"strategy (at setup): "
            f"process 0 has {texts[0]}, others {others}; launch every process alike")
