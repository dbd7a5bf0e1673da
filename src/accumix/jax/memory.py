"""Bytes per device of accumix.jax's compiled window step, per strategy: the JAX memory model.

Counted from the params' own leaves and the optimizer's own state (``jax.eval_shape`` of its
``init``, so Adam, SGD, or a chain are sized as they are), placed as ``strategies.py`` places
them (a leaf is sharded on its largest dimension the device count divides, else replicated),
and checked against XLA's ``compiled.memory_analysis()`` (arguments + temporaries) of the step
(``tests/unit/test_jax_fsdp.py``, ``tests/unit/test_jax_memory.py``). Per device, with n a
leaf's elements and s(n) its shard:

    term            single/ddp     zero1          fsdp                fsdp sync_each_microstep
    params          p*n            p*n            p*s(n)              p*s(n)
    optimizer       opt            opt/D          opt/D               opt/D
    accumulators    4*n            4*n            4*n                 4*s(n)
    reduced grads   4*n            4*n            0 (in place)        0 (the accumulators)
    in flight       4*max(n) (a)   0              4*max(n)            4*max(n)  (one leaf, float32)
    compute copy    c*n            c*n            c*s(n)              c*s(n)     (mixed only)
    gathered        0              0              see (b)             see (b)
    shard in use    0              0              4*max(s) fp32 only  4*max(s)
    16-bit shards   0              0              0                   c*s(n) (c)
    fp16 skip       0              opt/D          opt/D               4*s(n)     (fp16-mixed only)
    carried         b*m            b*m            b*s(m) + b*m        b*s(m) + b*m
    + the window's bytes on the device + activations (the caller's, or the compiled step's:
      ``accumix.jax.compiled_memory``)

p stored param bytes, c compute bytes, g the bytes XLA gathers a float32 copy in (float32 on a
CPU), c' = c where g != c, else 0; max(s) the largest sharded leaf's shard; the optimizer state
is sized on the stored dtype (bf16-true: bfloat16 moments). Every term below was measured
against ``memory_analysis()`` with ``tests/scripts/jax_fsdp_memory.py`` (2 and 8 layers, 2 and
4 devices, every precision) and read off XLA's buffer assignment (``--xla_dump_to``):

(a) in flight: one leaf's float32 gradient before it joins its accumulator. fsdp: always (on
    its way to the reduce-scatter); single and ddp: bf16-true only (its bf16 gradient cast;
    single's fused with the accumulate from issue 30 until the step weighed each micro-step's
    gradient by its share, issue 38: measured equal to ddp's since); under a mixed policy the
    cast fuses with the accumulate (measured, within 1% without it).
(b) gathered: ``accumix.jax.per_use`` gathers each leaf at each use and re-gathers it in that
    use's backward, so one leaf's gathered copy (the largest sharded leaf) is alive at a time.
    fp32 (and fp16-mixed with sync_each_microstep, whose skip keeps both): (g+c')*max(n)
    beside the gradient in flight. 16-bit compute otherwise: c*max(n), gathered in the
    compute dtype (``per_use`` casts before the gather); its float32 upcast for the CPU's dot
    shares the in-flight gradient's buffer.
    A lone sharded leaf: its gathered copy and its gradient share one buffer (its use's
    backward re-gathers nothing beside the gradient): (b) less the in-flight term, at least 0.
(c) 16-bit shards (bf16-mixed, bf16-true; measured, 2 bytes per shard element): with
    sync_each_microstep. Each use saves for its backward the shard it was given (the compute
    copy, counted), not the copy computed after the layer's activation: before issue 30 the
    default mode held these too (one per leaf, alive until its backward).
shard in use: one float32 shard of the largest leaf. fp32: the gather's input, a copy of the
shard that ``per_use`` computes after the layer's activation (16-bit: the c-byte cast, which
XLA put in a donated argument's buffer in every measured job); sync_each_microstep: the
reduce-scattered micro-step gradient before it joins its accumulator.
fp16 skip is measured: the loss scale's select between the old and the new sharded state holds
the new optimizer state (zero1, fsdp) or a copy of the sharded accumulators
(sync_each_microstep) until the global overflow check is known; ddp's fuses with its update
(ddp fp16-mixed is the model's lowest row: 0.91 of the step at 2 layers, 0.93 at 8).
Only float leaves train (``accumix.jax.trainable``): a carried leaf (an integer counter, a PRNG
key) of m elements of b bytes is held once, with no gradient and no optimizer state (fsdp: its
shard at rest plus the plain gather of sharded ones).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from accumix.errors import ConfigError
from accumix.jax import trainable
from accumix.jax.strategies import (
    DDPStrategy,
    FSDPStrategy,
    JaxStrategy,
    SingleStrategy,
    ZeRO1Strategy,
    shard_dim,
)

log = logging.getLogger("accumix")

JAX_STRATEGIES = ("single", "ddp", "zero1", "fsdp", "fsdp-sync")
# With several nodes (``replicas``): hsdp is fsdp over one node's S devices, replicated across
# the nodes; its default (a reduce-scatter every micro-step) is sized as fsdp-sync over S,
# ``defer_reduce_scatter=True`` as fsdp over S. Its cross-node all-reduce runs in place.
HSDP_ROWS = ("hsdp", "hsdp-defer")
_AS_FSDP = {"hsdp": "fsdp-sync", "hsdp-defer": "fsdp"}
_SHARDED_UPDATE = ("zero1", "fsdp", "fsdp-sync")
_DTYPE_BYTES = {"fp32": (4, 4), "bf16-mixed": (4, 2), "fp16-mixed": (4, 2), "bf16-true": (2, 2)}


@dataclass(kw_only=True, frozen=True, slots=True)
class JaxMemoryEstimate:
    """Bytes one device holds during the window step under one strategy (see the module doc).

    Attributes:
        strategy: one of ``JAX_STRATEGIES`` (``"fsdp-sync"``: ``sync_each_microstep=True``).
        params_bytes: stored params at rest on the device.
        optimizer_bytes: the optimizer state on the device.
        grads_bytes: accumulators + the reduced window gradient.
        working_bytes: the compute-dtype copy and the gathered params.
        other_bytes: the window's bytes on the device plus activations.
        total_bytes: the sum.
    """

    strategy: str
    params_bytes: int
    optimizer_bytes: int
    grads_bytes: int
    working_bytes: int
    other_bytes: int

    @property
    def total_bytes(self) -> int:
        return (self.params_bytes + self.optimizer_bytes + self.grads_bytes
                + self.working_bytes + self.other_bytes)


def estimate_jax_memory(params: Any, optimizer: Any = None, *, num_devices: int,
                        precision: str = "fp32", platform: str = "cpu",
                        optimizer_states: int = 2, window_bytes: int = 0,
                        activation_bytes: int | Mapping[str, int] = 0, replicas: int = 1
                        ) -> list[JaxMemoryEstimate]:
    """The per-device bytes of every JAX strategy (order of ``JAX_STRATEGIES``, then
    ``HSDP_ROWS`` when ``replicas`` > 1).

    Args:
        params: the params pytree (arrays or ``jax.ShapeDtypeStruct``), or a parameter count
            (one flat leaf: every element shardable, no leaf's gradient counted in flight).
        optimizer: an optax transformation (its state is sized by ``eval_shape``), or None to
            count ``optimizer_states`` float32 states per parameter.
        num_devices: the mesh's devices (D); ``single`` always uses one.
        precision: ``"fp32"``, ``"bf16-mixed"``, ``"fp16-mixed"`` or ``"bf16-true"``.
        platform: the devices' platform; on ``"cpu"`` XLA gathers 16-bit params in float32.
        optimizer_states: states per parameter when ``optimizer`` is None.
        window_bytes: one window's bytes over all devices (split over D, whole on ``single``).
        activation_bytes: activations per device (e.g. from a compiled step,
            ``accumix.jax.compiled_memory``) added to each row, or a mapping of a row's name
            to its own (rows it lacks: 0).
        replicas: the nodes the devices are spread over (hsdp's replicas); > 1 adds the hsdp
            rows, fsdp's over ``num_devices / replicas`` devices.

    Raises:
        ConfigError: an unknown precision, ``num_devices < 1``, or ``replicas`` that do not
            leave shard groups of 2 devices or more.
    """
    if precision not in _DTYPE_BYTES:
        raise ConfigError(f"unknown precision {precision!r}; use one of {', '.join(_DTYPE_BYTES)}")
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ConfigError(f"num_devices={num_devices!r} is invalid; use an integer >= 1")
    p, c = _DTYPE_BYTES[precision]
    g = 4 if platform == "cpu" else c
    # Only float leaves train (accumix.jax.trainable): carried leaves (integer counters, PRNG
    # keys) are stored once in their own dtype, with no gradient and no optimizer state.
    structs = _param_structs(params, np.float32 if p == 4 else jnp.bfloat16)
    carried = _carried_leaves(params)
    leaves = [tuple(x.shape) for x in jax.tree.leaves(structs)]
    if optimizer is not None:
        # Sized on the stored dtype, as the step builds it (bf16-true: bfloat16 Adam moments).
        opt_leaves = [(tuple(x.shape), np.dtype(x.dtype).itemsize)
                      for x in jax.tree.leaves(jax.eval_shape(optimizer.init, structs))]
    else:
        opt_leaves = [(s, p) for s in leaves for _ in range(optimizer_states)]
    # A bare count has no leaves to size the one in flight by: left out.
    bare = isinstance(params, (int, np.integer))
    largest = 0 if bare or not leaves else max(_size(s) for s in leaves)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1 or (
            replicas > 1 and (num_devices % replicas or num_devices // replicas < 2)):
        raise ConfigError(f"replicas={replicas!r} is invalid with {num_devices} devices; use a "
                          "number of nodes that leaves 2 or more devices in each")
    out = []
    for row in JAX_STRATEGIES + (HSDP_ROWS if replicas > 1 else ()):
        # hsdp's rows are fsdp's formulas over one node's devices.
        name = _AS_FSDP.get(row, row)
        d = 1 if name == "single" else num_devices // replicas if row in HSDP_ROWS else (
            num_devices)
        full = sum(_size(s) for s in leaves)
        shard = sum(_shard(s, d) for s in leaves)
        # fsdp gathers at each use (accumix.jax.per_use): one leaf's gathered copy at a time.
        gathered = max((_size(s) for s in leaves if shard_dim(s, d) is not None), default=0)
        opt_full = sum(_size(s) * b for s, b in opt_leaves)
        opt_shard = sum(_shard(s, d) * b for s, b in opt_leaves)
        fsdp = name.startswith("fsdp")
        mixed = c != p
        # Carried leaves rest where the strategy places them; fsdp gathers the sharded ones
        # plainly for the window (a full copy, no gradient).
        carried_rest = sum((_shard(s, d) if fsdp else _size(s)) * b for s, b in carried)
        carried_gathered = sum(_size(s) * b for s, b in carried
                               if fsdp and shard_dim(s, d) is not None)
        params_bytes = p * (shard if fsdp else full) + carried_rest
        optimizer_bytes = opt_full if name in ("single", "ddp") else opt_shard
        # One leaf's float32 gradient in flight before it joins its accumulator (measured):
        # fsdp's, on its way to the reduce-scatter; bf16-true's cast on single and ddp. Under
        # a mixed policy the cast fuses with the accumulate (within 1%).
        in_flight = 4 * largest if (fsdp or (c != 4 and not mixed and name in ("single", "ddp"))
                                    ) else 0
        if name == "fsdp-sync":
            grads = 4 * shard + in_flight
        elif fsdp:  # the window's reduce-scatter writes over the accumulators
            grads = 4 * full + in_flight
        else:
            grads = 4 * full + 4 * full + in_flight
        if precision == "fp16-mixed" and name in _SHARDED_UPDATE:
            # Measured (Adam, 2 and 4 devices): the loss scale's skip selects between the old
            # and the new sharded state once the global overflow check is known; XLA holds the
            # new optimizer state beside the old (a copy of the sharded accumulators with
            # sync_each_microstep). ddp's update fuses with the select (within 9% without).
            grads += 4 * shard if name == "fsdp-sync" else opt_shard
        sharded = [s for s in leaves if shard_dim(s, d) is not None]
        big_shard = max((_shard(s, d) for s in sharded), default=0)
        # Measured: one float32 shard of the largest leaf. fp32: the gather's input, which
        # per_use computes after the layer's activation (a copy of the shard); 16-bit: the
        # cast shard, which XLA put in a donated argument's buffer in every measured job.
        # sync_each_microstep: the reduce-scattered micro-step gradient before it is added.
        scattered = 4 * big_shard if (c == 4 or name == "fsdp-sync") else 0
        if c == 4 or (name == "fsdp-sync" and precision == "fp16-mixed"):
            # The gathered leaf beside the gradient in flight (16-bit on a CPU: gathered in
            # float32, then cast; fp16 sync_each_microstep's skip keeps both).
            gathered = (g + (c if g != c else 0)) * gathered
        else:
            # Measured (fsdp, 16-bit compute): the leaf is gathered in the compute dtype and
            # its float32 upcast shares the in-flight gradient's buffer.
            gathered = c * gathered
        if len(sharded) == 1:
            # A lone sharded leaf (measured, tests/unit/test_jax_memory.py): its gathered
            # copy and its gradient share one buffer (no re-gather beside the gradient).
            gathered = max(gathered - in_flight, 0)
        gathered += scattered
        # Measured, sync_each_microstep under 16-bit compute (not fp16-mixed, whose peak is
        # the update's skip select): a 16-bit shard per sharded leaf beside the others.
        saved = c * shard if (name == "fsdp-sync" and c != 4 and precision != "fp16-mixed") else 0
        working = (c * (shard if fsdp else full) if mixed else 0) + (
            gathered + saved if fsdp else 0)
        working += carried_gathered
        other = window_bytes // (num_devices if row in HSDP_ROWS else d) + (
            activation_bytes.get(row, 0) if isinstance(activation_bytes, Mapping)
            else activation_bytes)
        out.append(JaxMemoryEstimate(strategy=row, params_bytes=params_bytes,
                                     optimizer_bytes=optimizer_bytes, grads_bytes=grads,
                                     working_bytes=working, other_bytes=other))
    return out


def choose_auto(params: Any, optimizer: Any, *, precision: str, headroom: float = 0.8,
                free_bytes: int | None = None,
                sized: Callable[[str], JaxMemoryEstimate] | None = None) -> JaxStrategy:
    """``strategy="auto"``: the least communication whose bytes fit, on every process.

    ddp, zero1, fsdp, fsdp with ``sync_each_microstep`` in that order, against ``headroom`` of
    the smallest free device memory over all processes (``agreed_free_bytes``: every process
    gets the same number, so all choose alike); ``single`` on one device; fsdp with
    ``sync_each_microstep`` (the least memory) when nothing fits, said in the log. On several
    processes with several devices each (nodes: the link between them is the slow one), hsdp
    comes right after ddp (``first_fitting``), as on the torch side.

    Args:
        sized: a row's estimate with its window and activations (``accumix.jax.compiled_memory.
            measured_estimate``: from that strategy's compiled step, the numbers
            ``estimate-memory`` prints), asked for in order until one fits; None: the
            params and optimizer state alone (``estimate_jax_memory``, no activations).
    """
    devices = jax.devices()
    if len(devices) == 1:
        return SingleStrategy()
    free = agreed_free_bytes() if free_bytes is None else free_bytes
    how = "each row from its compiled window step"
    nodes = jax.process_count()
    if nodes == 1 or len(devices) % nodes or len(devices) // nodes < 2:
        nodes = 1  # hsdp needs several processes (nodes) of several devices
    if sized is None:
        rows = {e.strategy: e for e in estimate_jax_memory(
            params, optimizer, num_devices=len(devices), precision=precision,
            platform=devices[0].platform, replicas=nodes)}
        sized = rows.__getitem__
        how = ("params and optimizer state only, no activations: pass acc.setup(..., "
               "loss_fn=, batch=) to count them")
    name, reason = first_fitting(sized, device_bytes=free, headroom=headroom, nodes=nodes)
    log.info("strategy='auto' chose %s (%s)", reason, how)
    return strategy_of_row(name)


def first_fitting(sized: Callable[[str], JaxMemoryEstimate], *, device_bytes: int,
                  headroom: float = 0.8, nodes: int = 1) -> tuple[str, str]:
    """The first of ddp, zero1, fsdp, fsdp-sync whose ``sized(row)`` fits ``headroom *
    device_bytes`` (fsdp-sync when none does; rows after the first that fits are never
    sized), and a one-line reason. On ``nodes`` > 1: ddp, hsdp-defer, hsdp, zero1, fsdp,
    fsdp-sync (sharded within a node, a model crosses the nodes once per step with a shard of
    its gradients; zero1 and fsdp gather across them)."""
    budget = headroom * device_bytes
    order: tuple[str, ...] = ("ddp", "zero1", "fsdp", "fsdp-sync")
    if nodes > 1:
        order = ("ddp", *HSDP_ROWS[::-1], "zero1", "fsdp", "fsdp-sync")
    seen: dict[str, JaxMemoryEstimate] = {}
    for row in order:
        seen[row] = sized(row)
        if seen[row].total_bytes <= budget:
            break
    name = row
    verdict = "fits" if seen[name].total_bytes <= budget else "does not fit (nothing does)"
    reason = (f"{name}: {seen[name].total_bytes / 2**30:.2f} GiB per device {verdict} "
              f"{headroom:.0%} of {device_bytes / 2**30:.2f} GiB; ddp needs "
              f"{seen['ddp'].total_bytes / 2**30:.2f} GiB")
    if name in HSDP_ROWS:
        reason += (f"; sharded within a node's devices, replicated across the {nodes} nodes: "
                   "they exchange gradient shards once per step")
    return name, reason


def strategy_of_row(row: str, devices: list[Any] | None = None) -> JaxStrategy:
    """A fresh strategy for one of ``JAX_STRATEGIES``' rows, on ``devices`` (default: every
    device of every process; ``single``: the first)."""
    if row == "fsdp-sync":
        return FSDPStrategy(devices, sync_each_microstep=True)
    if row in HSDP_ROWS:  # replicas: the processes (auto offers hsdp only on several)
        from accumix.jax.hsdp import HSDPStrategy

        return HSDPStrategy(devices, defer_reduce_scatter=row == "hsdp-defer")
    return {"single": SingleStrategy, "ddp": DDPStrategy, "zero1": ZeRO1Strategy,
            "fsdp": FSDPStrategy}[row](devices)


def pick_strategy(estimates: list[JaxMemoryEstimate], *, device_bytes: int,
                  headroom: float = 0.8, nodes: int = 1) -> tuple[str, str]:
    """The first of ddp, zero1, fsdp, fsdp-sync whose total fits ``headroom * device_bytes``
    (fsdp-sync when none does; on ``nodes`` > 1 with the hsdp rows, ``first_fitting``'s
    order), and a one-line reason."""
    by_name = {e.strategy: e for e in estimates}
    return first_fitting(by_name.__getitem__, device_bytes=device_bytes, headroom=headroom,
                         nodes=nodes)


def format_jax_table(estimates: list[JaxMemoryEstimate], *, device_bytes: int | None = None,
                     headroom: float = 0.8) -> str:
    """The estimates as an aligned table (2 decimals) in GiB, or in MiB when every total is
    under 1 GiB, with ``fits`` when a device size is given."""
    unit, scale = ("GiB", 2**30) if max(e.total_bytes for e in estimates) >= 2**30 else (
        "MiB", 2**20)
    header = ("strategy", *(f"{name} {unit}" for name in (
        "params", "optimizer", "grads", "gathered+copy", "window+act", "total")), "fits")
    rows = [header]
    for e in estimates:
        sizes = (e.params_bytes, e.optimizer_bytes, e.grads_bytes, e.working_bytes,
                 e.other_bytes, e.total_bytes)
        fits = "-" if device_bytes is None else (
            "yes" if e.total_bytes <= headroom * device_bytes else "no")
        rows.append((e.strategy, *(f"{b / scale:.2f}" for b in sizes), fits))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in
                                                           zip(r[1:], widths[1:], strict=True)])
                     for r in rows)


def agreed_free_bytes() -> int:
    """The free memory of one device, the minimum over every process (one collective)."""
    free = device_free_bytes()
    if jax.process_count() == 1:
        return free
    from jax.experimental import multihost_utils

    # float32 (JAX's default has no int64): 24 bits of mantissa are plenty for a budget.
    every = multihost_utils.process_allgather(np.asarray([free], np.float32))
    return int(np.min(np.asarray(every)))


def device_free_bytes() -> int:
    """This process's free memory per local device (host memory shared by them on a CPU)."""
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    limits = [s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats if "bytes_limit" in s]
    if limits:
        return int(min(limits))
    from accumix.memory.device_memory import _host_available_bytes

    return _host_available_bytes() // max(len(jax.local_devices()), 1)


def _param_structs(params: Any, dtype: Any) -> Any:
    """The trainable leaves as ``dtype`` stand-ins (the stored dtype: the optimizer's state is
    sized as the step builds it), None at the carried ones (as ``trainable.select`` gives the
    optimizer)."""
    if isinstance(params, (int, np.integer)) and not isinstance(params, bool):
        return [jax.ShapeDtypeStruct((int(params),), dtype)]
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), dtype)
                        if trainable.is_trainable(x) else None, params)


def _carried_leaves(params: Any) -> list[tuple[tuple[int, ...], int]]:
    """``(shape, bytes per element)`` of each carried leaf (integers, booleans, PRNG keys)."""
    if isinstance(params, (int, np.integer)):
        return []
    out = []
    for x in jax.tree.leaves(params):
        if trainable.is_trainable(x):
            continue
        dtype = x.dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):  # its key data: uint32 words
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, dtype))
            out.append((tuple(x.shape), _size(data.shape[len(x.shape):]) * data.dtype.itemsize))
        else:
            out.append((tuple(x.shape), np.dtype(dtype).itemsize))
    return out


def _size(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _shard(shape: tuple[int, ...], num_devices: int) -> int:
    return _size(shape) // num_devices if shard_dim(shape, num_devices) is not None else (
        _size(shape))


def row_of(strategy: JaxStrategy) -> str:
    """The memory model's row of a strategy object (``"fsdp-sync"``, ``"hsdp-defer"``, ...)."""
    if strategy.name == "hsdp":
        return "hsdp-defer" if getattr(strategy, "defer_reduce_scatter", False) else "hsdp"
    return "fsdp-sync" if getattr(strategy, "sync_each_microstep", False) else strategy.name
