"""Multi-process test helper: run a function on N ranks over gloo on loopback.

Each rank is a fresh ``spawn``-ed interpreter with torchrun's variables set, one CPU thread,
``MASTER_ADDR=127.0.0.1`` and a free port. Results come back in rank order; a rank's exception
is re-raised here with its traceback. Group many checks in one call: a spawn costs seconds.
``spawn(fn, 4, nodes=2)`` simulates two machines of two ranks each: every rank gets the
per-node variables torchrun's agent on its node would set (``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``), on one loopback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    """A spawned rank raised; the message holds its traceback."""


def node_variables(rank: int, world: int, nodes: int = 1) -> dict[str, str]:
    """torchrun's variables for ``rank`` of ``world`` ranks on ``nodes`` machines of equal size,
    ranks numbered node by node (as torchrun's agents number them)."""
    per_node = world // nodes
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node),
            "GROUP_WORLD_SIZE": str(nodes)}


def _run_rank(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...],
              env: dict[str, str], queue: Any, nodes: int = 1) -> None:
    os.environ.update(env)
    os.environ.update({**node_variables(rank, world, nodes), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    import torch

    torch.set_num_threads(1)
    try:
        queue.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nprocs: int = 2, args: tuple[Any, ...] = (),
          env: dict[str, str] | None = None, timeout: float = 240.0, *, nodes: int = 1
          ) -> list[Any]:
    """Runs ``fn(*args)`` on ``nprocs`` ranks and returns each rank's result, rank order.

    Args:
        fn: a module-level (picklable) function.
        nprocs: the world size.
        args: passed to ``fn`` on every rank.
        env: extra environment variables for the ranks.
        timeout: seconds before the ranks are killed and this raises.
        nodes: simulated machines, ``nprocs // nodes`` ranks each (consecutive ranks share
            one): the per-node variables are set as torchrun sets them on each node.

    Raises:
        RankFailed: a rank raised, died, or the run timed out.
        ValueError: ``nodes`` does not divide ``nprocs``.
    """
    if nodes < 1 or nprocs % nodes:
        raise ValueError(f"nodes={nodes} does not divide nprocs={nprocs}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    # Not daemonic: a rank may start DataLoader workers. The ``finally`` below kills any rank
    # still alive, so none outlives this call.
    procs = [
        ctx.Process(target=_run_rank, args=(fn, r, nprocs, port, args, env or {}, queue, nodes),
                    daemon=False)
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(nprocs):
            try:
                rank, ok, value = queue.get(timeout=timeout)
            except Exception as exc:  # queue.Empty: a rank hung or died silently
                codes = [p.exitcode for p in procs]
                raise RankFailed(f"ranks did not finish in {timeout}s; exit codes {codes}"
                                 ) from exc
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RankFailed("\n".join(errors))
    return [results[r] for r in range(nprocs)]


class ResidualBlock(nn.Module):
    """``x + tanh(Linear(x))``: a tiny repeated block that FSDP's auto wrap finds."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


# -- counting what collectives move ---------------------------------------------------------
# The torch.distributed functions that move tensors, and which of their tensors is the
# logical (unsharded) payload: an all-gather's output, a reduce-scatter's input, the tensor
# itself otherwise. FSDP2 (torch 2.13) calls all_gather_single / reduce_scatter_single /
# all_reduce; DeepSpeed's comm calls these through ``torch.distributed`` too.
_PAYLOAD = {  # name: (position, keyword) of the payload tensor (or list)
    "all_reduce": (0, "tensor"), "broadcast": (0, "tensor"), "reduce": (0, "tensor"),
    "all_gather_into_tensor": (0, "output_tensor"), "_all_gather_base": (0, "output_tensor"),
    "all_gather_single": (0, "output_tensor"), "all_gather": (0, "tensor_list"),
    "reduce_scatter_tensor": (1, "input"), "_reduce_scatter_base": (1, "input"),
    "reduce_scatter_single": (1, "input"), "reduce_scatter": (1, "input_list"),
    "all_to_all_single": (1, "input"),
}


class Collective(NamedTuple):
    """One collective call on this rank: the function, the group's global ranks, the payload's
    dtype and bytes (the whole logical tensor: what an all-gather delivers, what a
    reduce-scatter reduces)."""

    op: str
    ranks: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


class CollectiveLog:
    """Records every ``torch.distributed`` collective this process calls while active.

    ``with CollectiveLog() as log: ...`` patches the module's functions (code that looks them up
    as ``dist.<name>`` at call time is seen; C++ callers such as DDP's reducer without a comm
    hook are not). ``log.nbytes(where=...)`` sums the payloads, e.g. those whose group spans
    two nodes: ``where=lambda ranks: len({r // 2 for r in ranks}) > 1``.
    """

    def __init__(self) -> None:
        self.calls: list[Collective] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> CollectiveLog:
        import torch.distributed as dist

        for name, where in _PAYLOAD.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original
            setattr(dist, name, self._wrap(name, where, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def _wrap(self, name: str, where: tuple[int, str], original: Callable[..., Any]
              ) -> Callable[..., Any]:
        import torch.distributed as dist

        index, keyword = where

        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[index] if len(args) > index else kwargs.get(keyword)
            if isinstance(tensor, (list, tuple)):  # all_gather(list, t): the list's total
                tensors = [t for t in tensor if isinstance(t, torch.Tensor)]
            else:
                tensors = [tensor] if isinstance(tensor, torch.Tensor) else []
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            ranks = tuple(dist.get_process_group_ranks(group if group is not None
                                                       else dist.group.WORLD))
            if tensors:
                self.calls.append(Collective(name, ranks, tensors[0].dtype,
                                             sum(t.numel() * t.element_size() for t in tensors)))
            return original(*args, **kwargs)

        return counted

    def nbytes(self, where: Callable[[tuple[int, ...]], bool] | None = None,
               op: str | None = None) -> int:
        """The payload bytes of the calls whose group's ranks satisfy ``where`` (and ``op``)."""
        return sum(c.nbytes for c in self.calls
                   if (where is None or where(c.ranks)) and (op is None or c.op == op))
