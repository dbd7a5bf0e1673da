"""Issue 45, case 2: a link planted in a run directory never makes accumix write its target.

Every writer of a run directory: ``latest`` (and its temporary ``.latest.tmp``), the lock,
``trackers.json`` (and its temporary names), ``metrics.csv`` / ``metrics.jsonl``, the
TensorBoard directory, the plot, ``model.safetensors``, the micro-batch cache. Each test plants
links to a file of the "victim" (the training user) and checks the victim's bytes afterwards.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from accumix.errors import ConfigError

VICTIM = b"export PATH=/usr/bin  # the user's own file\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "home" / ".bashrc"
    path.parent.mkdir()
    path.write_bytes(VICTIM)
    return path


def _umask_mode() -> int:
    """What ``open(path, "w")`` gives a new file: 0o666 less the umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _plant(run_dir: Path, name: str, target: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    link = run_dir / name
    link.symlink_to(target)
    return link


def test_save_state_writes_latest_without_following_links(tmp_path: Path, victim: Path) -> None:
    """Before: ``.latest.tmp -> ~/.bashrc`` made the victim ``'step-2\\n'``."""
    import accumix as ax
    from tests.scripts.resumable_train import build, train

    run_dir = tmp_path / "run"
    _plant(run_dir, ".latest.tmp", victim)
    _plant(run_dir, "latest", victim)
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=1, seed=0)
    train(acc, build(acc), epochs=1, run_dir=run_dir, save_at={2}, stop_at=2)
    assert victim.read_bytes() == VICTIM
    assert not (run_dir / "latest").is_symlink()
    assert (run_dir / "latest").read_text() == "step-2\n"
    # The model file too: a link at model.safetensors is replaced, its target untouched.
    _plant(run_dir, "model.safetensors", victim)
    acc.save_model(run_dir)
    assert victim.read_bytes() == VICTIM
    assert not (run_dir / "model.safetensors").is_symlink()
    assert (run_dir / "model.safetensors").stat().st_size > 100
    # What held: the umask decides the files' permissions (a temporary file's 0600 does not;
    # safetensors itself writes model.safetensors 0600, as before).
    assert stat.S_IMODE((run_dir / "latest").stat().st_mode) == _umask_mode()


def test_the_run_lock_is_never_taken_through_a_link(tmp_path: Path, victim: Path) -> None:
    """Before: ``accumix train nproc=2`` wrote ``'pid N on host\\n'`` into the lock's target,
    truncating it, before any rank started."""
    from accumix.trainer.run_lock import check_run_dir_free, lock_run_dir

    run_dir = tmp_path / "run"
    _plant(run_dir, ".lock", victim)
    with pytest.raises(ConfigError, match=r"\.lock is a symbolic link .*never writes through"):
        check_run_dir_free(run_dir)  # what the launcher runs before starting any rank
    with pytest.raises(ConfigError, match="is a symbolic link"):
        lock_run_dir(run_dir)
    assert victim.read_bytes() == VICTIM
    # A hard link (same file system) is refused as well.
    (run_dir / ".lock").unlink()
    os.link(victim, run_dir / ".lock")
    with pytest.raises(ConfigError, match="is a hard link"):
        lock_run_dir(run_dir)
    assert victim.read_bytes() == VICTIM
    # What held: a plain lock is taken, and refused to a second taker.
    (run_dir / ".lock").unlink()
    held = lock_run_dir(run_dir)
    assert held is not None
    assert (run_dir / ".lock").read_text().startswith(f"pid {os.getpid()} on ")
    held.release()


def test_metric_files_and_tracker_ids_never_follow_links(tmp_path: Path, victim: Path) -> None:
    from accumix.memory.micro_batch_cache import CACHE_FILE, read_cache, write_cache
    from accumix.trainer.loggers import CSVLogger, JSONLLogger, read_rows
    from accumix.trainer.trackers.base import RUN_IDS_FILE, read_run_ids, write_run_id

    run_dir = tmp_path / "run"
    for name in ("metrics.csv", "metrics.jsonl"):
        _plant(run_dir, name, victim)
    for logger in (CSVLogger(), JSONLLogger()):
        with pytest.raises(ConfigError, match="is a symbolic link"):
            logger.open(run_dir, resume_step=3)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        read_rows(run_dir, after=0, through=3)  # rows a tracker would re-send
    # trackers.json: its temporary names (the old one, trackers.tmp, too) and itself.
    for name in ("trackers.tmp", f".{RUN_IDS_FILE}.tmp"):
        _plant(run_dir, name, victim)
    write_run_id(run_dir, "mlflow", {"run_id": "abc"})
    assert read_run_ids(run_dir) == {"mlflow": {"run_id": "abc"}}
    (run_dir / RUN_IDS_FILE).unlink()
    _plant(run_dir, RUN_IDS_FILE, victim)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        read_run_ids(run_dir)
    # The micro-batch cache.
    for name in (CACHE_FILE, ".micro_batch_auto.json.tmp", "micro_batch_auto.tmp"):
        _plant(run_dir, name, victim)
    write_cache(run_dir, "key", 4)
    assert read_cache(run_dir, "key") == 4
    assert victim.read_bytes() == VICTIM
    # What held: the loggers write their files where no link is.
    clean = tmp_path / "clean"
    clean.mkdir()
    csv_logger = CSVLogger()
    csv_logger.open(clean, resume_step=0)
    csv_logger.log({"step": 1, "loss": 2.5})
    csv_logger.close()
    assert (clean / "metrics.csv").read_text() == "step,loss\n1,2.5\n"


def test_plot_and_tensorboard_never_write_through_links(tmp_path: Path, victim: Path) -> None:
    pytest.importorskip("matplotlib")
    from accumix.cli.plot import plot_metrics

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.csv").write_text("step,loss,lr\n1,2.0,0.1\n2,1.5,0.1\n")
    _plant(run_dir, "metrics.png", victim)
    path = plot_metrics(run_dir)
    assert victim.read_bytes() == VICTIM
    assert not path.is_symlink() and path.read_bytes()[:4] == b"\x89PNG"
    assert stat.S_IMODE(path.stat().st_mode) == _umask_mode()
    from accumix.trainer.loggers import TensorBoardLogger, tensorboard_available

    if tensorboard_available():
        _plant(run_dir, "tensorboard", victim.parent)
        with pytest.raises(ConfigError, match="is a symbolic link"):
            TensorBoardLogger().open(run_dir, resume_step=0)
        assert sorted(p.name for p in victim.parent.iterdir()) == [".bashrc"]
