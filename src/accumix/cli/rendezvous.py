"""An elastic job's rendezvous for ``accumix launch --nnodes MIN:MAX``: torchrun's own.

accumix runs no rendezvous of its own. An elastic job uses torchrun's dynamic rendezvous (c10d
by default, etcd where given): the nodes that are there form the job, a node that is lost
makes the others restart on fewer (each rank resumes from the last checkpoint, K re-derived
from ``global_batch_size``), and a node that comes back is taken in at the next restart.

The c10d rendezvous store lives in one launcher: node 0's, at node 0's address (``--master-addr``
and ``--master-port``, or ``--rdzv-endpoint``). Losing that node ends the job (the store goes
with it); an etcd rendezvous (``--rdzv-backend etcd-v2 --rdzv-endpoint ETCD:2379``) survives it.
"""

from __future__ import annotations

from dataclasses import dataclass

from accumix.common.engine_env import EngineNodes
from accumix.errors import ConfigError

DEFAULT_ELASTIC_RESTARTS = 3
BACKENDS = ("c10d", "etcd", "etcd-v2", "static")


@dataclass(kw_only=True, frozen=True, slots=True)
class Rendezvous:
    """torchrun's dynamic rendezvous for an elastic job.

    Attributes:
        min_nodes: the fewest nodes the job runs on.
        max_nodes: the most.
        backend: ``"c10d"``, ``"etcd"`` or ``"etcd-v2"``.
        endpoint: ``host:port`` of the rendezvous (c10d: node 0's launcher hosts it there).
        is_host: this launcher hosts the c10d store (node 0: True; others False); None where
            the node rank is not known (torch then decides by the host name).
        conf: more of torchrun's ``--rdzv-conf`` (``last_call_timeout=5,join_timeout=900``).
    """

    min_nodes: int
    max_nodes: int
    backend: str
    endpoint: str
    is_host: bool | None
    conf: str = ""

    def torchrun_args(self) -> list[str]:
        """torchrun's rendezvous arguments (its ``--node-rank`` and ``--master-*`` would be
        ignored by a dynamic rendezvous: ranks are given by arrival)."""
        args = [f"--nnodes={self.min_nodes}:{self.max_nodes}",
                f"--rdzv-backend={self.backend}", f"--rdzv-endpoint={self.endpoint}"]
        conf = [self.conf] if self.conf else []
        if self.backend == "c10d" and self.is_host is not None and "is_host=" not in self.conf:
            conf.append(f"is_host={int(self.is_host)}")
        return [*args, f"--rdzv-conf={','.join(conf)}"] if conf else args


def _agreed(engine: EngineNodes | None, key: str, flag: str | None, option: str) -> str | None:
    said = getattr(engine, key) if engine is not None else None
    if flag is not None and said is not None and flag != said:
        raise ConfigError(f"--{option} {flag} contradicts {engine.said[key]}; drop --{option}: "
                          "accumix launch reads it")
    return flag if flag is not None else said


def plan_rendezvous(*, nodes: tuple[int, int], node_rank: int | None, master_addr: str | None,
                    master_port: int | None, backend: str | None, endpoint: str | None,
                    engine: EngineNodes | None, default_port: int,
                    conf: str | None = None) -> Rendezvous | None:
    """The elastic rendezvous for ``nodes`` = (MIN, MAX); None for a static job (MIN == MAX and
    no dynamic backend asked for).

    Raises:
        ConfigError: an unknown backend, or no address for the rendezvous.
    """
    backend = _agreed(engine, "rdzv_backend", backend, "rdzv-backend")
    endpoint = _agreed(engine, "rdzv_endpoint", endpoint, "rdzv-endpoint")
    low, high = nodes
    if low == high and backend in (None, "static"):
        if conf:
            raise ConfigError("--rdzv-conf is for an elastic job (--nnodes MIN:MAX or "
                              "--rdzv-backend c10d); drop it")
        return None
    backend = backend or "c10d"
    if backend not in BACKENDS or backend == "static":
        raise ConfigError(f"--rdzv-backend {backend} is invalid for an elastic job; use c10d "
                          "(node 0 hosts it) or etcd-v2 (with --rdzv-endpoint)")
    if endpoint is None:
        if master_addr is None:
            raise ConfigError(
                f"nnodes={low}:{high} needs --master-addr: the address of node 0, where the "
                f"{backend} rendezvous runs, the same on every node (or --rdzv-endpoint)")
        endpoint = f"{master_addr}:{master_port or default_port}"
    return Rendezvous(min_nodes=low, max_nodes=high, backend=backend, endpoint=endpoint,
                      is_host=None if node_rank is None else node_rank == 0, conf=conf or "")
