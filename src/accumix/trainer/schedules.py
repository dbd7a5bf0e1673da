"""Learning-rate schedules (linear warmup, then cosine or linear decay) and batch-size scaling.

The schedule is a picklable callable object for ``LambdaLR``, so its settings travel in the
scheduler's ``state_dict`` as plain numbers and strings (safe to load with ``weights_only``).
It counts real optimizer steps: the Accelerator steps the scheduler only when the optimizer
stepped, never K times per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from accumix.errors import ConfigError

DECAYS = ("cosine", "linear", "constant")
SCALE_RULES = ("linear", "sqrt")


# Not slots: LambdaLR's state_dict saves a callable's __dict__ (plain numbers and a word).
@dataclass(kw_only=True)
class WarmupDecay:
    """The LR multiplier at a step: linear warmup, then decay to ``min_ratio``.

    ::

        step < warmup:  (step + 1) / (warmup + 1)
        else:           p = min(1, (step - warmup) / max(1, total - warmup))
                        cosine:   min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2
                        linear:   min_ratio + (1 - min_ratio) * (1 - p)
                        constant: 1

    Args:
        warmup_steps: steps of linear warmup (0 for none).
        total_steps: the step at which the decay reaches ``min_ratio``.
        decay: ``"cosine"``, ``"linear"`` or ``"constant"``.
        min_ratio: the final multiplier, in [0, 1].

    Raises:
        ConfigError: a negative count, warmup beyond the total, an unknown decay or a ratio
            outside [0, 1].
    """

    warmup_steps: int
    total_steps: int
    decay: str = "cosine"
    min_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.decay not in DECAYS:
            raise ConfigError(f"decay={self.decay!r} is invalid; use one of {', '.join(DECAYS)}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ConfigError(
                f"warmup_steps={self.warmup_steps}, total_steps={self.total_steps} are invalid; "
                "use warmup_steps >= 0 and total_steps >= 1"
            )
        if self.warmup_steps > self.total_steps:
            raise ConfigError(
                f"warmup_steps={self.warmup_steps} exceeds total_steps={self.total_steps}; "
                "use a shorter warmup"
            )
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ConfigError(f"min_ratio={self.min_ratio} is invalid; use a number in [0, 1]")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.decay == "constant":
            return 1.0
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        if self.decay == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = 1.0 - progress
        return self.min_ratio + (1.0 - self.min_ratio) * shape


def warmup_schedule(optimizer: Optimizer, *, warmup_steps: int, total_steps: int,
                    decay: str = "cosine", min_ratio: float = 0.0) -> LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` with a ``WarmupDecay`` multiplier (see there).

    Args:
        optimizer: the optimizer; its param groups' ``lr`` are the peak learning rates.
        warmup_steps: steps of linear warmup.
        total_steps: the step where the decay ends (usually ``max_steps``).
        decay: ``"cosine"``, ``"linear"`` or ``"constant"``.
        min_ratio: the final learning rate as a fraction of the peak.

    Returns:
        The scheduler; set it up with its optimizer (``acc.setup(..., scheduler)``).
    """
    return LambdaLR(optimizer, WarmupDecay(warmup_steps=warmup_steps, total_steps=total_steps,
                                           decay=decay, min_ratio=min_ratio))


def scale_lr(lr: float, *, global_batch_size: int, base_batch_size: int,
             rule: str = "linear") -> float:
    """Scales a learning rate tuned at ``base_batch_size`` to ``global_batch_size``.

    ``linear`` (Goyal et al. 2017, for SGD): ``lr * B / B0``; ``sqrt`` (common for Adam):
    ``lr * sqrt(B / B0)``.

    Args:
        lr: the learning rate tuned at the base batch.
        global_batch_size: samples per optimizer step now (over all ranks).
        base_batch_size: samples per step the learning rate was tuned at.
        rule: ``"linear"`` or ``"sqrt"``.

    Returns:
        The scaled learning rate.

    Raises:
        ConfigError: a batch size below 1, a non-positive lr or an unknown rule.
    """
    if rule not in SCALE_RULES:
        raise ConfigError(f"rule={rule!r} is invalid; use one of {', '.join(SCALE_RULES)}")
    if global_batch_size < 1 or base_batch_size < 1:
        raise ConfigError(
            f"global_batch_size={global_batch_size}, base_batch_size={base_batch_size} are "
            "invalid; use integers >= 1"
        )
    if not lr > 0:
        raise ConfigError(f"lr={lr} is invalid; use a number > 0")
    ratio = global_batch_size / base_batch_size
    return lr * (ratio if rule == "linear" else math.sqrt(ratio))
