"""What cluster engines tell each node: SLURM, Kubernetes (Kubeflow Trainer v2's ``PET_*``, the
older PyTorchJob's pods), SkyPilot, and Kubeflow's JAX runtime.

Read by ``accumix launch`` (one launcher per node starts that node's ranks in the job the
engine described) and by both backends, which refuse to train when the engine says the job has
more nodes or processes than the ones that joined: nowhere a silent world of 1. Torch-free.

The variables, as each engine sets them on every node (pod):

* SLURM, inside ``srun --ntasks-per-node=1``: ``SLURM_JOB_ID``, ``SLURM_STEP_NUM_NODES``,
  ``SLURM_NODEID``, ``SLURM_STEP_NODELIST`` (node 0 is the first host).
* Kubeflow Trainer v2 (``torch-distributed`` runtime), for torchrun: ``PET_NNODES``,
  ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``; an
  elastic PyTorchJob: ``PET_NNODES=MIN:MAX``, ``PET_RDZV_BACKEND``, ``PET_RDZV_ENDPOINT``,
  ``PET_MAX_RESTARTS``.
* PyTorchJob (``kubeflow.org/v1``) running ``python train.py`` in each pod: ``RANK`` (the
  pod's index), ``WORLD_SIZE`` (the pods), ``MASTER_ADDR``, ``MASTER_PORT``, and no
  ``LOCAL_*``: each pod is one node of one process.
* SkyPilot: ``SKYPILOT_NUM_NODES``, ``SKYPILOT_NODE_RANK``, ``SKYPILOT_NODE_IPS`` (one address
  a line, node 0 first), ``SKYPILOT_NUM_GPUS_PER_NODE``; no port.
* Kubeflow's JAX runtime, one process per pod: ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``,
  ``JAX_COORDINATOR_ADDRESS``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from accumix.common.launch_env import LaunchEnv, first_host
from accumix.errors import ConfigError

PET = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_NPROC_PER_NODE",
       "PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT")
SKYPILOT = ("SKYPILOT_NUM_NODES", "SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS")
JAX_RUNTIME = ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS")


@dataclass(kw_only=True, frozen=True, slots=True)
class EngineNodes:
    """One node's place in the job, as its cluster engine described it (None: not said).

    Attributes:
        engine: ``"slurm"``, ``"kubernetes"`` or ``"skypilot"``.
        nnodes: the nodes (the least, for an elastic range).
        max_nodes: the most nodes of an elastic range (``PET_NNODES=1:2``); else ``nnodes``.
        node_rank: this node's index.
        master_addr: node 0's address.
        master_port: node 0's port.
        rdzv_backend: an elastic job's rendezvous (``PET_RDZV_BACKEND``), e.g. ``"c10d"``.
        rdzv_endpoint: its ``host:port`` (``PET_RDZV_ENDPOINT``).
        max_restarts: restarts the engine allows (``PET_MAX_RESTARTS``).
        default_port: a port for node 0 where the engine names none (SLURM: from the job id),
            which a flag may change.
        nproc: processes per node the engine asks for (an int, or ``"auto"``/``"gpu"``/...).
        gpus: this node's GPUs as the engine counts them (a cap for ``--nproc auto``).
        cpus: this node's CPU cores as the engine counts them.
        said: each attribute given, with the variable that gave it (``"PET_NNODES=2"``).
    """

    engine: str
    nnodes: int | None = None
    max_nodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nproc: int | str | None = None
    gpus: int | None = None
    cpus: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    max_restarts: int | None = None
    default_port: int | None = None
    said: Mapping[str, str] = field(default_factory=dict)


def _number(environ: Mapping[str, str], name: str, minimum: int = 0) -> int:
    value = environ[name]
    try:
        number = int(value)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise ConfigError(f"{name}={value!r} is invalid; the engine should set an integer >= "
                          f"{minimum}")
    return number


def node_range(name: str, value: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:2"`` (an elastic range, torchrun's form) -> (1, 2).

    Raises:
        ConfigError: not N or MIN:MAX with 1 <= MIN <= MAX, naming ``name``.
    """
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(value))
    low, high = (int(match.group(1)), int(match.group(2) or match.group(1))) if match \
        else (0, 0)
    if not 1 <= low <= high:
        raise ConfigError(f"{name}={value!r} is invalid; use N or MIN:MAX with 1 <= MIN <= MAX "
                          "(e.g. 2 or 1:2)")
    return low, high


def slurm_nodes(environ: Mapping[str, str]) -> EngineNodes | None:
    """A SLURM allocation's nodes (None outside one).

    Raises:
        ConfigError: a multi-node allocation without one launcher per node.
    """
    if "SLURM_JOB_ID" not in environ:
        return None
    nodes = int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_JOB_NUM_NODES")
                or environ.get("SLURM_NNODES") or 1)
    in_step = "SLURM_STEP_ID" in environ
    tasks = int(environ.get("SLURM_STEP_NUM_TASKS") or nodes) if in_step else nodes
    if nodes > 1 and (not in_step or tasks != nodes):
        raise ConfigError(
            f"this SLURM allocation has {nodes} nodes; start one launcher per node: "
            "srun --ntasks-per-node=1 accumix launch ..."
        )
    node = int(environ.get("SLURM_NODEID", 0))
    said = {"nnodes": f"SLURM_STEP_NUM_NODES={nodes}", "node_rank": f"SLURM_NODEID={node}"}
    addr = port = None
    if nodes > 1:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
        addr = first_host(nodelist)
        # Lightning's rule, as runtime/env.py uses it: two jobs on one node get other ports.
        port = 10000 + int(environ["SLURM_JOB_ID"]) % 10000
        said.update(master_addr=f"SLURM_STEP_NODELIST={nodelist}")
    gpus = int(environ["SLURM_GPUS_ON_NODE"]) if environ.get("SLURM_GPUS_ON_NODE") else None
    cpus = int(environ["SLURM_CPUS_ON_NODE"]) if environ.get("SLURM_CPUS_ON_NODE") else None
    return EngineNodes(engine="slurm", nnodes=nodes, max_nodes=nodes, node_rank=node,
                       master_addr=addr, default_port=port, gpus=gpus, cpus=cpus, said=said)


def kubeflow_nodes(environ: Mapping[str, str]) -> EngineNodes | None:
    """A Kubeflow pod's place: Trainer v2's ``PET_*``, else a PyTorchJob pod's ``RANK`` /
    ``WORLD_SIZE`` / ``MASTER_*`` (a pod is a node); None elsewhere."""
    if any(name in environ for name in PET):
        said = {}
        low = high = None
        if "PET_NNODES" in environ:
            low, high = node_range("PET_NNODES", environ["PET_NNODES"])
            said["nnodes"] = said["max_nodes"] = f"PET_NNODES={environ['PET_NNODES']}"
        rank = _number(environ, "PET_NODE_RANK") if "PET_NODE_RANK" in environ else None
        port = _number(environ, "PET_MASTER_PORT", 1) if "PET_MASTER_PORT" in environ else None
        nproc: int | str | None = environ.get("PET_NPROC_PER_NODE") or None
        if nproc is not None and nproc.isdigit():
            nproc = _number(environ, "PET_NPROC_PER_NODE", 1)
        restarts = (_number(environ, "PET_MAX_RESTARTS") if "PET_MAX_RESTARTS" in environ
                    else None)
        for key, name in (("node_rank", "PET_NODE_RANK"), ("master_addr", "PET_MASTER_ADDR"),
                          ("master_port", "PET_MASTER_PORT"), ("nproc", "PET_NPROC_PER_NODE"),
                          ("rdzv_backend", "PET_RDZV_BACKEND"),
                          ("rdzv_endpoint", "PET_RDZV_ENDPOINT"),
                          ("max_restarts", "PET_MAX_RESTARTS")):
            if name in environ:
                said[key] = f"{name}={environ[name]}"
        return EngineNodes(engine="kubernetes", nnodes=low, max_nodes=high, node_rank=rank,
                           master_addr=environ.get("PET_MASTER_ADDR") or None,
                           master_port=port, nproc=nproc, said=said,
                           rdzv_backend=environ.get("PET_RDZV_BACKEND") or None,
                           rdzv_endpoint=environ.get("PET_RDZV_ENDPOINT") or None,
                           max_restarts=restarts)
    if is_pytorchjob_pod(environ):
        world, rank = _number(environ, "WORLD_SIZE", 1), _number(environ, "RANK")
        said = {"nnodes": f"WORLD_SIZE={world}", "node_rank": f"RANK={rank}"}
        port = _number(environ, "MASTER_PORT", 1) if "MASTER_PORT" in environ else None
        for key, name in (("master_addr", "MASTER_ADDR"), ("master_port", "MASTER_PORT")):
            if name in environ:
                said[key] = f"{name}={environ[name]}"
        return EngineNodes(engine="kubernetes", nnodes=world, max_nodes=world, node_rank=rank,
                           master_addr=environ.get("MASTER_ADDR") or None, master_port=port,
                           said=said)
    return None


def is_pytorchjob_pod(environ: Mapping[str, str]) -> bool:
    """A Kubernetes pod given one process's place in the job (``RANK``, ``WORLD_SIZE``) but no
    local rank: PyTorchJob's ``python train.py`` in each pod, where the pod is a node."""
    return ("KUBERNETES_SERVICE_HOST" in environ and "RANK" in environ
            and "WORLD_SIZE" in environ and "LOCAL_RANK" not in environ
            and "LOCAL_WORLD_SIZE" not in environ)


def skypilot_nodes(environ: Mapping[str, str]) -> EngineNodes | None:
    """A SkyPilot node's place (None outside SkyPilot's ``run``)."""
    if not any(name in environ for name in SKYPILOT):
        return None
    said = {}
    nodes = rank = None
    if "SKYPILOT_NUM_NODES" in environ:
        nodes = _number(environ, "SKYPILOT_NUM_NODES", 1)
        said["nnodes"] = said["max_nodes"] = f"SKYPILOT_NUM_NODES={nodes}"
    if "SKYPILOT_NODE_RANK" in environ:
        rank = _number(environ, "SKYPILOT_NODE_RANK")
        said["node_rank"] = f"SKYPILOT_NODE_RANK={rank}"
    ips = [line.strip() for line in environ.get("SKYPILOT_NODE_IPS", "").splitlines()
           if line.strip()]
    if ips:
        said["master_addr"] = f"SKYPILOT_NODE_IPS's first line {ips[0]}"
    if nodes is not None and ips and len(ips) != nodes:
        raise ConfigError(f"SKYPILOT_NODE_IPS has {len(ips)} address(es) but "
                          f"SKYPILOT_NUM_NODES={nodes}; the engine's variables disagree")
    gpus = (_number(environ, "SKYPILOT_NUM_GPUS_PER_NODE")
            if environ.get("SKYPILOT_NUM_GPUS_PER_NODE") else None)
    return EngineNodes(engine="skypilot", nnodes=nodes, max_nodes=nodes, node_rank=rank,
                       master_addr=ips[0] if ips else None, gpus=gpus or None, said=said)


def engine_nodes(environ: Mapping[str, str]) -> EngineNodes | None:
    """This node's place as the first engine found describes it: SLURM, Kubernetes, SkyPilot.

    Raises:
        ConfigError: the engine's variables are malformed or contradict each other.
    """
    for read in (slurm_nodes, kubeflow_nodes, skypilot_nodes):
        nodes = read(environ)
        if nodes is not None:
            return nodes
    return None


def engine_name(environ: Mapping[str, str]) -> str | None:
    """The engine whose variables this process has, for ``LaunchEnv.launcher`` (torchrun's
    ranks inside a Kubeflow pod or a SkyPilot node); None when there is none."""
    if any(name in environ for name in PET) or is_pytorchjob_pod(environ):
        return "kubernetes"
    if any(name in environ for name in SKYPILOT):
        return "skypilot"
    return None


def jax_runtime_env(environ: Mapping[str, str]) -> tuple[LaunchEnv, str] | None:
    """Kubeflow's JAX runtime (one process per pod): the process's place and the coordinator's
    ``host:port``; None without ``JAX_NUM_PROCESSES``.

    Raises:
        ConfigError: a variable missing or malformed (the message names it).
    """
    if "JAX_NUM_PROCESSES" not in environ:
        return None
    world = _number(environ, "JAX_NUM_PROCESSES", 1)
    missing = [name for name in JAX_RUNTIME if not environ.get(name)]
    if world > 1 and missing:
        raise ConfigError(f"JAX_NUM_PROCESSES={world} but {', '.join(missing)} is not set; "
                          "the engine gives every process all of " + ", ".join(JAX_RUNTIME))
    rank = _number(environ, "JAX_PROCESS_ID") if environ.get("JAX_PROCESS_ID") else 0
    if rank >= world:
        raise ConfigError(f"JAX_PROCESS_ID={rank} is invalid with JAX_NUM_PROCESSES={world}; "
                          f"use 0..{world - 1}")
    address = environ.get("JAX_COORDINATOR_ADDRESS", "127.0.0.1")
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "]" in port:
        port = environ.get("JAX_COORDINATOR_PORT", "")
        if not port.isdigit():
            raise ConfigError(f"JAX_COORDINATOR_ADDRESS={address!r} has no port; give host:port "
                              "(or set JAX_COORDINATOR_PORT)")
        host, address = address, f"{address}:{port}"
    launch = LaunchEnv(rank=rank, world_size=world, local_rank=0, local_world_size=1,
                       master_addr=host, master_port=int(port),
                       launcher="kubernetes" if "KUBERNETES_SERVICE_HOST" in environ else "jax",
                       node_rank=rank, num_nodes=world)
    return launch, address


def check_joined(launch: LaunchEnv, environ: Mapping[str, str], *,
                 backend: str = "torch") -> None:
    """Refuses a job that joined fewer nodes or processes than its engine started.

    A Kubeflow pod or SkyPilot node whose ranks formed a job alone (a launcher that ignored
    ``PET_NNODES``; ``python train.py`` where torchrun was meant) would train apart from the
    others with no error; so would a JAX process that read no ``JAX_NUM_PROCESSES``.

    Args:
        launch: what this process joined.
        environ: the process's variables.
        backend: ``"torch"`` or ``"jax"`` (only JAX reads ``JAX_NUM_PROCESSES``).

    Raises:
        ConfigError: the engine says more nodes or processes than joined, naming both.
    """
    if launch.launcher in ("slurm", "mpi", "ray"):  # they start every process themselves
        return
    how = ("start every node's ranks with `accumix launch` (it reads the engine's variables) "
           "or torchrun with them")
    if backend == "jax" and environ.get("JAX_NUM_PROCESSES"):
        wanted = _number(environ, "JAX_NUM_PROCESSES", 1)
        if launch.world_size < wanted:
            raise ConfigError(
                f"JAX_NUM_PROCESSES={wanted} but this process joined a job of "
                f"{launch.world_size}; every process must read it (accumix.jax does, unless "
                "another launcher's variables came first)")
    kubeflow = kubeflow_nodes(environ) if any(name in environ for name in PET) else None
    for nodes in (kubeflow, skypilot_nodes(environ)):
        if nodes is None:
            continue
        if nodes.nnodes is not None and launch.num_nodes < nodes.nnodes:
            raise ConfigError(
                f"{nodes.said['nnodes']} but this process joined a job of {launch.num_nodes} "
                f"node(s) ({launch.world_size} process(es)): each node would train alone; "
                f"{how}")
        if isinstance(nodes.nproc, int) and launch.local_world_size < nodes.nproc:
            raise ConfigError(
                f"{nodes.said['nproc']} but this node joined {launch.local_world_size} "
                f"process(es); {how}")


def is_one_node(nodes: EngineNodes | None) -> bool:
    """The engine describes a one-node job (its ranks then rendezvous on loopback)."""
    return nodes is None or (nodes.max_nodes or nodes.nnodes or 1) == 1

