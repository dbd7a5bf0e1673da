"""strategy="auto" from the memory model, with fake device sizes: no processes needed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accumix.memory.model import estimate_memory
from accumix.precision import Policy
from accumix.strategies.registry import choose_auto_strategy

FP32 = Policy(name="fp32")
BF16_MIXED = Policy(name="bf16-mixed", compute_dtype=torch.bfloat16)
HEADROOM = 0.8


def _model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)]
    return nn.Sequential(nn.Linear(8, 64), *blocks, nn.Linear(64, 2))


def _totals(model: nn.Module, precision: str, states: int, steps: int | None = 1
            ) -> dict[str, int]:
    return {e.strategy: e.total_bytes for e in estimate_memory(
        model, world_size=2, precision=precision, optimizer_states=states,
        grad_accum_steps=steps)}


def _device_between(larger: int, smaller: int) -> int:
    """A device on which ``smaller`` fits the headroom and ``larger`` does not."""
    return int((larger + smaller) / 2 / HEADROOM)


def _choose(model: nn.Module, optimizer: torch.optim.Optimizer, policy: Policy, device: int,
            world_size: int = 2, steps: int | None = 1) -> tuple[str, str | None, str]:
    strategy, reason = choose_auto_strategy(model, [optimizer], policy=policy,
                                            world_size=world_size, device_bytes=device,
                                            grad_accum_steps=steps)
    sharding = getattr(strategy, "sharding", None)
    if getattr(strategy, "sync_each_microstep", False):
        sharding = f"{sharding}, sync_each_microstep"
    return strategy.name, sharding, reason


def test_one_process_is_single_whatever_the_size() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    assert _choose(model, opt, FP32, 10**12, world_size=1)[:2] == ("single", None)
    name, _, reason = _choose(model, opt, FP32, 1000, world_size=1)
    assert name == "single" and "does not fit" in reason


def test_least_communication_that_fits() -> None:
    model = _model()
    adam = torch.optim.Adam(model.parameters())
    t = _totals(model, "bf16-mixed", 2)
    # Under bf16-mixed each step down saves memory: ddp > zero1 > fsdp grad_op > fsdp full.
    assert t["ddp"] > t["zero1"] > t["fsdp-grad_op"] > t["fsdp-full"]
    cases = [
        (int(t["ddp"] / HEADROOM) + 1, ("ddp", None)),
        (_device_between(t["ddp"], t["zero1"]), ("zero1", None)),
        (_device_between(t["zero1"], t["fsdp-grad_op"]), ("fsdp", "grad_op")),
        (_device_between(t["fsdp-grad_op"], t["fsdp-full"]), ("fsdp", "full")),
    ]
    for device, expected in cases:
        name, sharding, reason = _choose(model, adam, BF16_MIXED, device)
        assert (name, sharding) == expected, (device, reason)
        assert "fits" in reason
    name, sharding, reason = _choose(model, adam, BF16_MIXED, t["fsdp-full"] // 2)
    assert (name, sharding) == ("fsdp", "full") and "nothing fits" in reason


def test_fp32_prefers_zero1_over_grad_op_at_equal_memory() -> None:
    # fp32 at world 2: zero1 and fsdp grad_op hold the same bytes (grad_op's gathered copy
    # offsets its sharded parameters and gradients); the one with less traffic wins.
    model = _model()
    adam = torch.optim.Adam(model.parameters())
    t = _totals(model, "fp32", 2)
    assert t["zero1"] == t["fsdp-grad_op"]
    device = _device_between(t["ddp"], t["zero1"])
    assert _choose(model, adam, FP32, device)[:2] == ("zero1", None)


def test_optimizer_states_come_from_the_optimizer() -> None:
    """Plain SGD holds no states, SGD+momentum one, Adam two: a device that fits ddp with SGD
    but not with Adam."""
    model = _model()
    t0, t1, t2 = (_totals(model, "fp32", k)["ddp"] for k in (0, 1, 2))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adam = torch.optim.AdamW(model.parameters())
    assert _choose(model, sgd, FP32, _device_between(t1, t0))[0] == "ddp"
    assert _choose(model, momentum, FP32, _device_between(t1, t0))[0] == "zero1"
    assert _choose(model, momentum, FP32, _device_between(t2, t1))[0] == "ddp"
    assert _choose(model, adam, FP32, _device_between(t2, t1))[0] == "zero1"


@pytest.mark.parametrize("device", [0, -5])
def test_bad_device_size_is_a_config_error(device: int) -> None:
    from accumix.errors import ConfigError

    model = _model()
    with pytest.raises(ConfigError, match="device_bytes"):
        _choose(model, torch.optim.Adam(model.parameters()), FP32, device)


@pytest.mark.parametrize("steps", [4, None])
def test_a_window_that_fsdps_default_cannot_hold_picks_sync_each_microstep(
        steps: int | None) -> None:
    """K=4 (or not known yet): fsdp full's default sums the window in unsharded gradients; on a
    device where only its sync_each_microstep fits, that is the choice, where the model
    counting one micro-step picked the default (which then held more than the budget)."""
    model = _model()
    adam = torch.optim.Adam(model.parameters())
    one, window = _totals(model, "bf16-mixed", 2), _totals(model, "bf16-mixed", 2, steps)
    assert window["fsdp-full-sync"] == one["fsdp-full"] < window["fsdp-full"]
    smallest_default = min(window[r] for r in ("ddp", "zero1", "fsdp-grad_op", "fsdp-full",
                                               "fsdp-grad_op-sync"))
    device = _device_between(smallest_default, window["fsdp-full-sync"])
    assert _choose(model, adam, BF16_MIXED, device)[:2] == ("fsdp", "full")  # at K=1
    name, sharding, reason = _choose(model, adam, BF16_MIXED, device, steps=steps)
    assert (name, sharding) == ("fsdp", "full, sync_each_microstep"), reason
    assert "its default would hold the window's unsharded gradients" in reason
