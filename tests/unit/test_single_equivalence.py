"""One process: accumulation equals the large batch (semantics 1, 2, 3 of DESIGN.md)."""

from __future__ import annotations

import pytest

from tests import workloads as w

TOL = 1e-6


@pytest.mark.parametrize("steps,micro", [(1, 8), (4, 2), (3, 4)])
def test_mean_mode_equals_large_batch(steps: int, micro: int) -> None:
    data, model = w.regression_data(48), w.make_model()
    ref = w.reference_params(model, data, steps * micro, items=False)
    got, acc = w.accumix_params(model, data, micro_batch=micro, steps=steps, items=False)
    assert w.max_diff(ref, got) < TOL
    assert acc.optimizer_steps == 48 // (steps * micro)


def test_short_last_window_is_divided_by_its_true_size() -> None:
    # 40 samples, micro 4, K=3: windows of 3, 3, 3 and 1 micro-batches.
    data, model = w.regression_data(40), w.make_model()
    ref = w.reference_params(model, data, 12, items=False, epochs=2)
    got, acc = w.accumix_params(model, data, micro_batch=4, steps=3, items=False, epochs=2)
    assert acc.optimizer_steps == 8
    assert w.max_diff(ref, got) < TOL


def test_item_weighted_equals_full_batch_token_mean() -> None:
    data, model = w.sequence_data(48), w.make_model(4)
    ref = w.reference_params(model, data, 12, items=True)
    got, _ = w.accumix_params(model, data, micro_batch=3, steps=4, items=True)
    assert w.max_diff(ref, got) < TOL
    # The test has power: averaging per-micro-batch means (HF's old bug) lands elsewhere.
    biased, _ = w.accumix_params(model, data, micro_batch=3, steps=4, items="per-batch-mean")
    assert w.max_diff(ref, biased) > 1e-3


def test_item_weighted_short_window_and_scheduler() -> None:
    data, model = w.sequence_data(44), w.make_model(4)
    ref = w.reference_params(model, data, 12, items=True, sched=True)
    got, acc = w.accumix_params(model, data, micro_batch=3, steps=4, items=True, sched=True)
    assert acc.optimizer_steps == 4  # 15 micro-batches: windows of 4, 4, 4, 3
    assert w.max_diff(ref, got) < TOL
