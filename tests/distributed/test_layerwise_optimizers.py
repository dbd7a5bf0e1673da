"""2 ranks on gloo: optimizers whose update is not element-wise under the sharded optimizers
(issue 24 item 5). timm cannot be installed here (it pulls another torch), so ``Lamb`` below
is timm's algorithm: a per-parameter trust ratio and an optional global-norm clip inside the
optimizer.

zero1 (whole parameters per rank) keeps the trust ratio and Adafactor's factored moments exact
and refuses the in-optimizer global clip; deepspeed (flat partitions) refuses both unless the
user's config opts in; fsdp (DTensor parameters) keeps all of them exact.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import accumix as ax
from accumix.errors import ConfigError
from tests.distributed.shared_spawn import shared_result

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
MICRO, STEPS = 4, 3


class Lamb(torch.optim.Optimizer):
    """timm's ``Lamb`` (Adam moments, a trust ratio ``|w| / |update|`` per parameter, and with
    ``max_grad_norm`` the gradients divided by ``max(global_norm / max_grad_norm, 1)``)."""

    def __init__(self, params: Any, lr: float = 0.01, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01,
                 max_grad_norm: float | None = 1.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay, "max_grad_norm": max_grad_norm})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        clip = 1.0
        max_norm = self.defaults["max_grad_norm"]
        if max_norm is not None:
            total = torch.sqrt(sum(torch.sum(g * g) for g in grads))
            clip = torch.clamp(total / max_norm, min=1.0)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad / clip
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                m_hat = m / (1 - beta1 ** state["step"])
                v_hat = v / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm,
                                    torch.ones_like(w_norm))
                p.add_(update * trust, alpha=-group["lr"])


OPTIMIZERS = {
    "lamb": lambda ps: Lamb(ps, max_grad_norm=None),
    "lamb-clip": lambda ps: Lamb(ps, max_grad_norm=0.05),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 1))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 1, generator=g)


def _reference(optimizer: str) -> list[np.ndarray]:
    """Plain PyTorch on both ranks' batches at once."""
    model = _model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    for step in range(STEPS):
        x, y = (torch.cat(t) for t in zip(*(_batch(step, r) for r in range(2)), strict=True))
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().numpy().copy() for p in model.parameters()]


class _Warnings(logging.Handler):
    """DeepSpeed's warnings (its logger does not propagate)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            self.messages.append(record.getMessage())


DEEPSPEED_WARNINGS = _Warnings()


def _trained(strategy: str, optimizer: str) -> list[np.ndarray] | str:
    """The parameters after training under ``strategy``, or the ConfigError's message."""
    chosen = ax.DeepSpeedStrategy(stage=2) if strategy == "deepspeed" else strategy
    acc = ax.Accelerator(strategy=chosen, precision="fp32", seed=0)
    model = _model()
    logging.getLogger("DeepSpeed").addHandler(DEEPSPEED_WARNINGS)
    try:
        model, opt = acc.setup(model, OPTIMIZERS[optimizer](model.parameters()))
    except ConfigError as exc:
        acc.end()
        return str(exc)
    finally:
        logging.getLogger("DeepSpeed").removeHandler(DEEPSPEED_WARNINGS)
    for step in range(STEPS):
        x, y = _batch(step, acc.rank)
        with acc.accumulate():
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    full = acc.strategy.full_state_dict(model)
    acc.end()
    return [v.detach().float().numpy().copy() for v in full.values()]


def _job(cases: list[tuple[str, str]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy, optimizer in cases:
        result = _trained(strategy, optimizer)
        if isinstance(result, str) or not result:  # the full state is rank 0's
            out[f"{strategy}/{optimizer}"] = result
        else:
            ref = _reference(optimizer)
            out[f"{strategy}/{optimizer}"] = max(float(np.abs(a - b).max())
                                                 for a, b in zip(ref, result, strict=True))
    out["untested"] = [m for m in DEEPSPEED_WARNINGS.messages if "untested" in m]
    return out


EXACT = [("zero1", "lamb"), ("zero1", "adafactor"), ("fsdp", "lamb-clip"),
         *([("deepspeed", "adam"), ("deepspeed", "sgd")] if HAS_DEEPSPEED else [])]
REFUSED = [("zero1", "lamb-clip"),
           *([("deepspeed", "lamb"), ("deepspeed", "adafactor")] if HAS_DEEPSPEED else [])]


def shared_job(_: Path) -> tuple[Any, tuple[Any, ...]]:
    """This module's job, run in the spawn it shares with other modules (conftest.py)."""
    return _job, (EXACT + REFUSED,)


@pytest.fixture(scope="module")
def results(shared_spawn: dict[str, list[Any]]) -> dict[str, Any]:
    return shared_result(shared_spawn, __name__)[0]


def test_sharded_optimizers_keep_layerwise_updates_exact(results: dict[str, Any]) -> None:
    for strategy, optimizer in EXACT:
        diff = results[f"{strategy}/{optimizer}"]
        assert isinstance(diff, float) and diff < 1e-6, (strategy, optimizer, diff)


def test_sharded_optimizers_refuse_what_they_would_change(results: dict[str, Any]) -> None:
    for strategy, optimizer in REFUSED:
        message = results[f"{strategy}/{optimizer}"]
        assert isinstance(message, str), (strategy, optimizer, message)
        assert f"strategy='{strategy}'" in message and "'ddp'" in message, message


def test_deepspeed_does_not_warn_about_an_optimizer_accumix_checked(
        results: dict[str, Any]) -> None:
    """SGD (element-wise: exact on flat partitions) is not on DeepSpeed's list: it warned
    "You are using ZeRO with an untested optimizer, proceed with caution" (issue 29)."""
    if not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    assert results["untested"] == []
