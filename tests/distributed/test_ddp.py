"""2 ranks on gloo: DDP equals the single-process large batch; fp16 overflow on one rank makes
every rank skip; one gradient-reduction round per optimizer step."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import DataLoader

import accumix as ax
from accumix.testing import spawn
from tests import workloads as w

TOL = 1e-6


def _equivalence_checks() -> dict[str, float]:
    """Runs on each rank; returns the max parameter difference to the reference per case."""
    out = {}
    data, model = w.regression_data(48), w.make_model()
    # K=3 micro-batches of 4 on 2 ranks = windows of 24 samples.
    ref = w.reference_params(model, data, 24, items=False)
    got, acc = w.accumix_params(model, data, micro_batch=4, steps=3, items=False, strategy="ddp")
    out["mean"], out["mean_steps"] = w.max_diff(ref, got), acc.optimizer_steps
    # Short last window: 40 samples -> 20 a rank -> 5 micro-batches of 4 -> windows 2, 2, 1.
    data40 = w.regression_data(40)
    ref = w.reference_params(model, data40, 16, items=False, epochs=2)
    got, acc = w.accumix_params(model, data40, micro_batch=4, steps=2, items=False, epochs=2,
                                strategy="ddp")
    out["short"], out["short_steps"] = w.max_diff(ref, got), acc.optimizer_steps
    # Item-weighted, variable lengths: the two ranks see different token counts.
    seq, seq_model = w.sequence_data(48), w.make_model(4)
    ref = w.reference_params(seq_model, seq, 24, items=True, sched=True)
    got, acc = w.accumix_params(seq_model, seq, micro_batch=3, steps=4, items=True,
                                strategy="ddp", sched=True)
    out["items"] = w.max_diff(ref, got)
    got, _ = w.accumix_params(seq_model, seq, micro_batch=3, steps=4, items="int",
                              strategy="ddp", sched=True)
    out["items_int"] = w.max_diff(ref, got)
    biased, _ = w.accumix_params(seq_model, seq, micro_batch=3, steps=4, items="per-batch-mean",
                                 strategy="ddp")
    out["biased"] = w.max_diff(ref, biased)
    # Clipping: the returned norm is the single-process norm of the large-batch gradient.
    ref_model = w.make_model()
    w.mean_loss(ref_model, data[:24]).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1e9)
    acc = ax.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=3)
    model2 = w.make_model()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    model2, opt2, loader2 = acc.setup(model2, opt2, DataLoader(data, batch_size=4))
    for batch in loader2:
        with acc.accumulate():
            acc.backward(w.mean_loss(model2, batch))
            norm = acc.clip_grad_norm_(1e9)
            if acc.sync_gradients:
                break
    out["norm"] = abs(norm.item() - ref_norm.item())
    return out


def _comm_rounds(steps: int) -> tuple[int, int]:
    """Optimizer steps and gradient-reduction rounds (bucket 0 reductions) for K=steps."""
    acc = ax.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=steps)
    model = w.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(w.regression_data(64), batch_size=2)
    model, opt, loader = acc.setup(model, opt, loader)
    rounds: list[int] = []

    def counting_hook(state, bucket):
        if bucket.index() == 0:
            rounds.append(1)
        return allreduce_hook(state, bucket)

    model.register_comm_hook(dist.group.WORLD, counting_hook)
    for batch in loader:
        with acc.accumulate():
            acc.backward(w.mean_loss(model, batch))
            opt.step()
            opt.zero_grad()
    return acc.optimizer_steps, len(rounds)


def _overflow_on_one_rank() -> dict[str, object]:
    """fp16: rank 1's loss is inf on windows 2 and 3; both ranks must skip both."""
    acc = ax.Accelerator(strategy="ddp", precision="fp16-mixed", grad_accum_steps=2,
                         loss_scale=ax.DynamicLossScale(init_scale=1024.0, hysteresis=2))
    model = w.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, loader, sched = acc.setup(model, opt, DataLoader(w.regression_data(64),
                                                                  batch_size=4), sched)
    log = []
    for i, batch in enumerate(loader):
        window = i // 2
        before = [p.detach().clone() for p in model.parameters()]
        with acc.accumulate():
            loss = w.mean_loss(model, batch)
            if acc.rank == 1 and window in (1, 2) and i % 2 == 0:
                loss = loss * float("inf")
            acc.backward(loss)
            acc.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            after = list(model.parameters())
            changed = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
            log.append((acc.step_was_skipped, changed, acc.loss_scale, sched.get_last_lr()[0]))
    return {"log": log, "steps": acc.optimizer_steps}


def _two_runs_in_one_process() -> list[int]:
    """end() and then a new Accelerator in the same process (a notebook, a test suite)."""
    steps = []
    for _ in range(2):
        _, acc = w.accumix_params(w.make_model(), w.regression_data(48), micro_batch=4,
                                  steps=3, items=False, strategy="ddp")
        steps.append(acc.optimizer_steps)
        acc.end()
    return steps


def _mismatched_settings() -> str:
    """Ranks launched with different settings stop with one clear error, not a hang."""
    rank = int(os.environ["RANK"])
    try:
        ax.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=2 + rank)
    except ax.ConfigError as err:
        return str(err)
    return "no error"


def _all_checks() -> dict[str, object]:
    return {
        "mismatch": _mismatched_settings(),
        "two_runs": _two_runs_in_one_process(),
        "equivalence": _equivalence_checks(),
        "comm": {k: _comm_rounds(k) for k in (1, 4)},
        "overflow": _overflow_on_one_rank(),
    }


def test_ddp_two_ranks() -> None:
    results = spawn(_all_checks, nprocs=2)
    for rank, r in enumerate(results):
        assert r["two_runs"] == [2, 2]
        assert r["mismatch"].startswith("ranks disagree on"), r["mismatch"]
        assert "(2, None, None)" in r["mismatch"] and "(3, None, None)" in r["mismatch"]
        eq = r["equivalence"]
        assert eq["mean"] < TOL, (rank, eq)
        assert eq["mean_steps"] == 2
        assert eq["short"] < TOL and eq["short_steps"] == 6, (rank, eq)
        assert eq["items"] < TOL and eq["items_int"] < TOL, (rank, eq)
        assert eq["biased"] > 1e-3, (rank, eq)
        assert eq["norm"] < 1e-5, (rank, eq)
        # 64 samples / 2 ranks / micro 2 = 16 micro-batches: 16 steps at K=1, 4 at K=4;
        # exactly one reduction round per optimizer step, none off the boundary.
        assert r["comm"][1] == (16, 16)
        assert r["comm"][4] == (4, 4)
        log = r["overflow"]["log"]
        # windows: clean, inf (absorbed by hysteresis), inf (scale halves), clean
        assert [entry[0] for entry in log] == [False, True, True, False]
        assert [entry[1] for entry in log] == [True, False, False, True]
        assert [entry[2] for entry in log] == [1024.0, 1024.0, 512.0, 512.0]
        assert [entry[3] for entry in log] == [0.05, 0.05, 0.05, 0.025]
        assert r["overflow"]["steps"] == 2
    assert results[0]["overflow"] == results[1]["overflow"]
