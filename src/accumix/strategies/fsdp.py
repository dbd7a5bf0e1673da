"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer states
sharded over the ranks, whole blocks all-gathered around their forward and backward."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.checkpoint import checkpoint

from accumix.errors import ConfigError
from accumix.memory.param_counts import repeated_blocks
from accumix.precision import LossScaler, Policy
from accumix.precision.policy import dtype_name
from accumix.precision.reduce_dtype import EffectiveDtypes
from accumix.runtime.env import LaunchEnv
from accumix.step.compile import Compiler
from accumix.strategies.base import Strategy, grad_mark
from accumix.strategies.fsdp_reduce import NarrowedReduction
from accumix.strategies.memory_format import make_parameters_contiguous_
from accumix.strategies.norm_layers import agree_buffers_after_forward, float32_norm_units
from accumix.strategies.sharded_lbfgs import adapt_lbfgs

SHARDINGS = ("full", "grad_op")
ParallelizeFn = Callable[[nn.Module, DeviceMesh], nn.Module]


class FSDPStrategy(Strategy):
    """FSDP2 over all ranks: ZeRO-3 (``"full"``) or ZeRO-2-like (``"grad_op"``) sharding.

    Each repeated block (the class that repeats, e.g. transformer layers) becomes one FSDP unit
    and the root holds the rest; its parameters are all-gathered in the compute dtype around the
    block's forward and backward, and its gradients reduce-scattered in ``reduce_dtype``. The
    optimizer the user built over the plain parameters is re-pointed to the sharded ones, so its
    states live on one shard per rank. The model is sharded in place: ``acc.unwrap(model)`` is
    the user's module, its parameters DTensor shards (``.full_tensor()`` gathers one), its
    ``state_dict`` keys unchanged; ``acc.save_model`` gathers the full state dict to rank 0.

    Accumulation: off the boundary, ``set_requires_gradient_sync(False)`` keeps each rank's
    gradients local and *unsharded* (the full model's gradients on every rank, summed in the
    stored parameters' dtype, float32 under the mixed precisions), and the boundary's backward
    reduce-scatters the window once: 1 gradient reduction per optimizer step, but gradient
    memory of DDP during the window. ``sync_each_microstep=True`` instead reduce-scatters every
    micro-step into the sharded gradients: only 1/W of the gradients stay between micro-steps
    (the memory ZeRO-2/3 promise), for K times the gradient traffic. Both give the same result
    in float32; with a 16-bit ``reduce_dtype`` the first rounds on the wire once per optimizer
    step, ``sync_each_microstep`` K times (the shards still sum in float32).

    Reduction: in the policy's ``reduce_dtype`` (``Accelerator(reduce_dtype=)``). One narrower
    than the stored parameters (bf16 or fp16 under the mixed precisions) is cast from the
    window's float32 sum at the reduction only, pre-divided by the world (``fsdp_reduce``).

    On one process nothing is sharded (the model trains as with ``"single"``).

    Args:
        sharding: ``"full"`` reshards parameters after each unit's forward and gathers them again
            for its backward (least memory); ``"grad_op"`` keeps them gathered from forward to
            backward (one all-gather per unit per micro-step instead of two).
        wrap: module classes to make FSDP units (e.g. ``[TransformerBlock]``); None finds the
            repeated blocks (``accumix.memory.param_counts.repeated_blocks``). The root is always a
            unit.
        parallelize_fn: ``fn(model, mesh) -> model`` applying ``fully_shard`` itself
            (torchtitan style), instead of ``wrap``; mixed precision is then its own business.
        reduce_dtype: dtype of the gradient reduce-scatter; None takes the precision policy's
            (``Accelerator(reduce_dtype=)``; else float32, bfloat16 for ``"bf16-true"``).
            Given here and to the Accelerator, they must agree.
        sync_each_microstep: reduce-scatter on every micro-step (see above).
        activation_checkpointing: recompute each wrapped block's activations in backward
            (``torch.utils.checkpoint``, non-reentrant) instead of storing them.

    Raises:
        ConfigError: an unknown sharding, a ``wrap`` that is not a list of module classes, both
            ``wrap`` and ``parallelize_fn``, or a ``reduce_dtype`` that is not a torch dtype.
    """

    name = "fsdp"
    honours_reduce_dtype = True
    forward_collectives = True  # each unit's parameters are all-gathered in its forward

    def __init__(
        self,
        *,
        sharding: str = "full",
        wrap: list[type[nn.Module]] | None = None,
        parallelize_fn: ParallelizeFn | None = None,
        reduce_dtype: torch.dtype | None = None,
        sync_each_microstep: bool = False,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        if sharding not in SHARDINGS:
            raise ConfigError(f"FSDPStrategy(sharding={sharding!r}) is invalid; use 'full' or "
                              "'grad_op'")
        if wrap is not None and not (
            isinstance(wrap, (list, tuple))
            and all(isinstance(c, type) and issubclass(c, nn.Module) for c in wrap)
        ):
            raise ConfigError(f"FSDPStrategy(wrap={wrap!r}) is invalid; use a list of nn.Module "
                              "classes, e.g. [MyBlock], or None to find the repeated blocks")
        if wrap is not None and parallelize_fn is not None:
            raise ConfigError("FSDPStrategy got both wrap= and parallelize_fn=; give one: "
                              "parallelize_fn applies fully_shard itself")
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise ConfigError(f"FSDPStrategy(parallelize_fn={parallelize_fn!r}) is not callable; "
                              "pass fn(model, mesh) -> model")
        if reduce_dtype is not None and not isinstance(reduce_dtype, torch.dtype):
            raise ConfigError(f"FSDPStrategy(reduce_dtype={reduce_dtype!r}) is invalid; use a "
                              "torch dtype such as torch.float32, or None")
        self.sharding = sharding
        self.wrap = tuple(wrap) if wrap is not None else None
        self.parallelize_fn = parallelize_fn
        self.reduce_dtype = reduce_dtype
        self.sync_each_microstep = sync_each_microstep
        self.activation_checkpointing = activation_checkpointing
        self.mesh: DeviceMesh | None = None
        self._units: dict[int, list[FSDPModule]] = {}  # id(root) -> its FSDP units
        self._narrowed: dict[int, NarrowedReduction] = {}  # id(root) -> its narrower wire

    def connect(self, *, launch: LaunchEnv, device: torch.device, policy: Policy,
                scaler: LossScaler) -> None:
        # FSDPStrategy(reduce_dtype=) is the policy's reduce dtype from here on (the façade
        # refuses one that contradicts its own reduce_dtype=).
        if self.reduce_dtype is not None:
            policy = dataclasses.replace(policy, reduce_dtype=self.reduce_dtype)
        super().connect(launch=launch, device=device, policy=policy, scaler=scaler)

    def effective_dtypes(self) -> EffectiveDtypes:
        """Stored and stepped in ``param_dtype``, gathered for compute in ``compute_dtype``; the
        window summed in the accumulation dtype (``_accumulation_dtype``), or in the sharded
        gradients (``param_dtype``) under ``sync_each_microstep``, which reduces K times."""
        dtypes = super().effective_dtypes()
        if self.sync_each_microstep and self.world_size > 1:
            return dataclasses.replace(dtypes, reductions="every micro-step: sync_each_microstep")
        return dataclasses.replace(dtypes, accumulation=dtype_name(self._accumulation_dtype()))

    def _accumulation_dtype(self) -> torch.dtype:
        """What FSDP2 sums a unit's unsharded gradients in between reductions: its policy's
        ``reduce_dtype``, or the gradients' own (the gathered ``compute_dtype``) where equal.
        The wider of the stored and the reduce dtype: float32 under the mixed precisions
        whatever the wire (a narrower wire is cast at the reduction only, ``fsdp_reduce``)."""
        assert self.policy is not None
        stored, wire = self.policy.param_dtype, self.policy.reduce_dtype
        return stored if _itemsize(wire) < _itemsize(stored) else wire

    # -- setup -------------------------------------------------------------------------------
    def setup(
        self, model: nn.Module, optimizers: list[Optimizer]
    ) -> tuple[nn.Module, list[Optimizer]]:
        if not self._distributed:
            return self.prepare_module(model), optimizers
        assert self.policy is not None
        names = {id(p): name for name, p in model.named_parameters()}
        model = model.to(device=self.device)
        if self.policy.param_dtype != torch.float32:
            model = model.to(dtype=self.policy.param_dtype)  # bf16-true: stored in bf16
        make_parameters_contiguous_(model)  # channels_last: FSDP2 shards contiguous tensors
        blocks = self._blocks(model)
        if self.activation_checkpointing:
            for block in blocks:
                _checkpoint_forward(block)
        self.mesh = self.device_mesh()
        if self.parallelize_fn is not None:
            model = self.parallelize_fn(model, self.mesh)
        else:
            model = self._shard(model, blocks)
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if not units:
            raise ConfigError("parallelize_fn returned a model without any fully_shard unit; "
                              "call fully_shard(module, mesh=mesh) inside it")
        assert self.policy is not None
        if self._accumulation_dtype() != self.policy.reduce_dtype:  # a narrower wire
            self._narrowed[id(model)] = NarrowedReduction(
                model, units, self.policy.reduce_dtype, self._accumulation_dtype(),
                self.dp_world_size)
        self._units[id(model)] = units
        agree_buffers_after_forward(model, model, self.broadcast)
        new_params = dict(model.named_parameters())
        for optimizer in optimizers:
            _repoint(optimizer, names, new_params)
            adapt_lbfgs(optimizer)
        return model, optimizers

    def setup_late_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """An optimizer built over the sharded parameters: L-BFGS made exact over them."""
        return adapt_lbfgs(optimizer) if self._distributed else optimizer

    def device_mesh(self) -> DeviceMesh:
        """The mesh ``fully_shard`` shards over (collective): every rank in one dimension. A
        subclass with more dimensions (hsdp's replicate x shard) overrides it."""
        return init_device_mesh(self.device.type, (self.world_size,))

    def _blocks(self, model: nn.Module) -> list[nn.Module]:
        if self.wrap is None:
            blocks = repeated_blocks(model)
        else:
            blocks = [m for m in model.modules() if isinstance(m, self.wrap) and m is not model]
        # A parameter tied across units (an embedding shared with the output head) must live in
        # one unit: such a block stays in the root, which holds both ends.
        return [b for b in blocks if not _tied_outside(model, b)]

    def _shard(self, model: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        assert self.policy is not None
        policy = self.policy
        # Gathered in the compute dtype; a unit whose stored dtype is already that casts nothing
        # but still casts floating inputs to it (bf16-true takes float32 batches).
        param_dtype = policy.compute_dtype
        # The window is summed in this dtype; a narrower reduce dtype is applied to the
        # reduction alone afterwards (setup, fsdp_reduce).
        reduce_dtype = self._accumulation_dtype()
        # Only the root casts its outputs back (to float32 for the loss); blocks hand the compute
        # dtype to each other without a round trip.
        inner = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        outer = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                     output_dtype=policy.output_dtype)
        reshard = self.sharding == "full"
        # A norm layer with float32 running statistics keeps float32 weights under a half
        # compute dtype (as under DDP autocast; bf16 weights beside float32 statistics are an
        # error in torch): its own unit, gathered in float32, its bf16 input left as it comes.
        norms = {id(m) for m in float32_norm_units(model)} if (
            param_dtype != policy.param_dtype) else set()
        norm_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                           cast_forward_inputs=False)
        # fully_shard goes bottom-up: a unit's parameters exclude those of units inside it.
        ids = {id(b) for b in blocks}
        for module in reversed(list(model.modules())):
            if id(module) in norms:
                fully_shard(module, mesh=self.mesh, reshard_after_forward=reshard,
                            mp_policy=norm_policy)
            elif id(module) in ids:
                fully_shard(module, mesh=self.mesh, reshard_after_forward=reshard,
                            mp_policy=inner)
        fully_shard(model, mesh=self.mesh, reshard_after_forward=reshard, mp_policy=outer)
        return model

    def compile_module(self, model: nn.Module, compiler: Compiler) -> nn.Module:
        """Each FSDP unit below the root compiled on its own (torchtitan's per-block compile, as
        torch recommends for FSDP2): the units' all-gather and reduce-scatter hooks run around
        the compiled blocks, and identical blocks share one graph. A model without such units
        (or on one process) is compiled whole."""
        blocks = [u for u in self._units.get(id(model), []) if u is not model]
        if not blocks:
            return compiler.compile_in_place(model)
        for block in blocks:
            compiler.compile_in_place(block)
        return model

    # -- the step ------------------------------------------------------------------------------
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        units = self._units.get(id(model))
        if not units or self.sync_each_microstep:
            return contextlib.nullcontext()
        return _gradient_sync_off(units)

    def probe_settings(self) -> dict[str, Any]:
        return {"sharding": self.sharding, "reduce_dtype": str(self.reduce_dtype),
                "sync_each_microstep": self.sync_each_microstep,
                "activation_checkpointing": self.activation_checkpointing,
                "wrap": [c.__qualname__ for c in self.wrap or ()]}

    def probe_units(self, model: nn.Module) -> list[nn.Module]:
        """Every FSDP unit: each all-gathers before its forward and its backward."""
        return [m for m in model.modules() if isinstance(m, FSDPModule)] or [model]

    def clear_gradients(self, model: nn.Module) -> None:
        """Also the unsharded gradients FSDP2 keeps off the boundary (on its unsharded
        parameters, or upcast beside them), which a later boundary would reduce; and FSDP2's
        per-iteration state after a probe an error stopped mid-forward or mid-backward
        (``reset_iter_state``: reshards, forgets the forward order; no collective), on a root
        whose forward has run."""
        super().clear_gradients(model)
        for unit in self.probe_units(model):
            if not isinstance(unit, FSDPModule):
                continue
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    fp.unsharded_accumulated_grad = None
                    if hasattr(fp, "_unsharded_param"):
                        fp._unsharded_param.grad = None
        # Only a root whose forward ran has iteration state (lazily made at its first
        # forward): a probe stopped inside another model never ran this one, and resetting it
        # raised FSDP's AttributeError (no all_gather_state).
        if isinstance(model, FSDPModule) and model._get_fsdp_state()._is_root:
            model.reset_iter_state()

    def reduce_deferred_grads(self, model: nn.Module) -> None:
        # Off the boundary FSDP2 keeps the window in unsharded gradients that only a backward
        # with sync on reduce-scatters into the shards the optimizer steps.
        if self._units.get(id(model)) and not self.sync_each_microstep:
            raise ConfigError(
                "strategy='fsdp' reduces gradients only inside a backward, and a model's last "
                "backward of this window ran on an earlier micro-step with gradient sync off; "
                "run a backward through every trained model on each window's last micro-step "
                "(a zero loss works), or use FSDPStrategy(sync_each_microstep=True)"
            )

    def grad_marks(self, params: list[nn.Parameter]) -> list[Any]:
        # Off the boundary FSDP2 accumulates into the *unsharded* parameters' gradients (or an
        # upcast copy of them), and the sharded ones the optimizer holds change only at the
        # boundary's reduce-scatter: a backward is seen wherever it landed.
        owners = {id(fp.sharded_param): fp for units in self._units.values() for unit in units
                  for group in unit._get_fsdp_state()._fsdp_param_groups
                  for fp in group.fsdp_params}
        marks = []
        for p in params:
            grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            fp = owners.get(id(p))
            if fp is None:
                marks.append(grad_mark(grad))
                continue
            unsharded = getattr(fp, "_unsharded_param", None)
            marks.append((*grad_mark(grad),
                          *grad_mark(None if unsharded is None else unsharded.grad),
                          *grad_mark(fp.unsharded_accumulated_grad)))
        return marks

    def local_grads(self, params: Any) -> list[torch.Tensor]:
        # The rank's own shard: a DTensor's local tensor shares its storage, so rescaling it in
        # place rescales the sharded gradient.
        return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                for p in params if p.grad is not None]

    def reduce_found_inf(self, found_inf: torch.Tensor) -> torch.Tensor:
        # Each rank checked only its shard: an overflow one rank sees must skip every rank.
        return self.all_reduce(found_inf, "max")

    def clip_grad_norm_(
        self, params: list[nn.Parameter], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        if math.isinf(norm_type):
            return self._clip_inf_norm(params, max_norm)
        # torch sums the shards' norms over the mesh for DTensor gradients; the result is a
        # replicated DTensor, returned as the plain tensor users expect.
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def _clip_inf_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """The infinity norm from the local shards, the max agreed over the ranks.

        FSDP2 gives a rank an empty shard of every parameter whose dim 0 is smaller than the
        world (a ``Linear(16, 1)`` bias on 2 ranks), and torch's ``_foreach_norm`` refuses the
        infinity norm of an empty tensor on that rank alone (the others then wait in the
        all-reduce forever); empty shards hold no maximum, so they are left out.
        """
        grads = [g for g in self.local_grads(params) if g.numel()]
        if grads:
            local = torch.stack([g.detach().abs().amax().float() for g in grads]).amax()
        else:
            local = torch.zeros((), device=self.device)
        total = self.all_reduce(local.reshape(1), "max")[0]
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's clip coefficient
        if grads:
            torch._foreach_mul_(grads, coef)
        return total

    # -- state ---------------------------------------------------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if not self._units.get(id(model)):
            return super().full_state_dict(model)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)  # complete on rank 0, empty elsewhere


@contextlib.contextmanager
def _gradient_sync_off(units: list[FSDPModule]) -> Iterator[None]:
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _tied_outside(model: nn.Module, block: nn.Module) -> bool:
    inside = {id(m) for m in block.modules()}
    mine = {id(p) for p in block.parameters()}
    return any(id(p) in mine for m in model.modules() if id(m) not in inside
               for p in m.parameters(recurse=False))


def _repoint(optimizer: Optimizer, names: dict[int, str], params: dict[str, nn.Parameter]
             ) -> None:
    """Points an optimizer built over the plain parameters at the sharded ones, by name."""
    if optimizer.state:
        raise ConfigError(f"{type(optimizer).__name__} already holds state; set it up with its "
                          "model before its first step")
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if names.get(id(p)) not in params]
        if missing:
            raise ConfigError(f"{type(optimizer).__name__} holds {len(missing)} parameter(s) "
                              "that are not the model's; build it over model.parameters()")
        # In place: an optimizer may hold the list itself (LBFGS's ``_params`` is its first
        # group's list), and a new list left it stepping the replaced plain parameters, whose
        # gradients never come (LBFGS then saw a zero gradient and stopped at once).
        group["params"][:] = [params[names[id(p)]] for p in group["params"]]


def _checkpoint_forward(module: nn.Module) -> None:
    """Recomputes ``module``'s forward in backward. The instance's ``forward`` is replaced, so
    parameter names (and state_dict keys) stay the user's, unlike a wrapper module."""
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    module.forward = forward  # type: ignore[method-assign]
