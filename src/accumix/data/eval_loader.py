"""An evaluation loader split over ranks in blocks: every sample exactly once, no padding.

A set-up loader pads each epoch so that every rank has as many batches (``DistributedSampler``):
right for training, where the ranks step together, but a padded sample is evaluated twice. Here
rank ``r`` takes the ``r``-th contiguous block of the samples (the first ``N mod W`` blocks one
longer), so the shards are uneven, nothing is repeated, and the ranks' rows in rank order are
the samples in the loader's order: ``acc.reduce`` of per-rank sums, or ``acc.gather`` of
per-rank rows once after the loop, is exactly the one-process result on any world size.

The ranks may then run different numbers of batches: a collective inside the loop (a gather per
batch, a forward that gathers parameters) would wait for a rank that has finished. A strategy
whose forward communicates (fsdp, hsdp, DeepSpeed stage 3) is refused when the counts differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
)

from accumix.data.batch_place import BatchPlace, next_seq
from accumix.data.loader import move_to_device
from accumix.errors import ConfigError


def evaluated_indices(loader: DataLoader, world_size: int, name: str = "val_loader"
                      ) -> list[int]:
    """The dataset indices the loader's sampler covers, in a fixed order (no random draw): all of
    them for no sampler or a shuffle (the order never changes a sum), a ``SubsetRandomSampler``'s
    own; with ``drop_last`` only the whole batches of them, so every world size evaluates what
    one process would.

    Raises:
        ConfigError: a sampler whose samples cannot be known in advance (a weighted or
            with-replacement draw, a user's sampler).
    """
    sampler, size = loader.sampler, len(loader.dataset)  # type: ignore[arg-type]
    if isinstance(sampler, SequentialSampler):
        indices = list(range(size))
    elif isinstance(sampler, RandomSampler) and not sampler.replacement \
            and sampler.num_samples == size:
        indices = list(range(size))  # every sample once, shuffled: the same set
    elif isinstance(sampler, SubsetRandomSampler):
        indices = [int(i) for i in sampler.indices]
    else:
        raise ConfigError(
            f"{name}'s sampler {type(sampler).__name__} cannot be split over {world_size} "
            "ranks without changing which samples are evaluated; give the samples as "
            "torch.utils.data.Subset(dataset, indices) (or a SubsetRandomSampler) and no other "
            "sampler: accumix shards the evaluation set itself"
        )
    if loader.drop_last and loader.batch_size:
        indices = indices[:len(indices) // loader.batch_size * loader.batch_size]
    return indices


def subset_loader(loader: DataLoader, indices: list[int]) -> DataLoader:
    """The user's loader over ``dataset[indices]`` in that order: its batch size, collate_fn,
    workers and every other setting, no shuffle and no dropping (the indices are final)."""
    workers = loader.num_workers
    return DataLoader(
        Subset(loader.dataset, indices),
        batch_size=loader.batch_size,
        shuffle=False,
        num_workers=workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context if workers else None,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=loader.persistent_workers if workers else False,
    )


def block(count: int, rank: int, world_size: int) -> range:
    """Rank ``rank``'s contiguous share of ``count`` items (the first ``count % world_size``
    shares one longer)."""
    base, extra = divmod(count, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


class EvalLoader:
    """The user's evaluation DataLoader, this rank's block of it, batches on the device.

    Args:
        loader: the user's (unsharded) DataLoader.
        rank: this rank.
        world_size: the data-parallel ranks.
        device: where batches go.
        forward_collectives: whether the strategy's forward communicates (asked when an
            epoch starts: ``strategy="auto"`` chooses at the model's setup).

    Raises:
        ConfigError: on several ranks, a loader that cannot be split without changing the
            samples (an IterableDataset, a custom batch_sampler, a weighted sampler).
    """

    def __init__(self, loader: DataLoader, *, rank: int, world_size: int,
                 device: torch.device, forward_collectives: Callable[[], str | None]) -> None:
        self._dataset = loader.dataset
        self.device = device
        self._move = device.type != "cpu"
        self._forward_collectives = forward_collectives
        self.place: BatchPlace | None = None
        if isinstance(loader.dataset, IterableDataset) or not loader.batch_size:
            if world_size > 1:
                kind = (f"an IterableDataset ({type(loader.dataset).__name__})" if isinstance(
                    loader.dataset, IterableDataset) else "a custom batch_sampler")
                raise ConfigError(
                    f"acc.setup_eval_loader cannot split a DataLoader with {kind} over "
                    f"{world_size} ranks without repeating or losing samples; give a map-style "
                    "dataset with batch_size= (shard an iterable dataset yourself and gather "
                    "with acc.gather)")
            self.loader, self._counts = loader, [-1]
            return
        indices = evaluated_indices(loader, world_size, "the evaluation loader")
        batch = loader.batch_size
        blocks = [block(len(indices), r, world_size) for r in range(world_size)]
        self._counts = [math.ceil(len(b) / batch) for b in blocks]
        mine = blocks[rank]
        self.loader = subset_loader(loader, indices[mine.start:mine.stop])

    @property
    def dataset(self) -> Any:
        return self._dataset

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    @property
    def batches_per_rank(self) -> list[int]:
        """Each rank's batches (-1 where unknown: one process, a loader it did not split)."""
        return list(self._counts)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self._check_lockstep()
        try:
            for batch in self.loader:
                # Marks the batch as this loader's: acc.gather_for_metrics refuses it (a gather
                # per batch would wait for a rank that has run out of batches).
                self.place = BatchPlace(seq=next_seq(), rows=0, first=0, stride=1, samples=0,
                                        padded=False)
                yield move_to_device(batch, self.device) if self._move else batch
        finally:
            self.place = None

    def _check_lockstep(self) -> None:
        counts = self._counts
        strategy = self._forward_collectives()
        if strategy is None or len(set(counts)) <= 1:
            return
        listed = ", ".join(f"rank {r} {n}" for r, n in enumerate(counts))
        raise ConfigError(
            f"the {strategy} strategy runs collectives in the model's forward, so every rank "
            f"must evaluate as many batches, but this uneven split gives {listed} (batch size "
            f"{self.batch_size}); set the loader up with acc.setup (padded, equal batches) and "
            "gather with acc.gather_for_metrics, or pick a batch size that gives every rank "
            "as many batches")

