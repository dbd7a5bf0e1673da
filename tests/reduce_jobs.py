"""Issue 33's 2-rank jobs: accumix with a ``reduce_dtype``, and the plain-PyTorch run it must
equal: each rank's window summed in float32, then reduced as the wire does it (each rank's share
divided by the world, cast, summed in the wire dtype, cast back), then SGD.

On 2 ranks a sum is one addition, so the order gloo adds in cannot matter, and dividing by 2 is
exact in every dtype here: the reference is exact, and accumix must match it bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import accumix as ax
from accumix.testing import CollectiveLog
from tests.golden.pre_reduce33.make import make_model

LR, MOMENTUM, WORLD = 0.1, 0.9, 2
Batch = tuple[torch.Tensor, torch.Tensor]


def batch(rank: int, window: int, micro: int, rows: int = 4) -> Batch:
    """Rank ``rank``'s micro-batch ``micro`` of window ``window`` (the same on every call)."""
    gen = torch.Generator().manual_seed(10_000 * rank + 100 * window + micro)
    return torch.randn(rows, 8, generator=gen), torch.randn(rows, 1, generator=gen)


def mse(model: Callable[[torch.Tensor], torch.Tensor], data: Batch) -> torch.Tensor:
    x, y = data
    return nn.functional.mse_loss(model(x), y)


def autocast_forward(model: nn.Module, dtype: torch.dtype | None
                     ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The forward as a mixed precision runs it: under autocast, its output cast to float32
    (the loss is computed outside, in float32)."""
    if dtype is None:
        return model

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
        return out.float()

    return forward


def node_sums(grads: list[torch.Tensor], wire: torch.dtype, nodes: int = 1
              ) -> list[torch.Tensor]:
    """Each node's sum in ``wire`` of its ranks' shares (``grads`` in rank order, each divided
    by the world first; consecutive ranks share a node)."""
    parts = [(g / len(grads)).to(wire) for g in grads]
    per_node = len(parts) // nodes
    sums = []
    for node in range(nodes):
        total = parts[node * per_node]
        for part in parts[node * per_node + 1:(node + 1) * per_node]:
            total = total + part
        sums.append(total)
    return sums


def wire_mean(grads: list[torch.Tensor], wire: torch.dtype, nodes: int = 1) -> torch.Tensor:
    """What every strategy's reduction gives for the ranks' local gradients ``grads``: summed
    inside each node, then across the nodes (hsdp's all-reduce), in ``wire``."""
    sums = node_sums(grads, wire, nodes)
    total = sums[0]
    for part in sums[1:]:
        total = total + part
    return total.to(grads[0].dtype)


def reference(model: nn.Module, *, windows: int, accum: int, wire: torch.dtype,
              autocast: torch.dtype | None = None, extra: list[nn.Parameter] = (),
              every_micro_step: bool = False, world: int = WORLD, nodes: int = 1,
              partial_sums: bool = False) -> list[torch.Tensor]:
    """Plain PyTorch on one process: the ranks' windows, each summed in float32 (loss / K per
    micro-step, as accumix scales it), reduced as ``wire_mean``, one SGD step per window.
    ``extra``: a parameter outside the model that multiplies the loss, stepped too.
    ``every_micro_step``: each micro-step reduced on its own and the results summed in float32
    (fsdp's ``sync_each_microstep``, DeepSpeed's ZeRO-2). ``nodes``: the ranks' sums are taken
    inside each node, then across. ``partial_sums`` (hsdp's default): each micro-step summed
    inside the nodes in ``wire``; a node's off-boundary sums add in float32, into the boundary's
    (rounded to ``wire`` once), then across the nodes."""
    model = copy.deepcopy(model)
    forward = autocast_forward(model, autocast)
    extra = [nn.Parameter(p.detach().clone()) for p in extra]
    params = [*model.parameters(), *extra]
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    def local(window: int, micro_steps: range) -> list[list[torch.Tensor]]:
        """Each parameter's gradients, rank by rank."""
        per_rank = []
        for rank in range(world):
            for p in params:
                p.grad = None
            for micro in micro_steps:
                loss = mse(forward, batch(rank, window, micro))
                if extra:
                    loss = loss * extra[0]
                (loss * (1.0 / accum)).backward()
            per_rank.append([p.grad.clone() for p in params])
        return [list(grads) for grads in zip(*per_rank, strict=True)]

    def reduced(window: int, micro_steps: range) -> list[torch.Tensor]:
        return [wire_mean(grads, wire, nodes) for grads in local(window, micro_steps)]

    def hsdp(window: int) -> list[torch.Tensor]:
        partial = None
        for micro in range(accum - 1):
            sums = [[s.float() for s in node_sums(grads, wire, nodes)]
                    for grads in local(window, range(micro, micro + 1))]
            partial = sums if partial is None else [
                [a + b for a, b in zip(x, y, strict=True)] for x, y in zip(partial, sums,
                                                                          strict=True)]
        out = []
        for index, grads in enumerate(local(window, range(accum - 1, accum))):
            last = node_sums(grads, wire, nodes)
            if partial is not None:  # bf16 += float32: added in float32, rounded once
                last = [(a.float() + b).to(wire) for a, b in zip(last, partial[index],
                                                                  strict=True)]
            total = last[0]
            for part in last[1:]:
                total = total + part
            out.append(total.to(grads[0].dtype))
        return out

    for window in range(windows):
        if partial_sums:
            grads = hsdp(window)
        elif every_micro_step:
            parts = [reduced(window, range(micro, micro + 1)) for micro in range(accum)]
            grads = [sum(each[1:], each[0]) for each in zip(*parts, strict=True)]
        else:
            grads = reduced(window, range(accum))
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        opt.step()
    return [p.detach().clone() for p in params]


def run(strategy: Any, *, windows: int, accum: int, reduce_dtype: str | None,
        precision: str = "fp32", extra: list[nn.Parameter] = (), log: CollectiveLog | None = None,
        model: nn.Module | None = None, hook: Callable[[nn.Module], None] | None = None,
        **kwargs: Any) -> tuple[ax.Accelerator, nn.Module, list[torch.Tensor]]:
    """accumix on this rank, its own batches; ``log`` records the backward calls'
    collectives; ``hook(model)`` runs after setup. Returns the accelerator, the set-up model
    and the trained parameters (full tensors, extra ones last)."""
    acc = ax.Accelerator(strategy=strategy, precision=precision, grad_accum_steps=accum,
                         reduce_dtype=reduce_dtype, **kwargs)
    model = copy.deepcopy(model if model is not None else make_model())
    extra = [nn.Parameter(p.detach().clone()) for p in extra]
    opt = torch.optim.SGD([*model.parameters(), *extra], lr=LR, momentum=MOMENTUM)
    model, opt = acc.setup(model, opt)
    if hook is not None:
        hook(model)
    for window in range(windows):
        for micro in range(accum):
            with acc.accumulate():
                loss = mse(model, batch(acc.rank, window, micro))
                if extra:
                    loss = loss * extra[0]
                if log is None:
                    acc.backward(loss)
                else:
                    with log:
                        acc.backward(loss)
                opt.step()
                opt.zero_grad()
    return acc, model, full_params(acc, model) + [p.detach().clone() for p in extra]


def full_params(acc: ax.Accelerator, model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters as full tensors (collective under fsdp)."""
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in acc.unwrap(model).parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))


def gradient_bytes(log: CollectiveLog) -> tuple[int, list[str]]:
    """The gradient collectives' payload bytes (all-reduces, reduce-scatters) and dtypes."""
    calls = [c for c in log.calls if c.op == "all_reduce" or c.op.startswith("reduce_scatter")]
    return sum(c.nbytes for c in calls), sorted({str(c.dtype) for c in calls})


def fp16_wire_windows(strategy: Any, *, items: bool, windows: int = 6, accum: int = 4
                      ) -> tuple[int, float | None, list[torch.Tensor]]:
    """fp16-mixed with an fp16 wire, ``windows`` windows of ``accum`` micro-steps of 16 rows a
    rank, the loss a mean or ``(loss_sum, num_items)`` (every micro-batch has 16 items: the
    same gradients). A zero-initialised ``Linear(8, 1)`` against targets near 0.3: the bias
    gradient of the mean (0.6) times the initial scale 2**16 is just inside fp16, the same
    gradient K=4 times over is not. Returns (skipped steps, final scale, full parameters)."""
    acc = ax.Accelerator(strategy=strategy, precision="fp16-mixed", grad_accum_steps=accum,
                         reduce_dtype="fp16")
    model = nn.Linear(8, 1)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.setup(model, opt)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(windows * accum, acc.world_size, 16, 8, generator=gen)
    y = 0.3 + 0.05 * torch.randn(windows * accum, acc.world_size, 16, 1, generator=gen)
    skipped = 0
    for step in range(windows * accum):
        with acc.accumulate():
            err = (model(x[step, acc.rank]).float() - y[step, acc.rank]) ** 2
            if items:
                acc.backward(err.sum(), num_items=err.numel())
            else:
                acc.backward(err.mean())
            opt.step()
            opt.zero_grad()
        skipped += acc.sync_gradients and acc.step_was_skipped
    params = full_params(acc, model)
    scale = acc.loss_scale
    acc.end()
    return skipped, scale, params
