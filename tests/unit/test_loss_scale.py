"""The dynamic loss-scale algorithm of DESIGN.md, as the golden table of clean/overflow steps."""

from __future__ import annotations

import pytest

import accumix as ax
from tests.loss_scale_traces import IDS, TRACES


@pytest.mark.parametrize("trace", TRACES, ids=IDS)
def test_scale_sequence(trace) -> None:
    """The golden table shared with the JAX scaler (tests/golden/loss_scale_traces.json)."""
    scaler = ax.DynamicLossScale(**trace["settings"])
    for found_inf, expected in zip(trace["overflows"], trace["scales"], strict=True):
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
