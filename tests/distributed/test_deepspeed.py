"""2 ranks on gloo: DeepSpeed ZeRO 1/2/3 equals the single-process large batch (mean mode,
item-weighted, the short last window), clips to the single-process norm, halves the optimizer
states, saves the reference's weights, resumes exactly; fp16 overflow on one rank skips on both
and the engine's scale follows the hysteresis.

One spawned job runs every check (a spawn plus DeepSpeed's import costs seconds).
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax
from accumix.testing import spawn
from tests import split_backward_jobs as sj
from tests import window_jobs as wj
from tests import workloads as w
from tests.multi_model import max_diff

# find_spec, not importorskip: importing DeepSpeed here would cost the test process seconds.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed is not installed")

TOL = 1e-6
STAGES = (1, 2, 3)


# -- plain PyTorch on one process --------------------------------------------------------------
def _reference(model: torch.nn.Module, data: TensorDataset, window: int, *, items: bool,
               epochs: int = 1, sched: bool = False, clip: float | None = None
               ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One SGD+momentum step per window of ``window`` consecutive samples; the state dict and
    the pre-clip norms."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=w.LR, momentum=w.MOMENTUM)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if sched else None
    norms = []
    for _ in range(epochs):
        for batch in DataLoader(data, batch_size=window, shuffle=False):
            opt.zero_grad()
            if items:
                loss_sum, n = w.item_loss(model, batch)
                (loss_sum / n).backward()
            else:
                w.mean_loss(model, batch).backward()
            if clip is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            opt.step()
            if scheduler:
                scheduler.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


# -- accumix with DeepSpeed ----------------------------------------------------------------------
def _run(model: torch.nn.Module, data: TensorDataset, *, strategy: Any, micro: int, steps: int,
         items: bool = False, epochs: int = 1, sched: bool = False, clip: float | None = None,
         precision: str = "fp32") -> tuple[ax.Accelerator, Any, Any, list[float]]:
    """The loop of DESIGN.md; returns the accelerator, model, optimizer and returned norms."""
    acc = ax.Accelerator(strategy=strategy, precision=precision, grad_accum_steps=steps)
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=w.LR, momentum=w.MOMENTUM)
    loader = DataLoader(data, batch_size=micro, shuffle=False)
    objects: list[Any] = [model, opt, loader]
    if sched:
        objects.append(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    model, opt, loader, *rest = acc.setup(*objects)
    norms = []
    for _ in range(epochs):
        for batch in loader:
            with acc.accumulate():
                if items:
                    loss_sum, n = w.item_loss(model, batch)
                    acc.backward(loss_sum, num_items=n)
                else:
                    acc.backward(w.mean_loss(model, batch))
                if clip is not None and acc.sync_gradients:
                    norms.append(acc.clip_grad_norm_(clip).item())
                opt.step()
                for scheduler in rest:
                    scheduler.step()
                opt.zero_grad()
    return acc, model, opt, norms


def _diff(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    assert ref.keys() == got.keys(), (sorted(ref), sorted(got))
    return max((ref[k].float() - got[k].cpu().float()).abs().max().item() for k in ref)


def _state_bytes(optimizer: Any) -> int:
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if torch.is_tensor(v) and v.dim() > 0)


def _equivalence(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    data, model = w.regression_data(48), w.make_model()
    seq, seq_model = w.sequence_data(48), w.make_model(4)
    data40 = w.regression_data(40)
    ref_mean, ref_norms = _reference(model, data, 24, items=False, clip=1e9)
    ref_items, _ = _reference(seq_model, seq, 24, items=True, sched=True)
    ref_short, ref_short_norms = _reference(model, data40, 16, items=False, epochs=2, clip=0.3)
    ddp = _run(model, data, strategy="ddp", micro=4, steps=3)
    out["ddp_bytes"] = _state_bytes(ddp[2])
    for stage in STAGES:
        r: dict[str, Any] = {}
        # K=3 micro-batches of 4 on 2 ranks = windows of 24 samples; the norm is returned
        # (max_norm too large to clip).
        acc, m, opt, norms = _run(model, data, strategy=ax.DeepSpeedStrategy(stage=stage),
                                  micro=4, steps=3, clip=1e9)
        r["mean"] = _diff(ref_mean, acc.strategy.full_state_dict(m))
        r["mean_steps"] = (acc.optimizer_steps, m.global_steps)
        r["geometry"] = (m.train_micro_batch_size_per_gpu(), m.gradient_accumulation_steps(),
                         m.train_batch_size())
        r["norms"] = max(abs(a - b) for a, b in zip(norms, ref_norms, strict=True))
        r["bytes"] = _state_bytes(opt)
        path = acc.save_model(Path(tmp) / f"stage{stage}", m)
        if acc.is_main_process:
            from safetensors.torch import load_file

            r["saved"] = _diff(ref_mean, load_file(str(path)))
        # Item-weighted, variable lengths (ranks see different token counts), with a scheduler.
        acc, m, _, _ = _run(seq_model, seq, strategy=ax.DeepSpeedStrategy(stage=stage),
                            micro=3, steps=4, items=True, sched=True)
        r["items"] = _diff(ref_items, acc.strategy.full_state_dict(m))
        # 40 samples -> 20 a rank -> 5 micro-batches of 4 -> windows 2, 2, 1 per epoch; clipped.
        acc, m, _, norms = _run(model, data40, strategy=ax.DeepSpeedStrategy(stage=stage),
                                micro=4, steps=2, epochs=2, clip=0.3)
        r["short"] = _diff(ref_short, acc.strategy.full_state_dict(m))
        r["short_steps"] = (acc.optimizer_steps, m.global_steps)
        r["clipped_norms"] = max(abs(a - b) for a, b in zip(norms, ref_short_norms, strict=True))
        r["clips"] = sum(n > 0.3 for n in ref_short_norms)
        out[stage] = r
    # bf16-mixed (bf16 module, fp32 masters), item-weighted: stage 1 with fp32 gradient
    # accumulation runs DeepSpeed's BF16_Optimizer, another home for the gradients.
    for stage, config in ((1, {"data_types": {"grad_accum_dtype": "fp32"}}), (3, None)):
        acc, m, _, _ = _run(seq_model, seq, strategy=ax.DeepSpeedStrategy(stage=stage,
                                                                          config=config),
                            micro=3, steps=4, items=True, sched=True, precision="bf16-mixed")
        out[f"bf16-{stage}"] = (_diff(ref_items, acc.strategy.full_state_dict(m)),
                                type(m.optimizer).__name__)
    return out


def _enable_cpu_fp16() -> bool:
    """DeepSpeed refuses fp16 on a CPU without oneDNN fp16 (``is_fp16_supported``); torch runs
    fp16 there anyway (slowly), enough for a tiny model, so the test lifts the refusal.
    Returns whether it had to."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.is_fp16_supported():
        return False
    type(accelerator).is_fp16_supported = lambda self: True
    return True


def _fp16_overflow(stage: int) -> dict[str, Any]:
    """Rank 1's loss is inf in windows 1 and 2 (first micro-step); 6 windows of K=2."""
    loss_scale = ax.DynamicLossScale(init_scale=1024.0, hysteresis=2, growth_interval=2)
    acc = ax.Accelerator(strategy=ax.DeepSpeedStrategy(stage=stage), precision="fp16-mixed",
                         grad_accum_steps=2, loss_scale=loss_scale)
    model = w.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, loader, sched = acc.setup(model, opt, DataLoader(w.regression_data(96),
                                                                  batch_size=4), sched)
    log, ratios = [], []
    for i, batch in enumerate(loader):
        before = acc.strategy.full_state_dict(model) if i % 2 else None
        with acc.accumulate():
            loss = w.mean_loss(model, batch)
            if acc.rank == 1 and i // 2 in (1, 2) and i % 2 == 0:
                loss = loss * float("inf")
            acc.backward(loss)
            norm = acc.clip_grad_norm_(1e9)  # unscaled: the engine's own norm, not x1024
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            changed = _diff(before, acc.strategy.full_state_dict(model)) > 0
            log.append((acc.step_was_skipped, changed, acc.loss_scale, sched.get_last_lr()[0]))
            if not acc.step_was_skipped:
                ratios.append(norm.item() / float(model.get_global_grad_norm()))
    return {"log": log, "steps": (acc.optimizer_steps, model.global_steps, model.skipped_steps),
            "norm_ratios": ratios}


def _fp16_growth(stage: int) -> list[tuple[float, float]]:
    """Plain SGD, K=1, the scale doubling after every clean step but the first: each step's
    update must be lr x the true gradient (DeepSpeed alone applies half of it on growth steps).
    Returns (scale after the step, |update| / (lr x norm)) per step."""
    acc = ax.Accelerator(strategy=ax.DeepSpeedStrategy(stage=stage), precision="fp16-mixed",
                         loss_scale=ax.DynamicLossScale(init_scale=1024.0, growth_interval=1))
    model = w.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, loader = acc.setup(model, opt, DataLoader(w.regression_data(16), batch_size=2))
    rows = []
    for batch in loader:
        before = acc.strategy.full_state_dict(model)
        with acc.accumulate():
            acc.backward(w.mean_loss(model, batch))
            norm = acc.clip_grad_norm_(1e9).item()
            opt.step()
        after = acc.strategy.full_state_dict(model)
        update = sum(((before[k] - after[k]) ** 2).sum() for k in before) ** 0.5
        rows.append((acc.loss_scale, float(update) / (0.05 * norm)))
    return rows


def _fp16_floor() -> str:
    """An overflow with the scale at its floor raises LossScaleError on every rank."""
    acc = ax.Accelerator(strategy=ax.DeepSpeedStrategy(stage=2), precision="fp16-mixed",
                         grad_accum_steps=1,
                         loss_scale=ax.DynamicLossScale(init_scale=1.0, hysteresis=1))
    model = w.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.setup(model, opt)
    x, y = w.regression_data(4).tensors
    with acc.accumulate():
        acc.backward(torch.nn.functional.mse_loss(model(x), y) * float("inf"))
        try:
            opt.step()
        except ax.LossScaleError as exc:
            return type(exc).__name__
    return "no error"


def _resume(stage: int, run_dir: str) -> dict[str, Any]:
    """save_state after window 1, train on; a fresh accelerator loads and trains the same."""
    def build(seed: int) -> tuple[ax.Accelerator, Any, Any, Any, Any]:
        acc = ax.Accelerator(strategy=ax.DeepSpeedStrategy(stage=stage), precision="fp32",
                             grad_accum_steps=2)
        model = w.make_model(seed=seed)
        opt = torch.optim.SGD(model.parameters(), lr=w.LR, momentum=w.MOMENTUM)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return acc, *acc.setup(model, opt, DataLoader(w.regression_data(48), batch_size=4),
                               sched)

    def train(acc: ax.Accelerator, model: Any, opt: Any, batches: Any, sched: Any,
              stop_after: int | None = None) -> None:
        for batch in batches:
            with acc.accumulate():
                acc.backward(w.mean_loss(model, batch))
                opt.step()
                sched.step()
                opt.zero_grad()
            if acc.sync_gradients and acc.optimizer_steps == stop_after:
                return

    acc, model, opt, loader, sched = build(0)
    batches = iter(loader)  # one epoch, paused for the save
    train(acc, model, opt, batches, sched, stop_after=1)
    acc.save_state(run_dir)
    train(acc, model, opt, batches, sched)
    straight = acc.strategy.full_state_dict(model)
    acc2, model2, opt2, loader2, sched2 = build(7)
    acc2.load_state(run_dir)
    train(acc2, model2, opt2, iter(loader2), sched2)
    return {
        "diff": _diff(straight, acc2.strategy.full_state_dict(model2)),
        "steps": (acc.optimizer_steps, acc2.optimizer_steps, model2.global_steps),
        "lr": (sched.get_last_lr(), sched2.get_last_lr()),
    }


def _fp16_refused() -> str:
    """Where DeepSpeed has no fp16, setup says so with a ConfigError."""
    acc = ax.Accelerator(strategy=ax.DeepSpeedStrategy(stage=2), precision="fp16-mixed")
    model = w.make_model()
    try:
        acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    except ax.ConfigError as exc:
        return str(exc)
    return "no error"


def _step_forms() -> dict[str, Any]:
    """Issue 20: optimizer.step() after the block (item 9: mean mode divided by zero), and a
    window whose last backward ran before its boundary micro-step, refused (item 2: the engine
    failed with KeyError 0)."""
    out: dict[str, Any] = {}
    data = wj.after_block_data(world=2)
    for items in (False, True):
        params, steps = wj.after_block_accumix(data, items, ax.DeepSpeedStrategy(stage=2))
        out[f"after_block/{items}"] = (
            max_diff(wj.after_block_reference(data, items), params), steps)
    out["refused"] = wj.skipped_boundary_backward(ax.DeepSpeedStrategy(stage=2))
    try:  # two backward calls on a boundary micro-step: the engine kept the second's only
        sj.one_model_accumix(sj.one_model_data(2, world=2), steps=1, items=True,
                             strategy=ax.DeepSpeedStrategy(stage=2))
        out["second_backward_refused"] = "no error"
    except ax.ConfigError as exc:
        out["second_backward_refused"] = str(exc)
    try:  # item 4: a window the loop does not step cannot be discarded (the engine kept it)
        wj.skip_accumix(wj.skip_data(), "loss", strategy=ax.DeepSpeedStrategy(stage=2))
        out["skip_refused"] = "no error"
    except ax.ConfigError as exc:
        out["skip_refused"] = str(exc)
    return out


def _all_checks(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {"equivalence": _equivalence(tmp), "step_forms": _step_forms()}
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        out["fp16_refused"] = _fp16_refused()
        _enable_cpu_fp16()
    out["fp16"] = {stage: _fp16_overflow(stage) for stage in (2, 3)}
    out["growth"] = {stage: _fp16_growth(stage) for stage in (2, 3)}
    out["floor"] = _fp16_floor()
    out["resume"] = {stage: _resume(stage, f"{tmp}/run{stage}") for stage in (2, 3)}
    return out


def test_deepspeed_two_ranks(tmp_path: Path) -> None:
    results = spawn(_all_checks, nprocs=2, args=(str(tmp_path),))
    for rank, r in enumerate(results):
        forms = r["step_forms"]
        for items in (False, True):
            diff, steps = forms[f"after_block/{items}"]
            assert diff < TOL and steps == 3, (rank, items, forms)
        assert forms["refused"].startswith("strategy='deepspeed' reduces gradients only in a "
                                           "backward on the window's last micro-step"), forms
        assert forms["skip_refused"].startswith("strategy='deepspeed' clears gradients only "
                                                "inside optimizer.step()"), forms
        assert forms["second_backward_refused"].startswith(
            "strategy='deepspeed' takes one backward on a window's last micro-step"), forms
        eq = r["equivalence"]
        for stage in STAGES:
            s = eq[stage]
            assert s["mean"] < TOL and s["mean_steps"] == (2, 2), (rank, stage, s)
            assert s["geometry"] == (4, 3, 24), (rank, stage, s)  # micro, K, micro x K x world
            assert s["norms"] < 1e-5, (rank, stage, s)
            assert s["items"] < TOL, (rank, stage, s)
            assert s["short"] < TOL and s["short_steps"] == (6, 6), (rank, stage, s)
            assert s["clips"] >= 3 and s["clipped_norms"] < 1e-5, (rank, stage, s)
            # SGD momentum: one buffer per parameter, half of it per rank (padding aside).
            assert abs(s["bytes"] / (eq["ddp_bytes"] / 2) - 1) < 0.1, (rank, stage, s, eq)
            if rank == 0:
                assert s["saved"] < TOL, (stage, s)
        # bf16 rounding: about 1e-3 here.
        assert eq["bf16-1"][0] < 5e-3 and eq["bf16-1"][1] == "BF16_Optimizer", eq["bf16-1"]
        assert eq["bf16-3"][0] < 5e-3, eq["bf16-3"]
        for stage in (2, 3):
            fp16 = r["fp16"][stage]
            # windows: clean, inf (absorbed by hysteresis), inf (halves), then clean. DeepSpeed
            # doubles after growth_interval + 1 = 3 clean steps (accumix's own scaler: 2).
            assert [e[0] for e in fp16["log"]] == [False, True, True, False, False, False]
            assert [e[1] for e in fp16["log"]] == [True, False, False, True, True, True]
            assert [e[2] for e in fp16["log"]] == [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0]
            assert [e[3] for e in fp16["log"]] == [0.05, 0.05, 0.05, 0.025, 0.0125, 0.00625]
            # 4 real steps; the engine counts all 6 boundaries, 2 of them skipped.
            assert fp16["steps"] == (4, 6, 2), (rank, stage, fp16)
            assert all(abs(q - 1) < 1e-4 for q in fp16["norm_ratios"]), fp16["norm_ratios"]
        for stage in (2, 3):
            growth = r["growth"][stage]
            assert [scale for scale, _ in growth] == [1024.0, 2048.0, 4096.0, 8192.0], growth
            assert all(abs(q - 1) < 1e-2 for _, q in growth), (stage, growth)
        assert r["floor"] == "LossScaleError"
        if "fp16_refused" in r:
            assert "bf16-mixed" in r["fp16_refused"], r["fp16_refused"]
        for stage in (2, 3):
            res = r["resume"][stage]
            assert res["diff"] == 0.0 and res["steps"] == (3, 3, 3), (rank, stage, res)
            assert res["lr"][0] == res["lr"][1]
    assert results[0]["fp16"] == results[1]["fp16"]
