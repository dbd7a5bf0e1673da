"""Per-sample random streams (issue 12): a dataset drawing random augmentation from torch, numpy
and python gives each sample the same draws whatever the workers, the world size or where a run
resumed, and data loading leaves the main process's streams (dropout's) alone."""

from __future__ import annotations

import pickle
import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset, random_split

from accumix.data.loader import AcceleratedDataLoader
from accumix.data.sample_seeds import SeededDataset, _seed_all, mix


class Augmented(Dataset):
    """Row i: [i, torch draw, numpy draw, python draw]."""

    label = "augmented"

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item(), np.random.rand(), random.random()])


def mixup(samples: list[torch.Tensor]) -> torch.Tensor:
    """A collate that draws too (as a mixup or a random crop in the collate would)."""
    batch = torch.stack(samples)
    return torch.cat([batch, torch.rand(len(samples), 1)], dim=1)


def _wrap(loader: DataLoader, rank: int = 0, world: int = 1) -> AcceleratedDataLoader:
    return AcceleratedDataLoader(loader, device=torch.device("cpu"), rank=rank, world_size=world,
                                 seed=7, on_batch=lambda _: None)


def _loader(**kwargs: object) -> DataLoader:
    return DataLoader(Augmented(), batch_size=2, shuffle=True, collate_fn=mixup, **kwargs)


def _rows(batches: list[torch.Tensor]) -> dict[int, list[float]]:
    """Each sample's row by its index (so shards of different world sizes compare)."""
    return {int(row[0]): row.tolist() for batch in batches for row in batch}


def _epochs(acc_loader: AcceleratedDataLoader, n: int = 2) -> list[list[torch.Tensor]]:
    return [list(acc_loader) for _ in range(n)]


def test_the_same_draws_with_any_workers_and_persistent_or_not() -> None:
    plain = _epochs(_wrap(_loader()))
    for kwargs in ({"num_workers": 2}, {"num_workers": 2, "persistent_workers": True},
                   {"num_workers": 2, "prefetch_factor": 1}):
        other = _epochs(_wrap(_loader(**kwargs)))
        for a, b in zip(plain, other, strict=True):
            assert torch.equal(torch.cat(a), torch.cat(b)), kwargs
    # Each epoch draws anew; all three RNGs and the collate's are used.
    first, second = (torch.cat(e) for e in plain)
    by_index = [_rows([first]), _rows([second])]
    assert by_index[0][3] != by_index[1][3]
    assert len({round(v, 6) for v in by_index[0][3][1:]}) == 4


def test_a_sample_draws_the_same_on_another_world_size() -> None:
    # The collate's draw belongs to its batch; the sample's own draws to the sample.
    one = _rows(list(_wrap(_loader())))
    two = _rows(list(_wrap(_loader(), 0, 2)) + list(_wrap(_loader(), 1, 2)))
    assert one.keys() == two.keys() == set(range(12))
    assert all(one[i][:4] == two[i][:4] for i in one)


def test_resume_mid_epoch_gives_the_uninterrupted_draws_with_persistent_workers() -> None:
    full = _epochs(_wrap(_loader(num_workers=2, persistent_workers=True)))
    src = _wrap(_loader(num_workers=2, persistent_workers=True))
    list(src)
    for i, _ in enumerate(src):
        if i == 2:
            state = src.state_dict()
            break
    fresh = _wrap(_loader(num_workers=2, persistent_workers=True))
    fresh.load_state_dict(state)
    rest = list(fresh)
    assert torch.equal(torch.cat(rest), torch.cat(full[1][3:]))


def test_loading_leaves_the_main_process_streams_alone() -> None:
    # num_workers=0: the only draw is the DataLoader's base seed at each epoch's start (torch's
    # own, the same in a plain loop); dropout's stream is not moved by the dataset or collate.
    loader = _wrap(_loader())
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    list(loader)
    after = (torch.get_rng_state(), np.random.get_state()[1], random.getstate())
    torch.manual_seed(3)
    torch.empty((), dtype=torch.int64).random_()  # the base seed
    np.random.seed(3)
    random.seed(3)
    assert torch.equal(after[0], torch.get_rng_state())
    assert np.array_equal(after[1], np.random.get_state()[1])
    assert after[2] == random.getstate()


def test_the_wrapper_pickles_forwards_attributes_and_leaves_tensor_datasets() -> None:
    wrapped = pickle.loads(pickle.dumps(SeededDataset(Augmented())))  # spawned workers
    assert wrapped.label == "augmented" and len(wrapped) == 12
    assert torch.equal(wrapped[(7, 0, 5)], wrapped[(7, 0, 5)])
    assert not torch.equal(wrapped[(7, 0, 5)], wrapped[(7, 1, 5)])
    acc_loader = _wrap(_loader())
    assert isinstance(acc_loader.loader.dataset, SeededDataset)
    assert isinstance(acc_loader.dataset, Augmented)  # the user's, as set up
    tensors = _wrap(DataLoader(TensorDataset(torch.arange(4)), batch_size=2))
    assert isinstance(tensors.loader.dataset, TensorDataset)  # draws nothing: read as it is
    # Nearby keys do not share a stream.
    assert len({mix(7, e, i) for e in range(50) for i in range(50)}) == 2500
    assert mix(7, 0, 1) != mix(7, 1, 0)


def test_a_subset_sample_draws_the_same_in_any_batch_and_on_another_world_size() -> None:
    # Issue 20.5: Subset (random_split's) has a batched read; a batch read under one stream made
    # a sample's draws depend on its batch. 16 samples, batches of 2 and 4, 1 and 2 ranks.
    subset = random_split(Augmented16(), [16, 4], generator=torch.Generator().manual_seed(0))[0]

    def rows(batch_size: int, rank: int, world: int) -> dict[int, list[float]]:
        loader = DataLoader(subset, batch_size=batch_size, shuffle=True, collate_fn=mixup)
        return _rows(list(_wrap(loader, rank, world)))

    one = rows(2, 0, 1)
    two = {**rows(2, 0, 2), **rows(2, 1, 2)}
    wide = rows(4, 0, 1)
    assert len(one) == 16
    differ = sum(one[i][:4] != other[i][:4] for other in (two, wide) for i in one)
    assert differ == 0, differ
    # Each sample still draws its own numbers (not one stream replayed per batch).
    assert len({round(row[1], 6) for row in one.values()}) == 16
    # A Subset of a TensorDataset draws nothing: read as it is.
    tensors = Subset(TensorDataset(torch.arange(4)), [0, 2])
    assert not isinstance(_wrap(DataLoader(tensors, batch_size=2)).loader.dataset, SeededDataset)


class Augmented16(Augmented):
    def __len__(self) -> int:
        return 20


def test_numpy_takes_the_seed_bits_that_torch_drops() -> None:
    # Issue 20: numpy was seeded with the low 32 bits, the 32 that torch's CPU generator keeps
    # too, so two samples whose seeds share them drew the same numbers from both. numpy now
    # takes the high 32: a sample's three streams together depend on all 64 bits.
    low = 0x12345678
    draws = []
    for seed in (low, low | (1 << 40), low | (1 << 63)):
        _seed_all(seed)
        draws.append((torch.rand(()).item(), np.random.rand(), random.random()))
    assert len({d[0] for d in draws}) == 1, draws  # torch's own 32-bit limit (README)
    assert len({d[1] for d in draws}) == 3, draws
    assert len({d[2] for d in draws}) == 3, draws
