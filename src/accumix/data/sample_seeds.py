"""Per-sample random streams: the augmentation a sample gets depends on (seed, epoch, index) only.

A dataset that draws random augmentation in ``__getitem__`` (``torch.rand``, ``np.random``,
``random``) normally draws from whichever stream happens to fetch the sample: a worker's (seeded
from a base seed and the worker id, so it depends on which batches that worker fetched before)
or, with ``num_workers=0``, the main process's, shared with dropout and shifted by the loader's
look-ahead. A run resumed mid-epoch fetches other batches on other workers, so it augments
differently: the resume is not exact.

Here every ``dataset[index]`` runs with torch's CPU generator, numpy's global generator and
python's ``random`` seeded from ``mix(seed, epoch, index)``, and the caller's three states are
put back afterwards. The result depends on nothing but the sample, its epoch and the shuffle
seed: the same whatever ``num_workers``, ``persistent_workers``, the world size, or where a
run stopped, and the main process's streams (dropout) are not consumed by data loading.

torchdata's ``StatefulDataLoader`` was the alternative: it snapshots each worker's state, but a
worker's RNG is only saved if the user's dataset implements ``state_dict``, its state is per
worker (it cannot move to another worker count or world size), and the user's ``DataLoader``
would have to become a ``StatefulDataLoader``.

The sampler hands the dataset ``(seed, epoch, index)`` keys (``EpochSeedTagged``); the workers
need no message from the main process when an epoch starts, so persistent workers work too.
The collate runs under streams of its batch's first key (``SeededCollate``). A dataset with
its own batched read (``__getitems__``: torch's ``Subset``, what ``random_split`` returns, and
Hugging Face datasets) is read item by item all the same: one seed for a whole batch would
make a sample's draws depend on the batch it fell in (another world size, another batch).
Cost: ~23 us a
sample (re-seeding three Mersenne twisters and their first draw after it; bench/sample_seeds.py),
and in the main process (``num_workers=0``) ~80 us a batch to save and restore the states
(numpy's ``get_state``/``set_state`` are most of it).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, get_worker_info

_MASK = (1 << 64) - 1


def mix(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed from three integers: splitmix64's finalizer over each in turn, so nearby
    keys give unrelated streams (seeding with ``seed + index`` would make sample 1 of epoch 0
    and sample 0 of epoch 1 share one)."""
    h = 0x9E3779B97F4A7C15
    for value in (seed, epoch, index):
        h = (h ^ (value & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 31
    return h


def _seed_all(seed: int) -> None:
    torch.default_generator.manual_seed(seed)  # the CPU generator only: CUDA's is left be
    # torch's CPU generator keeps the low 32 bits of any seed and numpy's legacy seeder takes
    # 32 (as an array of words it keeps more, but costs ~60 us instead of ~10): numpy gets the
    # high 32, so two samples that share torch's stream (~n^2/2^33 pairs an epoch) do not
    # share numpy's too. python's random.seed takes all 64.
    np.random.seed(seed >> 32)
    random.seed(seed)


def _capture() -> tuple[Any, ...] | None:
    """The three global states, or None in a DataLoader worker: there nothing else draws from
    them between samples (each sample and each collate seeds them first), so restoring would
    only cost time (numpy's get/set_state is ~70 us)."""
    if get_worker_info() is not None:
        return None
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _restore(saved: tuple[Any, ...] | None) -> None:
    if saved is not None:
        torch_state, np_state, py_state = saved
        torch.set_rng_state(torch_state)
        np.random.set_state(np_state)
        random.setstate(py_state)


_COLLATE = 0xC011A7E  # the collate's streams differ from its first sample's


class _KeyedBatch(list):
    """A batch's samples as ``SeededDataset.__getitems__`` read them, with the first key (the
    collate's streams) and the states to put back once the collate is done."""

    key: tuple[int, int, int]
    saved: tuple[Any, ...] | None


class SeededDataset(Dataset):
    """The user's map-style dataset, read with ``(seed, epoch, index)`` keys under per-sample
    random streams. Other attributes are the user's dataset's (``worker_info.dataset.x``)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int, int]) -> Any:
        seed, epoch, index = key
        saved = _capture()
        try:
            _seed_all(mix(seed, epoch, index))
            return self.dataset[index]
        finally:
            _restore(saved)

    def __getitems__(self, keys: list[tuple[int, int, int]]) -> list[Any]:
        """A batch (the DataLoader's fetcher reads batches through this): the states are saved
        once here and put back by ``SeededCollate`` after the collate, which runs next. Each
        sample is read on its own under its own streams, also from a dataset with a batched
        read of its own (``Subset`` defines one): that read would draw a whole batch from one
        stream."""
        saved = _capture()
        try:
            samples = []
            for seed, epoch, index in keys:
                _seed_all(mix(seed, epoch, index))
                samples.append(self.dataset[index])
        except BaseException:
            _restore(saved)
            raise
        batch = _KeyedBatch(samples)
        batch.key, batch.saved = keys[0], saved
        return batch

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "dataset":  # pickling probes; not yet unpickled
            raise AttributeError(name)
        return getattr(self.dataset, name)


class SeededCollate:
    """The user's ``collate_fn`` under streams seeded from its batch's first key (a random
    mixup or crop in the collate resumes exactly too), then the caller's states put back."""

    def __init__(self, collate_fn: Any) -> None:
        self.collate_fn = collate_fn

    def __call__(self, batch: Any) -> Any:
        if not isinstance(batch, _KeyedBatch):
            return self.collate_fn(batch)
        try:
            _seed_all(mix(*batch.key) ^ _COLLATE)
            return self.collate_fn(list(batch))
        finally:
            _restore(batch.saved)


class EpochSeedTagged(Sampler):
    """Yields ``(seed, epoch, index)`` for each index of a ``DistributedSampler``, read when an
    epoch's iteration starts (after ``set_epoch`` and a resumed shuffle seed)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        seed, epoch = int(self.sampler.seed), int(self.sampler.epoch)
        return ((seed, epoch, int(index)) for index in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


def draws_nothing(dataset: Any) -> bool:
    """A dataset whose ``__getitem__`` is known to draw no random numbers (a ``TensorDataset``),
    which is read as it is: seeding costs a few microseconds a sample. A ``Subset`` of one
    (what ``random_split`` returns) draws nothing either."""
    from torch.utils.data import Subset, TensorDataset

    while type(dataset) is Subset:
        dataset = dataset.dataset
    return type(dataset) is TensorDataset
