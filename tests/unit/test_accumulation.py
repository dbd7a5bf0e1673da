"""Deriving K from the batch sizes, and the window's boundaries."""

from __future__ import annotations

import pytest

import accumix as ax
from accumix.step.accumulation import AccumulationWindow, derive_grad_accum_steps


def derive(k=None, g=None, m=None, w=1):
    return derive_grad_accum_steps(grad_accum_steps=k, global_batch_size=g,
                                   micro_batch_size=m, dp_world_size=w)


@pytest.mark.parametrize("k,g,m,w,expected", [
    (None, None, None, 4, 1), (3, None, None, 2, 3), (None, 64, 8, 2, 4), (None, 64, 8, 8, 1),
    (4, 64, 8, 2, 4), (None, 64, None, 2, None), (None, None, 8, 2, 1), (None, 48, 8, 3, 2),
])
def test_derivation(k, g, m, w, expected) -> None:
    assert derive(k, g, m, w) == expected


def test_not_dividing_names_numbers_and_world_sizes() -> None:
    with pytest.raises(ax.ConfigError) as err:
        derive(g=64, m=8, w=3)
    msg = str(err.value)
    assert "global_batch_size=64" in msg and "micro_batch_size=8" in msg and "3 = 24" in msg
    assert "world sizes that would divide it: [1, 2, 4, 8]" in msg


def test_micro_not_dividing_global() -> None:
    with pytest.raises(ax.ConfigError, match=r"micro batch sizes that divide it: \[1, 2, 4, 5"):
        derive(g=20, m=3, w=1)


def test_contradicting_k() -> None:
    with pytest.raises(ax.ConfigError, match="grad_accum_steps=3 contradicts"):
        derive(k=3, g=64, m=8, w=2)


@pytest.mark.parametrize("bad", [dict(k=0), dict(g=-1, m=2), dict(m=1.5), dict(k=True)])
def test_bad_values(bad) -> None:
    with pytest.raises(ax.ConfigError, match="use an integer >= 1"):
        derive(**bad)


def test_window_boundaries_and_end_of_data() -> None:
    win = AccumulationWindow(3)
    seen = []
    for i in range(7):
        win.end_of_data = i == 4  # the loader says batch 4 is the epoch's last
        seen.append((win.begin(), win.index, win.micro_step))
        win.end()
    assert seen == [(False, 0, 1), (False, 0, 2), (True, 0, 3),
                    (False, 1, 1), (True, 1, 2),
                    (False, 2, 1), (False, 2, 2)]


def test_boundary_factor_mean_mode_short_window() -> None:
    win = AccumulationWindow(4)
    for _ in range(2):
        win.begin()
        assert win.loss_multiplier(None) == 0.25
    # two of four micro-steps: the sum of loss/4 is corrected to the mean over 2, unscaled.
    factor = win.boundary_factor(num_items=0, backwards=2, loss_scale=8.0, grad_divisor=1,
                                 all_reduce=None, dynamic_scale=True, device=None)
    assert factor == 4 / (2 * 8.0)


def test_boundary_factor_item_mode_and_fp16_hint() -> None:
    win = AccumulationWindow(2)
    for n in (30, 10):
        win.begin()
        assert win.loss_multiplier(n) == 1.0
    f = win.boundary_factor(num_items=win.num_items, backwards=2, loss_scale=4.0,
                            grad_divisor=1, all_reduce=None, dynamic_scale=True, device=None)
    assert f == 1 / (4.0 * 40)
    assert win.items_hint == 20.0  # next window's losses are divided by the mean count
    win.end()
    win.begin()
    # and by K (issue 38: the window's sum is about its mean, as in mean mode)
    assert win.loss_multiplier(5) == 1 / (20.0 * 2)


def test_mixing_modes_in_a_window_is_an_error() -> None:
    win = AccumulationWindow(2)
    win.begin()
    win.loss_multiplier(None)
    win.begin()
    with pytest.raises(ax.ConfigError, match="mixed a mean loss and num_items"):
        win.loss_multiplier(3)
