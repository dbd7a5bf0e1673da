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

Object storage and saves behind the loop (issue 40) ride in A and B, on the session's local S3
server: in A, ddp saves to ``s3://<bucket>/ddp`` in the loop and fsdp to ``.../fsdp`` in the
background, after steps 1, 2 and 3 with ``keep_last=2``, and are abandoned; ddp also runs to the
end saving after every step, once in the background to S3 and once in the loop to disk. In B
both resume from the bucket and must end bit-identical to A's reference, as must both full runs.

The cross-strategy matrix rides in the same three jobs (a spawn and DeepSpeed's import cost
seconds): fp32, AdamW + StepLR, 48 samples in windows of 12 (2 ranks: micro-batch 2, K=3; one
rank: K=6), a checkpoint after step 2 of 4. A saves from ddp, zero1, fsdp and deepspeed
(ZeRO-3) on 2 ranks and loads each into every 2-rank strategy (deepspeed ZeRO-3); C loads
those into every 1-rank strategy (deepspeed ZeRO-2) and saves from each on one rank (deepspeed
ZeRO-1); B loads C's into every 2-rank strategy (deepspeed ZeRO-1). Every end state must match
the uninterrupted large-batch plain-PyTorch loop, and a same-strategy 2 -> 2 resume must be
bit-identical to that strategy's uninterrupted run.
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
from tests import workloads as w
from tests.scripts.resumable_train import build, params, train

EPOCHS, MICRO_BATCH = 2, 4
RESHARD_TOL = 1e-5
STRATEGIES = ["ddp", "zero1", "fsdp"]
if importlib.util.find_spec("deepspeed") is not None:
    STRATEGIES.append("deepspeed")
RESHARDABLE = ["ddp", "zero1", "fsdp"]
MATRIX = [*RESHARDABLE, *(["deepspeed"] if "deepspeed" in STRATEGIES else [])]
# The ZeRO stage of a deepspeed saver (by world size) and loader (by "saved->loaded" world).
SAVE_STAGE, LOAD_STAGE = {2: 3, 1: 1}, {"2->2": 3, "2->1": 2, "1->2": 1}
M_SAMPLES, M_MICRO, M_WINDOW, M_SAVE_AT = 48, 2, 12, 2


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
    acc.wait_for_save()  # a background save still in flight
    # numpy: torch tensors would cross the result queue as shared memory of a finished process
    return {k: v.float().numpy() for k, v in params(acc, objects[0]).items()}, acc.optimizer_steps


def _matrix_reference() -> dict[str, np.ndarray]:
    """Plain PyTorch: one AdamW step per window of 12 consecutive samples, StepLR after it."""
    model = w.make_model()
    opt, sched = _matrix_optim(model)
    for batch in torch.utils.data.DataLoader(w.regression_data(M_SAMPLES), batch_size=M_WINDOW):
        opt.zero_grad()
        w.mean_loss(model, batch).backward()
        opt.step()
        sched.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _matrix_optim(model: torch.nn.Module) -> tuple[Any, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)


def _matrix_run(strategy: str, world: int, *, stage: int = 2, load: str | None = None,
                save: str | None = None) -> dict[str, np.ndarray]:
    """The matrix job to its end; ``save``: a checkpoint after step 2 on the way."""
    chosen: Any = ax.DeepSpeedStrategy(stage=stage) if strategy == "deepspeed" else strategy
    acc = ax.Accelerator(strategy=chosen, precision="fp32", seed=0,
                         grad_accum_steps=M_WINDOW // (M_MICRO * world))
    model = w.make_model()
    opt, sched = _matrix_optim(model)
    loader = torch.utils.data.DataLoader(w.regression_data(M_SAMPLES), batch_size=M_MICRO)
    model, opt, loader, sched = acc.setup(model, opt, loader, sched)
    if load is not None:
        acc.load_state(load)
    for batch in loader:
        with acc.accumulate():
            acc.backward(w.mean_loss(model, batch))
            opt.step()
            sched.step()
            opt.zero_grad()
        if save is not None and acc.sync_gradients and acc.optimizer_steps == M_SAVE_AT:
            acc.save_state(save)
    assert acc.optimizer_steps == M_SAMPLES // M_WINDOW
    return {k: v.float().numpy() for k, v in params(acc, model).items()}


def _matrix_loads(tmp: str, saved: str, loaded: str, loaders: list[str]) -> dict[str, Any]:
    """Every saver's world-``saved`` checkpoint loaded into each of ``loaders`` and trained on."""
    world, stage = int(loaded), LOAD_STAGE[f"{saved}->{loaded}"]
    return {(saver, strategy, f"{saved}->{loaded}"): _matrix_run(
        strategy, world, stage=stage, load=f"{tmp}/m{saved}-{saver}")
        for saver in MATRIX for strategy in loaders}


def _save_on_two_ranks(tmp: str, s3: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy, background in (("ddp", False), ("fsdp", True)):  # to S3, then abandoned
        _run(strategy, stop_at=3, save_at={1, 2, 3}, run_dir=f"{s3}/{strategy}",
             background=background)
    out["ddp-background"] = _run("ddp", save_at={1, 2, 3, 4}, run_dir=f"{s3}/ddp-background",
                                 background=True)
    out["ddp-in-loop"] = _run("ddp", save_at={1, 2, 3, 4}, run_dir=f"{tmp}/ddp-in-loop")
    for saver in MATRIX:  # first: the uninterrupted run that saves on the way
        out[("straight", saver)] = _matrix_run(saver, 2, stage=SAVE_STAGE[2],
                                               save=f"{tmp}/m2-{saver}")
    out.update(_matrix_loads(tmp, "2", "2", MATRIX))
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
    out.update(_matrix_loads(tmp, "2", "1", ["single", *MATRIX]))
    for saver in MATRIX:
        _matrix_run(saver, 1, stage=SAVE_STAGE[1], save=f"{tmp}/m1-{saver}")
    out["single"] = _run("single")
    _run("single", stop_at=3, save_at={1, 3}, run_dir=f"{tmp}/single")
    out["single-resumed"] = _run("single", load=f"{tmp}/single")
    return out


def _resume_on_two_ranks(tmp: str, s3: str) -> dict[str, Any]:
    out: dict[str, Any] = {f"{strategy}-s3": _run(strategy, load=f"{s3}/{strategy}")
                           for strategy in ("ddp", "fsdp")}
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
    out.update(_matrix_loads(tmp, "1", "2", MATRIX))
    if "deepspeed" in STRATEGIES:  # fp16: the loss scale crosses between ddp and the engine
        for saver, loader in (("ddp", "deepspeed"), ("deepspeed", "ddp")):
            acc = _accelerator(loader)
            build(acc, dropout=0.2, micro_batch=MICRO_BATCH)
            acc.load_state(f"{tmp}/{saver}")
            out[("scaler", saver, loader)] = (acc.strategy.scaler.state_dict(), acc.loss_scale)
        out["scaler_trace"] = _scaler_trace()
    return out


def _scaler_trace() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """DeepSpeed's DynamicLossScaler and accumix's DynamicLossScale through the same overflows
    (no growth in between, where their rules differ by one step): the mapped states agree."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from accumix.strategies.deepspeed_state import scaler_state

    engine = DynamicLossScaler(init_scale=1024.0, scale_window=1000, min_scale=1.0,
                               delayed_shift=2, consecutive_hysteresis=False)
    ours = ax.DynamicLossScale(init_scale=1024.0, hysteresis=2)
    trace = []
    for overflow in (False, True, False, False, True, True, False):
        engine.update_scale(overflow)
        ours.update(overflow)
        trace.append((scaler_state(engine), ours.state_dict()))
    return trace


def _equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(torch.from_numpy(a[k]),
                                                    torch.from_numpy(b[k])) for k in a)


def _max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def test_resume_exact_and_reshard(tmp_path: Path, s3_server: dict[str, str], s3: str) -> None:
    tmp = str(tmp_path)
    saved = spawn(_save_on_two_ranks, nprocs=2, args=(tmp, s3), env=s3_server)[0]
    for strategy in STRATEGIES:
        assert saved[strategy][1] == 4, (strategy, saved[strategy][1])
        assert (tmp_path / strategy / "latest").read_text().strip() == "step-3"
    one = _on_one_rank(tmp)  # here: a process of its own, without a process group
    # A save torn mid-write: the newest checkpoint's shard file lost its tail.
    shutil.copytree(tmp_path / "ddp", tmp_path / "torn")
    shard = tmp_path / "torn" / "step-3" / "model" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    resumed = spawn(_resume_on_two_ranks, nprocs=2, args=(tmp, s3), env=s3_server)[0]
    _check_object_store(saved, resumed, s3)

    for strategy in STRATEGIES:  # bit for bit, from mid-epoch 1 and from mid-epoch 0
        assert resumed[strategy][1] == saved[strategy][1]
        assert _equal(resumed[strategy][0], saved[strategy][0]), strategy
        assert _equal(resumed[f"{strategy}-step1"][0], saved[strategy][0]), strategy
    assert _equal(one["single-resumed"][0], one["single"][0])
    assert one["single-resumed"][1] == one["single"][1] == 8  # 4 windows an epoch on 1 rank

    assert "__0_0.distcp" in resumed["torn"] and "truncated" in resumed["torn"], resumed["torn"]
    assert "step-1" in resumed["torn"]  # it names the checkpoint that still loads
    assert _equal(resumed["torn-previous"][0], saved["ddp"][0])

    _check_matrix(saved, one, resumed, tmp_path)

    for strategy in RESHARDABLE:
        reference = saved[f"{strategy}-fp32"]
        assert one[strategy][1] == 4 and resumed[f"{strategy}-from-one"][1] == 4
        assert _max_diff(one[strategy][0], reference[0]) < RESHARD_TOL, strategy
        assert _max_diff(resumed[f"{strategy}-from-one"][0], reference[0]) < RESHARD_TOL


def _check_object_store(saved: dict[Any, Any], resumed: dict[Any, Any], s3: str) -> None:
    import s3fs

    store = s3fs.S3FileSystem(use_listings_cache=False)
    bucket = s3.removeprefix("s3://")
    for strategy in ("ddp", "fsdp"):  # killed after step 3, resumed from the bucket: exact
        assert resumed[f"{strategy}-s3"][1] == saved[strategy][1] == 4
        assert _equal(resumed[f"{strategy}-s3"][0], saved[strategy][0]), strategy
        steps = sorted(p.rsplit("/", 1)[1] for p in store.ls(f"{bucket}/{strategy}")
                       if "/step-" in p)
        assert steps == ["step-2", "step-3"], steps  # keep_last=2
        assert store.cat_file(f"{bucket}/{strategy}/latest") == b"step-3\n"
    # Saves behind the loop change nothing: the same run saving in the loop, and never saving.
    assert _equal(saved["ddp-background"][0], saved["ddp-in-loop"][0])
    assert _equal(saved["ddp-background"][0], saved["ddp"][0])
    assert store.cat_file(f"{bucket}/ddp-background/latest") == b"step-4\n"


def _check_matrix(saved: dict[Any, Any], one: dict[Any, Any], resumed: dict[Any, Any],
                  tmp_path: Path) -> None:
    reference = _matrix_reference()
    loads = {k: v for part in (saved, one, resumed) for k, v in part.items()
             if isinstance(k, tuple) and len(k) == 3 and k[0] != "scaler"}
    expected = len(MATRIX) * (len(MATRIX) * 2 + len(MATRIX) + 1)  # 2->2, 1->2; 2->1 (+single)
    assert len(loads) == expected, (len(loads), expected)
    diffs = {key: _max_diff(got, reference) for key, got in loads.items()}
    for saver in MATRIX:
        diffs[("straight", saver)] = _max_diff(saved[("straight", saver)], reference)
        # Same strategy and world size: bit for bit.
        assert _equal(saved[(saver, saver, "2->2")], saved[("straight", saver)]), saver
    for way in ("2->2", "2->1", "1->2"):  # the numbers, for a reader of `pytest -s`
        part = {k: d for k, d in diffs.items() if k[-1] == way}
        worst = max(part, key=part.__getitem__)
        print(f"matrix {way}: {len(part)} loads, max |param - plain PyTorch| = "
              f"{part[worst]:.2e} ({worst[0]} -> {worst[1]})")
    bad = {k: d for k, d in diffs.items() if not d < RESHARD_TOL}
    assert not bad, bad
    if "deepspeed" in STRATEGIES:  # the same run's scaler state, whichever strategy wrote it
        import json

        metas = {s: json.loads((tmp_path / s / "step-3" / "meta.json").read_text())
                 for s in ("ddp", "deepspeed")}
        ddp_scaler, ds_scaler = (metas[s]["state"]["scaler"] for s in ("ddp", "deepspeed"))
        assert ddp_scaler == ds_scaler == {"scale": 1024.0, "clean_steps": 3, "budget": 2}
        for pair in (("ddp", "deepspeed"), ("deepspeed", "ddp")):
            assert resumed[("scaler", *pair)] == (ddp_scaler, 1024.0), (pair, resumed)
        trace = resumed["scaler_trace"]
        assert all(engine == ours for engine, ours in trace), trace
        assert trace[-1][1] == {"scale": 256.0, "clean_steps": 1, "budget": 1}
