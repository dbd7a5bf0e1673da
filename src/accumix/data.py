"""DataLoader wrapping: the distributed sampler, epochs, device placement, resumable position.

The wrapper rebuilds the user's loader around a ``ResumableSampler`` (a DistributedSampler that
keeps the loader's shuffle and drop_last and can start mid-epoch), calls ``set_epoch`` at each
new epoch without the user, moves batches to the device, and looks one batch ahead so the last
batch of an epoch is known to end the accumulation window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from accumix.errors import ConfigError


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` whose next epoch can start after ``start_index`` of its indices.

    Skipping happens on indices, so a resumed epoch never reads the skipped samples.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start_index = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self.start_index = self.start_index, 0  # only the resumed epoch skips
        return iter(indices[start:])

    def __len__(self) -> int:
        return self.num_samples - self.start_index


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Moves every tensor inside nested tuples, lists and dicts (and ``.to``-able objects)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to_device(b, device, non_blocking) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(b, device, non_blocking) for b in batch)
    if isinstance(batch, dict):
        return type(batch)((k, move_to_device(v, device, non_blocking)) for k, v in batch.items())
    if hasattr(batch, "to") and callable(batch.to):  # e.g. transformers' BatchEncoding
        return batch.to(device)
    return batch


def _rebuild(loader: DataLoader, sampler: ResumableSampler) -> DataLoader:
    kwargs: dict[str, Any] = {
        "batch_size": loader.batch_size,
        "sampler": sampler,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
    return DataLoader(loader.dataset, **kwargs)


class AcceleratedDataLoader:
    """The user's DataLoader, sharded over ranks, on the device, aware of its last batch.

    Each ``iter()`` starts a new epoch (``set_epoch`` is called for you); ``state_dict`` holds
    the epoch and the batches already yielded in it, so a resumed run continues at the exact
    batch.

    Args:
        loader: the user's DataLoader.
        device: where batches go.
        rank: this rank's index among the data-parallel ranks.
        world_size: the number of data-parallel ranks.
        seed: the shuffle seed, the same on every rank.
        on_batch: called with ``is_last`` before each batch is yielded.
    """

    def __init__(
        self,
        loader: DataLoader,
        *,
        device: torch.device,
        rank: int,
        world_size: int,
        seed: int,
        on_batch: Callable[[bool], None],
    ) -> None:
        self.device = device
        self._on_batch = on_batch
        self._move = device.type != "cpu"  # CPU tensors are already where they belong
        self._non_blocking = loader.pin_memory and device.type == "cuda"
        self.sampler: ResumableSampler | None = None
        self.epoch = 0
        self.position = 0  # batches yielded in the current epoch
        self._started = False
        self._resume_position = 0
        if isinstance(loader.dataset, IterableDataset):
            self.loader = loader  # the user shards an iterable dataset; we cannot
            return
        sampler = loader.sampler
        if loader.batch_size is None:
            if world_size > 1:
                raise ConfigError(
                    "DataLoader with a custom batch_sampler "
                    f"({type(loader.batch_sampler).__name__}) cannot be sharded over ranks; "
                    "pass batch_size= and shuffle= instead"
                )
            self.loader = loader
            return
        if isinstance(sampler, DistributedSampler):
            shuffle, seed = sampler.shuffle, sampler.seed
        elif isinstance(sampler, (RandomSampler, SequentialSampler)):
            shuffle = isinstance(sampler, RandomSampler)
        elif world_size == 1:
            self.loader = loader  # the user's own sampler; kept, but not resumable mid-epoch
            return
        else:
            raise ConfigError(
                f"DataLoader sampler {type(sampler).__name__} cannot be sharded over ranks; "
                "use shuffle=True/False or a DistributedSampler"
            )
        self.sampler = ResumableSampler(
            loader.dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=loader.drop_last,
        )
        self.loader = _rebuild(loader, self.sampler)

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Makes the next ``iter()`` run epoch ``epoch`` from its start."""
        self.epoch, self._started, self._resume_position = epoch, False, 0

    def __iter__(self) -> Iterator[Any]:
        if self._started and not self._resume_position:
            self.epoch += 1
        self._started = True
        skip, self._resume_position = self._resume_position, 0
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
            self.sampler.start_index = skip * (self.loader.batch_size or 1)
        self.position = skip
        iterator = iter(self.loader)
        try:
            batch = next(iterator)
        except StopIteration:
            return
        while True:
            try:
                upcoming = next(iterator)
                is_last = False
            except StopIteration:
                is_last = True
            self.position += 1
            self._on_batch(is_last)
            yield move_to_device(batch, self.device, self._non_blocking) if self._move else batch
            if is_last:
                return
            batch = upcoming

    def state_dict(self) -> dict[str, int]:
        """The epoch and the batches of it already yielded."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The next ``iter()`` continues epoch ``state["epoch"]`` after ``state["position"]``."""
        if self.sampler is None and state["position"]:
            raise ConfigError(
                "this DataLoader has no resumable sampler (custom sampler or iterable dataset); "
                "it cannot continue mid-epoch"
            )
        self.epoch, self._started = state["epoch"], True
        self._resume_position = state["position"]
        if not self._resume_position:  # at an epoch's end: the next iter() starts the next one
            self.position = 0
