"""Memory model per strategy: the bytes one rank holds (``strategy_choice`` picks from them).

Counts the *model states* one data-parallel rank holds (parameters, gradients, optimizer states)
the way the ZeRO paper does, plus an activation estimate the caller supplies. Imports only
``accumix.errors``, ``param_counts`` and ``table`` from accumix, none of which loads torch;
torch only where a torch model or device is passed (the JAX backend sizes its strategies from a
parameter count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # torch loads lazily: the JAX backend sizes its strategies with this model
    from torch import nn

# The ``x as x`` names are re-exported: callers size models and print tables through this module.
from accumix.errors import ConfigError
from accumix.memory.param_counts import count_params as count_params
from accumix.memory.param_counts import gathered_params as gathered_params
from accumix.memory.param_counts import repeated_blocks as repeated_blocks
from accumix.memory.table import format_table as format_table

# ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
# Models", sections 3.1 and 5.1): mixed-precision Adam holds 2 (fp16 params) + 2 (fp16 grads) +
# 12 (fp32 master, m, v) = 16 bytes per parameter; stages 1/2/3 divide the optimizer / +gradient /
# +parameter terms by W. DeepSpeed stores exactly that; torch's strategies store what the
# byte table below says. N parameters, T trainable (only they get grads and states), W ranks,
# K optimizer states (Adam 2, SGD+momentum 1, SGD 0), G parameters held gathered at once under
# full sharding (largest repeated block + the parameters outside the blocks, which FSDP2's root
# unit keeps gathered from forward to backward). Shards round up to whole elements (padding).
# hsdp (several nodes) is fsdp over the S ranks of a node (replicated across the nodes): its
# rows are fsdp's with S for W.
#
#   strategy       params          grads    optimizer        ZeRO stage
#   ddp            p*N             g*T      (m + K*s)*T      -
#   zero1          p*N             g*T      (m + K*s)*T/W    1
#   fsdp-grad_op   p*N/W + c*N     g*T/W    (m + K*s)*T/W    2 (params stay gathered fwd->bwd)
#   fsdp-full      p*N/W + c*G     g*T/W    (m + K*s)*T/W    3
#   hsdp-grad_op   p*N/S + c*N     g*T/S    (m + K*s)*T/S    2 within a node
#   hsdp-full      p*N/S + c*G     g*T/S    (m + K*s)*T/S    3 within a node
#   fsdp-*, hsdp-*-defer with a window: g*T (below); fsdp-*-sync and hsdp-* keep g*T/W, g*T/S
#   deepspeed-1    p*N             g*T      (m + K*s)*T/W    1
#   deepspeed-2    p*N             g*T/W    (m + K*s)*T/W    2
#   deepspeed-3    p*N/W + c*G     g*T/W    (m + K*s)*T/W    3
#   total = params + grads + optimizer + activation_bytes
#
# Bytes: p stored param, c gathered (compute dtype) param, g grad, s one state, m fp32 master.
#
#   precision                torch: ddp, zero1, fsdp   deepspeed
#   fp32                     p=4 c=4 g=4 s=4 m=0       p=4 c=4 g=4 s=4 m=4 (ZeRO 1/2), 0 (3)
#   bf16-mixed, fp16-mixed   p=4 c=2 g=4 s=4 m=0       p=2 c=2 g=2 s=4 m=4  (ZeRO's 16 bytes)
#   bf16-true                p=2 c=2 g=2 s=2 m=0       p=2 c=2 g=2 s=4 m=4
#
# Why torch differs from the paper: autocast keeps params, grads and states in fp32 and casts on
# the fly, so there is no master copy (its cached casts live only through the forward, like
# activations); FSDP2's MixedPrecisionPolicy stores fp32 shards, all-gathers in the compute dtype
# and returns fp32 sharded grads. DeepSpeed's fp16/bf16 modes always keep fp32 master weights and
# states, so bf16-true costs there what bf16-mixed does.
# Not counted (the headroom absorbs them): DDP's grad buckets without gradient_as_bucket_view,
# the next block FSDP prefetches during compute, DeepSpeed's transient fp32 grad partition,
# buffers, the CUDA context, allocator fragmentation.
#
# The window (``grad_accum_steps`` >= 2 micro-steps per optimizer step): by default FSDP2 runs
# the off-boundary micro-steps with gradient sync off, so each rank sums the window in unsharded,
# full-size gradients (g*T, in the stored dtype: g's) that the boundary's backward reduce-scatters
# (freeing them unit by unit as the shards appear): ``fsdp-grad_op``/``fsdp-full`` and
# ``hsdp-*-defer`` (``HSDPStrategy(defer_reduce_scatter=True)``) hold g*T where the table says
# g*T/W (g*T/S). ``fsdp-*-sync`` (``FSDPStrategy(sync_each_microstep=True)``) and hsdp's default
# reduce-scatter every micro-step into the shards and keep the table's figure. With one micro-step
# a window every micro-step is a boundary and those rows equal the defaults, so they are listed
# only with a window. Measured: tests/distributed/test_memory_model.py, hsdp_jobs.py.


class _Bytes(NamedTuple):
    param: int
    gathered: int
    grad: int
    state: int
    master: int


class _Sharding(NamedTuple):
    optimizer: bool
    grads: bool
    params: bool
    gathered: str  # "none", "all" (N, kept from forward to backward) or "block" (G at a time)
    deepspeed: bool
    within_node: bool = False  # sharded over the ranks of a node (hsdp), not over all ranks
    window_unsharded: bool = False  # a window's gradients summed unsharded (FSDP2 sync off)


_SHARDING: dict[str, _Sharding] = {
    # sharded: optimizer, grads, params; then gathered, and whether DeepSpeed stores it
    "ddp": _Sharding(False, False, False, "none", False),
    "zero1": _Sharding(True, False, False, "none", False),
    "fsdp-grad_op": _Sharding(True, True, True, "all", False, window_unsharded=True),
    "fsdp-full": _Sharding(True, True, True, "block", False, window_unsharded=True),
    "fsdp-grad_op-sync": _Sharding(True, True, True, "all", False),
    "fsdp-full-sync": _Sharding(True, True, True, "block", False),
    "hsdp-grad_op": _Sharding(True, True, True, "all", False, within_node=True),
    "hsdp-full": _Sharding(True, True, True, "block", False, within_node=True),
    "hsdp-grad_op-defer": _Sharding(True, True, True, "all", False, within_node=True,
                                    window_unsharded=True),
    "hsdp-full-defer": _Sharding(True, True, True, "block", False, within_node=True,
                                 window_unsharded=True),
    "deepspeed-1": _Sharding(True, False, False, "none", True),
    "deepspeed-2": _Sharding(True, True, False, "none", True),
    "deepspeed-3": _Sharding(True, True, True, "block", True),
}
_BYTES: dict[tuple[bool, str], _Bytes] = {
    # (deepspeed, precision): bytes p, c, g, s, m as in the table above
    (False, "fp32"): _Bytes(4, 4, 4, 4, 0),
    (False, "bf16-mixed"): _Bytes(4, 2, 4, 4, 0),
    (False, "fp16-mixed"): _Bytes(4, 2, 4, 4, 0),
    (False, "bf16-true"): _Bytes(2, 2, 2, 2, 0),
    (True, "fp32"): _Bytes(4, 4, 4, 4, 0),
    (True, "bf16-mixed"): _Bytes(2, 2, 2, 4, 4),
    (True, "fp16-mixed"): _Bytes(2, 2, 2, 4, 4),
    (True, "bf16-true"): _Bytes(2, 2, 2, 4, 4),
}
# The rows of one node's world at one micro-step a window; hsdp's come only with several nodes
# (``ranks_per_node``), the sync and defer variants only with a window (they differ only there).
HSDP_ROWS: tuple[str, ...] = ("hsdp-grad_op", "hsdp-full")
SYNC_ROWS: tuple[str, ...] = ("fsdp-grad_op-sync", "fsdp-full-sync")
DEFER_ROWS: tuple[str, ...] = ("hsdp-grad_op-defer", "hsdp-full-defer")
STRATEGIES: tuple[str, ...] = tuple(name for name in _SHARDING
                                    if name not in HSDP_ROWS + SYNC_ROWS + DEFER_ROWS)
PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")
_GIB = 1024**3


@dataclass(kw_only=True, frozen=True, slots=True)
class MemoryEstimate:
    """Bytes one data-parallel rank holds under one strategy.

    Attributes:
        strategy: The row: one of ``STRATEGIES``, ``SYNC_ROWS``, ``HSDP_ROWS``, ``DEFER_ROWS``.
        params_bytes: Stored parameters plus what the strategy holds all-gathered.
        grads_bytes: Gradients (trainable parameters only).
        optimizer_bytes: Optimizer states plus fp32 master copies where kept.
        activation_bytes: The caller's activation estimate, the same for every strategy.
        total_bytes: The sum of the four above.
        fits: Whether ``total_bytes <= headroom * device_bytes``; None when no device size was
            given.
    """

    strategy: str
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    total_bytes: int
    fits: bool | None

    def to_row(self) -> tuple[str, ...]:
        """Return the table row: strategy, five sizes in GiB (2 decimals), and fits."""
        fits = "-" if self.fits is None else ("yes" if self.fits else "no")
        parts = (self.params_bytes, self.grads_bytes, self.optimizer_bytes, self.activation_bytes)
        sizes = (f"{size / _GIB:.2f}" for size in (*parts, self.total_bytes))
        return (self.strategy, *sizes, fits)


def estimate_memory(
    model_or_num_params: nn.Module | int,
    *,
    world_size: int,
    precision: str = "fp32",
    optimizer_states: int = 2,
    activation_bytes: int = 0,
    device_bytes: int | None = None,
    headroom: float = 0.8,
    block_params: int | None = None,
    ranks_per_node: int | None = None,
    grad_accum_steps: int | None = 1,
) -> list[MemoryEstimate]:
    """Estimate the bytes per rank of every strategy (formulas: the table atop this module).

    With N parameters, T trainable, W ranks (S of them per node), K optimizer states and G
    gathered parameters::

        ddp           p*N           + g*T   + (m + K*s)*T
        zero1         p*N           + g*T   + (m + K*s)*T/W
        fsdp-grad_op  p*N/W + c*N   + g*T/W + (m + K*s)*T/W
        fsdp-full     p*N/W + c*G   + g*T/W + (m + K*s)*T/W
        hsdp-grad_op  p*N/S + c*N   + g*T/S + (m + K*s)*T/S     (several nodes only)
        hsdp-full     p*N/S + c*G   + g*T/S + (m + K*s)*T/S
        deepspeed-1   p*N           + g*T   + (m + K*s)*T/W
        deepspeed-2   p*N           + g*T/W + (m + K*s)*T/W
        deepspeed-3   p*N/W + c*G   + g*T/W + (m + K*s)*T/W

    each plus ``activation_bytes``. With a window (``grad_accum_steps`` >= 2) the fsdp rows hold
    the window's unsharded gradients, g*T, and ``SYNC_ROWS`` (``sync_each_microstep=True``, g*T/W)
    follow them; on several nodes ``DEFER_ROWS`` (``defer_reduce_scatter=True``, g*T) follow the
    hsdp rows, whose default keeps g*T/S.

    Bytes (param p, gathered c, grad g, state s, master m): fp32 4/4/4/4/0; bf16-/fp16-mixed
    4/2/4/4/0 under torch (autocast, FSDP2 MixedPrecisionPolicy) and 2/2/2/4/4 under DeepSpeed
    (ZeRO's 16 bytes for Adam); bf16-true 2/2/2/2/0 under torch and 2/2/2/4/4 under DeepSpeed,
    which always keeps fp32 master weights and states.

    Args:
        model_or_num_params: A model (its parameters are counted, tied ones once, and frozen ones
            get no grads or states) or a number of parameters (all trainable).
        world_size: Data-parallel ranks.
        precision: One of ``PRECISIONS``.
        optimizer_states: States per parameter: 2 for Adam/AdamW, 1 for SGD with momentum, 0 for
            plain SGD.
        activation_bytes: Activation estimate per rank, added to every strategy.
        device_bytes: Memory per rank; when given, each estimate says whether it fits.
        headroom: Fraction of ``device_bytes`` the model may use.
        block_params: G, the parameters full sharding gathers at once. Default: detected for a
            model (``gathered_params``); for a number, the whole model (the wrapping is unknown).
        ranks_per_node: S, the ranks of one node; when the world spans several nodes
            (``1 < S < world_size``) the hsdp rows follow the fsdp ones.
        grad_accum_steps: Micro-steps per optimizer step; None when not known yet (sized as a
            window, the larger figure).

    Returns:
        One estimate per strategy, in the order of ``STRATEGIES``, with (after ``fsdp-full``)
        ``SYNC_ROWS`` when there is a window, then ``HSDP_ROWS`` and with a window
        ``DEFER_ROWS`` on several nodes.

    Raises:
        ConfigError: A negative count, ``world_size < 1``, an unknown precision, a headroom outside
            (0, 1], a non-positive ``device_bytes``, ``block_params`` above the parameter count,
            a ``ranks_per_node`` that does not divide ``world_size``, or a ``grad_accum_steps``
            below 1.
    """
    if hasattr(model_or_num_params, "parameters"):  # a torch module
        num_params = count_params(model_or_num_params)
        trainable = count_params(model_or_num_params, trainable_only=True)
        if block_params is None:
            block_params = gathered_params(model_or_num_params)
    else:
        num_params = trainable = _check_int("num_params", model_or_num_params)
        if block_params is None:
            block_params = num_params
    _check_int("world_size", world_size, minimum=1)
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    _check_int("optimizer_states", optimizer_states)
    _check_int("activation_bytes", activation_bytes)
    _check_int("block_params", block_params)
    if block_params > num_params:
        raise ConfigError(f"block_params={block_params} exceeds the {num_params} parameters")
    budget = _budget(device_bytes, headroom)
    window = grad_accum_steps is None or _check_int("grad_accum_steps", grad_accum_steps,
                                                    minimum=1) > 1
    extra = list(SYNC_ROWS if window else ())
    if ranks_per_node is not None:
        _check_int("ranks_per_node", ranks_per_node, minimum=1)
        if world_size % ranks_per_node:
            raise ConfigError(f"ranks_per_node={ranks_per_node} does not divide world_size="
                              f"{world_size}; nodes run the same number of ranks")
        if 1 < ranks_per_node < world_size:
            extra += HSDP_ROWS + (DEFER_ROWS if window else ())
    rows = list(STRATEGIES)
    rows[rows.index("fsdp-full") + 1:rows.index("fsdp-full") + 1] = extra

    def shard(count: int, is_sharded: bool, ranks: int) -> int:
        # Elements per rank, rounded up: FSDP2 and DeepSpeed pad every shard to the same size.
        return -(-count // ranks) if is_sharded else count

    estimates = []
    for strategy in rows:
        sharding = _SHARDING[strategy]
        ranks = ranks_per_node if sharding.within_node and ranks_per_node else world_size
        size = _BYTES[sharding.deepspeed, precision]
        gathered = {"none": 0, "all": num_params, "block": block_params}[sharding.gathered]
        params_bytes = (size.param * shard(num_params, sharding.params, ranks)
                        + size.gathered * gathered)
        held_sharded = sharding.grads and not (window and sharding.window_unsharded)
        grads_bytes = size.grad * shard(trainable, held_sharded, ranks)
        # DeepSpeed's ZeRO 1/2 optimizer clones its fp32 partition even in fp32
        # (single_partition_of_fp32_groups): measured by bench/memory.py.
        master = 4 if sharding.deepspeed and not sharding.params and precision == "fp32" else (
            size.master)
        per_param_optimizer = master + optimizer_states * size.state
        optimizer_bytes = per_param_optimizer * shard(trainable, sharding.optimizer, ranks)
        total = params_bytes + grads_bytes + optimizer_bytes + activation_bytes
        estimates.append(
            MemoryEstimate(
                strategy=strategy,
                params_bytes=params_bytes,
                grads_bytes=grads_bytes,
                optimizer_bytes=optimizer_bytes,
                activation_bytes=activation_bytes,
                total_bytes=total,
                fits=None if budget is None else total <= budget,
            )
        )
    return estimates


def _budget(device_bytes: int | None, headroom: float) -> float | None:
    if not 0 < headroom <= 1:
        raise ConfigError(f"headroom must be in (0, 1], got {headroom}")
    if device_bytes is None:
        return None
    if device_bytes <= 0:
        raise ConfigError(f"device_bytes must be > 0, got {device_bytes}")
    return headroom * device_bytes


def _check_int(name: str, value: int, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


_MOVED = {"choose_strategy": "accumix.memory.strategy_choice",
          "StrategyChoice": "accumix.memory.strategy_choice",
          "device_free_bytes": "accumix.memory.device_memory"}


def __getattr__(name: str) -> object:
    """The names that moved out of this module stay importable from it (code written against
    ``accumix.memory.model.choose_strategy`` keeps working); imported on first use, as
    ``strategy_choice`` imports this module."""
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
