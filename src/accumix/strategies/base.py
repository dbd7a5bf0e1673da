"""The Strategy interface: the only place where backends differ.

A strategy owns the whole step lifecycle of its backend: how a model and its optimizers are
prepared, how a micro-step keeps gradients local, backward, the boundary's gradient pass, the
overflow agreement, clipping, the optimizer step, state dicts and the collectives. The
Accelerator calls these in the canonical order and never asks which backend it has.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from accumix.errors import ConfigError
from accumix.precision import LossScaler, NoLossScale, Policy
from accumix.precision.autocast import autocast_forward
from accumix.precision.policy import dtype_name
from accumix.precision.reduce_dtype import EffectiveDtypes, check_fp16_reduction
from accumix.runtime.env import LaunchEnv
from accumix.step.accumulation import rescale_grads_
from accumix.step.compile import Compiler
from accumix.strategies.norm_layers import broadcast_buffers_

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Strategy:
    """One backend behind one interface. Subclasses override what their engine does differently.

    The defaults describe a replicated model on one process group: gradients equal on every rank
    after backward (so the overflow flag needs no agreement), ``torch.nn.utils`` clipping and a
    plain ``optimizer.step()``. The collectives use ``torch.distributed`` when a group exists and
    are identities in a single process.
    """

    name = "base"
    # Whether the strategy communicates gradients in ``policy.reduce_dtype`` whatever their own
    # dtype. One that does not reduces them as they are (in the parameters' dtype): another
    # reduce dtype is refused at ``connect``, never silently ignored.
    honours_reduce_dtype = False
    # Whether the model's forward runs collectives (parameters gathered where they are used):
    # then every rank must run as many forwards, in an evaluation loop too.
    forward_collectives = False

    def __init__(self) -> None:
        self.launch = LaunchEnv()
        self.device = torch.device("cpu")
        self.policy: Policy | None = None
        self.scaler: LossScaler = NoLossScale()
        self.micro_batch_size: int | None = None
        self.grad_accum_steps = 1

    def connect(
        self, *, launch: LaunchEnv, device: torch.device, policy: Policy, scaler: LossScaler
    ) -> None:
        """Called once by the Accelerator, before any ``setup``.

        Raises:
            ConfigError: the policy's ``reduce_dtype`` is one this strategy cannot reduce in.
        """
        self.launch, self.device, self.policy, self.scaler = launch, device, policy, scaler
        self.check_reduce_dtype()

    def check_reduce_dtype(self) -> None:
        """Refuses a ``reduce_dtype`` the strategy would ignore (one process reduces nothing),
        and fp16 on the wire where no loss scale runs.

        Raises:
            ConfigError: the gradients would travel in another dtype than the one asked for,
                or could overflow fp16 with nothing to recover.
        """
        policy = self.policy
        assert policy is not None
        check_fp16_reduction(dtype_name(policy.reduce_dtype),
                             loss_scaled=policy.needs_loss_scaling, precision=policy.name)
        if (self.world_size > 1 and not self.honours_reduce_dtype
                and policy.reduce_dtype != policy.param_dtype):
            raise ConfigError(
                f"strategy {self.name!r} reduces gradients in their own dtype "
                f"({dtype_name(policy.param_dtype)}), not reduce_dtype="
                f"{dtype_name(policy.reduce_dtype)!r}; use reduce_dtype=None, or strategy "
                "'ddp', 'zero1', 'fsdp' or 'deepspeed'")

    def effective_dtypes(self) -> EffectiveDtypes:
        """The dtypes this strategy really uses under its policy (the startup line, trackers).

        The replicated default: parameters stored and stepped in ``param_dtype``, gradients
        summed by autograd in it during the window, reduced in ``reduce_dtype`` once per window.
        """
        policy = self.policy
        assert policy is not None
        params = dtype_name(policy.param_dtype)
        return EffectiveDtypes(
            params=params, compute=dtype_name(policy.compute_dtype), accumulation=params,
            reduction=dtype_name(policy.reduce_dtype) if self.world_size > 1 else "none",
            masters=params)

    # -- world -------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """The number of processes in the job."""
        return self.launch.world_size

    @property
    def rank(self) -> int:
        """This process's rank in the job."""
        return self.launch.rank

    @property
    def dp_world_size(self) -> int:
        """Ranks that each see different data (all of them, for the data-parallel backends)."""
        return self.launch.world_size

    @property
    def grad_divisor(self) -> int:
        """How many ranks the backend averages gradients over (undone for item-weighted losses)."""
        return self.dp_world_size

    @property
    def loss_scale(self) -> float | None:
        """The fp16 loss scale in use, or None. An engine that scales the loss itself
        (DeepSpeed) reports its own scale here while ``scaler.scale`` stays 1 for the façade."""
        return self.scaler.scale if self.scaler.enabled else None

    # -- setup -------------------------------------------------------------------------------
    def set_batch_geometry(self, *, micro_batch_size: int | None, grad_accum_steps: int) -> None:
        """Told by the Accelerator right before each ``setup``: samples per forward on one rank
        (None when not known yet) and micro-steps per window. Engines configured with them
        (DeepSpeed's config) read them; the others need nothing."""
        self.micro_batch_size, self.grad_accum_steps = micro_batch_size, grad_accum_steps

    def setup(
        self, model: nn.Module, optimizers: list[Optimizer]
    ) -> tuple[nn.Module, list[Optimizer]]:
        """Moves ``model`` to the device in the policy's form and wraps it for the backend.

        Args:
            model: the user's plain module.
            optimizers: the optimizers over its parameters, created by the user beforehand.

        Returns:
            The model to train (possibly a wrapper) and the optimizers to step.
        """
        return self.prepare_module(model), optimizers

    def setup_late_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """An optimizer set up after its model (replicated backends need nothing)."""
        return optimizer

    def prepare_module(self, model: nn.Module) -> nn.Module:
        """The replicated-model precision form: parameters in ``param_dtype``, autocast forward."""
        assert self.policy is not None
        model = model.to(device=self.device)
        if self.policy.param_dtype != torch.float32:
            model = model.to(dtype=self.policy.param_dtype)
        return autocast_forward(model, self.policy, self.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper ``setup`` returned."""
        return model

    def compile_module(self, model: nn.Module, compiler: Compiler) -> nn.Module:
        """Compiles what runs, in place, after ``setup`` wrapped or sharded the model (Fabric's
        order); the default compiles the whole model. A backend whose wrapper must stay eager
        (DDP: its ``no_sync`` branch) or whose units compile one by one (FSDP2) overrides it.

        Returns:
            The model to train (the same object).
        """
        return compiler.compile_in_place(model)

    # -- the step ------------------------------------------------------------------------------
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context of an off-boundary micro-step: no gradient communication."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, model: nn.Module | None) -> None:
        """Backward of an already multiplied (scaled, divided) loss."""
        loss.backward()

    def piece_sync(self, model: nn.Module | None, *, boundary: bool, last: bool
                   ) -> contextlib.AbstractContextManager[Any]:
        """Gradient communication for one piece of a micro-step that ``oom_split`` cut after an
        out-of-memory error (every rank runs the same pieces). The default keeps the
        micro-step's own: none off the boundary; at the boundary each piece reduces, which adds
        up (DDP re-averages gradients already equal on every rank; FSDP adds each piece's
        reduce-scatter into the sharded gradient). A backend that must reduce once per window
        returns its off-boundary context unless ``last``."""
        return contextlib.nullcontext()

    def probe_units(self, model: nn.Module) -> list[nn.Module]:
        """The modules whose forward or backward may communicate: ``micro_batch_size="auto"``
        agrees across ranks before each (``micro_batch_probe``), so a rank that runs out of
        memory never leaves another inside a collective. Default: the set-up model itself."""
        return [model]

    def probe_mode(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """How ``micro_batch_size="auto"`` runs its probe micro-step on ``model``: with no
        gradient communication in the backward. Default: ``no_sync``."""
        return self.no_sync(model)

    def probe_backward(self, loss: torch.Tensor, model: nn.Module | None) -> None:
        """The probe's backward (inside ``probe_mode``): no collective. Default: ``backward``."""
        self.backward(loss, model)

    def probe_settings(self) -> dict[str, Any]:
        """This strategy's settings that change a micro-step's memory (bucket sizes, sharding,
        activation checkpointing): ``micro_batch_size="auto"`` keys its cached answer by them,
        so a restart with other settings probes again. Default: none."""
        return {}

    def state_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The optimizer that holds this rank's states, stepped without communicating (what
        ``micro_batch_size="auto"`` copies to measure them): the stepped one itself here."""
        return optimizer

    def clear_gradients(self, model: nn.Module) -> None:
        """Drops every gradient a backward without gradient communication left on ``model``
        (the probe's): afterwards the next backward starts from nothing."""
        for param in model.parameters():
            param.grad = None

    def reduce_deferred_grads(self, model: nn.Module) -> None:
        """The boundary's reduction for a model whose window's last backward ran under
        ``no_sync(model)`` (a model unused on the boundary micro-step): its gradients are still
        each rank's own, and must not be stepped so. Called once per such model and window,
        before the boundary pass; collective. Backends without deferred communication need
        nothing; one that cannot reduce outside a backward raises ``ConfigError`` saying what
        works instead.
        """

    def backward_reduced(self, model: nn.Module | None) -> bool:
        """Whether the last backward that reached ``model`` with its gradient sync on left its
        gradients reduced over the ranks. Read after each backward on the optimizers it reached;
        False makes the boundary reduce the model once (``reduce_deferred_grads``) before
        anything reads its gradients. Backends that reduce in every synced backward (or never
        reduce) answer True; DDP's reducer reduces once per forward, so a second backward
        through one forward's graph is left local (two forwards of a GAN's discriminator, then
        two backward calls).
        """
        return True

    def local_grads(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        """The gradient tensors this rank holds (its shards, for sharded backends)."""
        return [p.grad for p in params if p.grad is not None]

    def grad_marks(self, params: list[nn.Parameter]) -> list[Any]:
        """A token per parameter that changes when a backward adds to its gradient: the
        gradient and its version counter (autograd accumulates in place, or sets a new one).
        Read before and after a backward when several optimizers are set up, to know which of
        them it reached; a backend keeping gradients elsewhere during the window overrides it."""
        return [grad_mark(p.grad) for p in params]

    def finalize_gradients(
        self, params: list[nn.Parameter], factor: float | torch.Tensor
    ) -> torch.Tensor | None:
        """The boundary pass: multiply by ``factor`` and, under fp16, find non-finite values.

        Returns:
            The overflow flag as agreed by all ranks (a tensor), or None without a loss scaler.
        """
        found_inf = rescale_grads_(self.local_grads(params), factor, self.scaler.enabled)
        return None if found_inf is None else self.reduce_found_inf(found_inf)

    def reduce_found_inf(self, found_inf: torch.Tensor) -> torch.Tensor:
        """Makes the overflow decision the same on every rank. Replicated gradients agree
        already; sharded backends all-reduce (fairscale PR #179's lesson)."""
        return found_inf

    def clip_grad_norm_(
        self, params: list[nn.Parameter], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        """Clips the (unscaled, normalised) gradients; returns the total norm over all ranks."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def optimizer_step(self, optimizer: Optimizer, *, skip: bool, closure: Any = None) -> bool:
        """Steps the optimizer unless ``skip``; returns whether it stepped."""
        if skip:
            return False
        optimizer.step() if closure is None else optimizer.step(closure)
        return True

    def zero_grad(self, optimizer: Optimizer, set_to_none: bool = True) -> None:
        """Clears ``optimizer``'s gradients at the window's end (DeepSpeed's engine clears
        its own inside its step)."""
        optimizer.zero_grad(set_to_none=set_to_none)

    # -- state ---------------------------------------------------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The unwrapped model's full state dict, complete on rank 0 (collective)."""
        return self.unwrap(model).state_dict()

    def save_checkpoint(
        self, directory: str, models: list[nn.Module], optimizers: list[Optimizer]
    ) -> None:
        """Writes the models' and optimizers' state into ``directory`` (collective).

        The default uses ``torch.distributed.checkpoint`` on ``get_state_dict`` (sharded where
        the backend shards, so it reshards on load). Backends whose state it cannot read
        (ZeroRedundancyOptimizer, DeepSpeed's engine) override both checkpoint methods.
        """
        from accumix.checkpoint.dcp_state import write  # DCP's import costs ~1 s: when used

        write(self.checkpoint_state(models, optimizers), directory)

    def checkpoint_state(self, models: list[nn.Module], optimizers: list[Optimizer]
                         ) -> dict[str, Any]:
        """The state dict ``save_checkpoint`` writes, of live tensors (collective): what a
        background save copies to host memory before the loop goes on. The default:
        ``get_state_dict`` of every model and its optimizers (``dcp_state.state_of``)."""
        from accumix.checkpoint.dcp_state import state_of

        if self._distributed:
            # DCP writes a replicated buffer from whichever rank its de-duplication picks;
            # the buffers that count are rank 0's (DDP broadcasts them at each forward).
            for model in models:
                broadcast_buffers_(self.unwrap(model), self.broadcast)
        return state_of(models, optimizers)

    def load_checkpoint(
        self, directory: str, models: list[nn.Module], optimizers: list[Optimizer], *,
        strict: bool = True,
    ) -> None:
        """Reads what ``save_checkpoint`` wrote into the set-up models and optimizers, in place
        (collective); the world size may differ from the saving run's. ``strict``: the models'
        keys must be the checkpoint's (False: load the keys both have)."""
        from accumix.checkpoint.dcp_state import load_sharded

        load_sharded(directory, models, optimizers, strict=strict)

    @property
    def checkpoint_format(self) -> str:
        """Which ``save_checkpoint`` wrote a checkpoint; a load needs the same one. Strategies on
        the default hooks share ``"dcp"`` (a ddp checkpoint loads into fsdp or one process);
        one that overrides the hooks gets its own name unless it sets this."""
        if type(self).save_checkpoint is Strategy.save_checkpoint:
            return "dcp"
        return self.name

    # -- collectives ---------------------------------------------------------------------------
    @property
    def _distributed(self) -> bool:
        return self.world_size > 1 and dist.is_initialized()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduces ``tensor`` in place over all ranks with ``op`` in sum|mean|max|min."""
        if op not in (*_REDUCE_OPS, "mean"):
            raise ConfigError(f"unknown reduce op {op!r}; use 'sum', 'mean', 'max' or 'min'")
        if self._distributed:
            dist.all_reduce(tensor, op=_REDUCE_OPS["sum" if op == "mean" else op])
            if op == "mean":
                tensor /= self.world_size
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on each), in rank order."""
        if not self._distributed:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor.contiguous())
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order (collective)."""
        if not self._distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``tensor`` as rank ``src`` holds it, in place on every rank (collective)."""
        if self._distributed:
            dist.broadcast(tensor, src=src)
        return tensor

    def barrier(self) -> None:
        """Waits until every rank has called it (collective)."""
        if self._distributed:
            dist.barrier()

    def teardown(self) -> None:
        """Releases what the backend holds; the process group is the Accelerator's."""


def grad_mark(grad: torch.Tensor | None) -> tuple[Any, int]:
    """A gradient's identity and version counter: one of them changes when a backward adds to
    it (autograd accumulates in place, or sets a new tensor where there was none)."""
    return (None, 0) if grad is None else (grad, grad._version)


def params_of(optimizers: Iterable[Optimizer]) -> Iterator[nn.Parameter]:
    """Each parameter of the optimizers once, in order."""
    seen: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p
