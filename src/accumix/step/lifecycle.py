"""The Accelerator's life on every rank: the ranks agree on its configuration at the start, a
preemption handler may be installed, and ``end()`` closes the pieces in order."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from accumix.common.preemption import parse_signals
from accumix.errors import ConfigError
from accumix.runtime import fault

if TYPE_CHECKING:
    from accumix.step.run_state import RunState


def check_same_config(run: RunState) -> None:
    """Every rank was launched with the same strategy, precision (and reduce dtype), batch
    sizes and scaler."""
    mine = (type(run.strategy).__name__, run.policy.name, str(run.policy.reduce_dtype),
            run.batch_sizes, type(run.strategy.scaler).__name__)
    every = run.strategy.all_gather_object(mine)
    if any(other != mine for other in every):
        diff = {r: cfg for r, cfg in enumerate(every) if cfg != every[0]}
        raise ConfigError(
            f"ranks disagree on (strategy, precision, reduce dtype, batch sizes, scaler): rank "
            f"0 has "
            f"{every[0]}, others {diff}; launch every rank with the same settings"
        )


def handle_preemption(run: RunState, run_dir: str | os.PathLike[str], *,
                      save: Callable[[Path, int | None], Path], signals: Iterable[int | str],
                      requeue: bool = False, keep_last: int | None,
                      exit: bool) -> fault.PreemptionHandler:
    """``acc.handle_preemption``: replaces any earlier handler."""
    chosen = parse_signals(signals)  # before the old handler goes: a bad name changes nothing
    if run.preemption is not None:
        run.preemption.close()
    run.preemption = fault.PreemptionHandler(
        run, run_dir, save=save, signals=chosen, requeue=requeue, keep_last=keep_last,
        exit=exit)
    return run.preemption


def end(run: RunState) -> None:
    """``acc.end()``: saves a pending preemption, stops the watchdog, tears the strategy down."""
    # A signal in the last window or after the loop: saved now (collective), exit below.
    preempted = run.preemption is not None and run.preemption.at_end()
    if run.preemption is not None:
        run.preemption.close()
    if run.watchdog is not None:
        run.watchdog.finish()
    run.strategy.teardown()
    if dist.is_initialized():
        dist.barrier()
    if preempted:
        raise SystemExit(0)
