"""Issue 12: the accumulation steps K come back with the checkpoint (one process each).

A K changed while training (a ``GradientAccumulationScheduler``, ``acc.grad_accum_steps = n``)
was lost on resume; now it is restored, an explicit K wins, and a global batch size that would
silently give another K is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import accumix as ax
from accumix.common.batch_sizes import batch_geometry, resumed_grad_accum_steps
from tests.scripts.resumable_train import dataset, params


def _setup(**kwargs: Any) -> tuple[ax.Accelerator, tuple[Any, ...]]:
    acc = ax.Accelerator(strategy="single", precision="fp32", seed=0, **kwargs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    return acc, acc.setup(model, opt, DataLoader(dataset(), batch_size=2, shuffle=True))


def _train(acc: ax.Accelerator, objects: tuple[Any, ...], *, until: int,
           k_from: dict[int, int] | None = None, save: Path | None = None,
           save_at: int = -1) -> list[int]:
    """Trains to ``until`` optimizer steps; ``k_from`` sets K at those steps (as a scheduler
    would); returns the K of every window."""
    model, opt, loader = objects
    ks: list[int] = []
    while acc.optimizer_steps < until:
        for x, y in loader:
            if acc._run.window.micro_step == 0 and k_from and acc.optimizer_steps in k_from:
                acc.grad_accum_steps = k_from[acc.optimizer_steps]
            with acc.accumulate():
                acc.backward(nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
            if acc.sync_gradients:
                ks.append(acc.grad_accum_steps)
                if acc.optimizer_steps == save_at:
                    acc.save_state(save)
                if acc.optimizer_steps == until:
                    return ks
    return ks


def test_a_k_changed_while_training_is_restored_and_the_run_is_exact(tmp_path: Path) -> None:
    acc, objects = _setup(grad_accum_steps=2)
    ks = _train(acc, objects, until=7, k_from={2: 3})
    reference = params(acc, objects[0])
    acc, objects = _setup(grad_accum_steps=2)
    _train(acc, objects, until=4, k_from={2: 3}, save=tmp_path, save_at=4)
    for kwargs in ({"grad_accum_steps": 2}, {}):  # the same settings, or none at all
        acc, objects = _setup(**kwargs)
        acc.load_state(tmp_path)
        assert acc.grad_accum_steps == 3
        resumed_ks = _train(acc, objects, until=7)
        assert ks == [2, 2, 3, 3, 3, 3, 3] and resumed_ks == ks[4:]
        resumed = params(acc, objects[0])
        assert all(torch.equal(resumed[k], reference[k]) for k in reference)


def test_an_explicit_k_wins(tmp_path: Path) -> None:
    acc, objects = _setup(grad_accum_steps=2)
    _train(acc, objects, until=2, save=tmp_path, save_at=2)
    acc, objects = _setup(grad_accum_steps=4)  # a new K, passed on purpose
    acc.load_state(tmp_path)
    assert acc.grad_accum_steps == 4
    acc, objects = _setup(grad_accum_steps=2)
    acc.grad_accum_steps = 5  # assigned before the load: also on purpose
    acc.load_state(tmp_path)
    assert acc.grad_accum_steps == 5


def test_a_global_batch_that_gives_another_k_is_refused(tmp_path: Path) -> None:
    acc, objects = _setup(global_batch_size=8)  # micro batch 2: K=4
    _train(acc, objects, until=1, save=tmp_path, save_at=1)
    acc, objects = _setup(global_batch_size=4)
    with pytest.raises(ax.ConfigError, match=r"saved with grad_accum_steps=4 .*global batch 8.*"
                       r"global_batch_size=4 gives grad_accum_steps=2.*grad_accum_steps=2 to "
                       "change K on purpose"):
        acc.load_state(tmp_path)
    assert acc.optimizer_steps == 0 and acc.grad_accum_steps == 2  # nothing was loaded
    acc, objects = _setup(global_batch_size=8)
    acc.load_state(tmp_path)
    assert (acc.optimizer_steps, acc.grad_accum_steps) == (1, 4)


def _geometry(steps: int, configured: int, given: str, micro: int, world: int
              ) -> dict[str, Any]:
    return batch_geometry(steps=steps, configured=configured, given=given,
                          micro_batch_size=micro, dp_world_size=world)


def test_another_world_size_keeps_the_saved_global_batch() -> None:
    # Saved on 2 ranks, micro batch 2, global 16 (K=4); a scheduler had raised K to 8 (32).
    saved = _geometry(8, 4, "global_batch_size", 2, 2)
    on_four = _geometry(2, 2, "global_batch_size", 2, 4)  # global 16 on 4 ranks: K=2
    assert resumed_grad_accum_steps(saved, on_four, global_batch_size=16, assigned=False) == 4
    unchanged = _geometry(4, 4, "global_batch_size", 2, 2)
    assert resumed_grad_accum_steps(_geometry(4, 4, "global_batch_size", 2, 2), unchanged,
                                    global_batch_size=16, assigned=False) == 4
    # Global 8 raised to 12 (K 2 -> 3) on 2 ranks; 12 does not split over 4 ranks of 2.
    raised = _geometry(3, 2, "global_batch_size", 2, 2)
    with pytest.raises(ax.ConfigError, match=r"global batch of 12 \(K=3 .* not a multiple of "
                                              "micro batch 2 x 4 ranks"):
        resumed_grad_accum_steps(raised, _geometry(1, 1, "global_batch_size", 2, 4),
                                 global_batch_size=8, assigned=False)
    # Same K passed, another world size: the scheduler's K is still restored.
    saved_k = _geometry(8, 4, "grad_accum_steps", 2, 2)
    assert resumed_grad_accum_steps(saved_k, _geometry(4, 4, "grad_accum_steps", 2, 1),
                                    global_batch_size=None, assigned=False) == 8
