"""The launch environment: who am I (rank, world, local rank), which device, which process group.

Read from torchrun's variables first, then SLURM's, then Open MPI's / PMI's, so one script runs
unchanged under `torchrun`, `srun` and `mpirun`. accumix never runs its own rendezvous: it hands
the address and port to `torch.distributed.init_process_group("env://")`.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from accumix.errors import ConfigError

# Re-exported: the launch variables are read by the torch-free module.
from accumix.launch_env import DEFAULT_PORT, LaunchEnv, detect_launch_env, first_host

__all__ = [
    "DEFAULT_PORT", "LaunchEnv", "detect_launch_env", "first_host", "init_process_group",
    "pick_device", "seed_everything",
]

log = logging.getLogger("accumix")


def pick_device(launch: LaunchEnv) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if launch.local_rank >= count:
            raise ConfigError(
                f"local rank {launch.local_rank} has no GPU: this node has {count}; "
                f"launch at most {count} processes per node"
            )
        device = torch.device("cuda", launch.local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_process_group(launch: LaunchEnv, device: torch.device, timeout: float) -> bool:
    """Joins the job's process group once (NCCL on CUDA, gloo on CPU).

    Args:
        launch: the launch environment.
        device: this rank's device; picks the backend.
        timeout: seconds a collective may wait before every rank fails.

    Returns:
        True if this call created the group; it is then destroyed when the process exits.
    """
    if not launch.distributed or dist.is_initialized():
        return False
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed; install a build with it")
    os.environ.setdefault("MASTER_ADDR", launch.master_addr)
    os.environ.setdefault("MASTER_PORT", str(launch.master_port))
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    store = _elastic_attempt_store(launch, timeout)
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = "env://"
    dist.init_process_group(
        backend=backend,
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timedelta(seconds=timeout),
        **kwargs,
    )
    atexit.register(_destroy_process_group)
    return True


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _elastic_attempt_store(launch: LaunchEnv, timeout: float) -> dist.Store | None:
    """torchrun's agent store, with a key prefix for this restart attempt.

    The agent keeps one TCP store for all attempts, and torch's env:// rendezvous adds no
    per-attempt prefix: a restarted rank can read the dead attempt's gloo/NCCL addresses and
    fail to connect ("Gloo connectFullMesh failed ... Connection refused").
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(launch.master_addr, launch.master_port, world_size=launch.world_size,
                           is_master=False, timeout=timedelta(seconds=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"/accumix/attempt_{attempt}", client)


def seed_everything(seed: int) -> None:
    """Seeds python, numpy and torch (CPU and every GPU) with the same value on every rank."""
    if not 0 <= seed < 2**32:
        raise ConfigError(f"seed={seed} is out of range; use an integer in [0, 2**32)")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
