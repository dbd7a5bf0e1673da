"""Built-in callbacks: LR monitor, throughput and MFU, stragglers, the accumulation scheduler,
early stopping and the NaN / loss-spike guard.

Every decision that changes the loop (stop, raise, change K) is taken from values that are the
same on every rank (the gathered window loss, the validation loss, step and epoch counts), so all
ranks take it together and none is left waiting in a collective.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from accumix.common.hardware import peak_flops_by_name
from accumix.errors import AccumixError, ConfigError
from accumix.trainer.events import Callback

if TYPE_CHECKING:
    from accumix.trainer.metrics import StepMetrics
    from accumix.trainer.trainer import Trainer

log = logging.getLogger("accumix")

def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is invalid; use one of {', '.join(allowed)}")


class LRMonitor(Callback):
    """Adds each param group's learning rate (``lr_group<i>``) and, if asked, momentum.

    Args:
        log_momentum: also log ``momentum_group<i>`` (SGD's momentum or Adam's beta1).
    """

    def __init__(self, log_momentum: bool = False) -> None:
        self.log_momentum = log_momentum

    @override
    def on_optimizer_step(self, trainer: Trainer, metrics: StepMetrics) -> None:
        for i, lr in enumerate(metrics.lrs):
            metrics.extra[f"lr_group{i}"] = lr
        if self.log_momentum:
            for i, group in enumerate(trainer.optimizer.param_groups):
                momentum = group.get("momentum", group.get("betas", (None,))[0])
                metrics.extra[f"momentum_group{i}"] = momentum


def peak_flops_of(device: torch.device, half_precision: bool) -> float | None:
    """The datasheet bf16/fp16 peak FLOP/s of a known GPU; None on CPUs, in fp32, or unknown."""
    if device.type != "cuda" or not half_precision:
        return None
    return peak_flops_by_name(torch.cuda.get_device_name(device))


class ThroughputMonitor(Callback):
    """Adds achieved FLOP/s and model FLOPs utilisation (MFU) when the FLOPs are known.

    ``flops_per_s = flops_per_item * items/s`` (or per sample), ``mfu = flops_per_s /
    (peak_flops * world_size)``, as in the PaLM paper's appendix B.

    Args:
        flops_per_item: training FLOPs per item (token), e.g. ``GPT.flops_per_token()``.
        flops_per_sample: training FLOPs per sample, when there are no items.
        peak_flops: one device's peak FLOP/s; default: a datasheet value for known GPUs under
            bf16/fp16 (no MFU on CPUs unless given).
    """

    def __init__(self, flops_per_item: float | None = None,
                 flops_per_sample: float | None = None, peak_flops: float | None = None) -> None:
        self.flops_per_item = flops_per_item
        self.flops_per_sample = flops_per_sample
        self.peak_flops = peak_flops

    @override
    def on_fit_start(self, trainer: Trainer) -> None:
        if self.peak_flops is None:
            acc = trainer.accelerator
            if hasattr(acc, "peak_flops"):  # a backend that knows its devices (accumix.jax)
                self.peak_flops = acc.peak_flops()
            else:
                self.peak_flops = peak_flops_of(acc.device, acc.policy.half_dtype is not None)

    @override
    def on_optimizer_step(self, trainer: Trainer, metrics: StepMetrics) -> None:
        rate = None
        if self.flops_per_item is not None and metrics.tokens_per_s is not None:
            rate = self.flops_per_item * metrics.tokens_per_s
        elif self.flops_per_sample is not None:
            rate = self.flops_per_sample * metrics.samples_per_s
        if rate is None:
            return
        metrics.extra["flops_per_s"] = rate
        if self.peak_flops:
            metrics.extra["mfu"] = rate / (self.peak_flops * trainer.accelerator.world_size)


class StragglerMonitor(Callback):
    """Warns when one rank is persistently slower than the others.

    Uses ``rank_busy_s`` (each rank's time before its boundary backward): when the slowest rank
    takes more than ``tolerance`` longer than the fastest for ``patience`` steps in a row, rank 0
    warns once, naming it.

    Args:
        tolerance: allowed relative spread, e.g. 0.25 for 25 %.
        patience: consecutive slow steps before the warning.
    """

    def __init__(self, tolerance: float = 0.25, patience: int = 10) -> None:
        self.tolerance, self.patience = tolerance, patience
        self._slow = 0
        self._warned = False

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"slow_steps": self._slow, "warned": self._warned}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._slow, self._warned = int(state["slow_steps"]), bool(state["warned"])

    @override
    def on_optimizer_step(self, trainer: Trainer, metrics: StepMetrics) -> None:
        busy = metrics.rank_busy_s
        fastest, slowest = min(busy), max(busy)
        self._slow = self._slow + 1 if slowest > fastest * (1 + self.tolerance) else 0
        if self._slow >= self.patience and not self._warned:
            self._warned = True
            if trainer.accelerator.is_main_process:
                log.warning("rank %d is a straggler: %.3fs per step before its backward against "
                            "%.3fs on the fastest rank, for %d steps", busy.index(slowest),
                            slowest, fastest, self._slow)


class GradientAccumulationScheduler(Callback):
    """Changes the accumulation steps K by epoch or by step, between windows.

    Args:
        scheduling: ``{start: K}``; from epoch (or step) ``start`` on, windows have K
            micro-steps. Before the first start, the Accelerator's K is kept.
        by: ``"epoch"`` or ``"step"`` (real optimizer steps).

    Raises:
        ConfigError: a negative start, K below 1, or an unknown ``by``.
    """

    def __init__(self, scheduling: Mapping[int, int], by: str = "epoch") -> None:
        _check_choice("by", by, ("epoch", "step"))
        for start, steps in scheduling.items():
            if not isinstance(start, int) or start < 0 or not isinstance(steps, int) or steps < 1:
                raise ConfigError(
                    f"GradientAccumulationScheduler entry {start}: {steps} is invalid; use "
                    "{start >= 0: grad_accum_steps >= 1}"
                )
        self.scheduling = dict(sorted(scheduling.items()))
        self.by = by
        # No state_dict: K follows from the epoch or step, which a resume restores, and the K
        # in force is the Accelerator's, saved in its checkpoint.

    def steps_for(self, position: int) -> int | None:
        """K at epoch (or step) ``position``, or None before the first entry."""
        chosen = None
        for start, steps in self.scheduling.items():
            if start <= position:
                chosen = steps
        return chosen

    @override
    def on_train_batch_start(self, trainer: Trainer, batch: Any) -> None:
        if trainer.micro_step != 0:
            return  # K changes only where a window begins
        steps = self.steps_for(trainer.epoch if self.by == "epoch" else trainer.step)
        if steps is not None and steps != trainer.accelerator.grad_accum_steps:
            trainer.accelerator.grad_accum_steps = steps


class EarlyStopping(Callback):
    """Stops when a metric has not improved for ``patience`` checks.

    Args:
        monitor: ``"val_loss"`` (checked after each evaluation) or a step-row column such as
            ``"loss"`` (checked after each optimizer step).
        patience: checks without improvement before stopping.
        min_delta: an improvement smaller than this does not count.
        mode: ``"min"`` or ``"max"``.
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 3, min_delta: float = 0.0,
                 mode: str = "min") -> None:
        _check_choice("mode", mode, ("min", "max"))
        if patience < 1:
            raise ConfigError(f"patience={patience} is invalid; use an integer >= 1")
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, min_delta, mode
        self.best: float | None = None
        self.bad_checks = 0

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_checks": self.bad_checks}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad_checks = state["best"], int(state["bad_checks"])

    def still_stops(self) -> bool:
        """A run this callback stopped stays stopped when resumed (its patience may have been
        raised since)."""
        return self.bad_checks >= self.patience

    def _check(self, trainer: Trainer, value: float) -> None:
        sign = 1.0 if self.mode == "min" else -1.0
        if self.best is None or sign * (self.best - value) > self.min_delta:
            self.best, self.bad_checks = value, 0
            return
        self.bad_checks += 1
        if self.bad_checks >= self.patience:
            trainer.should_stop = True
            if trainer.accelerator.is_main_process:
                log.info("early stopping at step %d: %s has not improved on %.4f for %d checks",
                         trainer.step, self.monitor, self.best, self.bad_checks)

    @override
    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if self.monitor in metrics:
            self._check(trainer, metrics[self.monitor])

    @override
    def on_optimizer_step(self, trainer: Trainer, metrics: StepMetrics) -> None:
        value = metrics.as_row().get(self.monitor) if not self.monitor.startswith("val_") else None
        if isinstance(value, (int, float)) and not metrics.skipped:
            self._check(trainer, float(value))


class LossGuard(Callback):
    """Guards against a non-finite loss and against loss spikes.

    A non-finite window loss on a step that was not skipped (fp16 overflow skips are the loss
    scaler's business) triggers ``on_nan``; a loss above ``spike_factor`` times the median of
    the last ``window`` losses triggers ``on_spike``. Actions: ``"raise"`` (an AccumixError
    with advice), ``"stop"`` (end the run after this step, with its checkpoint), ``"warn"``.

    Args:
        on_nan: the action for a NaN or infinite loss.
        spike_factor: the ratio to the recent median counted as a spike; None to not check.
        on_spike: the action for a spike.
        window: the number of recent losses the median is taken over (checks start once full).
    """

    _ACTIONS = ("raise", "stop", "warn")

    def __init__(self, on_nan: str = "raise", spike_factor: float | None = 3.0,
                 on_spike: str = "warn", window: int = 20) -> None:
        _check_choice("on_nan", on_nan, self._ACTIONS)
        _check_choice("on_spike", on_spike, self._ACTIONS)
        if spike_factor is not None and spike_factor <= 1:
            raise ConfigError(f"spike_factor={spike_factor} is invalid; use a number > 1 or None")
        self.on_nan, self.spike_factor, self.on_spike = on_nan, spike_factor, on_spike
        self._recent: deque[float] = deque(maxlen=window)
        self.spikes = 0

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self._recent), "spikes": self.spikes}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._recent.clear()
        self._recent.extend(float(x) for x in state["recent"])  # the newest `window` of them
        self.spikes = int(state["spikes"])

    def _act(self, trainer: Trainer, action: str, message: str) -> None:
        if action == "raise":
            raise AccumixError(message)
        if trainer.accelerator.is_main_process:
            log.warning(message)
        if action == "stop":
            trainer.should_stop = True

    @override
    def on_optimizer_step(self, trainer: Trainer, metrics: StepMetrics) -> None:
        if metrics.skipped:
            return
        loss = metrics.loss
        if not math.isfinite(loss):
            self._act(trainer, self.on_nan,
                      f"the loss is {loss} at step {metrics.step}: lower the learning rate, "
                      "clip gradients, check the data for bad values, or use bf16 / fp32")
            return
        full = self._recent.maxlen is not None and len(self._recent) == self._recent.maxlen
        if self.spike_factor is not None and full:
            median = statistics.median(self._recent)
            if median > 0 and loss > self.spike_factor * median:
                self.spikes += 1
                self._act(trainer, self.on_spike,
                          f"loss spike at step {metrics.step}: {loss:.4f} is "
                          f"{loss / median:.1f}x the median {median:.4f} of the last "
                          f"{len(self._recent)} steps")
                return  # a spike does not enter the median
        self._recent.append(loss)
