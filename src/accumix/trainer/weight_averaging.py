"""``WeightAveraging``: an exponential moving average (EMA) of the model's weights.

The average is held like the model: under ``single``, ``ddp`` and ``zero1`` each rank keeps a
full copy of its parameters; under ``fsdp`` each rank keeps only its DTensor shards (the local
tensors are cloned, nothing is gathered). It is saved per rank in the step directory
(``ema-rank-<r>.pt``, written to a temporary name and renamed) and loaded back bitwise on the
same world size and strategy.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from accumix import run_dir as layout
from accumix.errors import CheckpointError, ConfigError
from accumix.trainer.events import Callback

if TYPE_CHECKING:
    from accumix.trainer.metrics import StepMetrics
    from accumix.trainer.trainer import Trainer

# Strategies whose parameters are plain tensors or DTensor shards of the live model.
_SUPPORTED = ("single", "ddp", "zero1", "fsdp")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of the live parameter), else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class WeightAveraging(Callback):
    """Keeps ``ema = decay * ema + (1 - decay) * weights`` after every ``every_n_steps``-th real
    optimizer step (the name of Lightning's callback; timm's ``ModelEmaV3`` with its default
    ``include_buffers=False``).

    The average starts as the weights at ``fit`` start and is updated in place with
    ``ema.mul_(decay).add_(w, alpha=1 - decay)``. A step skipped by the fp16 loss scaler does not
    update it (``acc.optimizer_steps`` did not move). Only floating-point parameters are
    averaged; buffers (BatchNorm statistics) are the live model's, as in ``ModelEmaV3``.

    Args:
        decay: the weight of the old average, in [0, 1).
        every_n_steps: update after every this many optimizer steps.
        eval_with_average: evaluate with the average (swapped into the model for each
            validation, swapped back after it, bitwise).

    Raises:
        ConfigError: a ``decay`` or ``every_n_steps`` out of range; at ``fit`` start, a strategy
            other than single, ddp, zero1 or fsdp (DeepSpeed partitions its parameters itself).
    """

    def __init__(self, decay: float = 0.999, every_n_steps: int = 1,
                 eval_with_average: bool = False) -> None:
        if not 0.0 <= float(decay) < 1.0:
            raise ConfigError(f"decay={decay!r} is invalid; use a number in [0, 1)")
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, numbers.Integral) \
                or every_n_steps < 1:  # a numpy integer is an Integral too
            raise ConfigError(f"every_n_steps={every_n_steps!r} is invalid; use an integer >= 1")
        self.decay, self.every_n_steps = float(decay), int(every_n_steps)
        self.eval_with_average = eval_with_average
        self.updates = 0
        self.average: list[torch.Tensor] = []
        self._params: list[torch.Tensor] = []
        self._seen_steps = 0
        self._backup: list[torch.Tensor] | None = None

    # -- the average ---------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: Trainer) -> None:
        acc = trainer.accelerator
        name = getattr(getattr(acc, "strategy", None), "name", None)
        if name not in _SUPPORTED or not isinstance(trainer.model, torch.nn.Module):
            raise ConfigError(f"WeightAveraging does not support strategy={name!r}; use one of "
                              f"{', '.join(_SUPPORTED)} (torch backend)")
        self._params = [p for p in trainer.model.parameters() if p.is_floating_point()]
        with torch.no_grad():
            self.average = [_local(p).detach().clone() for p in self._params]
        self.updates = 0
        self._seen_steps = acc.optimizer_steps

    @override
    def on_optimizer_step(self, trainer: Trainer, metrics: StepMetrics) -> None:
        steps = trainer.accelerator.optimizer_steps
        if steps == self._seen_steps:  # an fp16-skipped step changed no weight
            return
        self._seen_steps = steps
        if steps % self.every_n_steps == 0:
            self.update()

    @torch.no_grad()
    def update(self) -> None:
        """Folds the current weights into the average (called by the Trainer)."""
        for avg, param in zip(self.average, self._params, strict=True):
            avg.mul_(self.decay).add_(_local(param).detach(), alpha=1.0 - self.decay)
        self.updates += 1

    # -- evaluation with the average -----------------------------------------------------------
    @override
    def on_validation_start(self, trainer: Trainer) -> None:
        if self.eval_with_average:
            self.swap_in()

    @override
    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.swap_out()

    @override
    def on_exception(self, trainer: Trainer, exception: BaseException) -> None:
        self.swap_out()

    @torch.no_grad()
    def swap_in(self) -> None:
        """Copies the average into the model, keeping the training weights aside."""
        if self._backup is not None:
            return
        self._backup = [_local(p).detach().clone() for p in self._params]
        for avg, param in zip(self.average, self._params, strict=True):
            _local(param).copy_(avg)

    @torch.no_grad()
    def swap_out(self) -> None:
        """Puts the training weights back (a no-op when the average is not swapped in)."""
        if self._backup is None:
            return
        for saved, param in zip(self._backup, self._params, strict=True):
            _local(param).copy_(saved)
        self._backup = None

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The counters (JSON, in ``meta.json``); the tensors go to ``ema-rank-<r>.pt``."""
        return {"updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the counters saved by ``state_dict``."""
        self.updates = int(state["updates"])

    @override
    def on_save_checkpoint(self, trainer: Trainer, path: Path) -> None:
        file = Path(path) / f"ema-rank-{trainer.accelerator.rank}.pt"
        tmp = file.with_name(file.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save([a.cpu() for a in self.average], f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)  # a crash leaves no half-written average under the real name
        trainer.accelerator.barrier()  # every rank's file is there before the run goes on

    @override
    def on_load_checkpoint(self, trainer: Trainer, path: Path) -> None:
        acc = trainer.accelerator
        file = layout.resolve(path) / f"ema-rank-{acc.rank}.pt"
        try:
            saved = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - missing file, zip errors
            raise CheckpointError(f"{file} cannot be read ({type(exc).__name__}); resume "
                                  "WeightAveraging on the world size and strategy it was saved "
                                  "with, or drop the callback") from exc
        shapes = [tuple(t.shape) for t in saved]
        if shapes != [tuple(a.shape) for a in self.average]:
            raise CheckpointError(f"{file} holds averages of shapes {shapes[:3]}... that do not "
                                  "match this model's parameters (another model or world size?)")
        with torch.no_grad():
            for avg, value in zip(self.average, saved, strict=True):
                avg.copy_(value)
        self._seen_steps = acc.optimizer_steps
