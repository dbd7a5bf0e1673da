"""accumix.jax: torch DataLoaders as windows, exact resume, torn checkpoints, save_model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

jax = pytest.importorskip("jax")
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import accumix.jax as axj  # noqa: E402
from tests import jax_workloads as w  # noqa: E402

K = 3


class Rows(Dataset):
    """22 rows of the ragged workload: 5 batches of 4 (plus 2 rows) per epoch."""

    def __init__(self) -> None:
        self.rows = w.concat(w.micro_batches(11, rows=2, seed=9))

    def __len__(self) -> int:
        return 22

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {k: v[i] for k, v in self.rows.items()}


def loader(**kwargs) -> DataLoader:
    return DataLoader(Rows(), batch_size=4, shuffle=True, **kwargs)


def run(windows_to_take: int, *, run_dir=None, resume=False, save_after=None, epochs=None):
    acc = axj.Accelerator(strategy="fsdp", precision="fp32", grad_accum_steps=K, seed=5)
    state, windows = acc.setup(w.init_params(), w.optimizer(), loader())
    if resume:
        state = acc.load_state(run_dir, state)
    step = acc.train_step(w.item_loss)
    taken, masks = 0, []
    while taken < windows_to_take:
        for window in windows:
            masks.append(np.asarray(window.mask).tolist())
            state, _ = step(state, window)
            taken += 1
            if taken == save_after:
                acc.save_state(run_dir, state)
            if taken == windows_to_take:
                break
    return acc, state, masks


def test_loader_yields_windows_with_a_short_last_one_and_drops_the_ragged_tail() -> None:
    acc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=K)
    _, windows = acc.setup(w.init_params(), w.optimizer(), loader())
    epoch = list(windows)
    # 22 rows / 4 = 5 full batches + one of 2 rows (dropped: it would recompile the step).
    assert [np.asarray(x.mask).tolist() for x in epoch] == [[True] * 3, [True, True, False]]
    assert epoch[0].batch["x"].shape == (K, 4, 3, 4)
    assert len(windows) == 2


def test_mid_epoch_resume_is_bitwise(tmp_path) -> None:
    """Stop after 3 windows (mid-epoch 2), resume in a fresh Accelerator, 2 more windows."""
    _, uninterrupted, masks = run(5)
    assert masks[:3] == [[True] * 3, [True, True, False], [True] * 3]  # epoch 2 began
    run(3, run_dir=tmp_path / "run", save_after=3)
    meta = json.loads((tmp_path / "run" / "step-3" / "meta.json").read_text())
    assert meta["loader"]["epoch"] == 1 and meta["loader"]["position"] == 3
    _, resumed, _ = run(2, run_dir=tmp_path / "run", resume=True)
    assert int(resumed.step) == 5
    for a, b in zip(jax.tree.leaves(uninterrupted), jax.tree.leaves(resumed), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_torn_and_foreign_checkpoints_are_refused_naming_the_file(tmp_path) -> None:
    acc, state, _ = run(1, run_dir=tmp_path / "run", save_after=1)
    step_dir = tmp_path / "run" / "step-1"
    victim = next(p for p in sorted((step_dir / "state").rglob("*")) if p.is_file()
                  and p.stat().st_size > 8)
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(axj.CheckpointError, match=f"torn: {victim}"):
        acc.load_state(tmp_path / "run", state)
    (tmp_path / "empty").mkdir()
    with pytest.raises(axj.CheckpointError, match="no checkpoint at"):
        acc.load_state(tmp_path / "empty", state)
    (step_dir / "meta.json").write_text(json.dumps({"format": 1, "files": {}}))
    with pytest.raises(axj.CheckpointError, match="not an accumix.jax checkpoint"):
        acc.load_state(step_dir, state)


def test_an_interrupted_save_leaves_the_previous_checkpoint_loadable(tmp_path) -> None:
    acc, state, _ = run(2, run_dir=tmp_path / "run", save_after=1)
    acc.save_state(tmp_path / "run", state)  # step 2
    # A crash half-way through a later save: its temp dir exists, latest still says step-2.
    (tmp_path / "run" / ".step-3.tmp" / "state").mkdir(parents=True)
    restored = acc.load_state(tmp_path / "run", state)
    assert int(restored.step) == 2
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-2"
    path = acc.save_state(tmp_path / "run", restored, keep_last=1)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["latest", "step-2"]
    assert path.name == "step-2"


def test_save_model_writes_float32_dotted_keys(tmp_path) -> None:
    from safetensors.numpy import load_file

    acc = axj.Accelerator(strategy="fsdp", precision="bf16-true", grad_accum_steps=1)
    state = acc.setup(w.init_params(), w.optimizer())
    path = acc.save_model(tmp_path / "out", state)
    tensors = load_file(str(path))
    assert sorted(tensors) == ["hidden.b", "hidden.w", "out.b", "out.w"]
    assert all(t.dtype == np.float32 for t in tensors.values())
    expected = np.asarray(w.init_params()["hidden"]["w"], dtype=jax.numpy.bfloat16)
    assert np.array_equal(tensors["hidden.w"], expected.astype(np.float32))


def test_importing_accumix_jax_does_not_import_torch() -> None:
    code = "import sys, accumix.jax; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "False"


def test_workers_and_torch_seed_do_not_change_the_windows() -> None:
    """The DataLoader's worker processes feed the same windows as the main process (spawned:
    forking a process that runs JAX's threads can deadlock, as JAX warns)."""
    torch.manual_seed(0)
    acc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=K, seed=5)
    _, plain = acc.setup(w.init_params(), w.optimizer(), loader())
    acc2 = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=K, seed=5)
    spawned = loader(num_workers=2, multiprocessing_context="spawn")
    _, workers = acc2.setup(w.init_params(), w.optimizer(), spawned)
    for a, b in zip(plain, workers, strict=True):
        assert np.array_equal(np.asarray(a.batch["x"]), np.asarray(b.batch["x"]))
