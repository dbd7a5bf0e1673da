"""The loader wrapper: sharding, epochs without set_epoch, last-batch flag, resume position."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from accumix.data.loader import AcceleratedDataLoader

DATA = TensorDataset(torch.arange(10))


def _wrap(loader, rank=0, world=1, flags=None):
    return AcceleratedDataLoader(loader, device=torch.device("cpu"), rank=rank,
                                 world_size=world, seed=7,
                                 on_batch=(flags.append if flags is not None else lambda _: None))


def _epoch(loader):
    return [b[0].tolist() for b in loader]


def test_shards_keep_order_and_flag_the_last_batch() -> None:
    flags: list[bool] = []
    r0 = _wrap(DataLoader(DATA, batch_size=2), 0, 2, flags)
    r1 = _wrap(DataLoader(DATA, batch_size=2), 1, 2)
    assert _epoch(r0) == [[0, 2], [4, 6], [8]]
    assert _epoch(r1) == [[1, 3], [5, 7], [9]]
    assert flags == [False, False, True]


def test_shuffle_changes_per_epoch_without_set_epoch_and_is_reproducible() -> None:
    a = _wrap(DataLoader(DATA, batch_size=5, shuffle=True))
    b = _wrap(DataLoader(DATA, batch_size=5, shuffle=True))
    e0, e1 = _epoch(a), _epoch(a)
    assert e0 != e1 and sorted(sum(e0, [])) == list(range(10))
    assert [_epoch(b), _epoch(b)] == [e0, e1]
    assert a.epoch == 1


def test_drop_last_is_kept() -> None:
    assert _epoch(_wrap(DataLoader(DATA, batch_size=4, drop_last=True))) == [[0, 1, 2, 3],
                                                                             [4, 5, 6, 7]]


def test_resume_mid_epoch_continues_at_the_exact_batch_without_reading_skipped() -> None:
    reads: list[int] = []

    class Counting(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            reads.append(i)
            return torch.tensor(i)

    full = _wrap(DataLoader(Counting(), batch_size=3, shuffle=True))
    _epoch(full)
    second = [b.tolist() for b in full]
    state = None
    resumed_src = _wrap(DataLoader(Counting(), batch_size=3, shuffle=True))
    _epoch(resumed_src)
    for i, _ in enumerate(resumed_src):
        if i == 1:
            state = resumed_src.state_dict()
            break
    assert state == {"epoch": 1, "position": 2}
    fresh = _wrap(DataLoader(Counting(), batch_size=3, shuffle=True))
    fresh.load_state_dict(state)
    reads.clear()
    rest = [b.tolist() for b in fresh]
    assert rest == second[2:]
    assert sorted(reads) == sorted(sum(second[2:], []))  # skipped samples were never read
    assert [b.tolist() for b in fresh] != second  # and the next epoch is a new one
