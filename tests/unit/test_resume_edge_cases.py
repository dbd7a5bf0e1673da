"""Issue 14: ways a resumed run came back wrong or not at all (one process each).

Every test compares the resumed run against the same job never interrupted, number for number.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as lrs
from torch.utils.data import DataLoader

import accumix as ax
from accumix.checkpoint import CheckpointError, latest_checkpoint
from accumix.data.loader import AcceleratedDataLoader
from tests.scripts.resumable_train import build, build_unused_head, dataset, params, train

STEPS, SAVE_AT = 8, 3


# -- 1. every torch LR scheduler's state survives the checkpoint exactly ---------------------
def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR": lambda o: lrs.LambdaLR(o, lambda s: 0.9 ** s),
    "MultiplicativeLR": lambda o: lrs.MultiplicativeLR(o, lambda s: 0.8),
    "StepLR": lambda o: lrs.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: lrs.MultiStepLR(o, milestones=[2, 5], gamma=0.1),
    "ConstantLR": lambda o: lrs.ConstantLR(o, factor=0.5, total_iters=4),
    "LinearLR": lambda o: lrs.LinearLR(o, start_factor=0.2, total_iters=6),
    "ExponentialLR": lambda o: lrs.ExponentialLR(o, gamma=0.9),
    "PolynomialLR": lambda o: lrs.PolynomialLR(o, total_iters=6, power=2.0),
    "CosineAnnealingLR": lambda o: lrs.CosineAnnealingLR(o, T_max=5),
    "CosineAnnealingWarmRestarts": lambda o: lrs.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2),
    "CyclicLR": lambda o: lrs.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2),
    "OneCycleLR": lambda o: lrs.OneCycleLR(o, max_lr=0.2, total_steps=STEPS + 2),
    "ReduceLROnPlateau": lambda o: lrs.ReduceLROnPlateau(o, factor=0.5, patience=1),
    "SequentialLR": lambda o: lrs.SequentialLR(
        o, [lrs.ConstantLR(o, factor=0.1, total_iters=2), lrs.MultiStepLR(o, [2, 4], 0.5)],
        milestones=[3]),
    "ChainedScheduler": lambda o: lrs.ChainedScheduler(
        [lrs.MultiStepLR(o, milestones=[1, 4], gamma=0.1), lrs.ExponentialLR(o, gamma=0.9)]),
}


def _lr_run(make: Callable[[torch.optim.Optimizer], Any], *, steps: int,
            save: Path | None = None, load: Path | None = None) -> list[float]:
    acc = ax.Accelerator(strategy="single", precision="fp32", seed=0)
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = _sgd(model)
    model, opt, sched = acc.setup(model, opt, make(opt))
    if load is not None:
        acc.load_state(load)
    x = torch.ones(4, 2)
    lrs_seen = []
    for _ in range(steps):
        with acc.accumulate():
            loss = model(x).pow(2).mean()
            acc.backward(loss)
            opt.step()
            if isinstance(sched.scheduler, lrs.ReduceLROnPlateau):
                sched.step(1.0)  # a plateau: the LR falls after `patience` steps
            else:
                sched.step()
            opt.zero_grad()
        lrs_seen.append(opt.param_groups[0]["lr"])
    if save is not None:
        acc.save_state(save)
    return lrs_seen


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_lr_scheduler_resumes_exactly(name: str, tmp_path: Path) -> None:
    make = SCHEDULERS[name]
    reference = _lr_run(make, steps=STEPS)
    first = _lr_run(make, steps=SAVE_AT, save=tmp_path)
    rest = _lr_run(make, steps=STEPS - SAVE_AT, load=tmp_path)
    assert first + rest == reference, (name, first + rest, reference)


# -- helpers for the training-loop items ----------------------------------------------------
EPOCHS = 2  # 24 micro-batches of 2 an epoch, K=3: 8 steps an epoch on one process


def _acc() -> ax.Accelerator:
    return ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=3, seed=0)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _job(build_fn: Callable[[ax.Accelerator], tuple[Any, ...]] = build, *,
         load: Path | None = None, **train_kwargs: Any
         ) -> tuple[dict[str, torch.Tensor], ax.Accelerator]:
    acc = _acc()
    objects = build_fn(acc)
    if load is not None:
        torch.manual_seed(99)  # whatever the RNG holds now, the checkpoint's must win
        acc.load_state(load)
    train(acc, objects, epochs=EPOCHS, **train_kwargs)
    return params(acc, objects[0]), acc


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return _job()[0]


def _signal_at(step: int, micro_step: int = 1) -> Callable[[ax.Accelerator], None]:
    sent: list[None] = []

    def hook(acc: ax.Accelerator) -> None:
        if acc.optimizer_steps == step and acc._run.window.micro_step == micro_step and not sent:
            sent.append(os.kill(os.getpid(), signal.SIGTERM))

    return hook


# -- 2. an optimizer parameter that never had a gradient ------------------------------------
def test_optimizer_parameter_without_gradient_resumes_exactly(tmp_path: Path) -> None:
    expected, _ = _job(build_unused_head)
    _job(build_unused_head, run_dir=tmp_path, save_at={5}, stop_at=5)
    resumed, acc = _job(build_unused_head, load=tmp_path)
    assert _equal(resumed, expected) and acc.optimizer_steps == 16
    assert "extra.weight" in resumed
    # The head still has no optimizer state, as in the uninterrupted run.
    opt = acc._run.optimizers[0]
    extra = acc.unwrap(acc._run.models[0]).extra.weight
    assert extra not in opt.state and len(opt.state) == 4


# -- issue 20.6: numpy numbers in param groups -----------------------------------------------
def _build_numpy_lr(acc: ax.Accelerator, tag: Any = None) -> tuple[Any, ...]:
    """``build``'s job with its hyper-parameters computed in numpy (``base * np.sqrt(...)``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    lr = np.float64(0.02) * np.sqrt(np.float64(256) / 256)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=np.float64(0.01),
                            betas=(np.float64(0.9), 0.999))
    if tag is not None:
        opt.param_groups[0]["tag"] = tag
    sched = lrs.StepLR(opt, step_size=2, gamma=np.float64(0.7))
    loader = DataLoader(dataset(), batch_size=2, shuffle=True)
    return acc.setup(model, opt, loader, sched)


def test_numpy_hyper_parameters_save_and_resume_exactly(reference: dict[str, torch.Tensor],
                                                        tmp_path: Path) -> None:
    expected, _ = _job(_build_numpy_lr)
    assert _equal(expected, reference)  # numpy's lr trains as the float one does
    _job(_build_numpy_lr, run_dir=tmp_path, save_at={5}, stop_at=5)
    resumed, acc = _job(_build_numpy_lr, load=tmp_path)
    assert _equal(resumed, expected) and acc.optimizer_steps == 16
    group = acc._run.optimizers[0].param_groups[0]
    assert type(group["lr"]) is float and type(group["betas"][0]) is float
    # Without a scheduler (whose save refused numpy's base_lrs), the save went through and
    # every load failed ("a different model or optimizer?").
    lrs_loaded = []
    for load in (None, tmp_path / "plain"):
        acc = _acc()
        torch.manual_seed(0)
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=np.float64(0.1) * np.sqrt(2.0))
        model, opt = acc.setup(model, opt)
        if load is None:
            acc.save_state(tmp_path / "plain")
        else:
            acc.load_state(load)
            lrs_loaded.append(opt.param_groups[0]["lr"])
    assert lrs_loaded == [0.1 * np.sqrt(2.0)]


def _build_float32_lr(acc: ax.Accelerator) -> tuple[Any, ...]:
    """``build``'s job with float32 numpy hyper-parameters (a config read into ``np.float32``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=np.float32(0.1))
    sched = lrs.StepLR(opt, step_size=1, gamma=np.float32(0.7))
    loader = DataLoader(dataset(), batch_size=2, shuffle=True)
    return acc.setup(model, opt, loader, sched)


def test_float32_hyper_parameters_resume_their_schedule_exactly(tmp_path: Path) -> None:
    # StepLR multiplies a float32 lr by a float32 gamma in float32; saved as Python floats the
    # resumed run multiplied in float64: its last lr was 0.00033232922804... instead of the
    # uninterrupted float32 chain's 0.00033232921850867 (and a float, not a float32).
    expected, acc = _job(_build_float32_lr)
    lr = acc._run.optimizers[0].param_groups[0]["lr"]
    assert type(lr) is np.float32 and lr == np.float32(0.1) * np.float32(0.7) ** 16
    _job(_build_float32_lr, run_dir=tmp_path, save_at={5}, stop_at=5)
    resumed, acc = _job(_build_float32_lr, load=tmp_path)
    back = acc._run.optimizers[0].param_groups[0]["lr"]
    assert (type(back), float(back)) == (np.float32, float(lr)) and _equal(resumed, expected)


def test_a_hyper_parameter_a_safe_load_cannot_read_is_refused_at_save(tmp_path: Path) -> None:
    acc = _acc()
    objects = _build_numpy_lr(acc, tag=Fraction(1, 3))
    with pytest.raises(ax.ConfigError, match=r"\['param_groups'\]\[0\]\['tag'\] is a "
                                             r"fractions.Fraction"):
        train(acc, objects, epochs=1, run_dir=tmp_path, save_at={1}, stop_at=1)
    assert latest_checkpoint(tmp_path) is None


# -- 3. pre-emption in an epoch's last window ------------------------------------------------
def test_preemption_in_the_last_window_of_an_epoch_is_exact(reference: dict[str, torch.Tensor],
                                                            tmp_path: Path) -> None:
    acc = _acc()
    objects = build(acc)
    acc.handle_preemption(tmp_path)
    with pytest.raises(SystemExit) as info:  # window 8 ends epoch 0
        train(acc, objects, epochs=EPOCHS, after_micro_step=_signal_at(7))
    assert info.value.code == 0 and latest_checkpoint(tmp_path) == tmp_path / "step-8"
    meta = json.loads((tmp_path / "step-8" / "meta.json").read_text())
    assert (meta["epoch"], meta["position"]) == (1, 0)
    resumed, _ = _job(load=tmp_path)
    assert _max_diff(resumed, reference) == 0.0
    assert _equal(resumed, reference)


# -- 4. persistent workers and a save at an epoch end ---------------------------------------
class _Deterministic(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.data = dataset()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i]


def _build_persistent(acc: ax.Accelerator) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    sched = lrs.StepLR(opt, step_size=2, gamma=0.7)
    # Not fork: the suite's JAX tests leave threads in this process (a fork could deadlock).
    loader = DataLoader(_Deterministic(), batch_size=2, shuffle=True, num_workers=1,
                        persistent_workers=True, multiprocessing_context="forkserver")
    return acc.setup(model, opt, loader, sched)


def test_persistent_workers_resume_at_an_epoch_end_exactly(tmp_path: Path) -> None:
    # The uninterrupted run saves on the way (epoch 0's last step): one worker start fewer.
    expected, _ = _job(_build_persistent, run_dir=tmp_path, save_at={8})
    resumed, acc = _job(_build_persistent, load=tmp_path)
    assert _max_diff(resumed, expected) == 0.0 and acc.optimizer_steps == 16
    meta = json.loads((tmp_path / "step-8" / "meta.json").read_text())
    assert meta["state"]["loaders"][0]["persistent_iterator"] == 1


# -- 5. a signal in the final window, or after the loop --------------------------------------
def test_signal_in_the_final_window_or_after_the_loop_is_honoured(
        reference: dict[str, torch.Tensor], tmp_path: Path) -> None:
    acc = _acc()
    objects = build(acc)
    acc.handle_preemption(tmp_path / "final-window")
    with pytest.raises(SystemExit) as info:  # window 16 is the run's last
        train(acc, objects, epochs=EPOCHS, after_micro_step=_signal_at(15))
    assert info.value.code == 0
    assert latest_checkpoint(tmp_path / "final-window") == tmp_path / "final-window" / "step-16"

    acc = _acc()
    objects = build(acc)
    acc.handle_preemption(tmp_path / "after")
    train(acc, objects, epochs=EPOCHS)
    os.kill(os.getpid(), signal.SIGTERM)  # during the work after training
    with pytest.raises(SystemExit) as info:
        acc.end()
    assert info.value.code == 0
    step = latest_checkpoint(tmp_path / "after")
    assert step == tmp_path / "after" / "step-16"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    _, loaded = _job(load=step)  # the finished run: nothing left to train
    assert _equal(params(loaded, loaded._run.models[0]), reference)


# -- 6. a crash while a second save at the same step replaces the first ---------------------
class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs, no handler sees it."""


def test_crash_between_the_renames_of_a_second_save_recovers(
        reference: dict[str, torch.Tensor], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    acc = _acc()
    objects = build(acc)
    train(acc, objects, epochs=EPOCHS, run_dir=run, save_at={9}, stop_at=9)
    renames: list[tuple[str, str]] = []
    real_rename = os.rename

    def rename(src: Any, dst: Any) -> None:
        if "step-9" in Path(dst).name:  # DCP renames its own files too
            renames.append((Path(src).name, Path(dst).name))
            if len(renames) == 2:
                raise _Killed
        real_rename(src, dst)

    monkeypatch.setattr("accumix.checkpoint.save_load.os.rename", rename)
    with pytest.raises(_Killed):
        acc.save_state(run)  # the same step again
    monkeypatch.undo()
    assert renames == [("step-9", ".step-9.old"), (".step-9.tmp", "step-9")]
    assert sorted(p.name for p in run.iterdir()) == [".step-9.old", ".step-9.tmp", "latest"]
    resumed, _ = _job(load=run, run_dir=run, save_at={10})
    assert _equal(resumed, reference)
    # The next save put the copy back in place before clearing leftovers.
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step-10", "step-9"]
    resumed, _ = _job(load=run / "step-9")
    assert _equal(resumed, reference)


def test_latest_checkpoint_finds_the_copy_that_survived(tmp_path: Path) -> None:
    (tmp_path / ".step-9.tmp").mkdir()
    (tmp_path / ".step-9.old").mkdir()
    (tmp_path / "latest").write_text("step-9\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-9"  # neither is complete
    (tmp_path / ".step-9.old" / "meta.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / ".step-9.old"
    (tmp_path / ".step-9.tmp" / "meta.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / ".step-9.tmp"  # the newer save


# -- 8. loaders that cannot continue mid-epoch -----------------------------------------------
class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Any:
        return iter(dataset())


def _loader_kinds() -> dict[str, DataLoader]:
    data = dataset()
    return {
        "an IterableDataset (_Stream)": DataLoader(_Stream(), batch_size=2),
        "a custom sampler (WeightedRandomSampler)": DataLoader(
            data, batch_size=2, sampler=torch.utils.data.WeightedRandomSampler(
                torch.ones(len(data)), num_samples=len(data))),
        "a custom batch_sampler (BatchSampler)": DataLoader(data, batch_sampler=(
            torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(data), 2, False))),
    }


def _build_with(loader: DataLoader) -> Callable[[ax.Accelerator], tuple[Any, ...]]:
    def build_fn(acc: ax.Accelerator) -> tuple[Any, ...]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=0.02)
        sched = lrs.StepLR(opt, step_size=2, gamma=0.7)
        return acc.setup(model, opt, loader, sched)

    return build_fn


@pytest.mark.parametrize("kind", sorted(_loader_kinds()))
def test_unresumable_loader_is_refused_at_save_and_never_half_loads(kind: str,
                                                                    tmp_path: Path) -> None:
    build_fn = _build_with(_loader_kinds()[kind])
    with pytest.raises(ax.ConfigError) as info:  # step 2 is mid-epoch 0
        _job(build_fn, run_dir=tmp_path / "mid", save_at={2}, stop_at=2)
    assert str(info.value).startswith("DataLoader 0 cannot be saved mid-epoch (6 batches into "
                                      f"epoch 0): it has {kind}"), str(info.value)
    assert not (tmp_path / "mid").exists()
    acc = _acc()
    build_fn(acc)
    with pytest.raises(ax.ConfigError, match="handle_preemption cannot save DataLoader 0"):
        acc.handle_preemption(tmp_path)
    # At an epoch end it saves, and the resumed run equals the uninterrupted one.
    expected, _ = _job(build_fn)
    _job(build_fn, run_dir=tmp_path / "end", save_at={8}, stop_at=8)
    resumed, _ = _job(build_fn, load=tmp_path / "end")
    assert _equal(resumed, expected)

    # A mid-epoch checkpoint of a resumable loader: refused before anything is replaced.
    acc = _acc()
    shuffled = build(acc, dropout=0.0)
    train(acc, shuffled, epochs=EPOCHS, run_dir=tmp_path / "shuffled", save_at={2}, stop_at=2)
    acc = _acc()
    model, opt, _, sched = build_fn(acc)
    train(acc, (model, opt, _, sched), epochs=EPOCHS, stop_at=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    with pytest.raises(CheckpointError) as info:
        acc.load_state(tmp_path / "shuffled")
    assert "DataLoader 0 was saved 6 batches into epoch 0 but has " + kind in str(info.value)
    assert _equal(model.state_dict(), before) and acc.optimizer_steps == 1
    assert _equal(opt.state[next(model.parameters())], opt_before)
    assert sched.last_epoch == 1


# -- 9. the user's DistributedSampler settings ----------------------------------------------
def test_user_distributed_sampler_keeps_its_drop_last() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(7))
    got = {}
    for drop_last in (True, False):
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=1,
                                                      shuffle=False, drop_last=drop_last)
        loader = AcceleratedDataLoader(DataLoader(data, batch_size=1, sampler=sampler),
                                       device=torch.device("cpu"), rank=1, world_size=2, seed=0,
                                       on_batch=lambda is_last: None)
        got[drop_last] = [int(b[0]) for b in loader]
        assert got[drop_last] == [int(i) for i in sampler]  # what the user's sampler yields
    assert got == {True: [1, 3, 5], False: [1, 3, 5, 0]}


# -- 10. clean refusals ----------------------------------------------------------------------
def test_two_models_sharing_one_optimizer_are_refused_at_setup() -> None:
    acc = _acc()
    a, b = nn.Linear(2, 2), nn.Linear(2, 1)
    shared = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    with pytest.raises(ax.ConfigError, match=r"optimizer 0 \(SGD\) holds parameters of models "
                                             r"\[0, 1\] of this setup call"):
        acc.setup(a, b, shared)


def test_foreign_meta_json_is_refused(tmp_path: Path) -> None:
    # Another tool's meta.json that happens to carry the fields checked first.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "meta.json").write_text(json.dumps({
        "format": 1, "checkpoint_format": "dcp", "precision": "fp32", "world_size": 1,
        "files": {}, "state": {"optimizer_steps": 3}}))
    acc = _acc()
    build(acc)
    with pytest.raises(CheckpointError) as info:
        acc.load_state(foreign)
    assert str(info.value) == (
        f"{foreign / 'meta.json'} is not the meta.json of an accumix checkpoint (it has no "
        "'state.step_was_skipped', 'state.window', 'state.scaler', 'state.models', "
        "'state.optimizers', 'state.schedulers', 'state.loaders'); pass a directory written "
        "by acc.save_state")


def test_model_with_only_some_of_the_keys_is_refused(tmp_path: Path) -> None:
    acc = _acc()
    train(acc, build(acc), epochs=EPOCHS, run_dir=tmp_path / "full", save_at={3}, stop_at=3)
    acc = _acc()
    torch.manual_seed(1)
    part = nn.Sequential(nn.Linear(6, 16))  # only the first layer of the saved model
    opt = torch.optim.AdamW(part.parameters(), lr=0.02)
    part, *_ = acc.setup(part, opt, DataLoader(dataset(), batch_size=2), lrs.StepLR(opt, 2))
    fresh = {k: v.clone() for k, v in part.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"does not fit model 0: the model has no keys "
                                                 r"that the checkpoint lacks, the checkpoint has "
                                                 r"2 key\(s\) \('3.bias', '3.weight'\)"):
        acc.load_state(tmp_path / "full")
    assert _equal(part.state_dict(), fresh) and not opt.state and acc.optimizer_steps == 0


def test_partial_model_loads_what_both_have_when_asked(tmp_path: Path) -> None:
    acc = _acc()
    train(acc, build(acc), epochs=EPOCHS, run_dir=tmp_path, save_at={3}, stop_at=3)
    saved = {k: v.clone() for k, v in acc._run.models[0].state_dict().items()}
    saved_opt = acc._run.optimizers[0].state
    acc = _acc()
    torch.manual_seed(1)
    part = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))  # a new last layer
    opt = torch.optim.AdamW(part.parameters(), lr=0.02)
    part, opt, *_ = acc.setup(part, opt, DataLoader(dataset(), batch_size=2),
                              lrs.StepLR(opt, 2))
    new_layer = part[2].weight.detach().clone()
    acc.load_state(tmp_path, strict=False)
    assert torch.equal(part[0].weight, saved["0.weight"]) and acc.optimizer_steps == 3
    assert torch.equal(part[2].weight, new_layer)  # not in the checkpoint: as it was
    old_first = next(iter(saved_opt.values()))
    assert torch.equal(opt.state[part[0].weight]["exp_avg"], old_first["exp_avg"])
    assert part[2].weight not in opt.state
