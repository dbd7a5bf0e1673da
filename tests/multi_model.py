"""Several models and closures in one step (issue 15): jobs with their plain-PyTorch references.

Each job runs the same data through accumix and through plain PyTorch on one process (the
reference sees every rank's shard), so the unit tests (one process) and the 2-rank ddp test
share them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import accumix as ax

LR, MOMENTUM = 0.1, 0.9


def gan_models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    gen = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4))
    disc = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return gen, disc


def gan_data(steps: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """Per step: real samples, noise and a 0/1 weight per sample (item counts that differ)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        real = torch.randn(batch, 4, generator=g) + 1.0
        noise = torch.randn(batch, 3, generator=g)
        weight = (torch.rand(batch, generator=g) < 0.7).float()
        weight[0] = 1.0  # never an empty micro-batch
        out.append((real, noise, weight))
    return out


def shard(batch: tuple[torch.Tensor, ...], rank: int, world: int) -> tuple[torch.Tensor, ...]:
    return tuple(t.chunk(world)[rank] for t in batch)


def g_loss(gen: nn.Module, disc: nn.Module, noise: torch.Tensor, weight: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed loss, its item count, the fake samples)."""
    fake = gen(noise)
    err = (disc(fake).squeeze(-1) - 1.0) ** 2 * weight
    return err.sum(), weight.sum(), fake


def d_loss(disc: nn.Module, real: torch.Tensor, fake: torch.Tensor, weight: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    err = ((disc(real).squeeze(-1) - 1.0) ** 2 + disc(fake.detach()).squeeze(-1) ** 2) * weight
    return err.sum(), 2 * weight.sum()


def _reduce(parts: list[tuple[torch.Tensor, torch.Tensor]], items: bool) -> torch.Tensor:
    """The loss the large batch divides: items over every rank, or the ranks' mean of means."""
    if items:
        return sum(s for s, _ in parts) / sum(n for _, n in parts)
    return sum(s / n for s, n in parts) / len(parts)


def gan_reference(order: str, data: list[Any], world: int, items: bool
                  ) -> dict[str, list[torch.Tensor]]:
    """Plain PyTorch, one process: ``order`` "g_first" (G's step, then D's: issue 15 item 1) or
    "d_first" (the DCGAN example's order: item 2); every rank's shard in the same step."""
    gen, disc = gan_models()
    opt_g = torch.optim.SGD(gen.parameters(), lr=LR, momentum=MOMENTUM)
    opt_d = torch.optim.SGD(disc.parameters(), lr=LR, momentum=MOMENTUM)
    for batch in data:
        shards = [shard(batch, r, world) for r in range(world)]
        if order == "g_first":
            opt_g.zero_grad()
            parts = [g_loss(gen, disc, noise, wt) for _, noise, wt in shards]
            _reduce([(s, n) for s, n, _ in parts], items).backward()
            opt_g.step()
            fakes = [f for _, _, f in parts]
        else:
            fakes = [gen(noise) for _, noise, _ in shards]
        opt_d.zero_grad()
        _reduce([d_loss(disc, real, f, wt) for (real, _, wt), f in zip(shards, fakes, strict=True)],
                items).backward()
        opt_d.step()
        if order == "d_first":
            opt_g.zero_grad()
            parts2 = [(((disc(f).squeeze(-1) - 1.0) ** 2 * wt).sum(), wt.sum())
                      for f, (_, _, wt) in zip(fakes, shards, strict=True)]
            _reduce(parts2, items).backward()
            opt_g.step()
    return {"G": _params(gen), "D": _params(disc)}


def gan_accumix(order: str, data: list[Any], *, strategy: str = "auto", items: bool,
                precision: str = "fp32") -> tuple[dict[str, list[torch.Tensor]], ax.Accelerator]:
    """The same GAN as a user writes it with accumix (K=1), each rank on its shard."""
    gen, disc = gan_models()
    acc = ax.Accelerator(strategy=strategy, precision=precision, grad_accum_steps=1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=LR, momentum=MOMENTUM)
    opt_d = torch.optim.SGD(disc.parameters(), lr=LR, momentum=MOMENTUM)
    gen, disc, opt_g, opt_d = acc.setup(gen, disc, opt_g, opt_d)

    def backward(loss_sum: torch.Tensor, n: torch.Tensor) -> None:
        if items:
            acc.backward(loss_sum, num_items=n)
        else:
            acc.backward(loss_sum / n)

    for batch in data:
        real, noise, wt = shard(batch, acc.rank, acc.world_size)
        with acc.accumulate():
            if order == "g_first":
                opt_g.zero_grad()
                loss, n, fake = g_loss(gen, disc, noise, wt)
                backward(loss, n)
                opt_g.step()
                opt_d.zero_grad()
                backward(*d_loss(disc, real, fake, wt))
                opt_d.step()
            else:
                fake = gen(noise)
                opt_d.zero_grad()
                backward(*d_loss(disc, real, fake, wt))
                opt_d.step()
                opt_g.zero_grad()
                backward(((disc(fake).squeeze(-1) - 1.0) ** 2 * wt).sum(), wt.sum())
                opt_g.step()
    return {"G": _params(acc.unwrap(gen)), "D": _params(acc.unwrap(disc))}, acc


# -- two independent models, item-weighted, K=2 (item 3) ---------------------------------------
def two_models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    return nn.Linear(4, 1), nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))


def _item_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, wt: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    return (((model(x).squeeze(-1) - y) ** 2) * wt).sum(), wt.sum()


def two_model_data(windows: int, micro: int, world: int, steps: int, seed: int = 3
                   ) -> list[tuple[torch.Tensor, ...]]:
    """Per micro-step (all ranks' samples): x, y, and weights for each of the two models."""
    g = torch.Generator().manual_seed(seed)
    n = micro * world
    out = []
    for _ in range(windows * steps):
        x = torch.randn(n, 4, generator=g)
        y = x.sum(-1).sin()
        wa = (torch.rand(n, generator=g) < 0.6).float()
        wb = (torch.rand(n, generator=g) < 0.9).float()
        wa[0] = wb[0] = 1.0
        out.append((x, y, wa, wb))
    return out


def two_models_reference(data: list[Any], steps: int) -> dict[str, list[torch.Tensor]]:
    a, b = two_models()
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in (a, b)]
    for start in range(0, len(data), steps):
        window = data[start:start + steps]
        for model, opt, col in ((a, opts[0], 2), (b, opts[1], 3)):
            opt.zero_grad()
            parts = [_item_loss(model, mb[0], mb[1], mb[col]) for mb in window]
            (sum(s for s, _ in parts) / sum(n for _, n in parts)).backward()
            opt.step()
    return {"A": _params(a), "B": _params(b)}


def two_models_accumix(data: list[Any], steps: int, strategy: str = "auto"
                       ) -> dict[str, list[torch.Tensor]]:
    a, b = two_models()
    acc = ax.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=steps)
    opt_a = torch.optim.SGD(a.parameters(), lr=LR, momentum=MOMENTUM)
    opt_b = torch.optim.SGD(b.parameters(), lr=LR, momentum=MOMENTUM)
    a, b, opt_a, opt_b = acc.setup(a, b, opt_a, opt_b)
    for mb in data:
        x, y, wa, wb = shard(mb, acc.rank, acc.world_size)
        with acc.accumulate():
            for model, wt in ((a, wa), (b, wb)):
                loss_sum, n = _item_loss(model, x, y, wt)
                acc.backward(loss_sum, num_items=n)
            opt_a.step()
            opt_b.step()
            opt_a.zero_grad()
            opt_b.zero_grad()
    return {"A": _params(acc.unwrap(a)), "B": _params(acc.unwrap(b))}


# -- LBFGS with a closure, K=1 (item 4) ----------------------------------------------------------
def lbfgs_data(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 6, generator=g)
    return x, (x @ torch.randn(6, 1, generator=g)).tanh()


def lbfgs_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def lbfgs_reference(steps: int) -> tuple[list[torch.Tensor], list[float]]:
    model = lbfgs_model()
    x, y = lbfgs_data()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    losses = [float(opt.step(closure)) for _ in range(steps)]
    return _params(model), losses


def lbfgs_accumix(steps: int, strategy: str = "auto", *, late: bool = False
                  ) -> tuple[list[torch.Tensor], list[Any]]:
    """``late``: the optimizer built over the set-up model's parameters, set up on its own."""
    acc = ax.Accelerator(strategy=strategy, precision="fp32")
    model = lbfgs_model()
    if late:
        model = acc.setup(model)
        opt = acc.setup(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4))
    else:
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
        model, opt = acc.setup(model, opt)
    x, y = shard(lbfgs_data(), acc.rank, acc.world_size)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        # every rank's line search must see the same loss: the mean over ranks
        return acc.reduce(loss, "mean")

    losses = []
    for _ in range(steps):
        with acc.accumulate():
            out = opt.step(closure)
        losses.append(None if out is None else float(out))
    return _params(acc.unwrap(model)), losses


# -- fp16 item mode: the first window's hint (item 8) ------------------------------------------
def fp16_item_run(items: bool, strategy: str = "auto") -> tuple[list[bool], list[torch.Tensor]]:
    """K=1 under fp16-mixed, 64 items per micro-batch with errors near 0.3: the bias gradient
    of the summed loss times 2**16 overflows fp16, that of the mean (or of the sum divided by
    the count) does not. On 2 ranks rank 1 has 48 items: the first count is agreed."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, 8, generator=g)
    y = 0.3 + 0.05 * torch.randn(3, 64, 1, generator=g)
    model = nn.Linear(8, 1)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    acc = ax.Accelerator(strategy=strategy, precision="fp16-mixed", grad_accum_steps=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.setup(model, opt)
    skipped = []
    n = 64 - 16 * acc.rank
    for xb, yb in zip(x[:, :n], y[:, :n], strict=True):
        with acc.accumulate():
            err = (model(xb).float() - yb) ** 2
            if items:
                acc.backward(err.sum(), num_items=err.numel())
            else:
                acc.backward(err.mean())
            opt.step()
            opt.zero_grad()
        skipped.append(acc.step_was_skipped)
    return skipped, [p.detach().clone() for p in acc.unwrap(model).parameters()]


def _params(model: nn.Module) -> list[torch.Tensor]:
    """Copies of the parameters, whole (an FSDP shard is gathered: collective)."""
    return [p.full_tensor().detach().clone() if isinstance(p, DTensor)
            else copy.deepcopy(p.detach()) for p in model.parameters()]


def max_diff(a: dict[str, list[torch.Tensor]] | list[torch.Tensor],
             b: dict[str, list[torch.Tensor]] | list[torch.Tensor]) -> float:
    if isinstance(a, dict):
        return max(max_diff(a[k], b[k]) for k in a)  # type: ignore[index]
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))
