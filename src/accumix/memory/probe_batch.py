"""The probe's batch (``micro_batch_size="auto"``): ``make_batch(n)`` gives n rows, the longest
the data can give. ``batch_maker`` builds one from a DataLoader over a map-style dataset (what
the Trainer uses); ``sample_elements`` is how it ranks samples by size.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from accumix.checkpoint import rng_state
from accumix.errors import ConfigError

MakeBatch = Callable[[int], Any]


def batch_maker(loader: Any, scan: int = 1000) -> MakeBatch:
    """A ``make_batch`` for a DataLoader over a map-style dataset: n copies of the largest of
    its first ``scan`` samples (by elements: of tensors, numpy arrays, token lists, texts),
    through the loader's ``collate_fn``. Give your own ``make_batch`` when the longest sample
    the data can give is known (the recipe's: ``block_size`` tokens).

    Raises:
        ConfigError: a dataset without ``len`` and indexing (an IterableDataset).
    """
    dataset, collate = loader.dataset, loader.collate_fn
    refusal = ConfigError(f"micro_batch_size='auto' cannot build a probe batch from "
                          f"{type(dataset).__name__} (no len/indexing); call "
                          "acc.find_micro_batch_size(step, make_batch) yourself")
    try:
        count = min(len(dataset), scan)
    except (TypeError, NotImplementedError) as exc:
        raise refusal from exc
    if not count:
        raise ConfigError("micro_batch_size='auto': the DataLoader's dataset is empty")
    found: list[Any] = []

    def make_batch(n: int) -> Any:
        # The scan reads samples, which may draw (augmentation): it runs at the first call,
        # inside the probe, whose RNG capture gives the global streams back; a generator of
        # the dataset's own is put back here. Read before the probe it would move them.
        if not found:
            try:
                with rng_state.generators_kept(dataset):
                    found.append(max((dataset[i] for i in range(count)), key=sample_elements))
            except (TypeError, NotImplementedError) as exc:
                raise refusal from exc
        return collate([found[0]] * n)

    return make_batch


def sample_elements(sample: Any) -> int:
    """How big a sample is: the elements of its tensors and numpy arrays, the entries of its
    lists of numbers (token ids), the characters of its texts, in any nesting of mappings,
    sequences and dataclasses."""
    if isinstance(sample, torch.Tensor):
        return sample.numel()
    if isinstance(sample, np.ndarray | np.generic):
        return int(sample.size)
    if isinstance(sample, str | bytes):
        return len(sample)
    if isinstance(sample, numbers.Number):
        return 1
    if isinstance(sample, Mapping):
        return sum(sample_elements(v) for v in sample.values())
    if isinstance(sample, list | tuple):
        return sum(sample_elements(v) for v in sample)
    if dataclasses.is_dataclass(sample) and not isinstance(sample, type):
        return sum(sample_elements(getattr(sample, f.name)) for f in dataclasses.fields(sample))
    return 0
