"""One process: the checkpoint layout on disk, refusals of torn, corrupt and foreign checkpoints
(the previous checkpoint still loads), no unpickling, pre-emption, and the loader's position."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import accumix as ax
from accumix.checkpoint import CheckpointError, latest_checkpoint
from accumix.data.loader import AcceleratedDataLoader
from tests.scripts.resumable_train import build, params, train

EPOCHS = 2  # 24 micro-batches of 2 an epoch, K=3: 8 steps an epoch on one process


def _run(run_dir: Path | None = None, *, load: str | Path | None = None,
         precision: str = "fp32", **kwargs: Any) -> tuple[dict[str, torch.Tensor], Any]:
    acc = ax.Accelerator(strategy="single", precision=precision, grad_accum_steps=3, seed=0)
    objects = build(acc)
    if load is not None:
        torch.manual_seed(99)
        acc.load_state(load)
    train(acc, objects, epochs=EPOCHS, run_dir=run_dir, **kwargs)
    return params(acc, objects[0]), acc


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], Path]:
    """The uninterrupted reference, and a run directory saved after steps 2, 4 and 9."""
    run_dir = tmp_path_factory.mktemp("ckpt") / "run"
    reference, _ = _run()
    _run(run_dir, save_at={2, 4, 9}, stop_at=9)
    return reference, run_dir


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "run"))


def test_layout_metadata_and_keep_last(saved: tuple[Any, Path]) -> None:
    _, run_dir = saved
    assert sorted(p.name for p in run_dir.iterdir()) == ["latest", "step-4", "step-9"]
    assert (run_dir / "latest").read_text() == "step-9\n"
    assert latest_checkpoint(run_dir) == run_dir / "step-9"
    meta = json.loads((run_dir / "step-9" / "meta.json").read_text())
    assert {k: meta[k] for k in ("step", "epoch", "position", "world_size", "strategy",
                                 "precision", "grad_accum_steps", "checkpoint_format")} == {
        "step": 9, "epoch": 1, "position": 3, "world_size": 1, "strategy": "single",
        "precision": "fp32", "grad_accum_steps": 3, "checkpoint_format": "dcp"}
    assert meta["accumix_version"] == ax.__version__
    assert meta["state"]["window"]["index"] == 8 and meta["state"]["window"]["micro_step"] == 0
    assert meta["state"]["schedulers"] == [{"type": "StepLR", "last_epoch": 9,
                                            "stepped_window": 8}]
    schedulers = torch.load(run_dir / "step-9" / "schedulers.pt", weights_only=True)
    assert [s["last_epoch"] for s in schedulers] == [9]
    files = {p.relative_to(run_dir / "step-9").as_posix(): p.stat().st_size
             for p in (run_dir / "step-9").rglob("*") if p.is_file() and p.name != "meta.json"}
    assert meta["files"] == files
    assert {"rank-0.pt", "schedulers.pt", "model/.metadata"} <= set(files)
    rng = torch.load(run_dir / "step-9" / "rank-0.pt", weights_only=True)
    assert set(rng) == {"python", "numpy", "torch", "cuda", "loaders"}


def test_resume_from_run_dir_or_step_dir_is_exact(saved: tuple[Any, Path]) -> None:
    reference, run_dir = saved
    from_latest, acc = _run(load=run_dir)  # mid-epoch 1
    assert _equal(from_latest, reference) and acc.optimizer_steps == 16
    from_step4, _ = _run(load=run_dir / "step-4")  # mid-epoch 0
    assert _equal(from_step4, reference)


def _refusal(run_dir: Path, load: Path | None = None) -> str:
    with pytest.raises(CheckpointError) as info:
        _run(load=load or run_dir)
    return str(info.value)


def test_torn_corrupt_and_foreign_checkpoints_are_refused(saved: tuple[Any, Path],
                                                          tmp_path: Path) -> None:
    reference, original = saved
    run_dir = _copy(original, tmp_path)
    newest = run_dir / "step-9"
    shard = newest / "model" / "__0_0.distcp"
    shard_bytes = shard.read_bytes()
    shard.write_bytes(shard_bytes[: len(shard_bytes) // 2])
    message = _refusal(run_dir)
    assert str(shard) in message and "truncated" in message and "step-4" in message, message
    shard.write_bytes(shard_bytes)

    meta_path = newest / "meta.json"
    meta_text = meta_path.read_text()
    meta_path.write_text(meta_text[:200])
    assert f"{meta_path} is unreadable" in _refusal(run_dir)
    meta_path.write_text(meta_text)

    rank_file = newest / "rank-0.pt"
    rank_bytes = rank_file.read_bytes()
    rank_file.unlink()
    assert f"{rank_file} is missing" in _refusal(run_dir)
    rank_file.write_bytes(rank_bytes)

    meta = json.loads(meta_text)
    meta["precision"] = "bf16-mixed"
    meta_path.write_text(json.dumps(meta))
    assert "precision='bf16-mixed' but this run has 'fp32'" in _refusal(run_dir)
    meta_path.write_text(meta_text)

    (run_dir / "latest").write_text("step-12\n")
    assert "points to step-12, which does not exist" in _refusal(run_dir)
    (run_dir / "latest").write_text("step-9\n")
    assert "neither latest nor meta.json" in _refusal(tmp_path)

    # The previous checkpoint loads whatever happened to the newest.
    shard.write_bytes(shard_bytes[:-1])
    previous, _ = _run(load=run_dir / "step-4")
    assert _equal(previous, reference)
    shard.write_bytes(shard_bytes)
    # A crash mid-save leaves only a temporary directory: latest still names step-9, and the
    # next save removes the leftover.
    (run_dir / ".step-12.tmp" / "model").mkdir(parents=True)
    resumed, _ = _run(run_dir, load=run_dir, save_at={10})
    assert _equal(resumed, reference)
    assert sorted(p.name for p in run_dir.iterdir()) == ["latest", "step-10", "step-9"]


def test_different_model_is_refused(saved: tuple[Any, Path]) -> None:
    _, run_dir = saved
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=3, seed=0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    acc.setup(model, opt, DataLoader(list(range(8)), batch_size=2), sched)
    with pytest.raises(CheckpointError, match=r"step-9/model does not fit model 0: the model "
                       r"has 2 key\(s\) \('2.bias', '2.weight'\) that the checkpoint lacks"):
        acc.load_state(run_dir)


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned > /dev/null",))


def test_loading_never_unpickles_arbitrary_objects(saved: tuple[Any, Path],
                                                   tmp_path: Path) -> None:
    _, original = saved
    run_dir = _copy(original, tmp_path)
    newest = run_dir / "step-9"
    meta_text = (newest / "meta.json").read_text()
    for name in ("rank-0.pt", "model/.metadata"):
        meta = json.loads(meta_text)
        path = newest / name
        saved_bytes = path.read_bytes()
        if name.endswith(".pt"):
            torch.save({"python": _Boom()}, path)
        else:
            path.write_bytes(pickle.dumps(_Boom()))
        meta["files"][name] = path.stat().st_size  # sizes agree: only the content is hostile
        (newest / "meta.json").write_text(json.dumps(meta))
        message = _refusal(run_dir)
        assert name.split("/")[-1] in message and "system" in message, message
        path.write_bytes(saved_bytes)
        (newest / "meta.json").write_text(meta_text)


def test_save_inside_a_window_is_refused(tmp_path: Path) -> None:
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=3, seed=0)
    model, opt, loader, _ = build(acc)
    x, y = next(iter(loader))
    with acc.accumulate():
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
    with pytest.raises(ax.AccumixError, match="micro-step 1 of 3"):
        acc.save_state(tmp_path)
    with pytest.raises(ax.ConfigError, match="keep_last=0"):
        ax.Accelerator(strategy="single").save_state(tmp_path, keep_last=0)


def test_save_before_the_first_step_changes_nothing(saved: tuple[Any, Path],
                                                    tmp_path: Path) -> None:
    # torch's get_state_dict would give AdamW a zero step (step count 1) on the way.
    reference, _ = saved
    got, _ = _run(tmp_path, save_at={0, 3}, stop_at=None)
    assert _equal(got, reference)
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=3, seed=0)
    objects = build(acc)
    acc.save_state(tmp_path / "zero")
    assert not objects[1].state
    resumed, _ = _run(load=tmp_path / "zero")
    assert _equal(resumed, reference)


def test_preemption_saves_at_the_next_boundary(saved: tuple[Any, Path], tmp_path: Path) -> None:
    reference, _ = saved
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=3, seed=0)
    objects = build(acc)
    handler = acc.handle_preemption(tmp_path, exit=False)
    sent = []

    def sigterm_in_window_5(acc: ax.Accelerator) -> None:
        if acc.optimizer_steps == 4 and acc._run.window.micro_step == 1 and not sent:
            sent.append(os.kill(os.getpid(), signal.SIGTERM))
        if handler.triggered:
            raise StopIteration

    with pytest.raises(StopIteration):
        train(acc, objects, epochs=EPOCHS, after_micro_step=sigterm_in_window_5)
    assert handler.checkpoint == tmp_path / "step-5" and acc.optimizer_steps == 5
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored once used
    resumed, _ = _run(load=tmp_path)
    assert _equal(resumed, reference)

    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=3, seed=0)
    objects = build(acc)
    acc.handle_preemption(tmp_path / "exit", keep_last=1)
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        train(acc, objects, epochs=EPOCHS)
    assert info.value.code == 0 and acc.optimizer_steps == 1
    assert latest_checkpoint(tmp_path / "exit") == tmp_path / "exit" / "step-1"


class _Recording(Dataset):
    def __init__(self, n: int) -> None:
        self.n, self.read = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.read.append(i)
        return i


def _loader(data: _Recording, rank: int, world: int, batch: int) -> AcceleratedDataLoader:
    return AcceleratedDataLoader(DataLoader(data, batch_size=batch, shuffle=True),
                                 device=torch.device("cpu"), rank=rank, world_size=world,
                                 seed=5, on_batch=lambda is_last: None)


def test_loader_resumes_at_the_sample_without_reading_skipped_ones() -> None:
    # Two ranks used 3 batches of 2 each of epoch 1; one rank continues: the epoch's other
    # samples, in the same shuffle, none of the used ones read again.
    data = _Recording(24)
    used = []
    for rank in (0, 1):
        loader = _loader(data, rank, 2, 2)
        loader.set_epoch(1)
        for i, batch in enumerate(loader):
            used += batch.tolist()
            if i == 2:
                break
        state = {**loader.state_dict(), **loader.sampling_state()}
    assert state == {"epoch": 1, "position": 3, "batch_size": 2, "world_size": 2, "seed": 5}
    full = _loader(_Recording(24), 0, 1, 2)
    full.set_epoch(1)
    epoch_order = [i for b in full for i in b.tolist()]
    one = _loader(data, 0, 1, 2)
    one.load_state_dict(state)
    data.read.clear()
    rest = [i for b in one for i in b.tolist()]
    assert one.epoch == 1 and sorted(used + rest) == list(range(24))
    assert rest == epoch_order[12:] and data.read == rest
    # The next epoch starts at its beginning with the next shuffle.
    assert one.state_dict()["epoch"] == 2 and one.state_dict()["position"] == 0
    with pytest.raises(ax.ConfigError, match="12 samples were used .* batch size 5"):
        _loader(data, 0, 1, 5).load_state_dict(state)
