"""Strategies on a device mesh: where params, optimizer state and gradients live.

One mesh axis, ``"data"``, over every device of every process (hsdp: two). Each strategy is a
placement rule plus the one gradient reduction it makes per window, inside the step's
``shard_map`` (JAX's own collectives; accumix writes none), in the policy's ``reduce_dtype``
(``accumix.jax.wire``):

    strategy   params        optimizer state   gradient reduction (once, after the scan)
    single     one device    one device        none (a 1-device mesh)
    ddp        replicated    replicated        psum
    zero1      replicated    sharded           psum; the sharded update is GSPMD's
    fsdp       sharded       sharded           psum_scatter to the param's shard
    hsdp       sharded on    sharded on        psum_scatter over "fsdp", psum over "replica"
               "fsdp"        "fsdp"            (``accumix.jax.hsdp``: a 2-axis mesh)

Sharded means split on the largest dimension that the device count divides; a leaf with no such
dimension (a bias of 1, a scalar) stays replicated and is psum'd.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from accumix.errors import ConfigError
from accumix.jax.gather import gather_at_use, gather_leading, into_accumulators
from accumix.jax.ordering import after
from accumix.jax.per_use import Leaf, call_at_use
from accumix.jax.trainable import accum_dtype
from accumix.jax.wire import FLOAT32, Wire

AXIS = "data"
STRATEGY_WORDS = ("single", "ddp", "zero1", "fsdp", "hsdp", "auto")


def shard_dim(shape: tuple[int, ...], num_devices: int) -> int | None:
    """The largest dimension of ``shape`` that ``num_devices`` divides (first on ties), or None."""
    if num_devices == 1:
        return None
    best = None
    for dim, size in enumerate(shape):
        if size % num_devices == 0 and size >= num_devices and (
                best is None or size > shape[best]):
            best = dim
    return best


class JaxStrategy:
    """Placement of the state on the mesh, and the window's gradient reduction.

    Subclasses set ``name`` and the two flags. The mesh spans all devices of all processes and
    is built at its first use (``acc.setup``, after ``jax.distributed`` has started), never in
    the constructor: a strategy object made before the ``Accelerator`` works under ``accumix
    launch``. The rows of a window split over ``data_axes``; sharded leaves split, gather and
    reduce-scatter over ``shard_axis`` (one axis, ``"data"``, for every strategy here).

    Args:
        devices: the mesh's devices (default: every device of every process).
    """

    name = "ddp"
    shards_params = False
    shards_optimizer = False
    data_axes: tuple[str, ...] = (AXIS,)
    shard_axis = AXIS

    def __init__(self, devices: list[Any] | None = None) -> None:
        self._devices = None if devices is None else list(devices)
        self._mesh: Mesh | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def default_devices(self) -> list[Any]:
        """The mesh's devices when none were given: every device of every process."""
        return list(jax.devices())

    @property
    def mesh(self) -> Mesh:
        """The device mesh, built on first use (JAX must know its processes by then)."""
        if self._mesh is None:
            devices = self.default_devices() if self._devices is None else self._devices
            self._mesh = self.build_mesh(devices)
        return self._mesh

    def build_mesh(self, devices: list[Any]) -> Mesh:
        """The mesh over ``devices``: one axis, ``"data"`` (``AxisType.Auto``: JAX.md)."""
        return Mesh(np.array(devices), (AXIS,), axis_types=(AxisType.Auto,))

    @property
    def num_devices(self) -> int:
        """Devices in the mesh."""
        return int(self.mesh.size)

    def sharding(self, spec: P) -> NamedSharding:
        """``spec`` on this strategy's mesh."""
        return NamedSharding(self.mesh, spec)

    def rows_spec(self, leading: int = 0) -> P:
        """The spec of an array whose axis ``leading`` holds the rows (split over the data
        axes); axes before it are whole."""
        axes = self.data_axes[0] if len(self.data_axes) == 1 else self.data_axes
        return P(*([None] * leading), axes)

    # -- placement -------------------------------------------------------------------------
    def param_spec(self, leaf: Any) -> P:
        """How a parameter leaf is placed: sharded on its largest dimension the device count
        divides where the strategy shards parameters, else replicated."""
        shape = tuple(getattr(leaf, "shape", ()))
        return self._sharded(shape) if self.shards_params else P()

    def opt_spec(self, leaf: Any) -> P:
        """How an optimizer-state leaf is placed (sharded under zero1, fsdp and hsdp)."""
        shape = tuple(getattr(leaf, "shape", ()))
        return self._sharded(shape) if self.shards_optimizer else P()

    def _sharded(self, shape: tuple[int, ...]) -> P:
        dim = shard_dim(shape, self.mesh.shape[self.shard_axis])
        if dim is None:
            return P()
        return P(*([None] * dim + [self.shard_axis]))

    # -- inside the step's shard_map (per device) -----------------------------------------
    # A micro-step differentiates ``grad_target(local)`` and hands ``loss_fn``
    # ``params_at_use(local, target)`` through ``call_at_use``; its gradient is what accumulates.
    reduces_each_microstep = False
    # Whether the target's value is the accumulator and the gradient of ``call_at_use`` with
    # respect to it the new accumulator (fsdp), rather than this micro-step's gradient.
    accumulates_in_backward = False

    def grad_target(self, local: Any, specs: Any) -> Any:
        """What a micro-step differentiates: here the (replicated) params themselves."""
        return local

    def params_at_use(self, local: Any, target: Any, specs: Any, weight: jax.Array) -> Any:
        """The params pytree ``loss_fn`` receives, built from the differentiated target."""
        return target

    def call_at_use(self, fn: Any, local: Any, target: Any, specs: Any,
                    weight: jax.Array) -> Any:
        """``fn`` (the micro-step's objective of the params pytree) on ``params_at_use``."""
        return fn(self.params_at_use(local, target, specs, weight))

    def gather_params(self, local: Any, specs: Any) -> Any:
        """The full params from this device's shards (fsdp); identity where replicated."""
        def gather(x: jax.Array, spec: P) -> jax.Array:
            dim = _axis_dim(spec, self.shard_axis)
            return x if dim is None else gather_leading(x, self.shard_axis, dim)
        return jax.tree.map(gather, local, specs)

    def reduce_grads(self, grads: Any, specs: Any) -> Any:
        """The one reduction of the window's summed gradients: to the params' placement, in
        the wire's dtype (``accumix.jax.wire``: cast just before, back just after)."""
        rest = tuple(a for a in self.data_axes if a != self.shard_axis)
        wire = self.wire
        flat, tree = jax.tree.flatten(grads)
        out, previous = [], None
        for g, spec in zip(flat, tree.flatten_up_to(specs), strict=True):
            dim = _axis_dim(spec, self.shard_axis)
            if dim is None:
                out.append(wire.finish(wire.receive(jax.lax.psum(wire.send(g), self.data_axes),
                                                    g)))
                continue
            sent, previous = scatter_in_turn(wire.send(g), self.shard_axis, dim, previous)
            reduced = jax.lax.psum(sent, rest) if rest else sent
            out.append(wire.finish(wire.receive(reduced, g)))
        return tree.unflatten(out)

    # -- what the run uses -----------------------------------------------------------------
    wire = FLOAT32  # float32: set from the policy's reduce_dtype by the Accelerator (``connect``)

    def connect(self, reduce_dtype: str) -> None:
        """Takes the policy's ``reduce_dtype`` (a ``precision.reduce_dtype`` name): what the
        gradients travel in from now on, over all the mesh's devices (one device: nothing
        travels, nothing is cast)."""
        devices = self.num_devices
        self.wire = Wire(reduce_dtype, devices) if devices > 1 else FLOAT32

    def reductions(self) -> str:
        """How often gradients cross devices (``EffectiveDtypes.reductions``)."""
        return "once per optimizer step"


def scatter_in_turn(g: jax.Array, axis: str, dim: int, previous: jax.Array | None
                    ) -> tuple[jax.Array, jax.Array | None]:
    """``psum_scatter(g, axis, dim)`` and the last array it scattered (the next one's anchor).

    XLA's CPU reduce-scatter wants the split dimension outermost: a leaf split on a later
    dimension is first copied whole into that layout, and the scheduler made every such copy
    before the first reduce-scatter (measured: a second full float32 stack of a scanned
    layer's accumulator, 8 MiB for 8 layers of 512x512). Such a leaf is scattered after the
    previous one (``ordering.after``), a stack (3 or more dimensions) one slice of its first
    dimension at a time: one layer's copy at most is alive.
    """
    if dim == 0:  # the accumulator itself is the reduce-scatter's operand: no copy
        return jax.lax.psum_scatter(g, axis, scatter_dimension=0, tiled=True), previous
    pieces = [g[i] for i in range(g.shape[0])] if g.ndim >= 3 else [g]
    piece_dim = dim - 1 if g.ndim >= 3 else dim
    out = []
    for piece in pieces:
        if previous is not None:
            piece = after([piece], [previous])[0]
        previous = jax.lax.psum_scatter(piece, axis, scatter_dimension=piece_dim, tiled=True)
        out.append(previous)
    return (jnp.stack(out) if g.ndim >= 3 else out[0]), previous


def _axis_dim(spec: P, axis: str) -> int | None:
    """The dimension of ``spec`` split over ``axis``, or None."""
    for dim, name in enumerate(spec):
        if name == axis:
            return dim
    return None


class SingleStrategy(JaxStrategy):
    """One device: the mesh has one device, the reductions are no-ops.

    Args:
        devices: the device to use, as a one-item list (default: this process's first).
    """

    name = "single"

    def __init__(self, devices: list[Any] | None = None) -> None:
        super().__init__(None if devices is None else list(devices)[:1])

    def default_devices(self) -> list[Any]:
        return list(jax.local_devices())[:1]


class DDPStrategy(JaxStrategy):
    """Params and optimizer state replicated; batch rows sharded; one gradient psum a window.

    Args:
        devices: the mesh's devices (default: every device of every process).
    """

    name = "ddp"


class ZeRO1Strategy(JaxStrategy):
    """ddp with the optimizer state sharded (ZeRO stage 1).

    Args:
        devices: the mesh's devices (default: every device of every process).
    """

    name = "zero1"
    shards_optimizer = True


class FSDPStrategy(JaxStrategy):
    """Params and optimizer state sharded (ZeRO-3); each leaf gathered in the micro-step at
    each of its uses in ``loss_fn``'s jaxpr and re-gathered where that use's backward runs
    (``accumix.jax.per_use``: per layer at the top level, inside jit/checkpoint calls and per
    iteration of a scan over stacked layers; a loop, cond or custom-derivative function that
    uses a parameter is one use), after the cast to the compute dtype.

    Accumulation: by default each device sums the window's gradients into full-size float32
    accumulators (inside the backward: each use's gradient joins its accumulator, a scanned
    layer's in its slice) and reduce-scatters them once after the scan (FSDP2 with gradient
    sync off);
    ``sync_each_microstep=True`` reduce-scatters every micro-step's gradients into sharded
    accumulators instead: 1/N of the gradient memory for K times the gradient traffic. Both give
    the same result.

    Args:
        devices: the mesh's devices (default: every device of every process).
        sync_each_microstep: reduce-scatter on every micro-step (see above).
    """

    name = "fsdp"
    shards_params = True
    shards_optimizer = True
    accumulates_in_backward = True

    def __init__(self, devices: list[Any] | None = None, *,
                 sync_each_microstep: bool = False) -> None:
        if not isinstance(sync_each_microstep, bool):
            raise ConfigError(f"FSDPStrategy(sync_each_microstep={sync_each_microstep!r}) is "
                              "invalid; use True or False")
        super().__init__(devices)
        self.sync_each_microstep = sync_each_microstep
        self.reduces_each_microstep = sync_each_microstep

    def __repr__(self) -> str:
        return f"FSDPStrategy(sync_each_microstep={self.sync_each_microstep})"

    def grad_target(self, local: Any, specs: Any) -> Any:
        """Zeros of the accumulator's shape and dtype (``accum_dtype``: float32, complex for
        complex leaves): the full leaf, or its shard when synced."""
        def tap(x: jax.Array, spec: P) -> jax.Array:
            shape = list(x.shape)
            dim = _axis_dim(spec, self.shard_axis)
            if dim is not None and not self.sync_each_microstep:
                shape[dim] *= self.mesh.shape[self.shard_axis]
            return jnp.zeros(shape, accum_dtype(x.dtype))
        return jax.tree.map(tap, local, specs)

    def params_at_use(self, local: Any, target: Any, specs: Any, weight: jax.Array) -> Any:
        def use(x: jax.Array, tap: jax.Array, spec: P) -> jax.Array:
            return gather_at_use(x, tap, weight, self.shard_axis,
                                 _axis_dim(spec, self.shard_axis), self.sync_each_microstep,
                                 self.wire)
        return jax.tree.map(use, local, target, specs)

    def call_at_use(self, fn: Any, local: Any, target: Any, specs: Any,
                    weight: jax.Array) -> Any:
        """``fn`` with each sharded leaf gathered at each use in its jaxpr (``per_use``);
        ``target`` holds the accumulators, and its cotangent is them plus this micro-step's
        gradient (``fn`` returns ``(objective, aux)``)."""
        flat, tree = jax.tree.flatten(local)
        taps = tree.flatten_up_to(target)
        dims = [_axis_dim(s, self.shard_axis) for s in tree.flatten_up_to(specs)]
        leaves, values = {}, []
        for i, (x, tap, dim) in enumerate(zip(flat, taps, dims, strict=True)):
            if dim is None:  # replicated: the identity, its gradient routed to the tap
                values.append(gather_at_use(x, tap, weight, self.shard_axis, None,
                                            self.sync_each_microstep, self.wire))
                continue
            shape = list(x.shape)
            shape[dim] *= self.mesh.shape[self.shard_axis]
            leaves[i] = Leaf(x, tap, dim)
            values.append(jax.ShapeDtypeStruct(tuple(shape), x.dtype))
        accumulated: set[int] = set()
        objective, aux = call_at_use(fn, tree.unflatten(values), leaves, weight=weight,
                                     axis=self.shard_axis, scatter=self.sync_each_microstep,
                                     accumulated=accumulated, wire=self.wire)
        # The other leaves' accumulators join their gradient at the end of the backward.
        rest = [tap for i, tap in enumerate(taps) if i not in accumulated]
        return into_accumulators(objective, rest), aux

    def reduce_grads(self, grads: Any, specs: Any) -> Any:
        if not self.sync_each_microstep:
            return super().reduce_grads(grads, specs)
        # Sharded leaves were reduce-scattered over the shard axis in each micro-step's
        # backward (their shares divided by the wire there); what remains is the sum over
        # the other data axes (hsdp's replicas; none for fsdp), once, in the wire's dtype.
        rest = tuple(a for a in self.data_axes if a != self.shard_axis)
        wire = self.wire

        def reduce(g: jax.Array, spec: P) -> jax.Array:
            if _axis_dim(spec, self.shard_axis) is None:
                return wire.finish(wire.receive(jax.lax.psum(wire.send(g), self.data_axes), g))
            if rest:
                g = wire.receive(jax.lax.psum(wire.recast(g), rest), g)
            return wire.finish(g)
        return jax.tree.map(reduce, grads, specs)

    def reductions(self) -> str:
        if self.sync_each_microstep:
            return "every micro-step: sync_each_microstep (the shards sum in float32)"
        return super().reductions()


_CLASSES: dict[str, type[JaxStrategy]] = {
    "single": SingleStrategy, "ddp": DDPStrategy, "zero1": ZeRO1Strategy, "fsdp": FSDPStrategy,
}


def resolve_jax_strategy(word: str | JaxStrategy) -> JaxStrategy | None:
    """The strategy for a word; None for ``"auto"`` (chosen at setup from the memory model).

    Raises:
        ConfigError: ``"deepspeed"`` (a torch engine), an unknown word, or ``"single"`` in a
            job of several processes.
    """
    if isinstance(word, JaxStrategy):
        return _one_world(word)
    if word == "deepspeed":
        raise ConfigError(
            "strategy='deepspeed' is a PyTorch engine and has no JAX backend; use 'zero1' "
            "(optimizer state sharded, like ZeRO-1) or 'fsdp' (like ZeRO-3) with accumix.jax"
        )
    if word == "auto":
        return None
    if word == "hsdp":  # its own module (it builds on FSDPStrategy here)
        from accumix.jax.hsdp import HSDPStrategy

        return HSDPStrategy()
    if word not in _CLASSES:
        raise ConfigError(
            f"unknown strategy {word!r} for accumix.jax; use one of {', '.join(STRATEGY_WORDS)}"
        )
    return _one_world(_CLASSES[word]())


def _one_world(strategy: JaxStrategy) -> JaxStrategy:
    """Refuses a one-device strategy in a job of several processes: each process would train
    its own copy apart (the torch side refuses it alike)."""
    if strategy.name == "single" and jax.process_count() > 1:
        raise ConfigError(
            f"strategy='single' cannot run in a world of {jax.process_count()} processes; "
            "use 'ddp' (or 'auto'), or launch one process")
    return strategy

