"""Multi-process test helper: run a function on N ranks over gloo on loopback.

Each rank is a fresh ``spawn``-ed interpreter with torchrun's variables set, one CPU thread,
``MASTER_ADDR=127.0.0.1`` and a free port. Results come back in rank order; a rank's exception
is re-raised here with its traceback. Group many checks in one call: a spawn costs seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    """A spawned rank raised; the message holds its traceback."""


def _run_rank(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...],
              env: dict[str, str], queue: Any) -> None:
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    })
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
          env: dict[str, str] | None = None, timeout: float = 240.0) -> list[Any]:
    """Runs ``fn(*args)`` on ``nprocs`` ranks and returns each rank's result, rank order.

    Args:
        fn: a module-level (picklable) function.
        nprocs: the world size.
        args: passed to ``fn`` on every rank.
        env: extra environment variables for the ranks.
        timeout: seconds before the ranks are killed and this raises.

    Raises:
        RankFailed: a rank raised, died, or the run timed out.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    # Not daemonic: a rank may start DataLoader workers. The ``finally`` below kills any rank
    # still alive, so none outlives this call.
    procs = [
        ctx.Process(target=_run_rank, args=(fn, r, nprocs, port, args, env or {}, queue),
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
