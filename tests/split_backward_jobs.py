"""The GAN of the README with D's loss split into two backward calls (issue: D forwarded on the
real and the fake batch, then ``acc.backward(real_part, num_items=)`` and ``acc.backward(
fake_part, num_items=)`` in one micro-step), in both orders, mean and item mode, any K, with a
set-up loader (so the last window of the epoch may be short); and its plain-PyTorch reference
on one process, which sees every rank's samples.

The reference is the plain-PyTorch loop for accumulation: both optimizers zeroed at each
window's start, ``step()`` only on its last micro-step, each optimizer's gradients divided at
its step by its own count: the items of the backward calls that reached it (item mode), or the
window's micro-steps (mean mode, each backward's loss the mean over the ranks of their shards'
means). What a window's micro-steps add stays in it, G's backward through D included (accumix's
``zero_grad()`` keeps an unfinished window); in a window of one micro-step the loop's own
``zero_grad()`` calls act as in plain PyTorch (the G-first loop's clears what G's backward left
on D).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax
from tests.multi_model import LR, MOMENTUM, _params, gan_data, gan_models


def split_data(micro_steps: int, world: int, micro: int = 3) -> list[tuple[torch.Tensor, ...]]:
    """Per micro-step (every rank's samples): real samples, noise, a 0/1 weight per sample."""
    data = gan_data(steps=micro_steps, batch=micro * world, seed=7)
    for _, _, weight in data:
        weight[:world] = 1.0  # no rank's shard without items (the sampler deals them in turn)
    return data


def _terms(disc: nn.Module, real: torch.Tensor, fake: torch.Tensor, weight: torch.Tensor,
           detach: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """D's two losses (real, fake) as (summed loss, items); ``detach``: D's step (the fake
    detached), else G's loss through D (one term)."""
    if not detach:
        return [(((disc(fake).squeeze(-1) - 1.0) ** 2 * weight).sum(), weight.sum())]
    out_real = disc(real).squeeze(-1)  # both forwards before either backward (the report's form)
    out_fake = disc(fake.detach()).squeeze(-1)
    return [(((out_real - 1.0) ** 2 * weight).sum(), weight.sum()),
            ((out_fake ** 2 * weight).sum(), weight.sum())]


def split_accumix(order: str, data: list[Any], *, steps: int, items: bool,
                  strategy: Any = "auto") -> tuple[dict[str, list[torch.Tensor]], int]:
    """The GAN through accumix, each rank on its share (the sampler deals each micro-step's
    samples out in turn); returns the parameters and ``optimizer_steps``."""
    gen, disc = gan_models()
    acc = ax.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=steps)
    opt_g = torch.optim.SGD(gen.parameters(), lr=LR, momentum=MOMENTUM)
    opt_d = torch.optim.SGD(disc.parameters(), lr=LR, momentum=MOMENTUM)
    per_rank = len(data[0][0]) // acc.world_size
    dataset = TensorDataset(*(torch.cat(column) for column in zip(*data, strict=True)))
    gen, disc, opt_g, opt_d, loader = acc.setup(gen, disc, opt_g, opt_d,
                                                DataLoader(dataset, batch_size=per_rank))

    def backward(terms: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for loss_sum, n in terms:
            if items:
                acc.backward(loss_sum, num_items=n)
            else:
                acc.backward(loss_sum / n)

    for real, noise, weight in loader:
        with acc.accumulate():
            if order == "g_first":
                opt_g.zero_grad()
                fake = gen(noise)
                backward(_terms(disc, real, fake, weight, detach=False))
                opt_g.step()
            else:
                fake = gen(noise)
            opt_d.zero_grad()
            backward(_terms(disc, real, fake, weight, detach=True))
            opt_d.step()
            if order == "d_first":
                opt_g.zero_grad()
                backward(_terms(disc, real, fake, weight, detach=False))
                opt_g.step()
    return {"G": _params(acc.unwrap(gen)), "D": _params(acc.unwrap(disc))}, acc.optimizer_steps


def split_reference(order: str, data: list[Any], *, steps: int, items: bool, world: int
                    ) -> tuple[dict[str, list[torch.Tensor]], int]:
    """Plain PyTorch on one process (see the module docstring); returns the parameters and the
    optimizer steps taken."""
    gen, disc = gan_models()
    opt_g = torch.optim.SGD(gen.parameters(), lr=LR, momentum=MOMENTUM)
    opt_d = torch.optim.SGD(disc.parameters(), lr=LR, momentum=MOMENTUM)
    count = {"G": 0.0, "D": 0.0}
    taken = 0

    def backward(shard_terms: list[list[tuple[torch.Tensor, torch.Tensor]]],
                 reached: tuple[str, ...]) -> None:
        # one backward per term, as the loop writes them; each over every rank's shard
        for parts in zip(*shard_terms, strict=True):
            if items:
                loss = sum(s for s, _ in parts)
                for name in reached:
                    count[name] += float(sum(n for _, n in parts))
            else:
                loss = sum(s / n for s, n in parts) / len(parts)
            loss.backward()

    def step(name: str, opt: torch.optim.Optimizer, size: int) -> None:
        divisor = count[name] if items else size
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(divisor)
        opt.step()

    def zero(name: str, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        count[name] = 0.0

    for start in range(0, len(data), steps):
        window = data[start:start + steps]
        alone = len(window) == 1  # the loop's zero_grad calls act as written
        if not alone:
            zero("G", opt_g)
            zero("D", opt_d)
        for m, batch in enumerate(window):
            last = m == len(window) - 1
            shards = [tuple(t[r::world] for t in batch) for r in range(world)]
            fakes = [gen(noise) for _, noise, _ in shards]
            if order == "g_first":
                if alone:
                    zero("G", opt_g)
                backward([_terms(disc, real, f, w, detach=False)
                          for (real, _, w), f in zip(shards, fakes, strict=True)], ("G", "D"))
                if last:
                    step("G", opt_g, len(window))
            if alone:
                zero("D", opt_d)
            backward([_terms(disc, real, f, w, detach=True)
                      for (real, _, w), f in zip(shards, fakes, strict=True)], ("D",))
            if last:
                step("D", opt_d, len(window))
                taken += 1
            if order == "d_first":
                if alone:
                    zero("G", opt_g)
                backward([_terms(disc, real, f, w, detach=False)
                          for (real, _, w), f in zip(shards, fakes, strict=True)], ("G", "D"))
                if last:
                    step("G", opt_g, len(window))
    return {"G": _params(gen), "D": _params(disc)}, taken


# -- one model, two forwards then two backward calls (what deepspeed, one engine, can run) -------
def one_model_data(micro_steps: int, world: int, micro: int = 3) -> list[tuple[torch.Tensor, ...]]:
    """Per micro-step (every rank's samples): two inputs, targets, and 0/1 weights for each."""
    g = torch.Generator().manual_seed(13)
    n = micro * world
    out = []
    for _ in range(micro_steps):
        xa, xb = torch.randn(n, 4, generator=g), torch.randn(n, 4, generator=g)
        wa = (torch.rand(n, generator=g) < 0.7).float()
        wb = (torch.rand(n, generator=g) < 0.5).float()
        wa[:world] = wb[:world] = 1.0  # no rank's shard without items
        out.append((xa, xb, xa.sum(-1).sin(), xb.sum(-1).cos(), wa, wb))
    return out


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _two_terms(model: nn.Module, batch: tuple[torch.Tensor, ...]
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    xa, xb, ya, yb, wa, wb = batch
    out_a, out_b = model(xa).float().squeeze(-1), model(xb).float().squeeze(-1)
    return [(((out_a - ya) ** 2 * wa).sum(), wa.sum()), (((out_b - yb) ** 2 * wb).sum(), wb.sum())]


def one_model_accumix(data: list[Any], *, steps: int, items: bool, strategy: Any = "auto"
                      ) -> tuple[list[torch.Tensor], int]:
    """One model forwarded on two batches, then one backward per batch's loss, each micro-step
    (deepspeed refuses the second backward on a boundary micro-step)."""
    model = _net()
    acc = ax.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=steps)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    per_rank = len(data[0][0]) // acc.world_size
    dataset = TensorDataset(*(torch.cat(column) for column in zip(*data, strict=True)))
    model, opt, loader = acc.setup(model, opt, DataLoader(dataset, batch_size=per_rank))
    for batch in loader:
        with acc.accumulate():
            for loss_sum, n in _two_terms(model, batch):
                if items:
                    acc.backward(loss_sum, num_items=n)
                else:
                    acc.backward(loss_sum / n)
            opt.step()
            opt.zero_grad()
    return _params(acc.unwrap(model)), acc.optimizer_steps


def one_model_reference(data: list[Any], *, steps: int, items: bool, world: int
                        ) -> tuple[list[torch.Tensor], int]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    taken = 0
    for start in range(0, len(data), steps):
        window = data[start:start + steps]
        opt.zero_grad()
        total, count = 0.0, 0.0
        for batch in window:
            shards = [_two_terms(model, tuple(t[r::world] for t in batch)) for r in range(world)]
            for parts in zip(*shards, strict=True):
                if items:
                    total = total + sum(s for s, _ in parts)
                    count += float(sum(n for _, n in parts))
                else:
                    total = total + sum(s / n for s, n in parts) / len(parts)
        (total / (count if items else len(window))).backward()
        opt.step()
        taken += 1
    return _params(model), taken
