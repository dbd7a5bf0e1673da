"""Exact resume in new processes for every strategy, and resharding between world sizes.

The job (tests/scripts/resumable_train.py): dropout, a shuffled loader, AdamW, StepLR, K=3,
fp16-mixed, 48 samples in micro-batches of 4 on 2 ranks (2 optimizer steps an epoch), 2 epochs
(CPU fp16 costs ~0.1 s a micro-step: few, small steps). In order:

A. 2 ranks, per strategy: the uninterrupted run (the reference), and a run that saves after
   steps 1 (mid-epoch 0) and 3 (mid-epoch 1) and is abandoned. Also fp32 without dropout (the
   resharding job: another world size changes the reduction order, so it is compared to float
   tolerance) saving after step 1.
C. 1 rank (the test's own process): the 2-rank fp32 checkpoints of ddp, zero1 and fsdp continue
   with K=6 (the same global batch); a 1-rank run saves after step 1 for the way back;
   ``single`` resumes exactly.
B. 2 ranks, new processes and process group: each strategy resumes from ``latest`` (step 3) and
   from step 1 and must end bit-identical to A's reference; a truncated checkpoint is refused on
   every rank and the previous one still loads; C's 1-rank checkpoints continue on 2 ranks.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

import accumix as ax
from accumix.checkpoint import CheckpointError
from accumix.testing import spawn
from tests.scripts.resumable_train import build, params, train

EPOCHS, MICRO_BATCH = 2, 4
RESHARD_TOL = 1e-5
STRATEGIES = ["ddp", "zero1", "fsdp"]
if importlib.util.find_spec("deepspeed") is not None:
    STRATEGIES.append("deepspeed")
RESHARDABLE = ["ddp", "zero1", "fsdp"]


def _accelerator(strategy: str, precision: str = "fp16-mixed", steps: int = 3
                 ) -> ax.Accelerator:
    if strategy == "deepspeed":
        _enable_cpu_fp16()
    # 2**10: DeepSpeed's fp16 gradients of this model overflow at the default 2**16.
    scale = ax.DynamicLossScale(init_scale=2.0**10) if precision == "fp16-mixed" else None
    return ax.Accelerator(strategy=strategy, precision=precision, grad_accum_steps=steps,
                          loss_scale=scale, seed=0)


def _enable_cpu_fp16() -> None:
    # DeepSpeed refuses fp16 on a CPU without oneDNN fp16; torch runs it (slowly), enough for
    # this tiny model (tests/distributed/test_deepspeed.py does the same).
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        type(accelerator).is_fp16_supported = lambda self: True


def _run(strategy: str, *, precision: str = "fp16-mixed", steps: int = 3, dropout: float = 0.2,
         load: str | None = None, **train_kwargs: Any) -> tuple[dict[str, np.ndarray], int]:
    acc = _accelerator(strategy, precision, steps)
    objects = build(acc, dropout=dropout, micro_batch=MICRO_BATCH)
    if load is not None:
        torch.manual_seed(1234)  # whatever the RNG holds now, the checkpoint's must win
        acc.load_state(load)
    train(acc, objects, epochs=EPOCHS, **train_kwargs)
    # numpy: torch tensors would cross the result queue as shared memory of a finished process
    return {k: v.float().numpy() for k, v in params(acc, objects[0]).items()}, acc.optimizer_steps


def _save_on_two_ranks(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in STRATEGIES:
        out[strategy] = _run(strategy)
        _run(strategy, stop_at=3, save_at={1, 3}, run_dir=f"{tmp}/{strategy}")
    for strategy in RESHARDABLE:
        out[f"{strategy}-fp32"] = _run(strategy, precision="fp32", dropout=0.0)
        _run(strategy, precision="fp32", dropout=0.0, stop_at=1, save_at={1},
             run_dir=f"{tmp}/{strategy}-fp32")
    return out


def _on_one_rank(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in RESHARDABLE:  # 2 -> 1: K=6 keeps the global batch of 12
        out[strategy] = _run(strategy, precision="fp32", steps=6, dropout=0.0,
                             load=f"{tmp}/{strategy}-fp32")
        _run(strategy, precision="fp32", steps=6, dropout=0.0, stop_at=1, save_at={1},
             run_dir=f"{tmp}/{strategy}-one")
    out["single"] = _run("single")
    _run("single", stop_at=3, save_at={1, 3}, run_dir=f"{tmp}/single")
    out["single-resumed"] = _run("single", load=f"{tmp}/single")
    return out


def _resume_on_two_ranks(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in STRATEGIES:
        out[strategy] = _run(strategy, load=f"{tmp}/{strategy}")
        out[f"{strategy}-step1"] = _run(strategy, load=f"{tmp}/{strategy}/step-1")
    try:
        _run("ddp", load=f"{tmp}/torn")
        out["torn"] = "loaded"
    except CheckpointError as exc:
        out["torn"] = str(exc)
    out["torn-previous"] = _run("ddp", load=f"{tmp}/torn/step-1")
    for strategy in RESHARDABLE:  # 1 -> 2
        out[f"{strategy}-from-one"] = _run(strategy, precision="fp32", dropout=0.0,
                                           load=f"{tmp}/{strategy}-one")
    return out


def _equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(torch.from_numpy(a[k]),
                                                    torch.from_numpy(b[k])) for k in a)


def _max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def test_resume_exact_and_reshard(tmp_path: Path) -> None:
    tmp = str(tmp_path)
    saved = spawn(_save_on_two_ranks, nprocs=2, args=(tmp,))[0]
    for strategy in STRATEGIES:
        assert saved[strategy][1] == 4, (strategy, saved[strategy][1])
        assert (tmp_path / strategy / "latest").read_text().strip() == "step-3"
    one = _on_one_rank(tmp)  # here: a process of its own, without a process group
    # A save torn mid-write: the newest checkpoint's shard file lost its tail.
    shutil.copytree(tmp_path / "ddp", tmp_path / "torn")
    shard = tmp_path / "torn" / "step-3" / "model" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    resumed = spawn(_resume_on_two_ranks, nprocs=2, args=(tmp,))[0]

    for strategy in STRATEGIES:  # bit for bit, from mid-epoch 1 and from mid-epoch 0
        assert resumed[strategy][1] == saved[strategy][1]
        assert _equal(resumed[strategy][0], saved[strategy][0]), strategy
        assert _equal(resumed[f"{strategy}-step1"][0], saved[strategy][0]), strategy
    assert _equal(one["single-resumed"][0], one["single"][0])
    assert one["single-resumed"][1] == one["single"][1] == 8  # 4 windows an epoch on 1 rank

    assert "__0_0.distcp" in resumed["torn"] and "truncated" in resumed["torn"], resumed["torn"]
    assert "step-1" in resumed["torn"]  # it names the checkpoint that still loads
    assert _equal(resumed["torn-previous"][0], saved["ddp"][0])

    for strategy in RESHARDABLE:
        reference = saved[f"{strategy}-fp32"]
        assert one[strategy][1] == 4 and resumed[f"{strategy}-from-one"][1] == 4
        assert _max_diff(one[strategy][0], reference[0]) < RESHARD_TOL, strategy
        assert _max_diff(resumed[f"{strategy}-from-one"][0], reference[0]) < RESHARD_TOL
