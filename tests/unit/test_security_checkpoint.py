"""Issue 45: a crafted checkpoint cannot read files outside itself (DCP ``relative_path``,
``latest``, ``meta.json``'s file list) nor make a load allocate what its files do not hold
(compressed zip entries, declared sizes); each refusal is one line, before anything changes."""

from __future__ import annotations

import io
import json
import pickle
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import accumix as ax
from accumix.checkpoint import CheckpointError, latest_checkpoint
from tests.scripts.resumable_train import build, params, train


def _acc() -> tuple[ax.Accelerator, tuple[Any, ...]]:
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=1, seed=0)
    return acc, build(acc)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory with one checkpoint (step 2) of the resumable workload."""
    run_dir = tmp_path_factory.mktemp("sec") / "run"
    acc, objects = _acc()
    train(acc, objects, epochs=1, run_dir=run_dir, save_at={2}, stop_at=2)
    return run_dir


def _copy(run_dir: Path, tmp_path: Path, name: str = "run") -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / name))


def _refused(path: Path, *fragments: str) -> None:
    """``load_state(path)`` refuses in one line holding ``fragments`` and changes nothing."""
    acc, objects = _acc()
    before = params(acc, objects[0])
    with pytest.raises(CheckpointError) as info:
        acc.load_state(path)
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    after = params(acc, objects[0])
    assert all(torch.equal(before[k], after[k]) for k in before)


# -- case 1: DCP entries' relative_path ---------------------------------------------------------
def _metadata(step_dir: Path) -> Any:
    with open(step_dir / "model" / ".metadata", "rb") as f:
        return pickle.load(f)


def _write_metadata(step_dir: Path, metadata: Any) -> None:
    with open(step_dir / "model" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    _manifest(step_dir)


def _manifest(step_dir: Path, **extra: int) -> None:
    """``meta.json``'s file list made to match the tampered files, as an attacker would."""
    meta = json.loads((step_dir / "meta.json").read_text())
    meta["files"] = {p.relative_to(step_dir).as_posix(): p.stat().st_size
                     for p in step_dir.rglob("*") if p.is_file() and not p.is_symlink()
                     and p.name != "meta.json"} | extra
    (step_dir / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("where", ["relative", "absolute", "link"])
def test_dcp_entries_outside_the_checkpoint_are_refused(saved: Path, tmp_path: Path,
                                                        where: str) -> None:
    """Before: the weight was read from the victim's file outside the checkpoint."""
    private = tmp_path / "private"
    private.mkdir()
    run_dir = _copy(saved, tmp_path)
    step = run_dir / "step-2"
    # The victim's own torch file of the same layout: a copy of the checkpoint's .distcp.
    (distcp,) = (step / "model").glob("*.distcp")
    shutil.copy(distcp, private / "weights.distcp")
    metadata = _metadata(step)
    name = {"relative": "../../../private/weights.distcp",
            "absolute": str(private / "weights.distcp"), "link": "planted.distcp"}[where]
    if where == "link":
        (step / "model" / "planted.distcp").symlink_to(private / "weights.distcp")
    for info in metadata.storage_data.values():
        info.relative_path = name
    distcp.unlink()  # the checkpoint's own data is gone: only the outside file could load
    _write_metadata(step, metadata)
    _refused(run_dir, "outside the checkpoint", repr(name))


def test_meta_json_file_list_outside_the_step_is_refused(saved: Path, tmp_path: Path) -> None:
    run_dir = _copy(saved, tmp_path)
    (tmp_path / "secret").write_text("x" * 7)
    _manifest(run_dir / "step-2", **{"../../secret": 7})  # a right size would say it exists
    _refused(run_dir, "outside the checkpoint", "'../../secret'")


# -- case 4: latest ------------------------------------------------------------------------------
def test_latest_must_name_a_step_of_its_own_directory(saved: Path, tmp_path: Path) -> None:
    """Before: ``latest='../../private/run/step-2'`` loaded the other run's checkpoint."""
    elsewhere = _copy(saved, tmp_path / "private", "run")
    run_dir = tmp_path / "shared" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "latest").write_text("../../private/run/step-2\n")
    with pytest.raises(CheckpointError, match="not the name of a step-N directory"):
        latest_checkpoint(run_dir)
    _refused(run_dir, "not the name of a step-N directory")
    (run_dir / "latest").write_text(f"{elsewhere / 'step-2'}\n")
    _refused(run_dir, "not the name of a step-N directory")
    # A step-N that is a link to elsewhere, or a latest that is a link.
    (run_dir / "step-2").symlink_to(elsewhere / "step-2")
    (run_dir / "latest").write_text("step-2\n")
    _refused(run_dir, "is a symbolic link")
    (run_dir / "step-2").unlink()
    (run_dir / "latest").unlink()
    (run_dir / "latest").symlink_to(elsewhere / "latest")
    _refused(run_dir, "is a symbolic link")
    # What held: a plain latest still loads, exactly.
    acc, objects = _acc()
    assert acc.load_state(elsewhere) == elsewhere / "step-2"


# -- case 5: decompression bombs -----------------------------------------------------------------
def _deflated(data: bytes) -> bytes:
    """``data`` (a torch.save zip) with every entry DEFLATE-compressed."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            entry = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            entry.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(entry, zin.read(info.filename), compresslevel=9)
    return out.getvalue()


def _saved_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _write_bomb(path: Path, obj: dict[str, Any], pad_bytes: int) -> None:
    """``obj`` plus ``pad_bytes`` of zeros, torch.save'd with every entry deflated, without
    this process ever holding the zeros (an untouched ``torch.empty`` is the kernel's zero
    page, saved to a file and deflated in 1 MiB pieces)."""
    plain = path.with_suffix(".plain")
    torch.save({**obj, "pad": torch.empty(pad_bytes, dtype=torch.uint8)}, plain)
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            entry = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            entry.compress_type = zipfile.ZIP_DEFLATED
            with zin.open(info) as src, zout.open(entry, "w") as dst:
                while chunk := src.read(2**20):
                    dst.write(chunk)
    plain.unlink()


def _reset_peak() -> bool:
    """Resets this process's peak resident memory (Linux >= 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_compressed_rank_and_scheduler_files_are_refused_before_inflating(
        saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a 0.07 MiB rank-0.pt inflated to 64 MiB inside torch.load (the peak resident
    memory rose by as much); now it is refused from the zip's directory, nothing inflated."""
    run_dir = _copy(saved, tmp_path)
    step = run_dir / "step-2"
    rng = torch.load(step / "rank-0.pt", weights_only=True)
    _write_bomb(step / "rank-0.pt", rng, 64 * 2**20)
    assert (step / "rank-0.pt").stat().st_size < 2**20
    _manifest(step)
    acc, objects = _acc()
    measured = _reset_peak()
    before = _rss_mib()
    with pytest.raises(CheckpointError) as info:
        acc.load_state(run_dir)
    if measured:
        assert _peak_mib() - before < 32, (_peak_mib(), before)
    assert "rank-0.pt holds compressed entries" in str(info.value)
    assert "inflate to 67,1" in str(info.value)
    # A stored (uncompressed) file past the bound (64 MiB; 1 MiB here): refused as well.
    monkeypatch.setattr("accumix.checkpoint.load_limits.SMALL_FILE_LIMIT", 2**20)
    (step / "rank-0.pt").write_bytes(_saved_bytes({**rng, "pad": torch.zeros(2**20)}))
    _manifest(step)
    _refused(run_dir, "rank-0.pt holds 4,2", "more than the 1,048,576")
    # schedulers.pt alike (rank-0.pt back as it was).
    shutil.copy(saved / "step-2" / "rank-0.pt", step / "rank-0.pt")
    schedulers = torch.load(step / "schedulers.pt", weights_only=True)
    (step / "schedulers.pt").write_bytes(_deflated(_saved_bytes(schedulers)))
    _manifest(step)
    _refused(run_dir, "schedulers.pt holds compressed entries")


def test_dcp_entries_that_would_inflate_or_exceed_their_shape_are_refused(
        saved: Path, tmp_path: Path) -> None:
    run_dir = _copy(saved, tmp_path)
    step = run_dir / "step-2"
    metadata = _metadata(step)
    (distcp,) = (step / "model").glob("*.distcp")
    data = distcp.read_bytes()
    # Every entry of the .distcp deflated, the offsets moved to the new entries.
    packed, offset = b"", 0
    infos = sorted(metadata.storage_data.items(), key=lambda kv: kv[1].offset)
    for _, info in infos:
        entry = _deflated(data[info.offset:info.offset + info.length])
        info.offset, info.length = offset, len(entry)
        packed += entry
        offset += len(entry)
    distcp.write_bytes(packed)
    _write_metadata(step, metadata)
    _refused(run_dir, "holds compressed entries", ".distcp (bytes ")

    # A .metadata that declares a larger tensor than the model's: refused before reading.
    run_dir = _copy(saved, tmp_path, "run2")
    step = run_dir / "step-2"
    metadata = _metadata(step)
    key = next(k for k in metadata.state_dict_metadata if k.startswith("model0."))
    md = metadata.state_dict_metadata[key]
    md.size = torch.Size([10**6, *md.size[1:]])
    _write_metadata(step, metadata)
    _refused(run_dir, f"{key} is ({10**6},", "in this run")
    # An entry longer than its chunk's bytes, or past its file's end.
    metadata = _metadata(saved / "step-2")
    index, info = next((i, v) for i, v in metadata.storage_data.items() if i.offset is not None)
    info.length += 2 * 2**20
    _write_metadata(step, metadata)
    _refused(run_dir, "lies at bytes", "torn or damaged")
