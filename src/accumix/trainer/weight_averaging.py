"""``WeightAveraging``: an exponential moving average (EMA) of the model's weights.

The average is held like the model (``accumix.trainer.average_shards``): under ``single``,
``ddp``, ``zero1`` and DeepSpeed ZeRO 1/2 each rank keeps a full copy of its parameters; under
``fsdp`` each rank keeps only its DTensor shards; under DeepSpeed ZeRO-3 only its flat partitions
(nothing is gathered to update or evaluate). It is saved in the step directory as the model is,
with ``torch.distributed.checkpoint`` (``step-N/ema/``; a second callback's in ``ema-1/``),
before the step directory is published, so it resumes bitwise, on another world size or strategy
too, and ``save_model`` exports the averaged model as ``acc.save_model`` does.
"""

from __future__ import annotations

import logging
import numbers
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from accumix.common import run_dir as layout
from accumix.errors import CheckpointError, ConfigError
from accumix.trainer.average_shards import PREFIX, Holder, named_floating
from accumix.trainer.events import Callback

if TYPE_CHECKING:
    from accumix.trainer.metrics import StepMetrics
    from accumix.trainer.trainer import Trainer

log = logging.getLogger("accumix")

EMA_DIR = "ema"
_SUPPORTED = ("single", "ddp", "zero1", "fsdp", "deepspeed")


class WeightAveraging(Callback):
    """Keeps ``ema = decay * ema + (1 - decay) * weights`` after every ``every_n_steps``-th real
    optimizer step (the name of Lightning's callback; the update of timm's ``ModelEmaV3``).

    The average starts as the weights at ``fit`` start and is updated in place with
    ``ema.mul_(decay).add_(w, alpha=1 - decay)``. A step skipped by the fp16 loss scaler does not
    update it (``acc.optimizer_steps`` did not move). Only floating-point parameters are
    averaged; buffers (BatchNorm statistics) are the live model's, as with timm's
    ``ModelEmaV3(exclude_buffers=True)`` and Lightning's ``WeightAveraging(use_buffers=False)``
    (their defaults average floating buffers too). The average is float32 for half-precision
    parameters (float64 stays float64). Under DeepSpeed
    the weights averaged are the module's (bf16 ones under bf16-mixed), not the optimizer's
    fp32 masters.

    Args:
        decay: the weight of the old average, in [0, 1).
        every_n_steps: update after every this many optimizer steps.
        eval_with_average: evaluate with the average (swapped into the model for each
            validation, swapped back after it, bitwise).

    Raises:
        ConfigError: a ``decay`` or ``every_n_steps`` out of range; at ``fit`` start, a strategy
            other than single, ddp, zero1, fsdp or deepspeed, or a model that is not a torch
            module.
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
        self.names: list[str] = []
        self._params: list[torch.Tensor] = []
        self._holder = Holder(None)
        self._seen_steps = 0
        self._backup: list[torch.Tensor] | None = None
        self._state_loaded = False
        self._dir = EMA_DIR

    # -- the average ---------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: Trainer) -> None:
        acc = trainer.accelerator
        strategy = getattr(acc, "strategy", None)
        name = getattr(strategy, "name", None)
        if name not in _SUPPORTED or not isinstance(trainer.model, torch.nn.Module):
            raise ConfigError(f"WeightAveraging does not support strategy={name!r}; use one of "
                              f"{', '.join(_SUPPORTED)} (torch backend)")
        zero = None
        if name == "deepspeed" and getattr(strategy, "stage", None) == 3:
            zero = strategy._engine(trainer.model).optimizer  # its partitions are the weights
        self._holder = Holder(strategy, zero)
        named = named_floating(acc.unwrap(trainer.model))
        self.names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._restart(acc.optimizer_steps)
        self._state_loaded = False  # load_state_dict sets it when the run resumes
        # One directory per WeightAveraging callback, by its order (two decays are common).
        index = [c for c in trainer.callbacks if isinstance(c, WeightAveraging)].index(self)
        self._dir = EMA_DIR if index == 0 else f"{EMA_DIR}-{index}"

    @torch.no_grad()
    def _restart(self, steps: int) -> None:
        # float32 at least: a bfloat16 average with decay 0.999 would never move (the update
        # is below half a bfloat16 step), e.g. DeepSpeed's bf16 modules.
        self.average = [self._holder.local(p).detach().to(
            torch.promote_types(p.dtype, torch.float32), copy=True) for p in self._params]
        self.updates = 0
        self._seen_steps = steps

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
        # Two foreach kernels over every tensor, not two launches per parameter (the same
        # ``mul_`` then ``add_`` per element: bitwise the per-tensor update).
        if self.average:  # foreach refuses an empty list
            torch._foreach_mul_(self.average, self.decay)
            torch._foreach_add_(self.average, [self._holder.local(p).detach()
                                               for p in self._params], alpha=1.0 - self.decay)
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
        """Copies the average into the model, keeping the training weights aside (collective
        under DeepSpeed ZeRO-3)."""
        if self._backup is not None:
            return
        self._backup = [self._holder.local(p).detach().clone() for p in self._params]
        self._write(self.average)

    @torch.no_grad()
    def swap_out(self) -> None:
        """Puts the training weights back (a no-op when the average is not swapped in)."""
        if self._backup is None:
            return
        self._write(self._backup)
        self._backup = None

    def _write(self, values: list[torch.Tensor]) -> None:
        with self._holder.writing():
            for value, param in zip(values, self._params, strict=True):
                self._holder.local(param).copy_(value)

    # -- export --------------------------------------------------------------------------------
    def full_state_dict(self, trainer: Trainer) -> dict[str, torch.Tensor]:
        """The averaged model's full state dict, as ``acc.save_model`` would write it for the
        live model: the average for each averaged parameter (every name of a tied one), the
        rest as the strategy's ``full_state_dict`` gives them (collective)."""
        acc = trainer.accelerator
        state = dict(acc.strategy.full_state_dict(trainer.model))
        full = {id(p): self._holder.full(a, p) for a, p in zip(self.average, self._params,
                                                               strict=True)}
        for name, p in acc.unwrap(trainer.model).named_parameters(remove_duplicate=False):
            if id(p) in full and name in state:
                state[name] = full[id(p)].to(state[name].dtype)
        return state

    def save_model(self, trainer: Trainer, directory: str | Path) -> Path:
        """Writes the averaged model as ``directory/model.safetensors`` (rank 0; collective),
        the file ``acc.save_model`` writes for the live model: it loads strictly into a fresh
        copy of the plain model.

        Args:
            trainer: the Trainer this callback is in.
            directory: created if needed.

        Returns:
            The file's path.
        """
        from accumix.checkpoint.model_file import write_full_state

        return write_full_state(trainer.accelerator.strategy, self.full_state_dict(trainer),
                                directory)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The counters (JSON, in ``meta.json``); the tensors go to ``step-N/ema/``."""
        return {"updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the counters in ``state``, what ``state_dict`` saved."""
        self.updates = int(state["updates"])
        self._state_loaded = True

    @override
    def on_write_checkpoint(self, trainer: Trainer, directory: Path) -> None:
        # Into the step directory before it is published: ``latest`` never names a checkpoint
        # without its average, and its manifest lists (and a load checks) the average's files.
        from accumix.checkpoint import dcp_state

        if self._backup is not None:  # the model files just written hold the average
            raise ConfigError(
                "a checkpoint was saved while WeightAveraging(eval_with_average=True) had the "
                "average swapped in for evaluation (by a callback before it in `callbacks`, "
                "at on_validation_end?): it would resume from the averaged weights; list "
                "WeightAveraging before that callback")
        state = {PREFIX + n: self._holder.saved(a, p)
                 for n, a, p in zip(self.names, self.average, self._params, strict=True)}
        dcp_state.write(state, str(directory / self._dir))  # a Path, or an object store's

    @override
    def on_load_checkpoint(self, trainer: Trainer, path: Path) -> None:
        acc = trainer.accelerator
        step_dir = layout.resolve(path)
        if (step_dir / self._dir).is_dir():
            self._load_dcp(step_dir / self._dir)
        elif any(step_dir.glob("ema-rank-*.pt")):
            self._load_per_rank(step_dir / f"ema-rank-{acc.rank}.pt")
        elif not self._state_loaded:  # the callback was added to a run saved without it
            log.warning("accumix: %s holds no weight average: WeightAveraging starts afresh "
                        "from the loaded weights", step_dir)
            self._restart(acc.optimizer_steps)
            return
        else:
            raise CheckpointError(f"{step_dir}/{self._dir} is missing (the save was interrupted?); "
                                  "resume from another checkpoint or drop WeightAveraging")
        self._seen_steps = acc.optimizer_steps

    def _load_dcp(self, directory: Path) -> None:
        from accumix.checkpoint import dcp_state

        reader = dcp_state.SafeReader(str(directory))
        saved = set(reader.read_metadata().state_dict_metadata)
        mine = {PREFIX + n for n in self.names}
        if saved != mine:
            missing, extra = sorted(mine - saved), sorted(saved - mine)
            raise CheckpointError(
                f"{directory} averages other parameters than this model's (missing "
                f"{missing[:3]}, unexpected {extra[:3]}); resume with the model it was saved "
                "with")
        state = {PREFIX + n: self._holder.template(a, p)
                 for n, a, p in zip(self.names, self.average, self._params, strict=True)}
        dcp_state.read(state, reader)
        with torch.no_grad():
            for n, avg, p in zip(self.names, self.average, self._params, strict=True):
                avg.copy_(self._holder.loaded(state[PREFIX + n], p))

    def _load_per_rank(self, file: Path) -> None:
        """The per-rank files an earlier accumix wrote (``ema-rank-<r>.pt``)."""
        from accumix.checkpoint.load_limits import ENTRY_OVERHEAD, check_torch_zip

        check_torch_zip(file, sum(a.numel() * a.element_size() for a in self.average)
                        + ENTRY_OVERHEAD, str(file))
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
