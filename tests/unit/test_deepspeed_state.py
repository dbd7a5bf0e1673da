"""DeepSpeed checkpoints without DeepSpeed: an old engine-format checkpoint is refused in one
line, and the fp16 scaler's state maps both ways (the engine itself: tests/distributed)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import accumix as ax
from accumix.checkpoint import CheckpointError
from accumix.strategies.deepspeed_state import load_scaler_state, scaler_state
from tests.scripts.resumable_train import build, train


def test_old_deepspeed_engine_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=3, seed=0)
    train(acc, build(acc), epochs=1, run_dir=tmp_path, save_at={1}, stop_at=1)
    meta_path = tmp_path / "step-1" / "meta.json"
    meta = json.loads(meta_path.read_text())  # what strategy='deepspeed' wrote before
    meta.update(checkpoint_format="deepspeed", strategy="deepspeed", world_size=2)
    meta_path.write_text(json.dumps(meta))
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=3, seed=0)
    build(acc)
    with pytest.raises(CheckpointError) as info:
        acc.load_state(tmp_path)
    message = str(info.value)
    assert "\n" not in message and acc.optimizer_steps == 0
    assert message.startswith(f"{tmp_path / 'step-1'} holds DeepSpeed's own engine checkpoint "
                              "(checkpoint_format='deepspeed', written by strategy='deepspeed' "
                              f"in accumix {ax.__version__}), which this accumix no longer "
                              "reads"), message
    assert "on 2 ranks" in message and "zero_to_fp32.py" in message


def test_engine_scaler_state_maps_to_dynamic_loss_scale_and_back() -> None:
    # 4 overflow-free updates after an overflow at iteration 6, one hysteresis left.
    engine = SimpleNamespace(cur_scale=512.0, cur_iter=10, last_overflow_iter=6,
                             cur_hysteresis=1)
    state = scaler_state(engine)
    assert state == {"scale": 512.0, "clean_steps": 3, "budget": 1}
    ours = ax.DynamicLossScale(init_scale=1024.0)
    ours.load_state_dict(state)
    assert ours.state_dict() == state
    fresh = SimpleNamespace(cur_scale=65536.0, cur_iter=0, last_overflow_iter=-1,
                            cur_hysteresis=2)
    load_scaler_state(fresh, ours.state_dict())
    assert scaler_state(fresh) == state and fresh.cur_scale == 512.0
