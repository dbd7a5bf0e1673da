"""Validation over all ranks: each rank takes every W-th sample, no sample twice, in lockstep.

A ``DistributedSampler`` pads the last shard with repeated samples, which biases a validation
loss; here each rank gets ``range(rank, N, W)`` and the loss is the exact item-weighted (or
sample-weighted) mean over the whole set. Sharded backends (FSDP, ZeRO-3) run collectives inside
the forward, so every rank runs the same number of forwards: a rank with fewer batches repeats
its last one with weight 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SubsetRandomSampler

from accumix.data.eval_loader import evaluated_indices, subset_loader
from accumix.data.loader import move_to_device
from accumix.errors import ConfigError
from accumix.trainer.metrics import batch_samples, split_loss


def shard_for_eval(loader: DataLoader, rank: int, world_size: int) -> tuple[DataLoader, int]:
    """This rank's share of a validation loader, and the most batches any rank gets.

    The samples evaluated are those one process would evaluate, on any world size: the
    sampler's indices (all of them for no sampler or a shuffle, a ``SubsetRandomSampler``'s
    own; the order never changes a sum), and with ``drop_last`` the whole batches of them in
    that order (a shuffled loader's dropped remainder would be another each time). Rank ``r``
    takes every W-th of them from the ``r``-th, without dropping anything more.

    Args:
        loader: the user's (unsharded) validation DataLoader.
        rank: this rank.
        world_size: the number of ranks.

    Returns:
        ``(loader, max_batches)``; an iterable dataset or a custom batch sampler cannot be split,
        so every rank then runs the whole loader (``max_batches`` is -1: each rank's own count).

    Raises:
        ConfigError: a sampler whose samples cannot be known in advance (a weighted or
            with-replacement draw, a user's sampler) on several ranks.
    """
    if isinstance(loader.dataset, IterableDataset) or not loader.batch_size:
        return loader, -1
    random_order = isinstance(loader.sampler, (RandomSampler, SubsetRandomSampler))
    if world_size == 1 and not (loader.drop_last and random_order):
        return loader, -1  # one process evaluates exactly what the loader yields
    indices = evaluated_indices(loader, world_size)
    shard = subset_loader(loader, indices[rank::world_size])
    return shard, math.ceil(len(indices[0::world_size]) / loader.batch_size)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    step_fn: Callable[[nn.Module, Any], Any],
    accelerator: Any,
    *,
    max_batches: int = -1,
    sharded: bool = True,
) -> dict[str, float]:
    """The validation loss over the whole set, the same on every rank.

    Args:
        model: the set-up model (evaluated in ``eval()`` mode, then put back in ``train()``).
        loader: this rank's share (from ``shard_for_eval``).
        step_fn: ``fn(model, batch)`` returning a mean loss or ``(loss_sum, num_items)``, or a
            dict of ``"loss"`` (``"num_items"``) and named ``(sum, count)`` pairs
            (``split_named_sums``).
        accelerator: the run's Accelerator (device and all-reduce).
        max_batches: forwards every rank runs (-1: this loader's own length).
        sharded: the ranks hold different samples, so their sums are all-reduced.

    Returns:
        ``{"val_loss": ..., "val_items": ..., "val_<name>": ...}``: the sum of losses over the
        sum of items (or the sample-weighted mean of batch means), and each named sum over its
        count.
    """
    was_training = model.training
    model.eval()
    device = accelerator.device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    names: list[str] | None = None  # the named sums, fixed by the first batch
    last: Any = None
    iterator = iter(loader)
    index = 0
    try:
        while max_batches < 0 or index < max_batches:
            batch = next(iterator, None)
            weight = 1.0
            if batch is None:
                if max_batches < 0:
                    break
                batch, weight = last, 0.0  # keep in step with ranks that have more batches
                if batch is None:  # this rank has no samples at all
                    batch = next(iter(DataLoader(loader.dataset.dataset, batch_size=1,
                                                 collate_fn=loader.collate_fn)))
            last = batch
            batch = move_to_device(batch, device)
            output, named = split_named_sums(step_fn(model, batch))
            if names is None:
                names = sorted(named)
                total = torch.cat([total, total.new_zeros(2 * len(names))])
            elif sorted(named) != names:
                raise ConfigError(f"the evaluation step returned sums {sorted(named)} after "
                                  f"{names}; return the same names for every batch")
            for i, name in enumerate(names):
                for j, value in enumerate(named[name]):
                    total[2 + 2 * i + j] += _as_double(value, device) * weight
            loss, items = split_loss(output)
            if items is None:  # a batch mean: weigh it by its samples
                items = batch_samples(batch)
                loss = loss.detach().double() * items
            count = items.detach().double() if isinstance(items, torch.Tensor) else float(items)
            total[0] += loss.detach().double() * weight
            total[1] += count * weight
            index += 1
    finally:
        model.train(was_training)
    if sharded:
        total = accelerator.reduce(total, "sum")
    loss_sum, count, *sums = total.tolist()
    result = {"val_loss": loss_sum / count if count > 0 else math.nan, "val_items": count}
    for i, name in enumerate(names or []):
        part, whole = sums[2 * i], sums[2 * i + 1]
        result[f"val_{name}"] = part / whole if whole > 0 else math.nan
    return result


def split_named_sums(output: Any) -> tuple[Any, dict[str, tuple[Any, Any]]]:
    """An evaluation step's result as (the loss part, ``{name: (sum, count)}``).

    A dict with ``"loss"`` (and optionally ``"num_items"``) may carry named sums, e.g.
    ``{"loss": loss, "accuracy": (correct, n), "top5": (correct5, n)}``: each is summed over
    the batches and all-reduced over the ranks with the loss (exact, as ``val_loss``), and
    reported as ``val_<name> = sum / count``. Anything else is the loss part alone.

    Raises:
        ConfigError: a named value that is not a ``(sum, count)`` pair.
    """
    if not (isinstance(output, dict) and "loss" in output):
        return output, {}
    named = {k: v for k, v in output.items() if k not in ("loss", "num_items")}
    for name, value in named.items():
        if name == "items":  # its column would replace val_items, the count of the loss
            raise ConfigError("the evaluation step returned a named sum 'items', whose "
                              "val_items column is the loss's item count; rename it, e.g. "
                              "'samples'")
        if not (isinstance(value, (tuple, list)) and len(value) == 2):
            raise ConfigError(f"the evaluation step returned {name}={value!r}; return named "
                              "sums as (sum, count) pairs, e.g. 'accuracy': (correct, n)")
    loss = output["loss"] if "num_items" not in output else (output["loss"],
                                                              output["num_items"])
    return loss, named


def _as_double(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64).reshape(())
    return torch.tensor(float(value), dtype=torch.float64, device=device)
