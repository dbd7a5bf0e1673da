"""The Accelerator's life on every rank: the ranks agree on its configuration at the start, a
preemption handler may be installed, and ``end()`` closes the pieces in order."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch.distributed as dist

from accumix.errors import ConfigError
from accumix.runtime import fault

if TYPE_CHECKING:
    from accumix.accelerator import Accelerator


def check_same_config(acc: Accelerator) -> None:
    """Every rank was launched with the same strategy, precision, batch sizes and scaler."""
    mine = (type(acc.strategy).__name__, acc.policy.name, acc._batch_sizes,
            type(acc.strategy.scaler).__name__)
    every = acc.strategy.all_gather_object(mine)
    if any(other != mine for other in every):
        diff = {r: cfg for r, cfg in enumerate(every) if cfg != every[0]}
        raise ConfigError(
            f"ranks disagree on (strategy, precision, batch sizes, scaler): rank 0 has "
            f"{every[0]}, others {diff}; launch every rank with the same settings"
        )


def handle_preemption(acc: Accelerator, run_dir: str | os.PathLike[str], *,
                      signals: tuple[int, ...], keep_last: int | None, exit: bool
                      ) -> fault.PreemptionHandler:
    """``acc.handle_preemption``: replaces any earlier handler."""
    if acc._preemption is not None:
        acc._preemption.close()
    acc._preemption = fault.PreemptionHandler(
        acc, run_dir, signals=tuple(signals), keep_last=keep_last, exit=exit
    )
    return acc._preemption


def end(acc: Accelerator) -> None:
    """``acc.end()``: saves a pending preemption, stops the watchdog, tears the strategy down."""
    # A signal in the last window or after the loop: saved now (collective), exit below.
    preempted = acc._preemption is not None and acc._preemption.at_end()
    if acc._preemption is not None:
        acc._preemption.close()
    if acc._watchdog is not None:
        acc._watchdog.finish()
    acc.strategy.teardown()
    if dist.is_initialized():
        dist.barrier()
    if preempted:
        raise SystemExit(0)
