"""Issue 20's step jobs, each with its plain-PyTorch reference on one process (which sees every
rank's shard): overlapping optimizers, a model unused on the boundary micro-step, fp16 with two
optimizers stepped after the block (GradScaler's trace), a window whose step the loop skips,
and optimizer.step() after the block. Shared by the unit and the 2-rank tests."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax
from tests.multi_model import _params, shard

LR, MOMENTUM = 0.1, 0.9


def _data(micro_steps: int, n: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Per micro-step (every rank's samples): x, y and a 0/1 weight per sample."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(micro_steps):
        x = torch.randn(n, 4, generator=g)
        weight = (torch.rand(n, generator=g) < 0.7).float()
        weight[0] = 1.0
        out.append((x, x.sum(-1, keepdim=True).sin(), weight))
    return out


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _item_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    return (((model(x).float() - y) ** 2).squeeze(-1) * weight).sum(), weight.sum()


# -- item 1: one optimizer over the whole model, another over its head ---------------------------
def overlap_data(world: int) -> list[tuple[torch.Tensor, ...]]:
    return _data(micro_steps=6, n=3 * world, seed=11)


def _overlap_optimizers(model: nn.Module) -> tuple[torch.optim.Optimizer, ...]:
    return (torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
            torch.optim.SGD(model[2].parameters(), lr=0.05))


def overlap_reference(data: list[Any], steps: int, clip: float
                      ) -> tuple[list[torch.Tensor], list[float]]:
    model = _net()
    whole, head = _overlap_optimizers(model)
    norms = []
    for start in range(0, len(data), steps):
        whole.zero_grad()
        head.zero_grad()
        parts = [_item_loss(model, *mb) for mb in data[start:start + steps]]
        (sum(s for s, _ in parts) / sum(n for _, n in parts)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        whole.step()
        head.step()
    return _params(model), norms


def overlap_accumix(data: list[Any], steps: int, clip: float, strategy: str = "auto"
                    ) -> tuple[list[torch.Tensor], list[float]]:
    """Item-weighted, clipped at the boundary, both optimizers stepped."""
    acc = ax.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=steps)
    model = _net()
    model, whole, head = acc.setup(model, *_overlap_optimizers(model))
    norms = []
    for mb in data:
        with acc.accumulate():
            acc.backward(*_item_loss(model, *shard(mb, acc.rank, acc.world_size)))
            norm = acc.clip_grad_norm_(clip)
            if norm is not None:
                norms.append(norm.item())
            whole.step()
            head.step()
            whole.zero_grad()
            head.zero_grad()
    return _params(acc.unwrap(model)), norms


# -- item 2: two models used alternately, K=2 (A off the boundary, B on it) ----------------------
def alternate_data(world: int) -> list[tuple[torch.Tensor, ...]]:
    return _data(micro_steps=6, n=2 * world, seed=13)  # 3 windows


def alternate_reference(data: list[Any]) -> list[torch.Tensor]:
    a, b = _net(0), _net(1)
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in (a, b)]
    for i, (x, y, _) in enumerate(data):
        model = a if i % 2 == 0 else b
        (nn.functional.mse_loss(model(x), y) / 2).backward()
        if i % 2:
            for opt in opts:
                opt.step()
                opt.zero_grad()
    return _params(a) + _params(b)


def alternate_accumix(data: list[Any], strategy: str | ax.Strategy, zero_loss: bool = False
                      ) -> list[torch.Tensor] | str:
    """A runs on the first micro-step of each window (gradient sync off), B on the boundary;
    ``zero_loss``: A also gets a zero loss's backward on the boundary (the workaround the
    refusals name). Returns the parameters, or a refusal's message."""
    acc = ax.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=2)
    a, b = _net(0), _net(1)
    opt_a = torch.optim.SGD(a.parameters(), lr=LR, momentum=MOMENTUM)
    opt_b = torch.optim.SGD(b.parameters(), lr=LR, momentum=MOMENTUM)
    a, b, opt_a, opt_b = acc.setup(a, b, opt_a, opt_b)
    try:
        for i, mb in enumerate(data):
            x, y, _ = shard(mb, acc.rank, acc.world_size)
            with acc.accumulate():
                loss = nn.functional.mse_loss((a if i % 2 == 0 else b)(x), y)
                if zero_loss and i % 2:
                    loss = loss + 0.0 * a(x).sum()
                acc.backward(loss)
                for opt in (opt_a, opt_b):
                    opt.step()
                    opt.zero_grad()
    except ax.ConfigError as exc:
        return str(exc)
    return _params(acc.unwrap(a)) + _params(acc.unwrap(b))


def skipped_boundary_backward(strategy: str | ax.Strategy) -> str:
    """One model, K=2, no backward on the boundary micro-step: refused where the backend
    cannot reduce afterwards (deepspeed), else 'stepped'."""
    acc = ax.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=2)
    model = _net()
    model, opt = acc.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    x, y, _ = shard(_data(1, 4, seed=2)[0], acc.rank, acc.world_size)
    try:
        for micro in range(2):
            with acc.accumulate():
                if micro == 0:
                    acc.backward(nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
    except ax.ConfigError as exc:
        return str(exc)
    return "stepped"


# -- item 3: fp16, two models, GradScaler's trace ------------------------------------------------
FP16_BAD_WINDOW = 2  # model A's loss is inf in this window: A skips, the scale backs off


def fp16_data() -> list[tuple[torch.Tensor, ...]]:
    return _data(micro_steps=5, n=8, seed=5)


def _fp16_loss(model: nn.Module, mb: tuple[torch.Tensor, ...], bad: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    # 8 items each (a power of two): dividing before or after fp16's backward rounds alike.
    loss_sum, n = _item_loss(model, mb[0], mb[1], torch.ones_like(mb[2]))
    return (loss_sum * math.inf if bad else loss_sum), n


def fp16_gradscaler(data: list[Any]) -> tuple[list[float], list[torch.Tensor]]:
    """torch's own: autocast fp16, ``GradScaler.step`` for each optimizer, one ``update``."""
    a, b = _net(0), _net(1)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (a, b)]
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1)
    trace = []
    for i, mb in enumerate(data):
        for opt in opts:
            opt.zero_grad()
        for model in (a, b):
            with torch.autocast("cpu", dtype=torch.float16):
                loss_sum, n = _fp16_loss(model, mb, i == FP16_BAD_WINDOW and model is a)
            scaler.scale(loss_sum / n).backward()
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        trace.append(scaler.get_scale())
    return trace, _params(a) + _params(b)


def fp16_accumix(data: list[Any], where: str) -> tuple[list[float | None], list[torch.Tensor]]:
    """The same with accumix (item-weighted, hysteresis 1 = GradScaler); ``where`` the steps
    are written: "inside" the block, "after" it, or "mixed" (A inside, B after)."""
    scale = ax.DynamicLossScale(init_scale=256.0, growth_interval=1, hysteresis=1)
    acc = ax.Accelerator(precision="fp16-mixed", grad_accum_steps=1, loss_scale=scale)
    a, b = _net(0), _net(1)
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=LR) for m in (a, b))
    a, b, opt_a, opt_b = acc.setup(a, b, opt_a, opt_b)
    trace = []
    for i, mb in enumerate(data):
        with acc.accumulate():
            for model in (a, b):
                loss_sum, n = _fp16_loss(model, mb, i == FP16_BAD_WINDOW and model is a)
                acc.backward(loss_sum, num_items=n)
            if where != "after":
                opt_a.step()
            if where == "inside":
                opt_b.step()
        if where == "after":
            opt_a.step()
        if where != "inside":
            opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
        trace.append(acc.loss_scale)
    return trace, _params(acc.unwrap(a)) + _params(acc.unwrap(b))


# -- item 4: the loop skips the step of a window whose gradients are not finite ------------------
SKIP_STEPS, SKIP_WINDOWS, SKIP_NAN_AT = 2, 6, 1  # micro-batch 1 (window 0) has a NaN loss


def skip_data() -> list[tuple[torch.Tensor, ...]]:
    return _data(micro_steps=SKIP_STEPS * SKIP_WINDOWS, n=4, seed=7)


def _skip_loss(model: nn.Module, i: int, mb: tuple[torch.Tensor, ...]) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(mb[0]).float(), mb[1])
    return loss * math.nan if i == SKIP_NAN_AT else loss


def skip_reference(data: list[Any]) -> tuple[int, list[torch.Tensor]]:
    """Plain PyTorch: clip at the boundary, step only on a finite norm, zero_grad either way."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps = 0
    for i, mb in enumerate(data):
        (_skip_loss(model, i, mb) / SKIP_STEPS).backward()
        if (i + 1) % SKIP_STEPS == 0:
            if torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)):
                opt.step()
                steps += 1
            opt.zero_grad()
    return steps, _params(model)


def skip_accumix(data: list[Any], check: str, strategy: Any = "auto"
                 ) -> tuple[int, list[torch.Tensor]]:
    """The loop with accumix, zero_grad() inside the block after the (maybe skipped) step;
    ``check``: "norm" (``acc.clip_grad_norm_``'s result) or "loss" (the window's losses, no
    accumix call between backward and the decision)."""
    acc = ax.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=SKIP_STEPS)
    model = _net()
    model, opt = acc.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    steps, finite = 0, True
    for i, mb in enumerate(data):
        with acc.accumulate():
            loss = _skip_loss(model, i, mb)
            acc.backward(loss)
            finite = finite and bool(torch.isfinite(loss))
            if acc.sync_gradients:
                norm = acc.clip_grad_norm_(1.0)
                if check == "loss":
                    norm = torch.tensor(0.0 if finite else math.nan)
                if torch.isfinite(norm):
                    opt.step()
                    steps += 1
                finite = True
            opt.zero_grad()
    assert steps == acc.optimizer_steps
    return steps, _params(acc.unwrap(model))


# -- item 9: optimizer.step() after the block -----------------------------------------------------
def after_block_data(world: int) -> list[tuple[torch.Tensor, ...]]:
    """5 micro-steps, K=2: windows of 2, 2 and a short one of 1."""
    return _data(micro_steps=5, n=2 * world, seed=9)


def after_block_reference(data: list[Any], items: bool) -> list[torch.Tensor]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for start in range(0, len(data), 2):
        window = data[start:start + 2]
        opt.zero_grad()
        if items:
            parts = [_item_loss(model, *mb) for mb in window]
            loss = sum(s for s, _ in parts) / sum(n for _, n in parts)
        else:
            loss = sum(nn.functional.mse_loss(model(x), y) for x, y, _ in window) / len(window)
        loss.backward()
        opt.step()
        sched.step()
    return _params(model)


def after_block_accumix(data: list[Any], items: bool, strategy: Any = "auto"
                        ) -> tuple[list[torch.Tensor], int]:
    """The GAN form of the README: the step, the scheduler and zero_grad after the block. The
    set-up loader ends the epoch with the short window (a rank's batches of 2 are its share of
    each micro-step's samples: the sampler deals them out in turn)."""
    acc = ax.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=2)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    dataset = TensorDataset(*(torch.cat(column) for column in zip(*data, strict=True)))
    model, opt, sched, loader = acc.setup(model, opt, sched, DataLoader(dataset, batch_size=2))
    for x, y, weight in loader:
        with acc.accumulate():
            if items:
                acc.backward(*_item_loss(model, x, y, weight))
            else:
                acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
    return _params(acc.unwrap(model)), acc.optimizer_steps


# -- item 1 (review): a backward that reaches only one of the overlapping optimizers -------------
def partial_reach_accumix(head_first: bool) -> list[torch.Tensor]:
    """Item mode, K=2: micro-step 1's loss goes through the whole model, micro-step 2's (an
    auxiliary loss on the body's features) reaches the whole-model optimizer only."""
    data = _data(micro_steps=2, n=3, seed=5)
    acc = ax.Accelerator(precision="fp32", grad_accum_steps=2)
    model = _net()
    model, whole, head = acc.setup(model, *_overlap_optimizers(model))
    for i, (x, y, weight) in enumerate(data):
        with acc.accumulate():
            if i == 0:
                acc.backward(*_item_loss(model, x, y, weight))
            else:
                acc.backward((model[0](x) ** 2).sum(), 5)
            for opt in (head, whole) if head_first else (whole, head):
                opt.step()
    return _params(acc.unwrap(model))


# -- item 3 (review): a checkpoint written while the window's scale update waits -----------------
def pending_update_run(run_dir: str, cut: int | None, start: int = 0) -> tuple[float, list[Any]]:
    """fp16, K=2, A's loss is inf in window 1; the loop clips A and skips its step on a
    non-finite norm, steps B, then (``cut``: in that window) saves before ``zero_grad()``, which
    is what the scale update waits for. ``start``: resume from ``run_dir`` at that micro-step."""
    data = _data(micro_steps=8, n=4, seed=13)
    scale = ax.DynamicLossScale(init_scale=256.0, growth_interval=2, hysteresis=1)
    acc = ax.Accelerator(precision="fp16-mixed", grad_accum_steps=2, loss_scale=scale, seed=0)
    a, b = _net(0), _net(1)
    a, b, opt_a, opt_b = acc.setup(a, b, *(torch.optim.SGD(m.parameters(), lr=LR) for m in (a, b)))
    if start:
        acc.load_state(run_dir)
    for i in range(start, len(data) if cut is None else cut + 1):
        x, y, _ = data[i]
        with acc.accumulate():
            loss_a = nn.functional.mse_loss(a(x).float(), y)
            acc.backward(loss_a * math.inf if i in (2, 3) else loss_a)
            acc.backward(nn.functional.mse_loss(b(x).float(), y))
        if acc.sync_gradients:
            if torch.isfinite(acc.clip_grad_norm_(1.0, parameters=a.parameters())):
                opt_a.step()
            opt_b.step()
            if i == cut:
                acc.save_state(run_dir)
            opt_a.zero_grad()
            opt_b.zero_grad()
    return acc.loss_scale, _params(acc.unwrap(a)) + _params(acc.unwrap(b))


def lbfgs_items(with_accumix: bool) -> list[torch.Tensor]:
    """LBFGS (closure, item-weighted) over a model with a parameter no loss reaches, beside a
    second optimizer: that parameter stays finalized by LBFGS's own first evaluation while the
    later evaluations' backward calls reach the rest."""
    x, y, _ = _data(micro_steps=1, n=6, seed=2)[0]
    model = nn.ModuleDict({"net": _net(), "unused": nn.Linear(2, 2)})
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    if not with_accumix:
        for _ in range(3):
            def closure() -> torch.Tensor:
                lbfgs.zero_grad()
                loss = ((model["net"](x) - y) ** 2).sum() / len(x)
                loss.backward()
                return loss
            lbfgs.step(closure)
        return _params(model)
    acc = ax.Accelerator(precision="fp32", grad_accum_steps=1)
    other = _net(1)
    model, other, lbfgs, _ = acc.setup(model, other, lbfgs,
                                       torch.optim.SGD(other.parameters(), lr=LR))
    for _ in range(3):
        with acc.accumulate():
            def closure() -> torch.Tensor:
                lbfgs.zero_grad()
                loss_sum = ((model["net"](x) - y) ** 2).sum()
                acc.backward(loss_sum, num_items=len(x))
                return loss_sum / len(x)
            lbfgs.step(closure)
    return _params(acc.unwrap(model))
