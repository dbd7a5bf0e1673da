"""The choice ``strategy="auto"`` makes from the memory model (``accumix.memory.model``): the
least communication whose estimate fits. Torch-free, like the model."""

from __future__ import annotations

from dataclasses import dataclass

from accumix.errors import ConfigError
from accumix.memory.model import _GIB, HSDP_ROWS, MemoryEstimate, _budget, _check_int

# The order "auto" tries, least communication first: (estimate, strategy word, FSDP sharding).
_AUTO_ORDER: tuple[tuple[str, str, str | None], ...] = (
    ("ddp", "ddp", None),
    ("zero1", "zero1", None),
    ("fsdp-grad_op", "fsdp", "grad_op"),
    ("fsdp-full", "fsdp", "full"),
)
# With a window (the estimates have them): fsdp reduce-scattering every micro-step, K times the
# gradient traffic for sharded gradients between micro-steps; tried last, and the least memory.
_SYNC_ORDER: tuple[tuple[str, str, str | None], ...] = (
    ("fsdp-grad_op-sync", "fsdp", "grad_op"),
    ("fsdp-full-sync", "fsdp", "full"),
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


@dataclass(kw_only=True, frozen=True, slots=True)
class StrategyChoice:
    """What ``strategy="auto"`` picked and why.

    Attributes:
        strategy: ``"single"``, ``"ddp"``, ``"zero1"``, ``"fsdp"`` or ``"hsdp"``.
        sharding: ``"grad_op"`` or ``"full"`` when ``strategy`` is fsdp or hsdp, else None.
        reason: One line naming the choice, the bytes per rank and the budget.
        sync_each_microstep: fsdp reducing every micro-step (``FSDPStrategy``'s argument).
    """

    strategy: str
    sharding: str | None
    reason: str
    sync_each_microstep: bool = False


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
    crosses nodes once per step), then zero1 and fsdp. With a window (the estimates have
    ``SYNC_ROWS``, whose fsdp default holds unsharded window gradients) fsdp with
    ``sync_each_microstep=True`` comes last, ``grad_op`` then ``full``. DeepSpeed is never picked
    automatically. When nothing fits the answer is the least memory, fsdp ``full`` (with a window
    ``sync_each_microstep``), with a reason saying by how much it misses: the caller decides
    whether that is an error.

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
    order = (_AUTO_ORDER_NODES if nodes else _AUTO_ORDER) + tuple(
        row for row in _SYNC_ORDER if row[0] in by_name)
    for name, strategy, sharding in order:
        total = by_name[name].total_bytes
        if total <= budget:
            reason = f"{_label(name, strategy, sharding)}: {_verdict(total, budget, of_budget)}"
            if name != "ddp":
                reason += f"; ddp needs {_gib(ddp_total)}"
            if strategy == "hsdp":
                within = f"the {ranks_per_node} ranks of a node" if ranks_per_node else "a node"
                reason += (f"; sharded within {within}, replicated across nodes: "
                           "the nodes exchange gradient shards once per step")
            if name.endswith("-sync"):
                default = by_name[name.removesuffix("-sync")].total_bytes
                reason += (f"; its default would hold the window's unsharded gradients "
                           f"({_gib(default)})")
            return StrategyChoice(strategy=strategy, sharding=sharding, reason=reason,
                                  sync_each_microstep=name.endswith("-sync"))
    name, strategy, sharding = order[-1]  # fsdp full, the least memory
    reason = (
        f"{_label(name, strategy, sharding)}: "
        f"{_verdict(by_name[name].total_bytes, budget, of_budget)}; nothing fits: use a "
        "smaller micro batch, activation checkpointing or more ranks"
    )
    return StrategyChoice(strategy=strategy, sharding=sharding, reason=reason,
                          sync_each_microstep=name.endswith("-sync"))


def _label(name: str, strategy: str, sharding: str | None) -> str:
    if sharding is None:
        return strategy
    sync = ", sync_each_microstep=True" if name.endswith("-sync") else ""
    return f"{strategy} (sharding={sharding}{sync})"


def _verdict(total: int, budget: float, of_budget: str) -> str:
    if total <= budget:
        return f"{_gib(total)} per rank fits {of_budget}"
    return (
        f"{_gib(total)} per rank does not fit {of_budget} ({_gib(budget)}), "
        f"{_gib(total - budget)} over"
    )


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / _GIB:.2f} GiB"
