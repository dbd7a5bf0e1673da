"""Ray Train (``TorchTrainer``, ``JaxTrainer``; Ray Train v2, ray 2.60): who this worker is,
its device and JAX's coordinator (Ray's pre-emption notice: ``common/preemption.py``).
Torch-free; ``ray`` is imported only inside a Ray Train worker, where it is loaded already.

Ray runs the training function in a thread of each worker actor and says where the worker sits
through its train context (rank, local rank, node rank), not only through variables: under
``TorchTrainer`` it also sets torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and joins the
torch process group itself; under ``JaxTrainer`` on CPU it sets nothing and starts no
``jax.distributed`` (only for GPUs and TPUs), so two workers would each train alone as world 1.
accumix reads the context in both cases (``launcher="ray"``) and, for JAX, starts
``jax.distributed`` with a coordinator that rank 0 names through Ray's own broadcast
(``ray.train.collective.broadcast_from_rank_zero``): no rendezvous of accumix's own.
"""

from __future__ import annotations

import os
import socket
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from accumix.common.launch_env import DEFAULT_PORT, LaunchEnv

# Set in each Ray Train v2 worker process before the training function starts.
_CONTEXT_MODULE = "ray.train.v2._internal.execution.context"


def train_context() -> Any | None:
    """Ray Train's context when this code runs inside a Ray Train (v2) worker, else None.

    Cheap outside Ray: nothing is imported unless Ray's worker module is loaded already.
    """
    module = sys.modules.get(_CONTEXT_MODULE)
    if module is None or getattr(module, "_train_context", None) is None:
        return None
    import ray.train

    return ray.train.get_context()


def in_worker() -> bool:
    """This process is a Ray Train worker (its training function is running)."""
    return train_context() is not None


def launch_env() -> LaunchEnv | None:
    """This worker's place in the job from Ray's context (``launcher="ray"``); None outside
    Ray Train.

    The nodes are the distinct nodes of the worker group's placement group (Ray may place
    unequal numbers of workers on them); the master address and port are the ones Ray gave
    torch's process group (``TorchTrainer``), else unused.
    """
    context = train_context()
    if context is None:
        return None
    world, local_world = context.get_world_size(), context.get_local_world_size()
    return LaunchEnv(
        rank=context.get_world_rank(),
        world_size=world,
        local_rank=context.get_local_rank(),
        local_world_size=local_world,
        node_rank=context.get_node_rank(),
        num_nodes=_num_nodes(world, local_world),
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(os.environ.get("MASTER_PORT") or DEFAULT_PORT),
        launcher="ray",
    )


_nodes_cache: dict[str, int] = {}


def _num_nodes(world: int, local_world: int) -> int:
    """The nodes the worker group's placement group spans (one bundle per worker)."""
    import ray
    from ray.util import get_current_placement_group, placement_group_table

    # (Not initialized: no group to read, and asking would start a Ray instance.)
    group = get_current_placement_group() if ray.is_initialized() else None
    if group is None:
        return max(world // max(local_world, 1), 1)
    key = group.id.hex()
    if key not in _nodes_cache:
        nodes = placement_group_table(group).get("bundles_to_node_id") or {}
        _nodes_cache[key] = len(set(nodes.values())) or max(world // max(local_world, 1), 1)
    return _nodes_cache[key]


def torch_device() -> Any:
    """The torch device Ray assigned this worker (``ray.train.torch.get_device()``): with
    ``use_gpu=True`` each worker sees only its own GPUs, so ``cuda:LOCAL_RANK`` would name
    another worker's (or no) device."""
    from ray.train.torch import get_device

    return get_device()


def jax_coordinator(launch: LaunchEnv) -> tuple[str, AbstractContextManager[Any]]:
    """The address of JAX's coordination service, named by rank 0 and broadcast by Ray.

    Rank 0 binds a port on its node's address (the one Ray reaches it at) and keeps it bound,
    with ``SO_REUSEPORT``, until JAX's service (gRPC sets the option too) has bound it as well:
    a port merely checked free can be taken by then (``accumix launch`` holds its port the same
    way). Collective: every worker calls it once, before ``jax.distributed.initialize``.

    Returns:
        ``"host:port"``, and a context that holds the port (rank 0) until it exits.
    """
    import ray
    from ray.train.collective import broadcast_from_rank_zero

    held: AbstractContextManager[Any] = nullcontext()
    address = None
    if launch.rank == 0:
        host = ray.util.get_node_ip_address()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, 0))
        except OSError:
            sock.close()
            raise
        held = sock
        port = sock.getsockname()[1]
        address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    try:
        address = broadcast_from_rank_zero(address)
    except BaseException:
        held.__exit__(None, None, None)
        raise
    return address, held
