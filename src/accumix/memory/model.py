"""Memory model per strategy, and the choice that ``strategy="auto"`` makes from it.

Counts the *model states* one data-parallel rank holds (parameters, gradients, optimizer states)
the way the ZeRO paper does, plus an activation estimate the caller supplies. Imports only
``accumix.errors``, ``param_counts`` and ``table`` from accumix, none of which loads torch;
torch only where a torch model or device is passed (the JAX backend sizes its strategies from a
parameter count).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # torch loads lazily: the JAX backend sizes its strategies with this model
    import torch
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


_SHARDING: dict[str, _Sharding] = {
    # sharded: optimizer, grads, params; then gathered, and whether DeepSpeed stores it
    "ddp": _Sharding(False, False, False, "none", False),
    "zero1": _Sharding(True, False, False, "none", False),
    "fsdp-grad_op": _Sharding(True, True, True, "all", False),
    "fsdp-full": _Sharding(True, True, True, "block", False),
    "hsdp-grad_op": _Sharding(True, True, True, "all", False, within_node=True),
    "hsdp-full": _Sharding(True, True, True, "block", False, within_node=True),
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
# The rows of one node's world; hsdp's come only with several nodes (``ranks_per_node``).
HSDP_ROWS: tuple[str, ...] = ("hsdp-grad_op", "hsdp-full")
STRATEGIES: tuple[str, ...] = tuple(name for name in _SHARDING if name not in HSDP_ROWS)
PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")
# The order "auto" tries, least communication first: (estimate, strategy word, FSDP sharding).
_AUTO_ORDER: tuple[tuple[str, str, str | None], ...] = (
    ("ddp", "ddp", None),
    ("zero1", "zero1", None),
    ("fsdp-grad_op", "fsdp", "grad_op"),
    ("fsdp-full", "fsdp", "full"),
)
# On several nodes the link between them is the slow one: ddp and hsdp cross it once per step
# with the gradients (hsdp: each rank its shard), zero1 adds an all-gather of the parameters
# across every rank, fsdp two per micro-step.
_AUTO_ORDER_NODES: tuple[tuple[str, str, str | None], ...] = (
    ("ddp", "ddp", None),
    ("hsdp-grad_op", "hsdp", "grad_op"),
    ("hsdp-full", "hsdp", "full"),
    ("zero1", "zero1", None),
    ("fsdp-grad_op", "fsdp", "grad_op"),
    ("fsdp-full", "fsdp", "full"),
)
_GIB = 1024**3


@dataclass(kw_only=True, frozen=True, slots=True)
class MemoryEstimate:
    """Bytes one data-parallel rank holds under one strategy.

    Attributes:
        strategy: One of ``STRATEGIES``.
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


@dataclass(kw_only=True, frozen=True, slots=True)
class StrategyChoice:
    """What ``strategy="auto"`` picked and why.

    Attributes:
        strategy: ``"single"``, ``"ddp"``, ``"zero1"``, ``"fsdp"`` or ``"hsdp"``.
        sharding: ``"grad_op"`` or ``"full"`` when ``strategy`` is fsdp or hsdp, else None.
        reason: One line naming the choice, the bytes per rank and the budget.
    """

    strategy: str
    sharding: str | None
    reason: str


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

    each plus ``activation_bytes``. Bytes (param p, gathered c, grad g, state s, master m): fp32
    4/4/4/4/0; bf16-/fp16-mixed 4/2/4/4/0 under torch (autocast, FSDP2 MixedPrecisionPolicy) and
    2/2/2/4/4 under DeepSpeed (ZeRO's 16 bytes for Adam); bf16-true 2/2/2/2/0 under torch and
    2/2/2/4/4 under DeepSpeed, which always keeps fp32 master weights and states.

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

    Returns:
        One estimate per strategy, in the order of ``STRATEGIES`` (with ``HSDP_ROWS`` after
        ``fsdp-full`` on several nodes).

    Raises:
        ConfigError: A negative count, ``world_size < 1``, an unknown precision, a headroom outside
            (0, 1], a non-positive ``device_bytes``, ``block_params`` above the parameter count,
            or a ``ranks_per_node`` that does not divide ``world_size``.
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
    rows = list(STRATEGIES)
    if ranks_per_node is not None:
        _check_int("ranks_per_node", ranks_per_node, minimum=1)
        if world_size % ranks_per_node:
            raise ConfigError(f"ranks_per_node={ranks_per_node} does not divide world_size="
                              f"{world_size}; nodes run the same number of ranks")
        if 1 < ranks_per_node < world_size:
            rows[rows.index("fsdp-full") + 1:rows.index("fsdp-full") + 1] = HSDP_ROWS

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
        grads_bytes = size.grad * shard(trainable, sharding.grads, ranks)
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


def choose_strategy(
    estimates: list[MemoryEstimate],
    *,
    device_bytes: int,
    headroom: float = 0.8,
    world_size: int,
    ranks_per_node: int | None = None,
) -> StrategyChoice:
    """Pick the strategy with the least communication that fits ``headroom * device_bytes``.

    One rank gets ``"single"``. Otherwise ddp, zero1, fsdp ``grad_op`` and fsdp ``full`` are
    tried in that order (each communicates more than the one before). On several nodes (the
    estimates have the hsdp rows) the link between nodes decides: ddp, hsdp ``grad_op``, hsdp
    ``full`` (sharded within a node, so a model that fits sharded over one node's ranks
    crosses nodes once per step), then zero1 and fsdp. DeepSpeed is never picked
    automatically. When nothing fits the answer is fsdp ``full`` with a reason saying by how
    much it misses: the caller decides whether that is an error.

    Args:
        estimates: From ``estimate_memory`` (must include ddp, zero1, fsdp-grad_op, fsdp-full).
        device_bytes: Memory per rank, e.g. from ``device_free_bytes``.
        headroom: Fraction of ``device_bytes`` the model may use.
        world_size: Data-parallel ranks.
        ranks_per_node: the ranks of one node (named in an hsdp choice's reason).

    Returns:
        The choice, with a one-line reason that names the bytes per rank.

    Raises:
        ConfigError: ``world_size < 1``, a headroom outside (0, 1], a non-positive
            ``device_bytes``, or an estimate missing.
    """
    _check_int("world_size", world_size, minimum=1)
    budget = _budget(device_bytes, headroom)
    assert budget is not None  # device_bytes is required here
    by_name = {estimate.strategy: estimate for estimate in estimates}
    missing = [name for name, _, _ in _AUTO_ORDER if name not in by_name]
    if missing:
        raise ConfigError(f"estimates lack {', '.join(missing)}; pass estimate_memory()'s list")
    of_budget = f"{headroom:.0%} of {_gib(device_bytes)}"
    ddp_total = by_name["ddp"].total_bytes
    nodes = HSDP_ROWS[0] in by_name

    if world_size == 1:
        verdict = _verdict(ddp_total, budget, of_budget)
        return StrategyChoice(
            strategy="single", sharding=None, reason=f"single (world size 1): {verdict}"
        )
    for name, strategy, sharding in _AUTO_ORDER_NODES if nodes else _AUTO_ORDER:
        total = by_name[name].total_bytes
        if total <= budget:
            label = strategy if sharding is None else f"{strategy} (sharding={sharding})"
            reason = f"{label}: {_verdict(total, budget, of_budget)}"
            if name != "ddp":
                reason += f"; ddp needs {_gib(ddp_total)}"
            if strategy == "hsdp":
                within = f"the {ranks_per_node} ranks of a node" if ranks_per_node else "a node"
                reason += (f"; sharded within {within}, replicated across nodes: "
                           "the nodes exchange gradient shards once per step")
            return StrategyChoice(strategy=strategy, sharding=sharding, reason=reason)
    full_total = by_name["fsdp-full"].total_bytes
    reason = (
        f"fsdp (sharding=full): {_verdict(full_total, budget, of_budget)}; nothing fits: use a "
        "smaller micro batch, activation checkpointing or more ranks"
    )
    return StrategyChoice(strategy="fsdp", sharding="full", reason=reason)


def device_free_bytes(device: torch.device | str, *, local_world_size: int = 1) -> int:
    """Free memory one rank may use on ``device``.

    Args:
        device: A CUDA device (its free memory, ``torch.cuda.mem_get_info``) or the CPU (the
            host's available memory shared by the ranks on this host).
        local_world_size: Ranks sharing the host's memory; divides the CPU figure.

    Returns:
        Bytes.

    Raises:
        ConfigError: ``local_world_size < 1`` or a device type other than cuda or cpu.
    """
    _check_int("local_world_size", local_world_size, minimum=1)
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        return _host_available_bytes() // local_world_size
    raise ConfigError(f"cannot size memory of device type {device.type!r}; choose cuda or cpu")


def _host_available_bytes() -> int:
    # MemAvailable counts reclaimable page cache; SC_AVPHYS_PAGES (MemFree) does not and reads
    # far too low on a host that has been reading files for a while.
    meminfo = _read_text("/proc/meminfo") or ""
    lines = [line.split() for line in meminfo.splitlines() if line.startswith("MemAvailable:")]
    if lines:
        available = int(lines[0][1]) * 1024
    else:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    # Inside a container /proc/meminfo shows the whole host; the cgroup v2 limit is what kills us.
    limit = _read_text("/sys/fs/cgroup/memory.max")
    current = _read_text("/sys/fs/cgroup/memory.current")
    if limit is None or current is None or not limit.isdigit() or not current.isdigit():
        return available
    return min(available, max(int(limit) - int(current), 0))


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return None


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


def _verdict(total: int, budget: float, of_budget: str) -> str:
    if total <= budget:
        return f"{_gib(total)} per rank fits {of_budget}"
    return (
        f"{_gib(total)} per rank does not fit {of_budget} ({_gib(budget)}), "
        f"{_gib(total - budget)} over"
    )


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / _GIB:.2f} GiB"
