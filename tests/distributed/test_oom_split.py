"""2 ranks on gloo: the out-of-memory safety net under ddp, fsdp and deepspeed.

Rank 1's model raises ``torch.OutOfMemoryError`` above a few rows in one off-boundary micro-step
and in one boundary micro-step (where the gradient collectives run): the run equals the unsplit
run (the same job without the injection) to float tolerance, in mean and item mode, with the
same optimizer steps and one log line per split. Under ddp also ranks holding different rows
(rank 0 fewer rows than pieces: one-row pieces weighted zero) and a one-row piece that still
does not fit (raised on both ranks, no hang). One spawned job runs every check, shared with
test_micro_batch_auto (``micro_batch_jobs``).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import accumix as ax
from tests import workloads as w
from tests.distributed import micro_batch_jobs
from tests.oom_injection import LogLines, make_model

TOL = 1e-6
K, MICRO = 3, 4
# Rank 1's loader batch index -> the rows its forward may take: micro-step 2 of window 1 (off
# the boundary: cut 4 -> 2 -> 1), micro-step 3 of window 2 (the boundary: cut once).
INJECT = {1: 1, 5: 2}


def _train(strategy: str, *, items: bool, inject: bool) -> dict[str, Any]:
    model = make_model(in_features=4 if items else 6)
    head = model[-1]
    acc = ax.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=K,
                         micro_batch_size=MICRO)
    opt = torch.optim.SGD(model.parameters(), lr=w.LR, momentum=w.MOMENTUM)
    data = w.sequence_data(2 * K * MICRO * 2) if items else w.regression_data(2 * K * MICRO * 2)
    model, opt, loader = acc.setup(model, opt, DataLoader(data, batch_size=MICRO))
    lines = LogLines()
    logging.getLogger("accumix").addHandler(lines)
    losses = []
    for index, batch in enumerate(loader):
        head.limit = INJECT.get(index) if inject and acc.rank == 1 else None
        with acc.accumulate():
            step = ((lambda part: w.item_loss(model, part)) if items
                    else (lambda part: w.mean_loss(model, part)))
            out = acc.run_micro_batch(step, batch)
            opt.step()
            opt.zero_grad()
        losses.append(float((out[0] if items else out).detach()))
    logging.getLogger("accumix").removeHandler(lines)
    # numpy: tensors through the result queue would travel as shared-memory handles
    state = {k: v.detach().numpy().copy() for k, v in acc.strategy.full_state_dict(model).items()}
    result = {"state": state, "steps": acc.optimizer_steps, "losses": losses,
              "raised": head.raised, "lines": [x for x in lines.lines if "out of memory" in x]}
    acc.end()
    return result


def _uneven(*, inject: bool, rows_on_rank0: int = 1, limit: int = 1) -> list[torch.Tensor]:
    """One boundary micro-step, rank 0 with ``rows_on_rank0`` rows, rank 1 with 4."""
    model = make_model()
    head = model[-1]
    acc = ax.Accelerator(strategy="ddp", precision="fp32")
    opt = torch.optim.SGD(model.parameters(), lr=w.LR)
    model, opt = acc.setup(model, opt)
    x, y = w.regression_data(8).tensors
    rows = rows_on_rank0 if acc.rank == 0 else 4
    batch = (x[4 * acc.rank:4 * acc.rank + rows], y[4 * acc.rank:4 * acc.rank + rows])
    head.limit = limit if inject and acc.rank == 1 else None
    with acc.accumulate():
        acc.run_micro_batch(lambda part: w.mean_loss(model, part), batch)
        opt.step()
        opt.zero_grad()
    return [p.detach().numpy().copy() for p in acc.unwrap(model).parameters()]


def job(strategies: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in strategies:
        for items in (False, True):
            out[f"{strategy} items={items}"] = (_train(strategy, items=items, inject=False),
                                                 _train(strategy, items=items, inject=True))
    out["uneven"] = (_uneven(inject=False), _uneven(inject=True))
    try:  # not even one row fits on rank 1: every rank raises, nobody waits
        _uneven(inject=True, limit=0)
        out["one_row"] = "no error"
    except torch.OutOfMemoryError as exc:
        out["one_row"] = str(exc)
    return out


STRATEGIES = ["ddp", "fsdp"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") else [])


def test_out_of_memory_micro_step_is_split_on_every_rank() -> None:
    strategies = STRATEGIES
    for rank, both in enumerate(micro_batch_jobs.results()):  # one spawn with the auto test
        result = both["split"]
        for name in (f"{s} items={i}" for s in strategies for i in (False, True)):
            plain, split = result[name]
            # rank 1 raised at 4, 2 and 2 rows off the boundary, at 4 rows on it
            assert split["raised"] == (4 if rank == 1 else 0), name
            assert plain["steps"] == split["steps"] == 2, (name, plain["steps"], split["steps"])
            assert plain["losses"] == pytest.approx(split["losses"], rel=TOL, abs=TOL), name
            if rank == 0:
                diff = max(abs(plain["state"][k] - split["state"][k]).max()
                           for k in plain["state"])
                print(f"{name}: max |split - unsplit| = {diff:.2e}")
                assert diff < TOL, name
                assert len(split["lines"]) == 2, split["lines"]
                assert "on rank 1" in split["lines"][0]
                assert not plain["lines"]
        plain, split = result["uneven"]
        assert max(abs(a - b).max() for a, b in zip(plain, split, strict=True)) < TOL
        assert "on rank 1 with a piece of one row" in result["one_row"], result["one_row"]
