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

from accumix.common.worker_signals import with_guard
from accumix.data.batch_place import BatchPlace, strided_place
from accumix.data.sample_seeds import EpochSeedTagged, SeededCollate, SeededDataset, draws_nothing
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
    """The user's loader around ``sampler``; unless the dataset draws nothing, each sample is
    read under its own random streams (``accumix.data.sample_seeds``), so a resumed epoch augments
    every sample as the uninterrupted run did, whatever the workers."""
    dataset, indices, collate = loader.dataset, sampler, loader.collate_fn
    if not draws_nothing(dataset):
        dataset, indices = SeededDataset(dataset), EpochSeedTagged(sampler)
        collate = SeededCollate(collate)
    return DataLoader(dataset, **_loader_kwargs(loader, sampler=indices, collate_fn=collate,
                                                batch_size=loader.batch_size))


def with_batch_size(loader: DataLoader, batch_size: int) -> DataLoader:
    """The user's loader with another batch size: the same dataset, sampler (so shuffle and its
    generator), collate_fn, workers and every other setting (``micro_batch_size="auto"``); an
    IterableDataset's stream is grouped into batches of the new size.

    Raises:
        ConfigError: a loader with a custom batch_sampler, or over an IterableDataset that
            batches itself: no batch size to change.
    """
    if loader.batch_size is None and isinstance(loader.dataset, IterableDataset):
        raise ConfigError(f"micro_batch_size='auto' re-batches the DataLoader but its "
                          f"{type(loader.dataset).__name__} yields batches itself "
                          "(batch_size=None); yield samples and pass batch_size=, or give "
                          "micro_batch_size=N")
    if loader.batch_size is None:
        raise ConfigError(f"micro_batch_size='auto' re-batches the DataLoader but it has a "
                          f"custom batch_sampler ({type(loader.batch_sampler).__name__}); pass "
                          "batch_size= and shuffle= instead")
    if loader.batch_size == batch_size:
        return loader
    kwargs = _loader_kwargs(loader, sampler=loader.sampler, collate_fn=loader.collate_fn,
                            batch_size=batch_size)
    if isinstance(loader.dataset, IterableDataset):
        # Its samples come in the dataset's own order: torch refuses any sampler option (the
        # loader's is an internal placeholder); the re-batched loader groups them anew.
        del kwargs["sampler"]
    return DataLoader(loader.dataset, **kwargs)


def _loader_kwargs(loader: DataLoader, *, sampler: Any, collate_fn: Any, batch_size: int | None
                   ) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "batch_size": batch_size,
        "sampler": sampler,
        "num_workers": loader.num_workers,
        "collate_fn": collate_fn,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        # Workers that outlive a pre-emption signal meant for their rank (worker_signals).
        "worker_init_fn": with_guard(loader.worker_init_fn) if loader.num_workers > 0
        else loader.worker_init_fn,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
    return kwargs


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
        between_batches: called when the previous batch has been used and before the next is
            taken (a checkpoint taken there has ``position`` batches fully consumed).
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
        between_batches: Callable[[], None] | None = None,
    ) -> None:
        self.device = device
        self._on_batch = on_batch
        self._between_batches = between_batches
        self._world_size = world_size
        self._move = device.type != "cpu"  # CPU tensors are already where they belong
        self._non_blocking = loader.pin_memory and device.type == "cuda"
        self.sampler: ResumableSampler | None = None
        self._dataset = loader.dataset  # the user's (the rebuilt loader may hold a wrapper)
        self.epoch = 0
        self.position = 0  # batches yielded in the current epoch
        self._started = False  # the current epoch has begun: the next iter() starts another
        self._epoch_done = False  # its last batch has been yielded
        self._resume_position = 0
        # The interrupted run's persistent worker iterator existed: its epochs drew no seed.
        self._seeded_before = False
        self._unresumable = ""  # why a mid-epoch position cannot be continued, if it cannot
        self._yielded: tuple[int, int | None] = (0, None)  # id of the last batch, its rows
        self.place: BatchPlace | None = None  # the current batch's rows in the epoch's order
        if isinstance(loader.dataset, IterableDataset):
            self.loader = loader  # the user shards an iterable dataset; we cannot
            self._unresumable = f"an IterableDataset ({type(loader.dataset).__name__})"
            return
        sampler = loader.sampler
        drop_last = loader.drop_last
        if loader.batch_size is None:
            if world_size > 1:
                raise ConfigError(
                    "DataLoader with a custom batch_sampler "
                    f"({type(loader.batch_sampler).__name__}) cannot be sharded over ranks; "
                    "pass batch_size= and shuffle= instead"
                )
            self.loader = loader
            self._unresumable = (f"a custom batch_sampler ({type(loader.batch_sampler).__name__})")
            return
        if isinstance(sampler, DistributedSampler):
            # The user's settings, drop_last included (else 7 samples on 2 ranks would repeat
            # sample 0 on rank 1).
            shuffle, seed, drop_last = sampler.shuffle, sampler.seed, sampler.drop_last
        elif isinstance(sampler, (RandomSampler, SequentialSampler)):
            shuffle = isinstance(sampler, RandomSampler)
        elif world_size == 1:
            self.loader = loader  # the user's own sampler; kept, but not resumable mid-epoch
            self._unresumable = f"a custom sampler ({type(sampler).__name__})"
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
            drop_last=drop_last,
        )
        self.loader = _rebuild(loader, self.sampler)

    @property
    def dataset(self) -> Any:
        return self._dataset

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Makes the next ``iter()`` run epoch ``epoch`` from its start."""
        self.epoch, self._started, self._resume_position = epoch, False, 0

    def __iter__(self) -> Iterator[Any]:
        if self._started:
            self.epoch += 1
        self._started, self._epoch_done = True, False
        skip, self._resume_position = self._resume_position, 0
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
            self.sampler.start_index = skip * (self.loader.batch_size or 1)
        self.position = skip
        remaining = self._samples_this_epoch()  # read before the sampler starts (and resets)
        seeded, self._seeded_before = (self._seeded_before
                                       and getattr(self.loader, "_iterator", None) is None), False
        if skip or seeded:
            # DataLoader.__iter__ draws its workers' base seed from the global RNG (or the
            # loader's generator). The interrupted run drew it when this epoch began, before the
            # RNG state that was saved and restored (or, with persistent workers, only at its
            # first epoch): drawing again would shift dropout.
            generator = self.loader.generator
            saved = generator.get_state() if generator is not None else None
            with torch.random.fork_rng(devices=[]):
                iterator = iter(self.loader)
            if generator is not None:
                generator.set_state(saved)
        else:
            iterator = iter(self.loader)
        try:
            batch = next(iterator)
        except StopIteration:
            self._epoch_done = True
            return
        while True:
            if self._between_batches is not None:
                self._between_batches()
            try:
                upcoming = next(iterator)
                is_last = False
            except StopIteration:
                is_last = True
            self.position += 1
            self._epoch_done = is_last
            self._on_batch(is_last)
            out = move_to_device(batch, self.device, self._non_blocking) if self._move else batch
            rows = self.loader.batch_size
            if rows is not None and remaining is not None:
                rows = min(rows, remaining)
                remaining -= rows
            elif is_last:  # an IterableDataset's last batch may be short
                rows = None
            self._yielded = (id(out), rows)
            self.place = self._place_of(rows)
            try:
                yield out
            except GeneratorExit:  # the loop was left early: no batch of it is current
                self.place = None
                raise
            if is_last:
                self.place = None  # no batch of this loader is current any more
                # The last batch is used: the hook runs before the user's next iter() draws
                # the next epoch's seed (a save there would miss that draw on resume).
                if self._between_batches is not None:
                    self._between_batches()
                return
            batch = upcoming

    def _place_of(self, rows: int | None) -> BatchPlace | None:
        """Where this batch's rows sit in the epoch (``acc.gather_for_metrics``); None where
        accumix did not shard the loader."""
        sampler, batch_size = self.sampler, self.loader.batch_size
        if sampler is None or rows is None or batch_size is None:
            return None
        samples = sampler.total_size if sampler.drop_last else len(self._dataset)
        return strided_place(rows=rows, offset=(self.position - 1) * batch_size,
                             rank=sampler.rank, world_size=sampler.num_replicas, samples=samples)

    def rows_of(self, batch: Any) -> int | None:
        """The samples in ``batch`` if it is the batch this loader yielded last (what
        ``acc.run_micro_batch`` reads a list of samples by), else None."""
        batch_id, rows = self._yielded
        return rows if batch_id == id(batch) else None

    def _samples_this_epoch(self) -> int | None:
        if self.loader.batch_size is None or isinstance(self._dataset, IterableDataset):
            return None
        try:
            return len(self.loader.sampler)
        except TypeError:  # a sampler without a length
            return None

    def state_dict(self) -> dict[str, int]:
        """Where the next ``iter()`` continues: an epoch and the batches of it already used.
        A finished epoch is saved as the start of the next one. With persistent workers,
        ``persistent_iterator`` says the workers exist (the next epochs draw no seed)."""
        if not self._started:
            state = {"epoch": self.epoch, "position": self._resume_position}
        elif self._epoch_done:
            state = {"epoch": self.epoch + 1, "position": 0}
        else:
            state = {"epoch": self.epoch, "position": self.position}
        if self.loader.persistent_workers and self.loader.num_workers > 0 and (
                self._seeded_before or getattr(self.loader, "_iterator", None) is not None):
            state["persistent_iterator"] = 1
        return state

    def check_savable(self, name: str) -> None:
        """Refuses a mid-epoch save that ``load_state_dict`` could not continue.

        Raises:
            ConfigError: the epoch is part used and the loader has no position to resume.
        """
        position = self.state_dict()["position"]
        if position and self._unresumable:
            raise ConfigError(
                f"{name} cannot be saved mid-epoch ({position} batches into epoch "
                f"{self.epoch}): it has {self._unresumable}, which cannot continue at a batch; "
                "save when its epoch has ended, or use batch_size= with shuffle=True/False or a "
                "DistributedSampler, which resume at the exact batch"
            )

    def sampling_state(self) -> dict[str, int]:
        """What lets a run on another world size continue ``state_dict()`` at the same sample
        and with the same shuffle: the batch size, the data-parallel world size, the seed."""
        return {
            "batch_size": self.loader.batch_size or 1,
            "world_size": self._world_size,
            "seed": self.sampler.seed if self.sampler is not None else 0,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The next ``iter()`` continues epoch ``state["epoch"]`` after ``state["position"]``.

        ``state`` may also hold ``sampling_state()``'s keys: a position saved with another batch
        size or world size is then re-mapped by samples, and the saved shuffle seed is used.

        Raises:
            ConfigError: a mid-epoch position for a loader without a resumable sampler, or one
                that does not fall on a batch boundary at this world size and batch size.
        """
        position = self._position_from(state, "this DataLoader")
        if self.sampler is not None and "seed" in state:
            self.sampler.seed = int(state["seed"])  # the interrupted run's shuffle
        self.epoch, self._started, self._epoch_done = int(state["epoch"]), False, False
        self._resume_position = self.position = position
        self._seeded_before = bool(state.get("persistent_iterator"))

    def check_state(self, state: dict[str, int], name: str) -> None:
        """Raises the ``ConfigError`` that ``load_state_dict(state)`` would, changing nothing."""
        self._position_from(state, name)

    def _position_from(self, state: dict[str, int], name: str) -> int:
        position = int(state["position"])
        if self._unresumable and position:
            raise ConfigError(
                f"{name} was saved {position} batches into epoch {state['epoch']} but has "
                f"{self._unresumable}, which cannot continue mid-epoch; load a checkpoint saved "
                "at an epoch end"
            )
        batch_size = self.loader.batch_size or 1
        saved_batch, saved_world = state.get("batch_size", batch_size), state.get(
            "world_size", self._world_size)
        if position and (saved_batch, saved_world) != (batch_size, self._world_size):
            # Rank r of W takes the shuffled indices r, r+W, ...: the first S samples of the
            # epoch are used up on every world size alike when each rank skips S / W of its own.
            samples = position * saved_batch * saved_world
            per_step = batch_size * self._world_size
            if samples % per_step:
                raise ConfigError(
                    f"cannot continue mid-epoch: {samples} samples were used ({position} batches "
                    f"of {saved_batch} on {saved_world} ranks), not a multiple of batch size "
                    f"{batch_size} x {self._world_size} ranks; resume from a checkpoint at an "
                    "epoch boundary or with a batch size and world size that divide it"
                )
            position = samples // per_step
        return position
