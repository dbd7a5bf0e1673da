"""The metrics of one optimizer step: the true window loss, throughput, memory, per-rank time.

The window loss is what the gradients were computed from, not the last micro-batch's: the loss of
every micro-step is added up on the device (no host sync per micro-step), and at the boundary one
``all_gather`` of a few scalars per rank gives every rank the same numbers:

* mean mode (``backward(loss)``): the mean over micro-steps and ranks of the micro-batch means;
* item mode (``backward(loss_sum, num_items=n)``): the sum of all loss sums over the sum of all
  items of the window on every rank -- the loss of the large batch, not a mean of means.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

# The step function's result and a batch's rows are read where the safety net splits batches.
from accumix.memory.oom_split import batch_samples, split_loss  # noqa: F401 - re-exported
from accumix.trainer.system_metrics import SystemSampler, system_columns

# One gathered row per rank: the window's sums and this rank's own measurements (the norm is
# the same on every rank; -1 when none was computed).
_LOSS, _COUNT, _ITEMS, _SAMPLES, _BUSY, _MEM, _NORM = range(7)
_WIDTH = 7


@dataclass(kw_only=True, slots=True)
class StepMetrics:
    """What happened in one optimizer step (one accumulation window).

    Attributes:
        step: real optimizer steps so far (``acc.optimizer_steps``; a skipped fp16 step does not
            count, so its row repeats the previous step number with ``skipped=True``).
        epoch: the epoch the window ended in.
        loss: the true window loss (see the module docstring); the same on every rank.
        lrs: each param group's learning rate used by this step.
        grad_norm: the total gradient norm before clipping (None when nothing was clipped).
        loss_scale: the fp16 loss scale the window's losses were multiplied by, or None.
        skipped: the step was skipped (fp16 overflow).
        samples: samples in the window over all ranks.
        items: items (tokens) over all ranks in item mode, else None.
        step_time_s: rank 0's wall time of the window, from the end of the previous step.
        rank_busy_s: each rank's time before its boundary backward (data, forwards and the
            off-boundary backwards): no communication happens there, so a slow rank shows up
            here while the gradient all-reduce makes every rank's wall time equal.
        max_mem_mb: the largest peak memory of any rank (CUDA allocator peak, or the process's
            peak resident memory on a CPU).
        extra: more columns from callbacks (``mfu``, ``val_loss``, ...).
    """

    step: int
    epoch: int
    loss: float
    lrs: list[float]
    grad_norm: float | None
    loss_scale: float | None
    skipped: bool
    samples: int
    items: int | None
    step_time_s: float
    rank_busy_s: list[float]
    max_mem_mb: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def lr(self) -> float:
        """The first param group's learning rate."""
        return self.lrs[0] if self.lrs else math.nan

    @property
    def samples_per_s(self) -> float:
        """Samples per second over all ranks in this step (NaN for a step of no time)."""
        return self.samples / self.step_time_s if self.step_time_s > 0 else math.nan

    @property
    def tokens_per_s(self) -> float | None:
        """Items (tokens) per second over all ranks, when the step returns item counts;
        None in mean mode."""
        if self.items is None:
            return None
        return self.items / self.step_time_s if self.step_time_s > 0 else math.nan

    def as_row(self) -> dict[str, Any]:
        """The logged row: the fixed columns, then the per-rank spread, then ``extra``."""
        busy = self.rank_busy_s
        row: dict[str, Any] = {
            "step": self.step,
            "epoch": self.epoch,
            "loss": self.loss,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "loss_scale": self.loss_scale,
            "skipped": int(self.skipped),
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "step_time_s": self.step_time_s,
            "max_mem_mb": self.max_mem_mb,
            "rank_busy_max_s": max(busy),
            "rank_busy_spread_s": max(busy) - min(busy),
            "slowest_rank": busy.index(max(busy)),
        }
        row.update(self.extra)
        return row


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory in MiB: the CUDA allocator's, or the peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes there, KiB here


def torch_system_sampler(device: torch.device, every: int | None) -> SystemSampler | None:
    """The system metrics sampler of a torch rank (None when ``every`` is None): CUDA memory
    in use and peak, and the GPU's utilisation where NVML (``pynvml``) is installed."""
    if every is None:
        return None
    if device.type != "cuda":
        return SystemSampler(every)

    def memory() -> tuple[float, float]:
        return (torch.cuda.memory_allocated(device) / 2**20,
                torch.cuda.max_memory_allocated(device) / 2**20)

    def utilisation() -> float | None:
        try:
            return float(torch.cuda.utilization(device))
        except Exception:  # no pynvml, or NVML not usable here
            return None

    return SystemSampler(every, device_memory=memory, gpu_util=utilisation)


class _Clock:
    """Marks on the host, or CUDA events on a GPU (whose work runs after the host queued it)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


class WindowMeter:
    """Adds up one window's losses on the device and gathers the window's metrics once.

    Args:
        accelerator: the run's Accelerator (its device and its ``gather``).
        system: this rank's system metrics sampler: its values ride in the same gather.
    """

    def __init__(self, accelerator: Any, system: SystemSampler | None = None) -> None:
        self.acc = accelerator
        self.system = system
        self.device = accelerator.device
        self._clock = _Clock(self.device)
        self.reset()

    def reset(self) -> None:
        """Starts a new window now (called after a step's evaluation and checkpoint)."""
        self._start_wall = time.perf_counter()
        self._start_mark = self._clock.mark()
        self._ready_mark: Any = None
        self._loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._items = torch.zeros((), dtype=torch.float64, device=self.device)
        self._micro_steps = 0
        self._samples = 0
        self._item_mode: bool | None = None

    def add(self, loss: torch.Tensor, num_items: Any, samples: int) -> None:
        """Records one micro-step's loss (mean, or sum with ``num_items``); no host sync."""
        self._loss += loss.detach()
        if num_items is not None:
            self._items += num_items.detach() if isinstance(num_items, torch.Tensor) else num_items
        self._item_mode = num_items is not None
        self._micro_steps += 1
        self._samples += samples

    def mark_ready(self) -> None:
        """This rank reached its boundary backward (where it starts waiting for the others)."""
        self._ready_mark = self._clock.mark()

    def finish(
        self, *, step: int, epoch: int, lrs: list[float], grad_norm: torch.Tensor | None,
        loss_scale: float | None, skipped: bool,
    ) -> StepMetrics:
        """Gathers the window's numbers from every rank (one collective, one host sync).

        Returns:
            The step's metrics, identical on every rank except ``step_time_s`` (each rank's own
            wall time, which the gradient all-reduce makes nearly equal).
        """
        ready = self._ready_mark if self._ready_mark is not None else self._clock.mark()
        busy = self._clock.seconds(self._start_mark, ready)
        sampled = self.system is not None and self.system.due(step)
        system = ([] if self.system is None else self.system.sample(
            time.perf_counter() - self._start_wall) if sampled else self.system.empty())
        local = torch.tensor(
            [0.0, 0.0, 0.0, float(self._samples), busy, peak_memory_mb(self.device), -1.0,
             *system], dtype=torch.float64,
        ).to(self.device, non_blocking=True)
        local[_LOSS] = self._loss
        local[_ITEMS] = self._items
        local[_COUNT] = self._items if self._item_mode else float(self._micro_steps)
        if grad_norm is not None:
            local[_NORM] = grad_norm.detach()
        rows = self.acc.gather(local).view(-1, _WIDTH + len(system)).tolist()
        wall = time.perf_counter() - self._start_wall
        count = sum(r[_COUNT] for r in rows)
        norm = rows[0][_NORM]
        return StepMetrics(
            step=step,
            epoch=epoch,
            loss=sum(r[_LOSS] for r in rows) / count if count > 0 else math.nan,
            lrs=lrs,
            grad_norm=None if norm < 0 else norm,  # -1: none; NaN stays NaN
            loss_scale=loss_scale,
            skipped=skipped,
            samples=int(sum(r[_SAMPLES] for r in rows)),
            items=int(sum(r[_ITEMS] for r in rows)) if self._item_mode else None,
            step_time_s=wall,
            rank_busy_s=[r[_BUSY] for r in rows],
            max_mem_mb=max(r[_MEM] for r in rows),
            extra=system_columns([r[_WIDTH:] for r in rows]) if sampled else {},
        )
