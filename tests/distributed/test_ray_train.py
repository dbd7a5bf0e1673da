"""Ray Train runs the loop written for torchrun (and accumix.jax's) unchanged, checkpoints go to
Ray, and restarted workers resume exactly: one local Ray cluster (2 CPUs, loopback) for the
session, one ``fit`` per backend with the cases chained over Ray's restarts (tests/ray_jobs.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("ray.train", reason="ray[train] is not installed: pip install "
                    "'accumix[ray]' to run the Ray Train tests")

from examples import ray_train as example  # noqa: E402

from tests import ray_jobs  # noqa: E402
from tests.golden import matches_golden  # noqa: E402


def _facts(out: Path) -> dict[tuple[int, int], dict[str, Any]]:
    return {(int(p.stem[1:].split("-")[0]), int(p.stem.split("-r")[1])): json.loads(p.read_text())
            for p in out.glob("a*-r*.json")}


def _large_batch(steps: int = 6) -> list[torch.Tensor]:
    """The example's job on one process: AdamW on windows of 16 consecutive samples."""
    model, data = example.make_model(), example.make_data()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        start = step * 16 % len(data)
        x, y = data[start:start + 16]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def _model(run_dir: Path) -> list[torch.Tensor]:
    tensors = load_file(run_dir / "model" / "model.safetensors")
    return [tensors[k] for k in ("0.weight", "0.bias", "2.weight", "2.bias")]


def test_torch_trainer_runs_the_torchrun_loop_saves_to_ray_and_resumes(
        ray_cluster: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in ray_cluster.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    out.mkdir()
    result = example.make_trainer(str(tmp_path / "storage"), name="torch-cases", max_failures=1,
                                  num_to_keep=None, loop=ray_jobs.torch_cases,
                                  config={"out": str(out)}).fit()
    facts = _facts(out)
    assert sorted(facts) == [(a, r) for a in range(2) for r in range(2)], sorted(facts)

    # Where accumix thinks it runs: Ray's world, its process group and device, on loopback.
    for rank in range(2):
        assert facts[0, rank]["launch"] == ["ray", 2, 1, rank, rank, "127.0.0.1"]
        assert facts[0, rank]["device"] == "cpu" and facts[0, rank]["group_by_ray"]
    # ddp and fsdp, K=4 on 2 workers: the one-process large batch.
    reference = _large_batch()
    for strategy in ("ddp", "fsdp"):
        got = _model(out / f"ref-{strategy}" / "node-0")
        diff = max((a - b).abs().max().item() for a, b in zip(got, reference, strict=True))
        assert diff < 1e-6, (strategy, diff)
    uninterrupted = _model(out / "ref-ddp" / "node-0")

    # L, each worker its own run directory: worker 1 lost its disk and was SIGKILLed right
    # after the save of step 3; both resume there, worker 1 from Ray's copy (downloaded),
    # whatever Ray's controller had registered by then ...
    assert not facts[1, 1]["L_dir_existed"]
    for rank in range(2):
        assert facts[1, rank]["L_resumed"][0] == 3, facts[1, rank]
    assert facts[1, 1]["L_resumed"][1] == str(out / "L" / "node-1" / "step-3")
    # ... and end bit for bit where the run without failures (nor saves) ended.
    for got, want in zip(_model(out / "L" / "node-0"), uninterrupted, strict=True):
        assert torch.equal(got, want)

    # T, the Trainer: Ray's pre-emption notice during step 1 saved at the next boundary and
    # training went on (the scheduled saves are at steps 2, 4, 6)...
    assert facts[0, 0]["T_saves"] == [1, 2] and facts[0, 1]["T_saves"] == [1, 2]
    assert facts[1, 0]["T_saves"] == [4, 6]
    # ... with Ray's ASYNC upload: latest names a step directory that is still there
    # (Ray deleted only the links it uploaded); resumed at step 2, it ends bit for bit at the
    # plain loop's parameters.
    assert facts[0, 0]["T_async_latest"] == ["step-2", True]
    assert facts[0, 0]["T_links_left"] == [] and facts[0, 1]["T_links_left"] == []
    for rank in range(2):
        assert facts[1, rank]["T_resumed"][0] == 2 and facts[1, rank]["T_done"][0] == 6
        got = [torch.tensor(p) for p in facts[1, rank]["T_params"]]
        assert all(torch.equal(a, b.flatten()) for a, b in zip(got, uninterrupted, strict=True))
    # The ASYNC uploads reached Ray whole: its last saves of T, every file of both workers.
    storage = tmp_path / "storage" / "torch-cases"
    records = json.loads((storage / "accumix-latest").read_text())["runs"]
    steps = []
    for name in records[str(out / "T" / "node-0")]:
        run_file = json.loads((storage / name / "accumix-ray.json").read_text())
        assert run_file["run_dirs"] == [str(out / "T" / f"node-{r}") for r in range(2)]
        assert all((storage / name / f).stat().st_size == size
                   for f, size in run_file["files"].items()), name
        steps.append(run_file["step"])
    assert steps == [2, 4, 6], steps

    # `accumix train` inside the TorchTrainer: one job of the 2 workers, its checkpoint at Ray.
    assert facts[1, 0]["R_exit"] == 0 and facts[1, 1]["R_exit"] == 0
    rows = (out / "R" / "node-0" / "metrics.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("step,")
    recipe = json.loads((storage / records[str(out / "R" / "node-0")][-1] /
                         "accumix-ray.json").read_text())
    assert recipe["step"] == 2 and len(recipe["run_dirs"]) == 2

    # Ray's result holds what save_state wrote (no ray.train.report in the loops): the last
    # checkpoint is L's step 6, every file of both workers in it.
    saved = Path(result.checkpoint.path)
    run_file = json.loads((saved / "accumix-ray.json").read_text())
    assert run_file["step"] == 6
    assert run_file["run_dirs"] == [str(out / "L" / f"node-{r}") for r in range(2)]
    assert {"meta.json", "rank-0.pt", "rank-1.pt", "model/.metadata"} <= set(run_file["files"])
    for name, size in run_file["files"].items():
        assert (saved / name).stat().st_size == size, name
    assert json.loads((saved / "meta.json").read_text())["state"]["optimizer_steps"] == 6
    assert result.metrics["step"] == 6


def test_jax_trainer_on_cpu_is_one_job_exact_as_accumix_launch_and_resumes(
        ray_cluster: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("jax")
    from examples import ray_train_jax as jax_example

    for name, value in ray_cluster.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    out.mkdir()
    jax_example.make_trainer(str(tmp_path / "storage"), name="jax-cases", max_failures=1,
                             loop=ray_jobs.jax_cases, config={"out": str(out)}).fit()
    facts = _facts(out)
    assert sorted(facts) == [(a, r) for a in range(2) for r in range(2)], sorted(facts)
    # One job of 2 processes x 2 CPU devices (Ray started no jax.distributed: before, each
    # worker trained alone as a world of 1).
    for rank in range(2):
        assert facts[0, rank]["launch"] == ["ray", 2, rank, 2, 4]
    # The params of `accumix launch --nproc 2` on the same job (tests/distributed/
    # test_jax_processes.py checks them against this golden file), within another CPU's rounding.
    golden = json.loads((Path(__file__).resolve().parents[1] / "golden" / "pre_jax33" /
                         "uneven_strategy_params.json").read_text())
    for rank in range(2):
        for name in ("ddp", "fsdp"):
            got = facts[0, rank][f"golden_{name}"]  # recorded on another CPU (tests/golden)
            assert got.keys() == golden[name].keys() and all(
                matches_golden(golden[name][k], got[k]) for k in got), (rank, name)
    # Saved at step 2, every copy of the run directory lost, a worker failed: both resume at
    # step 2 from Ray's copy and end bit for bit where the run without failures ended.
    for rank in range(2):
        assert facts[1, rank]["J_resumed"] == 2
    done = load_file(out / "J" / "model" / "model.safetensors")
    reference = load_file(out / "J-ref" / "model" / "model.safetensors")
    assert done.keys() == reference.keys()
    assert all(torch.equal(done[k], reference[k]) for k in done)
