"""DeepSpeed: ZeRO stage 1, 2 or 3 through ``deepspeed.initialize``, behind the Strategy interface.

The engine does backward, gradient reduction, fp16 loss scaling, the overflow decision and the
optimizer step itself. accumix maps its step onto the engine without a special case in the
façade:

* config: generated from accumix's settings (micro batch, K, stage, the precision's fp16/bf16
  block with the ``DynamicLossScale`` settings); a user config is merged, and a value in it that
  contradicts accumix's is a ``ConfigError`` naming the keys (``deepspeed_config``);
* boundary: ``no_sync`` (off-boundary micro-steps) sets ``engine.set_gradient_accumulation_boundary
  (False)`` and restores True, so the engine reduces (stage 1) and steps once per window however
  long the window is: a short last window needs no counter of the engine's to line up;
* loss: the façade multiplies by 1/K (mean mode) or 1/items hint (item mode) and nothing for the
  loss scale (the scaler proxy's ``scale`` is 1.0); ``engine.backward(loss, scale_wrt_gas=False)``
  adds only the engine's own fp16 scale, never a second 1/K;
* boundary factor (short window K/k, item weighting W·hint/N): multiplied into the gradient
  partitions the engine holds after the window's last backward, before its step reads them;
* clipping: the engine's ``gradient_clipping`` stays 0. ``clip_grad_norm_`` takes the p-norm
  of the partitions (all-reduced), divides by the engine's loss scale (the true norm, as torch
  computes it), and multiplies the still-scaled partitions by ``max_norm / (norm + 1e-6)`` when
  below 1; the engine then unscales. The result equals clipping the unscaled gradients
  (DeepSpeed's own ``unscale_and_clip_grads`` computes the same combined factor) and the norm
  is returned at once;
* step: ``engine.step()``; it returns ``engine.was_step_applied()``, so an fp16 overflow (found
  and agreed across ranks inside the engine) skips the optimizer and the scheduler alike, and
  ``acc.loss_scale`` reads the engine's scale (DeepSpeed's hysteresis is the one DESIGN.md
  specifies). DeepSpeed's ZeRO step (0.19) moves the loss scale *before* it unscales, so a
  step that grows the scale would apply half the gradient; the strategy defers the engine's
  scale update to after its step (``defer_scale_update``). The engine steps once per window:
  a second ``optimizer.step()`` at one boundary is an ``AccumixError`` (inside DeepSpeed it is
  a ``TypeError``; these rules: ``deepspeed_window``);
* ZeRO-3's gradient partitions are zeroed after each step: DeepSpeed 0.19.8 copies a reduced
  gradient into its partition on a window's first micro-step and adds on later ones without
  clearing between windows, so a parameter unused on the first micro-step got the previous
  window's leftover added (``clear_stage3_grad_partitions``);
* ``full_state_dict``: trainable parameters the optimizer does not hold have no fp32 master
  (ZeRO-3's ``safe_get_full_fp32_param`` raises ``KeyError``): they come from the module, as
  frozen ones do;
* checkpoints: the format the other strategies share (``torch.distributed.checkpoint``, keys
  ``model0.<fqn>`` and torch's FQN-keyed optimizer state, ``deepspeed_state``), so a state
  saved under deepspeed at any world size and ZeRO stage loads into single, ddp, zero1, fsdp or
  deepspeed at any world size, and the other way round. The fp16 loss scale lives in the
  engine; the scaler proxy's ``state_dict`` maps it to ``DynamicLossScale``'s.

Not supported: ``offload_optimizer`` (the gradients then live in DeepSpeed's CPU buffers) and
more than one model per strategy (one engine owns one model and one optimizer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from accumix.errors import ConfigError, LossScaleError
from accumix.precision import DynamicLossScale, LossScaler, NoLossScale, Policy
from accumix.precision.autocast import autocast_forward
from accumix.precision.policy import dtype_name
from accumix.precision.reduce_dtype import EffectiveDtypes
from accumix.step.accumulation import rescale_grads_
from accumix.step.compile import Compiler
from accumix.strategies import deepspeed_probe, deepspeed_state
from accumix.strategies.base import Strategy
from accumix.strategies.deepspeed_config import (
    deepspeed_config,
    import_deepspeed,
    read_user_config,
)
from accumix.strategies.deepspeed_engine import (
    clear_stage3_grad_partitions,
    clip_partitions_,
    compile_engine,
    defer_scale_update,
    ensure_process_group,
    initialize,
    off_boundary,
    partition_grads,
    release_group_references,
    skip_cpu_shm_build,
)
from accumix.strategies.deepspeed_loss_scale import EngineLossScale
from accumix.strategies.deepspeed_window import EngineWindows, refuse_deferred_reduction
from accumix.strategies.memory_format import make_parameters_contiguous_
from accumix.strategies.node_groups import check_groups_within_nodes, hpz_partition_size
from accumix.strategies.norm_layers import agree_buffers_after_forward, float32_norm_forward
from accumix.strategies.optimizer_exactness import check_deepspeed, is_elementwise


# -- the strategy ----------------------------------------------------------------------------
class DeepSpeedStrategy(Strategy):
    """DeepSpeed's engine with ZeRO stage 1, 2 or 3 and the user's torch optimizer.

    ``setup`` returns the engine as the model (call it like the model; ``acc.unwrap`` gives the
    module) and the user's optimizer, which the engine steps on its fp32 partitions (an LR
    scheduler built on it drives the engine's learning rate). Under ``fp16-mixed`` and
    ``bf16-mixed`` the engine holds the model in half precision with fp32 master weights and
    the forward runs under autocast with float32 outputs.

    Stage 1 reduces gradients once per window; stages 2 and 3 reduce-scatter on every
    micro-step (DeepSpeed's design: each rank keeps only its gradient partition), so they trade
    traffic for memory. One process works too (a one-rank group is created for the engine).

    Args:
        stage: ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters.
        config: more DeepSpeed settings, a dict or a JSON file path, merged over accumix's; a
            value contradicting accumix's (batch sizes, K, stage, precision, clipping, loss
            scale, an optimizer or scheduler block) is a ``ConfigError``.
        hpz: ZeRO++'s hierarchical partitioning (stage 3, several nodes): ``"node"`` keeps a
            secondary copy of the parameters partitioned over the ranks of each node
            (``zero_hpz_partition_size``), so the backward's all-gathers stay inside the
            node; an integer partitions over that many consecutive ranks of a node. The
            forward's all-gathers and the gradients' reduce-scatter (every micro-step, as in
            ZeRO-3) still span all ranks: for one crossing per step use ``"hsdp"``.

    Raises:
        ConfigError: DeepSpeed is not installed (``pip install 'accumix[deepspeed]'``), a bad
            stage or config, fp16 on a device where DeepSpeed has no fp16, or ``hpz`` with a
            stage other than 3, on one node, or not within a node.
    """

    name = "deepspeed"
    honours_reduce_dtype = True  # communication_data_type

    def __init__(self, *, stage: int = 2, config: dict[str, Any] | str | Path | None = None,
                 hpz: str | int | None = None) -> None:
        super().__init__()
        if isinstance(stage, bool) or stage not in (1, 2, 3):
            raise ConfigError(f"DeepSpeedStrategy(stage={stage!r}) is invalid; use 1, 2 or 3")
        if hpz is not None and not (hpz == "node" or (
                isinstance(hpz, int) and not isinstance(hpz, bool) and hpz >= 2)):
            raise ConfigError(f"DeepSpeedStrategy(hpz={hpz!r}) is invalid; use 'node', an "
                              "integer >= 2 (ranks of a node), or None")
        if hpz is not None and stage != 3:
            raise ConfigError(f"DeepSpeedStrategy(hpz={hpz!r}) partitions ZeRO-3's parameters; "
                              f"use stage=3 with it (not stage={stage})")
        self.stage, self.hpz = stage, hpz
        self.forward_collectives = stage == 3  # ZeRO-3 gathers parameters in the forward
        self.hpz_partition_size: int | None = None
        self.user_config = read_user_config(config)
        import_deepspeed()  # fail at construction, not at the first setup
        self._fp16: DynamicLossScale | None = None
        self._engines: list[Any] = []
        self._engine_of: dict[int, Any] = {}  # id(user's optimizer) -> engine
        self._scale_updates: dict[int, Callable[[], None]] = {}  # id(engine) -> deferred update
        self._trained: dict[int, set[int]] = {}  # id(engine) -> ids of its optimizer's params
        self._groups: dict[int, list[list[str]]] = {}  # id(engine) -> param groups' FQNs
        self._windows = EngineWindows()  # each engine's backward and step in its window
        self._owns_group = False

    def connect(self, *, launch: Any, device: torch.device, policy: Policy,
                scaler: LossScaler) -> None:
        super().connect(launch=launch, device=device, policy=policy, scaler=scaler)
        if self.hpz is not None:
            self.hpz_partition_size = hpz_partition_size(self.hpz, launch)
        if isinstance(scaler, DynamicLossScale):
            self._fp16 = scaler
            self.scaler = EngineLossScale(scaler, self._engines)
        else:
            self.scaler = NoLossScale()

    def effective_dtypes(self) -> EffectiveDtypes:
        """Under a half precision the engine stores the module in it, keeps float32 masters
        and sums the window in float32; stage 1 reduces once per window, stages 2 and 3 on
        every micro-step (each backward's reduce-scatter, added into float32 partitions)."""
        assert self.policy is not None
        half = self.policy.half_dtype
        stored = dtype_name(half) if half is not None else "float32"
        return EffectiveDtypes(
            params=stored, compute=dtype_name(self.policy.compute_dtype),
            accumulation="float32", masters="float32",
            reduction=dtype_name(self.policy.reduce_dtype) if self.world_size > 1 else "none",
            reductions="once per optimizer step" if self.stage == 1 else
            f"every micro-step: ZeRO stage {self.stage} reduces each backward")

    @property
    def loss_scale(self) -> float | None:
        if self._fp16 is None:
            return None
        if not self._engines:
            return float(self._fp16.init_scale)
        return float(self._engines[0].optimizer.loss_scale)

    # -- setup -------------------------------------------------------------------------------
    def set_batch_geometry(self, *, micro_batch_size: int | None, grad_accum_steps: int) -> None:
        super().set_batch_geometry(micro_batch_size=micro_batch_size,
                                   grad_accum_steps=grad_accum_steps)
        for engine in self._engines if micro_batch_size else ():  # 'auto' chose after setup
            deepspeed_probe.follow_choice(engine, micro_batch_size, grad_accum_steps)

    def setup(self, model: nn.Module, optimizers: list[Optimizer]
              ) -> tuple[nn.Module, list[Optimizer]]:
        if self._engines:
            raise ConfigError("strategy='deepspeed' trains one model (one engine); set up one "
                              "model, or use strategy='fsdp' for several")
        if len(optimizers) != 1:
            raise ConfigError(
                f"strategy='deepspeed' needs exactly one optimizer over the model, set up in the "
                f"same acc.setup call; got {len(optimizers)}"
            )
        assert self.policy is not None
        config = deepspeed_config(
            stage=self.stage, grad_accum_steps=self.grad_accum_steps,
            micro_batch_size=self.micro_batch_size, dp_world_size=self.dp_world_size,
            policy=self.policy, loss_scale=self._fp16, user_config=self.user_config,
            hpz_partition_size=self.hpz_partition_size,
        )
        # accumix vouches for the element-wise optimizers DeepSpeed has not listed (SGD, ...);
        # any other runs only where the user's config accepts it.
        check_deepspeed(optimizers[0], self.user_config.get("zero_allow_untested_optimizer")
                        is True)
        config.setdefault("zero_allow_untested_optimizer", True)
        self._ensure_process_group()
        if self.hpz_partition_size is not None:  # DeepSpeed groups consecutive ranks
            check_groups_within_nodes(self.all_gather_object(self.launch.node_rank),
                                      self.hpz_partition_size,
                                      f"DeepSpeedStrategy(hpz={self.hpz!r}) partitions")
        skip_cpu_shm_build()
        # Read before the engine takes the optimizer over (ZeRO-3 re-points its groups at flat
        # partitions): a trainable parameter outside it has no fp32 master to save.
        trained = {id(p) for group in optimizers[0].param_groups for p in group["params"]}
        groups = deepspeed_state.group_fqns(model, optimizers[0])
        model = autocast_forward(model.to(self.device), self.policy, self.device)
        make_parameters_contiguous_(model)  # channels_last: DeepSpeed flattens parameters
        if self.policy.half_dtype is not None:
            float32_norm_forward(model)  # the engine stores them in half, beside fp32 buffers
        engine = initialize(model, optimizers[0], config, self.device,
                            vouched=is_elementwise(optimizers[0]))
        engine.set_gradient_accumulation_boundary(True)
        if self._distributed:
            agree_buffers_after_forward(engine, engine.module, self.broadcast)
        self._scale_updates[id(engine)] = defer_scale_update(engine.optimizer)
        self._engines.append(engine)
        self._engine_of[id(optimizers[0])] = engine
        self._trained[id(engine)] = trained
        self._groups[id(engine)] = groups
        return engine, optimizers

    def _ensure_process_group(self) -> None:
        self._owns_group |= ensure_process_group(self.device, self.launch.local_rank)

    def setup_late_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise ConfigError("strategy='deepspeed' builds the engine from the model and its "
                          "optimizer: set them up in the same acc.setup call")

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model) if model in self._engines else model

    def compile_module(self, model: nn.Module, compiler: Compiler) -> nn.Module:
        """Through the engine's ``compile()`` (``deepspeed_engine.compile_engine``)."""
        return compile_engine(self._engine(model), compiler)

    def _engine(self, model: nn.Module | None) -> Any:
        if model is not None and model in self._engines:
            return model
        if not self._engines:
            raise ConfigError("strategy='deepspeed': set up the model before the step")
        return self._engines[0]

    # -- the step ------------------------------------------------------------------------------
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return off_boundary(self._engine(model))

    def piece_sync(self, model: nn.Module | None, *, boundary: bool, last: bool
                   ) -> contextlib.AbstractContextManager[Any]:
        # The engine's boundary (stage 1's reduction, the partitions' copy-or-add) once per
        # window: only the last piece of a boundary micro-step is on it.
        if boundary and not last:
            return off_boundary(self._engine(model))
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, model: nn.Module | None) -> None:
        # The façade already divided by K (or the item hint); the engine adds only its fp16 scale.
        engine = self._engine(model)
        at_boundary = engine.is_gradient_accumulation_boundary()
        self._windows.check_backward(engine, at_boundary)
        engine.backward(loss, scale_wrt_gas=False)
        self._windows.backward_done(engine, at_boundary)

    def reduce_deferred_grads(self, model: nn.Module) -> None:
        refuse_deferred_reduction()

    def probe_units(self, model: nn.Module) -> list[nn.Module]:
        """The engine: its forward hook broadcasts BatchNorm buffers (ZeRO 1/2 forwards and the
        probe's backward do not communicate, ``deepspeed_probe``); stage 3 is refused."""
        deepspeed_probe.check_probeable(self.stage)
        return [self._engine(model)]

    def probe_mode(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return deepspeed_probe.module_forward(self._engine(model))

    def probe_settings(self) -> dict[str, Any]:
        # The user's config holds the bucket sizes, overlap_comm, contiguous_gradients, ...
        return {"stage": self.stage, "config": self.user_config, "hpz": self.hpz_partition_size}

    def probe_backward(self, loss: torch.Tensor, model: nn.Module | None) -> None:
        deepspeed_probe.probe_backward(loss, self._engine(model))

    def local_grads(self, params: Any = None) -> list[torch.Tensor]:
        """The gradient partitions this rank's engine holds after the window's last backward."""
        return [g for engine in self._engines for g in partition_grads(engine.optimizer)]

    def finalize_gradients(self, params: list[nn.Parameter], factor: float | torch.Tensor
                           ) -> torch.Tensor | None:
        rescale_grads_(self.local_grads(), factor, check_finite=False)
        return None  # the engine finds (and agrees on) an fp16 overflow inside its step

    def clip_grad_norm_(self, params: list[nn.Parameter], max_norm: float, norm_type: float
                        ) -> torch.Tensor:
        """The true norm of every gradient the engine holds (``params`` cannot pick a subset:
        the partitions are flat), from the still-scaled partitions; clips them in place."""
        return clip_partitions_(self.local_grads(), max_norm, norm_type, all_reduce=self.all_reduce,
                                loss_scale=self.loss_scale, device=self.device)

    def optimizer_step(self, optimizer: Optimizer, *, skip: bool, closure: Any = None) -> bool:
        if closure is not None:
            raise ConfigError("strategy='deepspeed' steps without a closure; call "
                              "optimizer.step() with no argument")
        # ``skip`` is always False here: finalize_gradients returns no overflow flag, the
        # engine decides inside its step (and must step anyway to move its loss scale).
        engine = self._engine_of.get(id(optimizer))
        engine = self._engine(None) if engine is None else engine
        self._windows.check_step(engine)
        try:
            engine.step()
            self._windows.step_done(engine)
            self._scale_updates[id(engine)]()
            if self.stage == 3:
                clear_stage3_grad_partitions(engine.optimizer)
        except Exception as exc:
            if "loss scale already at minimum" not in str(exc):
                raise
            raise LossScaleError(
                "fp16 gradients overflowed with DeepSpeed's loss scale at its floor "
                f"min_scale={engine.optimizer.loss_scale}: the model's values exceed fp16's "
                "range; train with precision='bf16-mixed' (or lower the learning rate)"
            ) from exc
        engine.set_gradient_accumulation_boundary(True)
        return bool(engine.was_step_applied())

    def zero_grad(self, optimizer: Optimizer, set_to_none: bool = True) -> None:
        """Nothing: the engine clears its gradients inside every step, applied or skipped.

        Raises:
            ConfigError: the window's gradients are to be discarded without a step (the loop
                skipped it): the engine keeps its reduced partitions until a step, and the
                next window would add to them.
        """
        self._windows.check_discard(self._engine_of.get(id(optimizer)))

    # -- state ---------------------------------------------------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The module's state dict with every trainable parameter as its full fp32 master
        weight (gathered across partitions: collective), buffers as the module holds them."""
        engine = self._engine(model)
        return deepspeed_state.full_state(engine, self._trained.get(id(engine), set()),
                                          self.stage)

    @property
    def checkpoint_format(self) -> str:
        return "dcp"

    def save_checkpoint(self, directory: str, models: list[nn.Module],
                        optimizers: list[Optimizer]) -> None:
        """The engine's module and optimizer as ``save_sharded`` writes a plain model and
        optimizer: full fp32 masters and Adam-style states per parameter name, the param
        groups' hyper-parameters (``deepspeed_state``). Collective."""
        for model, optimizer in zip(models, optimizers, strict=True):
            engine = self._engine(model)
            deepspeed_state.save(directory, engine, optimizer, self._groups[id(engine)],
                                 self._trained[id(engine)], self.stage)

    def checkpoint_state(self, models: list[nn.Module], optimizers: list[Optimizer]
                         ) -> dict[str, Any]:
        """The one engine's ``save_checkpoint`` state (gathered fp32 copies), for a background
        save to stage."""
        if len(models) != 1:
            raise ConfigError("save_state(background=True) with strategy='deepspeed' holds one "
                              f"model; this run set up {len(models)}: save with "
                              "background=False")
        engine = self._engine(models[0])
        return deepspeed_state.state(engine, optimizers[0], self._groups[id(engine)],
                                     self._trained[id(engine)], self.stage)

    def load_checkpoint(self, directory: str, models: list[nn.Module],
                        optimizers: list[Optimizer], *, strict: bool = True) -> None:
        """Reads a checkpoint of any strategy on the default format, saved on any world size,
        into the engine (``deepspeed_state``); ``strict`` as for the other strategies."""
        for model, optimizer in zip(models, optimizers, strict=True):
            engine = self._engine(model)
            deepspeed_state.load(directory, engine, optimizer, self._groups[id(engine)],
                                 self._trained[id(engine)], self.stage, strict=strict)
            engine.set_gradient_accumulation_boundary(True)

    def teardown(self) -> None:
        for engine in self._engines:
            with contextlib.suppress(Exception):
                engine.destroy()
        self._engines.clear()
        self._engine_of.clear()
        self._trained.clear()
        self._groups.clear()
        # Every engine's window state goes: a later engine may be given a destroyed one's id().
        self._windows = EngineWindows()
        self._scale_updates.clear()
        release_group_references()  # DeepSpeed's cached clone of the world group
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

