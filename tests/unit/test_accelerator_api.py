"""The façade's behaviour off and on the boundary, its errors, and save_model (one process)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

import accumix as ax
from tests import workloads as w


def _setup(steps=2, precision="fp32", **kwargs):
    acc = ax.Accelerator(precision=precision, grad_accum_steps=steps, **kwargs)
    model = w.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = DataLoader(w.regression_data(16), batch_size=2)
    return (acc, *acc.setup(model, opt, sched, loader))


def test_off_boundary_calls_are_no_ops_and_on_boundary_they_act() -> None:
    acc, model, opt, sched, loader = _setup(steps=3)
    batches = iter(loader)
    before = [p.detach().clone() for p in model.parameters()]
    grads = []
    for i in range(3):
        with acc.accumulate():
            acc.backward(w.mean_loss(model, next(batches)))
            assert acc.sync_gradients == (i == 2)
            norm = acc.clip_grad_norm_(10.0)
            assert (norm is None) == (i < 2)
            opt.step()
            sched.step()
            opt.zero_grad()
            grads.append(model[0].weight.grad)
            changed = not torch.equal(before[0], model[0].weight)
            assert changed == (i == 2)
    assert grads[0] is not None and grads[1] is not None  # kept while accumulating
    assert grads[2] is None  # cleared after the real step
    assert acc.optimizer_steps == 1 and sched.get_last_lr() == [0.05]


def test_zero_grad_at_the_top_of_the_loop_keeps_the_window() -> None:
    """zero_grad() before forward must not wipe the window's accumulated gradients."""
    data, model = w.regression_data(16), w.make_model()
    ref = w.reference_params(model, data, 8, items=False)
    acc = ax.Accelerator(precision="fp32", grad_accum_steps=4)
    opt = torch.optim.SGD(model.parameters(), lr=w.LR, momentum=w.MOMENTUM)
    model, opt, loader = acc.setup(model, opt, DataLoader(data, batch_size=2))
    for batch in loader:
        with acc.accumulate():
            opt.zero_grad()
            acc.backward(w.mean_loss(model, batch))
            opt.step()
    assert w.max_diff(ref, list(model.parameters())) < 1e-6


def test_scheduler_steps_once_per_optimizer_step_even_if_called_twice() -> None:
    acc, model, opt, sched, loader = _setup(steps=2)
    for batch in loader:
        with acc.accumulate():
            acc.backward(w.mean_loss(model, batch))
            opt.step()
            sched.step()
        sched.step()  # a second call, outside the context
        opt.zero_grad()
    assert acc.optimizer_steps == 4
    assert sched.get_last_lr() == [0.1 * 0.5**4]
    assert sched.last_epoch == 4


def test_fp16_single_process_skip_and_scale() -> None:
    acc, model, opt, sched, loader = _setup(
        steps=1, precision="fp16-mixed",
        loss_scale=ax.DynamicLossScale(init_scale=256.0, hysteresis=1))
    results = []
    for i, batch in enumerate(loader):
        with acc.accumulate():
            loss = w.mean_loss(model, batch)
            acc.backward(loss * float("nan") if i == 1 else loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        results.append((acc.step_was_skipped, acc.loss_scale))
    assert results[:3] == [(False, 256.0), (True, 128.0), (False, 128.0)]
    assert acc.optimizer_steps == 7
    assert sched.get_last_lr() == [0.1 * 0.5**7]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fp16_equals_fp32_grads_after_unscale() -> None:
    """The fused pass unscales exactly: gradients match fp32 to fp16 compute error."""
    x, y = w.regression_data(8).tensors
    out = {}
    for precision in ("fp32", "fp16-mixed"):
        acc = ax.Accelerator(precision=precision, grad_accum_steps=2)
        model = w.make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.setup(model, opt)
        for half in (slice(0, 4), slice(4, 8)):
            with acc.accumulate():
                acc.backward(w.mean_loss(model, (x[half], y[half])))
                out[precision] = acc.clip_grad_norm_(1e9)
    assert out["fp16-mixed"].item() == pytest.approx(out["fp32"].item(), rel=2e-3)


def test_clip_grad_norm_takes_a_numpy_max_norm() -> None:
    """A max_norm read from a numpy config (np.float32 is no float subclass) clips as a float."""
    import numpy as np

    x, y = w.regression_data(4).tensors
    clipped = []
    for max_norm in (0.01, np.float32(0.01)):
        torch.manual_seed(0)
        acc = ax.Accelerator(precision="fp32")
        model = w.make_model()
        model, opt = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with acc.accumulate():
            acc.backward(w.mean_loss(model, (x, y)))
            norm = acc.clip_grad_norm_(max_norm)
        clipped.append((norm.item(), [p.grad.clone() for p in model.parameters()]))
    assert clipped[0][0] == clipped[1][0] > 0.01
    assert all(torch.equal(a, b) for a, b in zip(clipped[0][1], clipped[1][1], strict=True))
    with pytest.raises(ax.ConfigError, match="max_norm=True"):
        acc.clip_grad_norm_(True)


def test_bf16_true_casts_parameters() -> None:
    acc = ax.Accelerator(precision="bf16-true")
    model = acc.setup(w.make_model())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    x, y = w.regression_data(4).tensors  # float32 inputs are cast; the output is float32
    assert model(x).dtype == torch.float32


def test_save_model_keys_and_values(tmp_path) -> None:
    acc, model, opt, sched, loader = _setup()
    path = acc.save_model(tmp_path / "out")
    saved = load_file(str(path))
    ref = acc.unwrap(model).state_dict()
    assert sorted(saved) == sorted(ref)
    assert all(torch.equal(saved[k], ref[k]) for k in ref)


def test_collectives_in_one_process() -> None:
    acc = ax.Accelerator(precision="fp32")
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(acc.reduce(t, "sum"), t) and torch.equal(acc.gather(t), t)
    assert acc.gather(torch.tensor(3.0)).shape == (1,)
    assert (acc.rank, acc.world_size, acc.is_main_process) == (0, 1, True)
    acc.barrier()
    acc.end()


def test_global_batch_derives_k_from_the_loader() -> None:
    acc = ax.Accelerator(precision="fp32", global_batch_size=8)
    acc.setup(DataLoader(w.regression_data(16), batch_size=2))
    assert acc.grad_accum_steps == 4


@pytest.mark.parametrize("kwargs,match", [
    (dict(strategy="zero9"), "unknown strategy 'zero9'; use one of auto, single, ddp"),
    (dict(precision="fp8"), "unknown precision 'fp8'"),
    (dict(timeout=0), "timeout=0"),
    (dict(precision="fp32", loss_scale=ax.DynamicLossScale()), "only used by precision"),
    (dict(loss_scale=2.0), "loss_scale=2.0 is invalid"),
    (dict(seed=-1), "seed=-1"),
    (dict(global_batch_size=10, micro_batch_size=4), "not a multiple"),
])
def test_construction_errors(kwargs, match) -> None:
    with pytest.raises(ax.ConfigError, match=match):
        ax.Accelerator(**kwargs)


def test_usage_errors() -> None:
    acc = ax.Accelerator(precision="fp32")
    model = w.make_model()
    wrapped = acc.setup(model)
    with pytest.raises(ax.AccumixError, match="inside `with acc.accumulate"):
        acc.backward(w.mean_loss(wrapped, w.regression_data(2).tensors))
    with pytest.raises(ax.ConfigError, match="already set up"):
        acc.setup(model)
    with pytest.raises(ax.ConfigError, match="cannot set up a str"):
        acc.setup("model")
    with pytest.raises(ax.ConfigError, match="belong to no set-up model"):
        acc.setup(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ax.ConfigError, match="optimizer was not set up"):
        acc.setup(torch.optim.lr_scheduler.StepLR(other, 1))
    with pytest.raises(ax.ConfigError, match="batch_size=4 differs from micro_batch_size=2"):
        ax.Accelerator(precision="fp32", micro_batch_size=2).setup(
            DataLoader(w.regression_data(8), batch_size=4))
    with pytest.raises(ax.ConfigError, match="without micro_batch_size"), \
         ax.Accelerator(precision="fp32", global_batch_size=8).accumulate():
        pass
    with acc.accumulate(), pytest.raises(ax.AccumixError, match="entered twice"), \
         acc.accumulate():
        pass


@pytest.mark.parametrize("strategy", [ax.DDPStrategy, ax.ZeRO1Strategy])
def test_static_graph_with_accumulation_is_one_line(strategy) -> None:
    """DDP's reducer asserts (INTERNAL ASSERT, expect_autograd_hooks_) on the first backward
    under ``no_sync`` with ``static_graph=True``: one line naming what works instead, at the
    first off-boundary micro-step, on any world size."""
    acc = ax.Accelerator(precision="fp32", strategy=strategy(static_graph=True),
                         grad_accum_steps=2)
    model = acc.setup(nn.Linear(2, 1))
    with pytest.raises(ax.ConfigError, match=r"static_graph=True\) cannot run a micro-step "
                       r"without its all-reduce .*use static_graph=False"), acc.accumulate():
        pass
    single = ax.Accelerator(precision="fp32", strategy=strategy(static_graph=True))
    model = single.setup(nn.Linear(2, 1))
    with single.accumulate():  # K=1: every micro-step reduces, as DDP's static graph needs
        single.backward(model(torch.ones(1, 2)).sum())
    assert model.weight.grad is not None
