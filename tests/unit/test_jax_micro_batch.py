"""``micro_batch_size="auto"`` on JAX: the choice read from the compiled window step's
``memory_analysis()`` equals an exhaustive check of every candidate, an auto run equals the
explicit run of the chosen size bitwise (the user's DataLoader re-batched to the choice), and
bad input is a one-line ConfigError.
(2 processes agreeing: tests/distributed/test_jax_processes.py.)"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import numpy as np  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import accumix.jax as axj  # noqa: E402
from accumix.common.micro_batch_search import DEFAULT_HEADROOM  # noqa: E402
from accumix.errors import ConfigError  # noqa: E402
from accumix.jax.micro_batch import window_peak_bytes  # noqa: E402
from tests import jax_workloads as w  # noqa: E402

G = 32  # one process, 2 CPU devices: candidates 2, 4, ..., 32 (a multiple of the devices)


def _rows(n: int) -> dict[str, np.ndarray]:
    return w.micro_batches(1, rows=n, seed=3)[0]


def _auto(memory_limit: int) -> tuple[axj.Accelerator, object]:
    acc = axj.Accelerator(strategy="ddp", precision="fp32", global_batch_size=G,
                          micro_batch_size="auto", memory_limit=memory_limit, seed=1)
    return acc, acc.setup(w.init_params(), w.optimizer())


def test_choice_equals_the_exhaustive_check_of_candidates() -> None:
    acc, state = _auto(10**9)
    sizes = [2, 4, 8, 16, 32]
    peaks = {m: window_peak_bytes(acc, state, w.item_loss, _rows, m, clip_norm=1.0)
             for m in sizes}
    assert all(peaks[a] < peaks[b] for a, b in zip(sizes, sizes[1:], strict=False)), peaks
    # A limit between two candidates' peaks (with the headroom): 4 fits, 8 does not.
    for cut in (2,):
        limit = int((peaks[sizes[cut - 1]] + peaks[sizes[cut]]) / 2 / (1 - DEFAULT_HEADROOM))
        exhaustive = max(m for m in sizes if peaks[m] <= limit * (1 - DEFAULT_HEADROOM))
        acc, state = _auto(limit)
        chosen = acc.find_micro_batch_size(state, w.item_loss, _rows, clip_norm=1.0)
        assert chosen == exhaustive == sizes[cut - 1], (cut, chosen, exhaustive, peaks)
        assert acc.grad_accum_steps == G // chosen


def test_auto_run_equals_the_explicit_run_bitwise() -> None:
    acc, state = _auto(10**9)
    peak16 = window_peak_bytes(acc, state, w.mean_loss, _rows, 16, clip_norm=None)
    peak32 = window_peak_bytes(acc, state, w.mean_loss, _rows, 32, clip_norm=None)
    acc, state = _auto(int((peak16 + peak32) / 2 / (1 - DEFAULT_HEADROOM)))
    before = jax.tree.map(np.asarray, state.params)
    assert acc.find_micro_batch_size(state, w.mean_loss, _rows) == 16
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(
        jax.tree.leaves(before), jax.tree.leaves(state.params), strict=True))  # only read
    explicit = axj.Accelerator(strategy="ddp", precision="fp32", global_batch_size=G,
                               micro_batch_size=16, seed=1)
    ref = explicit.setup(w.init_params(), w.optimizer())
    # The user's loader (batch_size=4) is re-batched to the choice: same dataset, shuffle.
    data = Rows(w.concat(w.micro_batches(4, rows=16, seed=9)))
    results, shapes = [], []
    for a, s, size in ((acc, state, 4), (explicit, ref, 16)):
        windows = a.setup_loader(DataLoader(data, batch_size=size, shuffle=True))
        step = a.train_step(w.mean_loss)
        for window in windows:
            shapes.append(window.batch["x"].shape)
            s, _ = step(s, window)
        results.append(jax.tree.map(np.asarray, s.params))
        results.append(windows.state_dict())
    assert shapes == [(2, 16, 3, 4)] * 4, shapes  # 64 rows: 2 windows of K=2 x 16, each run
    assert results[1] == results[3]  # the loader's position: the same resume state
    assert all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(results[0]), jax.tree.leaves(results[2]), strict=True))


class Rows(Dataset):
    """The rows of a dict of arrays, one sample each."""

    def __init__(self, rows: dict[str, np.ndarray]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows["x"])

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {k: v[i] for k, v in self.rows.items()}


def test_bad_input_is_one_line() -> None:
    with pytest.raises(ConfigError, match="needs global_batch_size"):
        axj.Accelerator(strategy="ddp", micro_batch_size="auto")
    acc = axj.Accelerator(strategy="ddp", precision="fp32", global_batch_size=G,
                          micro_batch_size="auto")
    state = acc.setup(w.init_params(), w.optimizer())
    with pytest.raises(ConfigError, match="pass memory_limit= in bytes"):
        acc.find_micro_batch_size(state, w.item_loss, _rows)
    acc, state = _auto(1000)
    with pytest.raises(ConfigError, match="not even 2 rows"):
        acc.find_micro_batch_size(state, w.item_loss, _rows)
    for bad in (1.5, -0.1, True, "10%"):
        with pytest.raises(ConfigError, match=r"headroom=.* is invalid; use a fraction in"):
            acc.find_micro_batch_size(state, w.item_loss, _rows, headroom=bad)
    with pytest.raises(ConfigError, match="find_micro_batch_size"):
        acc.setup_loader(__import__("torch").utils.data.DataLoader(range(8), batch_size=2))


def test_cache_key_changes_with_the_world_and_not_otherwise() -> None:
    """The run directory's answer is keyed by what it depends on: a restart on another number
    of processes (or devices, limit, headroom) chooses again; the same settings reuse it."""
    from types import SimpleNamespace

    from accumix.jax.micro_batch import cache_key

    acc, state = _auto(10**9)

    def key(**changed: object) -> str:
        fake = SimpleNamespace(**{"world_size": acc.world_size, "num_devices": acc.num_devices,
                                  "policy": acc.policy, "strategy": acc.strategy,
                                  "global_batch_size": acc.global_batch_size,
                                  "memory_limit": acc.memory_limit, **changed})
        return cache_key(fake, state, _rows, clip_norm=1.0, headroom=0.1)

    same = key()
    assert same == cache_key(acc, state, _rows, clip_norm=1.0, headroom=0.1)
    others = [key(world_size=2), key(num_devices=4), key(memory_limit=10**8),
              cache_key(acc, state, _rows, clip_norm=1.0, headroom=0.2)]
    assert len({same, *others}) == 5
