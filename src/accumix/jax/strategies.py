"""Strategies on a device mesh: where params, optimizer state and gradients live.

One mesh axis, ``"data"``, over every device of every process. Each strategy is a placement rule
plus the one gradient reduction it makes per window, inside the step's ``shard_map`` (JAX's own
collectives; accumix writes none):

    strategy   params        optimizer state   gradient reduction (once, after the scan)
    single     one device    one device        none (a 1-device mesh)
    ddp        replicated    replicated        psum
    zero1      replicated    sharded           psum; the sharded update is GSPMD's
    fsdp       sharded       sharded           psum_scatter to the param's shard

Sharded means split on the largest dimension that the device count divides; a leaf with no such
dimension (a bias of 1, a scalar) stays replicated and is psum'd.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from accumix.errors import ConfigError

log = logging.getLogger("accumix")

AXIS = "data"
STRATEGY_WORDS = ("single", "ddp", "zero1", "fsdp", "auto")


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


def _sharded_spec(shape: tuple[int, ...], num_devices: int) -> P:
    dim = shard_dim(shape, num_devices)
    if dim is None:
        return P()
    return P(*([None] * dim + [AXIS]))


class JaxStrategy:
    """Placement of the state on the mesh, and the window's gradient reduction.

    Subclasses set ``name`` and the two flags; the mesh spans all devices of all processes.
    """

    name = "ddp"
    shards_params = False
    shards_optimizer = False

    def __init__(self, devices: list[Any] | None = None) -> None:
        devices = list(jax.devices() if devices is None else devices)
        self.mesh = Mesh(np.array(devices), (AXIS,), axis_types=(AxisType.Auto,))
        self.num_devices = len(devices)

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    # -- placement -------------------------------------------------------------------------
    def param_spec(self, leaf: Any) -> P:
        shape = tuple(getattr(leaf, "shape", ()))
        return _sharded_spec(shape, self.num_devices) if self.shards_params else P()

    def opt_spec(self, leaf: Any) -> P:
        shape = tuple(getattr(leaf, "shape", ()))
        return _sharded_spec(shape, self.num_devices) if self.shards_optimizer else P()

    # -- inside the step's shard_map (per device) -----------------------------------------
    def gather_params(self, local: Any, specs: Any) -> Any:
        """The full params from this device's shards (fsdp); identity where replicated."""
        def gather(x: jax.Array, spec: P) -> jax.Array:
            dim = _axis_dim(spec)
            return x if dim is None else jax.lax.all_gather(x, AXIS, axis=dim, tiled=True)
        return jax.tree.map(gather, local, specs)

    def reduce_grads(self, grads: Any, specs: Any) -> Any:
        """The one reduction of the window's summed gradients: to the params' placement."""
        def reduce(g: jax.Array, spec: P) -> jax.Array:
            dim = _axis_dim(spec)
            if dim is None:
                return jax.lax.psum(g, AXIS)
            return jax.lax.psum_scatter(g, AXIS, scatter_dimension=dim, tiled=True)
        return jax.tree.map(reduce, grads, specs)


def _axis_dim(spec: P) -> int | None:
    for dim, name in enumerate(spec):
        if name == AXIS:
            return dim
    return None


class SingleStrategy(JaxStrategy):
    """One device: the mesh has one device, the reductions are no-ops."""

    name = "single"

    def __init__(self, devices: list[Any] | None = None) -> None:
        super().__init__(list(jax.local_devices() if devices is None else devices)[:1])


class DDPStrategy(JaxStrategy):
    """Params and optimizer state replicated; batch rows sharded; one gradient psum a window."""

    name = "ddp"


class ZeRO1Strategy(JaxStrategy):
    """ddp with the optimizer state sharded (ZeRO stage 1)."""

    name = "zero1"
    shards_optimizer = True


class FSDPStrategy(JaxStrategy):
    """Params and optimizer state sharded; gathered once a window, grads reduce-scattered once."""

    name = "fsdp"
    shards_params = True
    shards_optimizer = True


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


def choose_auto(num_params: int, *, precision: str, optimizer_states: int = 2) -> JaxStrategy:
    """``"auto"``: the torch side's memory model and order (ddp, zero1, fsdp) on this mesh.

    The ZeRO-paper byte counts of ``accumix.memory`` per device, against the smallest device's
    memory (host memory shared by the local devices on a CPU).
    """
    from accumix.memory import choose_strategy, estimate_memory

    devices = jax.devices()
    if len(devices) == 1:
        return SingleStrategy()
    free = _device_free_bytes()
    estimates = estimate_memory(num_params, world_size=len(devices), precision=precision,
                                optimizer_states=optimizer_states)
    choice = choose_strategy(estimates, device_bytes=free, world_size=len(devices))
    log.info("strategy='auto' chose %s", choice.reason)
    return _CLASSES[choice.strategy]()


def _device_free_bytes() -> int:
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    limits = [s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats if "bytes_limit" in s]
    if limits:
        return int(min(limits))
    from accumix.memory import _host_available_bytes

    return _host_available_bytes() // max(len(jax.local_devices()), 1)
