"""Issue 15 on one process: several models, closures and fp16 item mode in the step, each
against plain PyTorch on the same data (the 2-rank ddp versions are in tests/distributed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import accumix as ax
from tests import multi_model as mm
from tests import split_backward_jobs as sj

TOL = 1e-6


@pytest.fixture(scope="module")
def gan_batches() -> list[tuple[torch.Tensor, ...]]:
    return mm.gan_data(steps=4, batch=6)


def test_gan_zero_grad_clears_what_the_other_models_backward_left(gan_batches) -> None:
    """Item 1: G's backward goes through D; ``optD.zero_grad()`` must then clear D as torch
    does (it was a no-op: D off by 1.04)."""
    ref = mm.gan_reference("g_first", gan_batches, world=1, items=False)
    got, acc = mm.gan_accumix("g_first", gan_batches, items=False)
    assert mm.max_diff(ref, got) <= TOL
    assert acc.optimizer_steps == 4


@pytest.mark.parametrize("items", [False, True], ids=["mean", "items"])
def test_gan_backward_after_the_first_step_is_finalized(gan_batches, items: bool) -> None:
    """Item 2, DCGAN order (D's backward and step, then G's): G's gradients are normalised
    by their own item count too (they were not: 0.20 off in item mode)."""
    ref = mm.gan_reference("d_first", gan_batches, world=1, items=items)
    got, _ = mm.gan_accumix("d_first", gan_batches, items=items)
    assert mm.max_diff(ref, got) <= TOL


def test_gan_fp16_unscales_the_second_optimizers_gradients(gan_batches) -> None:
    """Item 2 under fp16-mixed: G stepped on gradients still multiplied by the loss scale
    (hundreds off, no overflow check on them). fp16 compute: close to fp32, not equal."""
    ref = mm.gan_reference("d_first", gan_batches, world=1, items=False)
    got, acc = mm.gan_accumix("d_first", gan_batches, items=False, precision="fp16-mixed")
    assert mm.max_diff(ref, got) <= 1e-3
    assert not acc.step_was_skipped and acc.loss_scale == 65536.0


@pytest.mark.parametrize("items", [False, True], ids=["mean", "items"])
def test_gan_g_first_with_accumulation_never_steps_d_twice_on_one_window(items: bool) -> None:
    """G first, K=2, D's loss in two backward calls: G's backward reaches D before
    ``opt_d.zero_grad()``, which keeps the window it now holds; D's last window's gradients,
    already stepped (and divided by their count), were kept with it and stepped again. Five
    micro-steps: windows of 2, 2 and a short 1."""
    data = sj.split_data(5, world=1)
    ref, ref_steps = sj.split_reference("g_first", data, steps=2, items=items, world=1)
    got, steps = sj.split_accumix("g_first", data, steps=2, items=items)
    assert mm.max_diff(ref, got) <= TOL
    assert steps == ref_steps == 3


def test_two_models_item_counts_are_their_own() -> None:
    """Item 3: two models with their own ``num_items`` in one window (K=2) each get the mean
    over their own items (the counts were pooled: both stepped at half the gradient)."""
    data = mm.two_model_data(windows=3, micro=4, world=1, steps=2)
    ref = mm.two_models_reference(data, steps=2)
    assert mm.max_diff(ref, mm.two_models_accumix(data, steps=2)) <= TOL


def test_lbfgs_closure_steps_as_torch_and_returns_the_loss() -> None:
    """Item 4: the closure's ``zero_grad`` clears between evaluations, and ``step(closure)``
    returns the first evaluation's loss as torch does (it returned None, 1.84 off)."""
    ref_params, ref_losses = mm.lbfgs_reference(steps=3)
    params, losses = mm.lbfgs_accumix(steps=3)
    assert mm.max_diff(ref_params, params) <= TOL
    assert losses == pytest.approx(ref_losses, abs=TOL)


def test_closure_with_accumulation_or_fp16_is_refused() -> None:
    model = nn.Linear(2, 1)
    acc = ax.Accelerator(precision="fp32", grad_accum_steps=2)
    opt = acc.setup(model, torch.optim.LBFGS(model.parameters()))[1]
    with acc.accumulate(), pytest.raises(ax.ConfigError, match="grad_accum_steps=1, not 2"):
        opt.step(lambda: None)


def test_closure_outside_the_accumulate_block_is_refused() -> None:
    """Before any window, ``step(closure)`` outside ``acc.accumulate()`` returned None and left
    the weights as they were, where torch steps (found by the review of issue 28)."""
    model = nn.Linear(2, 1)
    acc = ax.Accelerator(precision="fp32")
    opt = acc.setup(model, torch.optim.LBFGS(model.parameters()))[1]
    before = model.weight.detach().clone()
    with pytest.raises(ax.AccumixError, match=r"inside `with acc.accumulate\(\):`"):
        opt.step(lambda: model(torch.ones(1, 2)).sum())
    assert torch.equal(model.weight, before)


@pytest.mark.filterwarnings("ignore:precision='fp16-mixed' on this CPU")
def test_fp16_item_mode_first_window_divides_by_its_first_count() -> None:
    """Item 8: the first window's hint was 1, so the summed loss overflowed and the first step
    was skipped where mean mode on the same data is not; now both step alike."""
    mean_skipped, mean_params = mm.fp16_item_run(items=False)
    item_skipped, item_params = mm.fp16_item_run(items=True)
    assert mean_skipped == [False, False, False]
    assert item_skipped == [False, False, False]
    assert mm.max_diff(mean_params, item_params) <= 1e-3
