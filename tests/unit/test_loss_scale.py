"""The dynamic loss-scale algorithm of DESIGN.md, as tables of clean/overflow steps."""

from __future__ import annotations

import pytest

import accumix as ax

INF, OK = True, False  # overflow, clean


@pytest.mark.parametrize(
    "kwargs,steps,scales",
    [
        # hysteresis=2: the first overflow is absorbed, the second and later ones halve.
        (dict(init_scale=1024.0), [INF, INF, INF, OK], [1024, 512, 256, 256]),
        # growth_interval clean steps grow the scale and refill the budget.
        (dict(init_scale=8.0, growth_interval=2), [OK, OK, INF, INF, OK, OK, INF],
         [8, 16, 16, 8, 8, 16, 16]),
        # an overflow resets the clean count: growth needs growth_interval clean in a row.
        (dict(init_scale=8.0, growth_interval=3, hysteresis=1), [OK, OK, INF, OK, OK, OK],
         [8, 8, 4, 4, 4, 8]),
        # hysteresis=1 is GradScaler: every overflow halves.
        (dict(init_scale=64.0, hysteresis=1), [INF, INF, OK], [32, 16, 16]),
        # hysteresis=3 absorbs two.
        (dict(init_scale=64.0, hysteresis=3), [INF, INF, INF, INF], [64, 64, 32, 16]),
        # custom factors; the floor holds the scale.
        (dict(init_scale=10.0, backoff_factor=0.25, growth_factor=3.0, growth_interval=1,
              hysteresis=1, min_scale=2.0), [INF, OK, INF, INF], [2.5, 7.5, 2.0, None]),
    ],
)
def test_scale_sequence(kwargs, steps, scales) -> None:
    scaler = ax.DynamicLossScale(**kwargs)
    for found_inf, expected in zip(steps, scales, strict=True):
        if expected is None:  # overflow at the floor
            with pytest.raises(ax.LossScaleError, match="bf16"):
                scaler.update(found_inf)
            return
        scaler.update(found_inf)
        assert scaler.scale == expected


def test_overflow_at_floor_raises_with_advice() -> None:
    scaler = ax.DynamicLossScale(init_scale=2.0, min_scale=1.0, hysteresis=1)
    scaler.update(True)
    assert scaler.scale == 1.0
    with pytest.raises(ax.LossScaleError, match="precision='bf16-mixed'"):
        scaler.update(True)


def test_state_round_trip() -> None:
    a = ax.DynamicLossScale(init_scale=16.0, growth_interval=3)
    for found_inf in (True, False, False):
        a.update(found_inf)
    b = ax.DynamicLossScale(init_scale=16.0, growth_interval=3)
    b.load_state_dict(a.state_dict())
    for found_inf in (False, True, True):
        a.update(found_inf)
        b.update(found_inf)
        assert (a.scale, a.budget, a.clean_steps) == (b.scale, b.budget, b.clean_steps)


@pytest.mark.parametrize("bad", [
    dict(init_scale=0), dict(growth_factor=1.0), dict(backoff_factor=1.0),
    dict(growth_interval=0), dict(hysteresis=0), dict(min_scale=2.0**17),
])
def test_bad_settings_are_config_errors(bad) -> None:
    with pytest.raises(ax.ConfigError, match=next(iter(bad))):
        ax.DynamicLossScale(**bad)


def test_null_scaler_is_inert() -> None:
    s = ax.NoLossScale()
    s.update(True)
    assert s.scale == 1.0 and not s.enabled and s.state_dict() == {}
