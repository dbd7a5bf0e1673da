"""The jobs of ``test_hsdp.py``: what each of the 4 ranks (2 simulated nodes of 2) and then
each of 2 ranks runs, and the plain-PyTorch references they are compared with."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import accumix as ax
from accumix.memory.model import estimate_memory
from accumix.testing import spawn
from tests import multi_model as mm
from tests import skipped_blocks
from tests import workloads as w
from tests.distributed.test_sharded import Net
from tests.frozen_heap import frozen_heap
from tests.scripts.resumable_train import params

if TYPE_CHECKING:
    import pytest

TOL = 1e-6
NODES, WORLD = 2, 4
# The resume job: Adam + StepLR over 64 samples, micro-batches of 2, 16 samples a step (K=2 on
# 4 ranks, 4 on 2, 8 on 1): 4 optimizer steps, a checkpoint after the second.
SAMPLES, MICRO, GLOBAL, SAVE_AT = 64, 2, 16, 2


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(params_: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.full_tensor() if isinstance(p, DTensor) else p for p in params_]


def _digest(model: nn.Module) -> str:
    """This rank's parameter shards, bitwise."""
    data = b"".join(_local(p).detach().numpy().tobytes() for p in model.parameters())
    return hashlib.sha256(data).hexdigest()


def _train(strategy: Any, model: nn.Module, data: Any, *, steps: int, items: bool,
           sched: bool = False, precision: str = "fp32") -> tuple[list[torch.Tensor],
                                                                  ax.Accelerator, list[str]]:
    """The DESIGN.md loop; returns the full parameters, the accelerator and this rank's shard
    digest after each optimizer step."""
    acc = ax.Accelerator(strategy=strategy, precision=precision, grad_accum_steps=steps)
    opt = torch.optim.SGD(model.parameters(), lr=w.LR, momentum=w.MOMENTUM)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if sched else None
    model, opt, loader = acc.setup(model, opt, DataLoader(data, batch_size=MICRO))
    if scheduler is not None:
        scheduler = acc.setup(scheduler)
    digests = []
    for batch in loader:
        with acc.accumulate():
            if items:
                loss_sum, n = w.item_loss(model, batch)
                acc.backward(loss_sum, num_items=n)
            else:
                acc.backward(w.mean_loss(model, batch))
            opt.step()
            if scheduler is not None:
                scheduler.step()
            opt.zero_grad()
        if acc.sync_gradients:
            digests.append(_digest(acc.unwrap(model)))
    if acc.strategy.name == "deepspeed":  # ZeRO-3's partitions, gathered on every rank
        return list(params(acc, model).values()), acc, digests
    return _full(list(acc.unwrap(model).parameters())), acc, digests


def _exactness(out_dir: str) -> dict[str, Any]:
    """(max difference to the large batch, optimizer steps, shard digests, mesh) per case. 56
    samples on 4 ranks with K=4: windows of 32 and a short one of 24. The last case's
    ``save_model`` (rank 0's file) against the large batch too."""
    out: dict[str, Any] = {}
    cases = {
        "K1/mean": (ax.HSDPStrategy(), 1, False, 64),
        "K4/mean": (ax.HSDPStrategy(), 4, False, 56),
        "K4/items": (ax.HSDPStrategy(), 4, True, 56),
        "K4/mean/defer": (ax.HSDPStrategy(defer_reduce_scatter=True), 4, False, 56),
        "K4/items/defer": (ax.HSDPStrategy(defer_reduce_scatter=True, sharding="grad_op"), 4,
                           True, 56),
    }
    for name, (strategy, steps, items, samples) in cases.items():
        data = w.sequence_data(samples) if items else w.regression_data(samples)
        model = Net(in_features=4 if items else 6)
        ref = w.reference_params(model, data, MICRO * WORLD * steps, items=items, sched=items)
        got, acc, digests = _train(strategy, model, data, steps=steps, items=items, sched=items)
        out[name] = (w.max_diff(ref, got), acc.optimizer_steps, digests,
                     tuple(acc.strategy.mesh.shape))
    path = acc.save_model(out_dir)  # collective; rank 0 writes
    if acc.is_main_process:
        from safetensors.torch import load_file

        saved = load_file(str(path))
        out["saved"] = w.max_diff(ref, [saved[k] for k in model.state_dict()])
    return out


class _RecordingHSDP(ax.HSDPStrategy):
    """Records each rank's own overflow flag before the agreement."""

    def __init__(self) -> None:
        super().__init__()
        self.local_flags: list[float] = []

    def reduce_found_inf(self, found_inf: torch.Tensor) -> torch.Tensor:
        self.local_flags.append(float(found_inf.item()))
        return super().reduce_found_inf(found_inf)


def _overflow_on_one_rank() -> dict[str, Any]:
    """fp16, K=2, 4 windows: rank 2 (node 1) overflows on the first micro-step of windows 1
    and 2. The model is one Linear(6, 2) whose second output row is the second shard of each
    node: rank 2's reduce-scatter sends the inf to rank 3, the boundary's all-reduce to rank 1;
    ranks 0 and 2 see finite shards and skip only by the agreed flag."""
    strategy = _RecordingHSDP()
    acc = ax.Accelerator(strategy=strategy, precision="fp16-mixed", grad_accum_steps=2,
                         loss_scale=ax.DynamicLossScale(init_scale=1024.0, hysteresis=2))
    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, loader, sched = acc.setup(model, opt, DataLoader(w.regression_data(64),
                                                                  batch_size=2), sched)
    log = []
    for i, (x, y) in enumerate(loader):
        overflow = acc.rank == 2 and i // 2 in (1, 2) and i % 2 == 0
        with acc.accumulate():
            out = model(x)
            # 1e5 * 1024 / 2 is past fp16's max in the second row's gradient
            loss = nn.functional.mse_loss(out[:, :1], y) + out[:, 1].mean() * (
                1e5 if overflow else 1.0)
            acc.backward(loss)
            acc.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            log.append((acc.step_was_skipped, acc.loss_scale, sched.get_last_lr()[0],
                        _digest(acc.unwrap(model))))
    return {"log": log, "steps": acc.optimizer_steps, "local_flags": strategy.local_flags}


def _refuses_interleaved_nodes() -> str:
    """Ranks numbered round-robin over the nodes (srun --distribution=cyclic): refused at setup
    on every rank, before any mesh exists."""
    saved = os.environ["GROUP_RANK"]
    os.environ["GROUP_RANK"] = str(int(os.environ["RANK"]) % NODES)
    try:
        acc = ax.Accelerator(strategy="hsdp", precision="fp32")
        acc.setup(Net(), )
    except ax.ConfigError as exc:
        return str(exc)
    finally:
        os.environ["GROUP_RANK"] = saved
    return "accepted"


# (memory model row, K) of ``_memory``: hsdp's default reduce-scatters every micro-step into
# shards, ``defer_reduce_scatter=True`` holds the window's unsharded gradients from K=2.
MEMORY_CASES = [("hsdp-full", 2), ("hsdp-full-defer", 1), ("hsdp-full-defer", 2),
                ("hsdp-grad_op-defer", 2)]


def _memory() -> dict[str, Any]:
    """Model-state bytes on this rank (``tests/model_states.py``) under each of
    ``MEMORY_CASES`` with Adam, and the memory model's rows for them (and ddp's)."""
    from tests.model_states import window_model_states

    out: dict[str, Any] = {}
    for row, steps in MEMORY_CASES:
        model = Net(width=64, blocks=4)
        rows = {e.strategy: e.total_bytes for e in estimate_memory(
            model, world_size=WORLD, ranks_per_node=WORLD // NODES, grad_accum_steps=steps)}
        strategy = ax.HSDPStrategy(sharding=row.split("-")[1],
                                   defer_reduce_scatter=row.endswith("defer"))
        acc = ax.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=steps)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model, opt = acc.setup(model, opt)
        held = window_model_states(acc, model, opt, torch.randn(8, 6), micro_steps=steps)
        # a K=1 window holds what the default does: the defer rows are listed from K=2 only
        out[f"{row}|{steps}"] = {"measured": held["total"],
                                 "model": rows.get(row, rows[row.removesuffix("-defer")]),
                                 "ddp": rows["ddp"]}
    return out


def _out_of_memory_split() -> dict[str, Any]:
    """Rank 3 runs out of memory on each boundary micro-step (K=2): every rank runs its
    micro-batch as pieces, and only the last piece's backward all-reduces across nodes."""
    from accumix.testing import CollectiveLog
    from tests.oom_injection import OOMAbove, make_model

    out: dict[str, Any] = {}
    for split in (False, True):
        acc = ax.Accelerator(strategy="hsdp", precision="fp32", grad_accum_steps=2)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt, loader = acc.setup(model, opt, DataLoader(w.regression_data(32),
                                                              batch_size=4))
        head = next(m for m in acc.unwrap(model).modules() if isinstance(m, OOMAbove))
        with CollectiveLog() as log:
            for i, batch in enumerate(loader):
                head.limit = 1 if split and acc.rank == 3 and i % 2 else None
                with acc.accumulate():
                    acc.run_micro_batch(lambda b, model=model: w.mean_loss(model, b), batch)
                    opt.step()
                    opt.zero_grad()
        gradients = log.nbytes(_crosses, op="all_reduce") - log.nbytes(
            lambda ranks: _crosses(ranks) and len(ranks) == WORLD, op="all_reduce")
        out[split] = (_full(list(acc.unwrap(model).parameters())), gradients, head.raised)
    return {"diff": w.max_diff(out[False][0], out[True][0]), "bytes": (out[False][1],
            out[True][1]), "raised": out[True][2]}


def _crosses(ranks: tuple[int, ...]) -> bool:
    return len({r // (WORLD // NODES) for r in ranks}) > 1


def _auto_picks_hsdp() -> dict[str, Any]:
    """strategy="auto" on 2 nodes, a device where hsdp fits and ddp does not (fake size)."""
    from unittest import mock

    model, data = Net(), w.regression_data(64)
    totals = {e.strategy: e.total_bytes for e in estimate_memory(
        model, world_size=WORLD, ranks_per_node=WORLD // NODES, optimizer_states=1)}
    device = int((totals["ddp"] + totals["hsdp-grad_op"]) / 2 / 0.8)
    with mock.patch("accumix.strategies.registry.device_free_bytes", return_value=device):
        got, acc = w.accumix_params(model, data, micro_batch=MICRO, steps=2, items=False)
    ref = w.reference_params(model, data, MICRO * WORLD * 2, items=False)
    return {"chosen": (acc.strategy.name, acc.strategy.sharding), "diff": w.max_diff(ref,
                                                                                  _full(got))}


def _compiled() -> dict[str, Any]:
    """``acc.setup(torch.compile(model))`` under hsdp (dynamo's eager backend): each block
    compiled once, no recompilation over K=3 with a short last window, the eager run's result
    (``tests/compile_workloads.py``, as for the other strategies)."""
    from tests import compile_workloads as cw

    # 80 samples: each of 4 ranks 5 micro-batches of 4, windows of 3 and 2
    eager = cw.train(strategy="hsdp", how="eager", samples=80)
    return cw.check(cw.train(strategy="hsdp", how="wrapped", samples=80), eager)


def _micro_batch_auto() -> dict[str, Any]:
    """``micro_batch_size="auto"`` under hsdp, rank 1 running out of memory in the backward
    above 5 rows (``test_micro_batch_auto``'s job): every rank chooses 3 (of 24 / 4 ranks) and
    trains bitwise as the run given 3."""
    from tests.distributed import test_micro_batch_auto as auto

    _, steps, explicit = auto._train("hsdp", 3, "")
    chosen, auto_steps, got = auto._train("hsdp", "auto", "backward")
    return {"chosen": chosen, "steps": (auto_steps, steps),
            "unequal": [k for k in explicit if not torch.equal(got[k], explicit[k])]}


# -- checkpoints across meshes ---------------------------------------------------------------
def resume_run(strategy: Any, *, load: str | None = None, save: str | None = None
                ) -> dict[str, np.ndarray]:
    """The resume job to its end; ``save``: a checkpoint after step 2 on the way."""
    acc = ax.Accelerator(strategy=strategy, precision="fp32", seed=0, micro_batch_size=MICRO,
                         global_batch_size=GLOBAL)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    loader = DataLoader(w.regression_data(SAMPLES), batch_size=MICRO)
    model, opt, loader, sched = acc.setup(model, opt, loader, sched)
    if load is not None:
        acc.load_state(load)
    for batch in loader:
        with acc.accumulate():
            acc.backward(w.mean_loss(model, batch))
            opt.step()
            sched.step()
            opt.zero_grad()
        if save is not None and acc.sync_gradients and acc.optimizer_steps == SAVE_AT:
            acc.save_state(save)
    assert acc.optimizer_steps == SAMPLES // GLOBAL
    return {k: v.float().numpy() for k, v in params(acc, model).items()}


def resume_reference() -> dict[str, np.ndarray]:
    """Plain PyTorch: one Adam step per window of 16 consecutive samples, StepLR after it."""
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    for batch in DataLoader(w.regression_data(SAMPLES), batch_size=GLOBAL):
        opt.zero_grad()
        w.mean_loss(model, batch).backward()
        opt.step()
        sched.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _hpz(run_dir: str) -> dict[str, Any]:
    """DeepSpeed ZeRO-3 with ZeRO++'s secondary partition within each node: the large batch
    (K=4, items, StepLR, a short last window; and the resume job's K=2, mean, Adam), and a
    resume on the same mesh (three engines: DeepSpeed's import and first engine cost most)."""
    data, model = w.sequence_data(56), Net(in_features=4)
    ref = w.reference_params(model, data, MICRO * WORLD * 4, items=True, sched=True)
    got, acc, _ = _train(ax.DeepSpeedStrategy(stage=3, hpz="node"), model, data, steps=4,
                         items=True, sched=True)
    out: dict[str, Any] = {"K4/items": (w.max_diff(ref, got), acc.optimizer_steps,
                                        acc.strategy._engine(None).zero_hpz_partition_size())}
    out["straight"] = resume_run(ax.DeepSpeedStrategy(stage=3, hpz="node"), save=run_dir)
    out["resumed"] = resume_run(ax.DeepSpeedStrategy(stage=3, hpz="node"), load=run_dir)
    return out


def four_rank_job(run_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {"interleaved": _refuses_interleaved_nodes()}
    if importlib.util.find_spec("deepspeed") is not None:
        out["hpz"] = _hpz(run_dir + "-hpz")
    out["exact"] = _exactness(run_dir + "-model")
    out["skipped blocks"] = skipped_blocks.max_diff_to_reference(ax.HSDPStrategy())
    lbfgs_ref = mm.lbfgs_reference(steps=3)
    lbfgs = mm.lbfgs_accumix(steps=3, strategy="hsdp")
    out["lbfgs"] = (mm.max_diff(lbfgs_ref[0], lbfgs[0]), lbfgs_ref[1], lbfgs[1])
    out["overflow"] = _overflow_on_one_rank()
    out["memory"] = _memory()
    out["oom"] = _out_of_memory_split()
    out["auto"] = _auto_picks_hsdp()
    out["compiled"] = _compiled()
    with frozen_heap():  # the probes' garbage passes see only this part's objects
        out["micro_batch_auto"] = _micro_batch_auto()
    out["straight"] = resume_run(ax.HSDPStrategy(), save=run_dir)
    for name, strategy in (("hsdp", ax.HSDPStrategy()), ("fsdp", "fsdp"), ("ddp", "ddp")):
        out[f"resumed/{name}"] = resume_run(strategy, load=run_dir)
    # test_reduce_dtype_error's checks: the same 4 ranks as 2 nodes, one spawn for both files
    from tests.distributed import test_reduce_dtype_error as reduce_error

    out["reduce"] = reduce_error.job()
    out["two ranks"] = _on_two_ranks(run_dir)
    return out


_RESULTS: list[tuple[list[dict[str, Any]], Path]] = []


def results(tmp: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    """Each rank's ``four_rank_job`` result and its run directory: one spawn a session, which
    ``test_hsdp`` and ``test_reduce_dtype_error`` share (a 4-rank spawn and its imports cost
    tens of seconds on 2 cores)."""
    if not _RESULTS:
        run_dir = tmp.mktemp("hsdp") / "run"
        _RESULTS.append((spawn(four_rank_job, WORLD, args=(str(run_dir),), nodes=NODES,
                               timeout=1500), run_dir))
    return _RESULTS[0]


def _on_two_ranks(run_dir: str) -> dict[str, Any] | None:
    """The 2x2 checkpoint resumed by 2 ranks (fsdp: a 1x2 world, ddp: 2x1), in this spawn
    rather than a second one (a spawn costs seconds a rank): the 4-rank process group ends,
    ranks 0 and 1 start a world of their own on one node (a new port), ranks 2 and 3 stop."""
    import torch.distributed as dist

    from accumix.testing import free_port, node_variables

    rank = dist.get_rank()
    port = torch.tensor([free_port() if rank == 0 else 0])
    dist.broadcast(port, 0)
    dist.destroy_process_group()
    if rank >= 2:
        return None
    os.environ.update({**node_variables(rank, 2), "MASTER_PORT": str(int(port.item()))})
    return {name: resume_run(strategy, load=run_dir) for name, strategy in
            (("fsdp 1x2", "fsdp"), ("ddp 2x1", "ddp"))}


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert sorted(a) == sorted(b)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)
