"""2 ranks on gloo: zero1 and FSDP2 (full, grad_op) equal the single-process large batch; fp16
overflow seen by one rank's shard skips every rank; clipping sees the global norm; optimizer
states are halved; save_model gathers the full model; one reduce-scatter per optimizer step."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import accumix as ax
from accumix.memory.model import estimate_memory
from accumix.testing import ResidualBlock as Block
from accumix.testing import spawn
from tests import workloads as w

TOL = 1e-6


class Net(nn.Module):
    """Three identical blocks between an input and a head: FSDP's auto wrap finds the blocks."""

    def __init__(self, in_features: int = 6, width: int = 16, blocks: int = 3, seed: int = 0
                 ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _shard_blocks_then_root(model: nn.Module, mesh: Any) -> nn.Module:
    """A torchtitan-style parallelize_fn."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


STRATEGIES = {
    "zero1": lambda: ax.ZeRO1Strategy(),
    "fsdp-full": lambda: ax.FSDPStrategy(sharding="full"),
    "fsdp-grad_op": lambda: ax.FSDPStrategy(sharding="grad_op"),
}
VARIANTS = {  # each checked in mean mode only
    "fsdp-full-ac-wrap-linear": lambda: ax.FSDPStrategy(wrap=[nn.Linear],
                                                        activation_checkpointing=True),
    "fsdp-parallelize-fn": lambda: ax.FSDPStrategy(parallelize_fn=_shard_blocks_then_root),
}


def _full(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.full_tensor() if isinstance(p, DTensor) else p for p in params]


def _equivalence(out_dir: str) -> dict[str, Any]:
    """Max parameter difference to the large-batch reference per strategy and loss mode, plus
    what save_model wrote (rank 0)."""
    out: dict[str, Any] = {}
    data, model = w.regression_data(96), Net()
    # K=3 micro-batches of 4 on 2 ranks: windows of 24 samples, 4 optimizer steps.
    ref_mean = w.reference_params(model, data, 24, items=False)
    # Item-weighted, variable lengths, StepLR halving the lr each step (the schedule must reach
    # what really steps: ZeRO rebuilds the optimizer).
    seq, seq_model = w.sequence_data(96), Net(in_features=4)
    ref_items = w.reference_params(seq_model, seq, 24, items=True, sched=True)
    keys = list(model.state_dict())
    for name, make in {**STRATEGIES, **VARIANTS}.items():
        got, acc = w.accumix_params(model, data, micro_batch=4, steps=3, items=False,
                                    strategy=make())
        out[f"{name}/mean"] = (w.max_diff(ref_mean, _full(got)), acc.optimizer_steps)
        path = acc.save_model(Path(out_dir) / name)
        if acc.is_main_process:
            saved = load_file(str(path))
            out[f"{name}/saved_keys"] = sorted(saved) == sorted(keys)
            out[f"{name}/saved"] = w.max_diff(ref_mean, [saved[k] for k in keys])
        if name in STRATEGIES:
            got, acc = w.accumix_params(seq_model, seq, micro_batch=3, steps=4, items=True,
                                        strategy=make(), sched=True)
            out[f"{name}/items"] = (w.max_diff(ref_items, _full(got)), acc.optimizer_steps)
    return out


def _auto_picks_fsdp_full() -> dict[str, Any]:
    """strategy="auto" with a device that fits fsdp full but not zero1 or grad_op (fake size),
    K=3: fsdp full's default with its window's unsharded gradients."""
    model, data = Net(), w.regression_data(96)
    by_name = {e.strategy: e.total_bytes for e in estimate_memory(
        model, world_size=2, optimizer_states=1, grad_accum_steps=3)}
    assert by_name["fsdp-full"] < by_name["zero1"] < by_name["fsdp-grad_op"], by_name
    device = int((by_name["fsdp-full"] + by_name["zero1"]) / 2 / 0.8)
    with mock.patch("accumix.strategies.registry.device_free_bytes", return_value=device):
        got, acc = w.accumix_params(model, data, micro_batch=4, steps=3, items=False)
    ref = w.reference_params(model, data, 24, items=False)
    return {"chosen": (acc.strategy.name, getattr(acc.strategy, "sharding", None),
                       getattr(acc.strategy, "sync_each_microstep", None)),
            "diff": w.max_diff(ref, _full(got))}


def _clip(name: str) -> dict[str, float]:
    """The returned norm and the clipped gradients against the single-process large batch."""
    data = w.regression_data(48)
    ref_model = Net()
    w.mean_loss(ref_model, data[:24]).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1e9).item()
    torch.nn.utils.clip_grad_norm_(ref_model.parameters(), ref_norm / 2)
    acc = ax.Accelerator(strategy=STRATEGIES[name](), precision="fp32", grad_accum_steps=3)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.setup(model, opt, DataLoader(data, batch_size=4))
    # The user's optimizer steps the parameters that really train (FSDP re-points it).
    trained = {id(p) for p in acc.unwrap(model).parameters()}
    repointed = all(id(p) in trained for p in opt.param_groups[0]["params"])
    for batch in loader:
        with acc.accumulate():
            acc.backward(w.mean_loss(model, batch))
            norm = acc.clip_grad_norm_(ref_norm / 2)
            if acc.sync_gradients:
                break
    grads = _full([p.grad for p in acc.unwrap(model).parameters()])
    return {"norm": abs(norm.item() - ref_norm), "is_plain": type(norm) is torch.Tensor,
            "clipped": w.max_diff([p.grad for p in ref_model.parameters()], grads),
            "repointed": repointed}


def _optimizer_state_bytes(strategy: Any) -> int:
    """Bytes of Adam's states this rank holds after one step."""
    acc = ax.Accelerator(strategy=strategy, precision="fp32")
    model = Net(width=32, blocks=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = acc.setup(model, opt)
    with acc.accumulate():
        acc.backward(w.mean_loss(model, w.regression_data(8)[:]))
        opt.step()
    inner = opt.optimizer
    inner = getattr(inner, "optim", inner)  # ZeroRedundancyOptimizer: its shard's optimizer
    tensors = [t.to_local() if isinstance(t, DTensor) else t
               for state in inner.state.values() for t in state.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _reduce_scatters(sync_each_microstep: bool) -> dict[str, Any]:
    """Counts FSDP2's gradient reduce-scatters (calls of dist.reduce_scatter_single, which
    fully_shard's default ReduceScatter uses) over 16 micro-steps with K=4, and checks the
    result against the reference."""
    data, model = w.regression_data(64), Net()
    ref = w.reference_params(model, data, 16, items=False)
    acc = ax.Accelerator(strategy=ax.FSDPStrategy(sync_each_microstep=sync_each_microstep),
                         precision="fp32", grad_accum_steps=4)
    opt = torch.optim.SGD(model.parameters(), lr=w.LR, momentum=w.MOMENTUM)
    model, opt, loader = acc.setup(model, opt, DataLoader(data, batch_size=2))
    calls: list[int] = []
    real = dist.reduce_scatter_single

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    with mock.patch.object(dist, "reduce_scatter_single", counting):
        for batch in loader:
            with acc.accumulate():
                acc.backward(w.mean_loss(model, batch))
                opt.step()
                opt.zero_grad()
    units = 4  # three blocks and the root
    return {"steps": acc.optimizer_steps, "per_unit": len(calls) / units,
            "diff": w.max_diff(ref, _full(list(acc.unwrap(model).parameters())))}


class _RecordingFSDP(ax.FSDPStrategy):
    """Records each rank's own overflow flag before the agreement."""

    def __init__(self) -> None:
        super().__init__()
        self.local_flags: list[float] = []

    def reduce_found_inf(self, found_inf: torch.Tensor) -> torch.Tensor:
        self.local_flags.append(float(found_inf.item()))
        return super().reduce_found_inf(found_inf)


def _overflow_on_one_rank(name: str) -> dict[str, Any]:
    """fp16, K=2, 4 windows: rank 1 overflows in windows 1 and 2.

    For FSDP the model is one Linear(6, 2) and the overflow reaches only its second output row,
    which lives in rank 1's shard: rank 0's shard stays finite, so only the all-reduced flag
    makes it skip.
    """
    sharded = name != "zero1"
    strategy = _RecordingFSDP() if sharded else ax.ZeRO1Strategy()
    acc = ax.Accelerator(strategy=strategy, precision="fp16-mixed", grad_accum_steps=2,
                         loss_scale=ax.DynamicLossScale(init_scale=1024.0, hysteresis=2))
    torch.manual_seed(0)
    model = nn.Linear(6, 2) if sharded else w.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, loader, sched = acc.setup(model, opt, DataLoader(w.regression_data(64),
                                                                  batch_size=4), sched)
    log = []
    for i, (x, y) in enumerate(loader):
        overflow = acc.rank == 1 and i // 2 in (1, 2) and i % 2 == 0
        before = [p.detach().clone() for p in model.parameters()]
        with acc.accumulate():
            out = model(x)
            if sharded:  # 1e5 * 1024 / 4 is past fp16's max in the output row's gradient
                loss = nn.functional.mse_loss(out[:, :1], y) + out[:, 1].mean() * (
                    1e5 if overflow else 1.0)
            else:
                loss = nn.functional.mse_loss(out, y) * (float("inf") if overflow else 1.0)
            acc.backward(loss)
            acc.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            after = list(model.parameters())
            changed = any(not torch.equal(a.detach(), b) for a, b in zip(after, before,
                                                                          strict=True))
            log.append((acc.step_was_skipped, changed, acc.loss_scale, sched.get_last_lr()[0]))
    local = strategy.local_flags if sharded else None
    return {"log": log, "steps": acc.optimizer_steps, "local_flags": local}


def _tied_gpt() -> float:
    """The recipe's GPT (token embedding tied to the output head, 2 blocks: as many as its 2
    embeddings, so auto wrap also picks the embeddings) under fsdp equals ddp."""
    from accumix.recipes.gpt import GPT, GPTConfig

    params = {}
    for name, strategy in (("ddp", "ddp"), ("fsdp", ax.FSDPStrategy())):
        acc = ax.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=2)
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=16))
        opt = torch.optim.SGD(model.parameters(), lr=w.LR, momentum=w.MOMENTUM)
        model, opt = acc.setup(model, opt)
        tokens = torch.randint(0, 256, (4, 2, 8), generator=torch.Generator().manual_seed(acc.rank))
        for idx in tokens:
            with acc.accumulate():
                acc.backward(*model(idx, labels=idx))
                opt.step()
                opt.zero_grad()
        params[name] = _full(list(acc.unwrap(model).parameters()))
    return w.max_diff(params["ddp"], params["fsdp"])


def _train_adam(strategy: Any, run_dir: Path, *, save_at: int | None = None,
                stop_at: int | None = None, load: bool = False
                ) -> tuple[ax.Accelerator, Any, list[torch.Tensor]]:
    """Adam + StepLR, K=2, 4 windows over 64 samples; saves at ``save_at`` optimizer steps,
    stops at ``stop_at``, or starts from the saved state."""
    acc = ax.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=2)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = DataLoader(w.regression_data(64), batch_size=4)
    model, opt, loader, sched = acc.setup(model, opt, loader, sched)
    if load:
        acc.load_state(run_dir)
    for batch in loader:
        with acc.accumulate():
            acc.backward(w.mean_loss(model, batch))
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients and acc.optimizer_steps == save_at:
            acc.save_state(run_dir)
        if acc.sync_gradients and acc.optimizer_steps == stop_at:
            break
    return acc, opt, _full(list(acc.unwrap(model).parameters()))


def _zero1_resume(out_dir: str) -> dict[str, Any]:
    """zero1 saves after 2 of 4 steps; a fresh zero1 and a fresh ddp resume from it."""
    run_dir = Path(out_dir) / "zero1-run"
    _, opt, whole = _train_adam(ax.ZeRO1Strategy(), run_dir, save_at=2)
    out: dict[str, Any] = {}
    for name, strategy in (("zero1", ax.ZeRO1Strategy()), ("ddp", "ddp")):
        acc, resumed_opt, got = _train_adam(strategy, run_dir, load=True)
        out[name] = (w.max_diff(whole, got), acc.optimizer_steps,
                     resumed_opt.param_groups[0]["lr"])
    # What a one-process load must find: ddp's (unsharded) Adam state and parameters at step 2.
    _, ddp_opt, params = _train_adam("ddp", run_dir, stop_at=2)
    # As lists: tensors in a spawned rank's result are shared by file descriptor, which dies
    # with the rank.
    state = {i: {k: v.tolist() for k, v in entry.items()}
             for i, entry in ddp_opt.state_dict()["state"].items()}
    out["step2"] = (state, [p.tolist() for p in params])
    return out


def _all_checks(out_dir: str) -> dict[str, Any]:
    return {
        "zero1_resume": _zero1_resume(out_dir),
        "equivalence": _equivalence(out_dir),
        "auto": _auto_picks_fsdp_full(),
        "tied": _tied_gpt(),
        "clip": {name: _clip(name) for name in ("zero1", "fsdp-full")},
        "state_bytes": {"ddp": _optimizer_state_bytes("ddp"),
                        "zero1": _optimizer_state_bytes(ax.ZeRO1Strategy()),
                        "fsdp": _optimizer_state_bytes(ax.FSDPStrategy())},
        "reduce_scatters": {each: _reduce_scatters(each) for each in (False, True)},
        "overflow": {name: _overflow_on_one_rank(name) for name in ("zero1", "fsdp-full")},
    }


def test_sharded_strategies_two_ranks(tmp_path: Path) -> None:
    results = spawn(_all_checks, nprocs=2, args=(str(tmp_path),))
    for rank, r in enumerate(results):
        # zero1 resumes exactly into zero1 and into ddp (same checkpoint format); the lr the
        # scheduler set after 4 steps (0.01 / 2**4) reached the optimizer that steps.
        for name in ("zero1", "ddp"):
            assert r["zero1_resume"][name] == (r["zero1_resume"][name][0], 4, 0.01 / 16), r
            assert r["zero1_resume"][name][0] < TOL, (rank, name, r["zero1_resume"])
        eq = r["equivalence"]
        for name in (*STRATEGIES, *VARIANTS):
            diff, steps = eq[f"{name}/mean"]
            assert diff < TOL and steps == 4, (rank, name, eq[f"{name}/mean"])
            if name in STRATEGIES:
                diff, steps = eq[f"{name}/items"]
                assert diff < TOL and steps == 4, (rank, name, eq[f"{name}/items"])
            if rank == 0:
                assert eq[f"{name}/saved_keys"], name
                assert eq[f"{name}/saved"] < TOL, (name, eq[f"{name}/saved"])
        assert r["auto"]["chosen"] == ("fsdp", "full", False), r["auto"]
        assert r["auto"]["diff"] < TOL, r["auto"]
        assert r["tied"] < TOL, (rank, r["tied"])
        for name, clip in r["clip"].items():
            assert clip["norm"] < 1e-5 and clip["clipped"] < TOL, (rank, name, clip)
            assert clip["is_plain"] and clip["repointed"], (rank, name, clip)
        ddp_bytes = r["state_bytes"]["ddp"]
        for name in ("zero1", "fsdp"):
            ratio = r["state_bytes"][name] / ddp_bytes
            assert 0.45 <= ratio <= 0.55, (rank, name, r["state_bytes"])
        # 64 samples / 2 ranks / micro 2 = 16 micro-steps, K=4: 4 optimizer steps; each FSDP
        # unit reduce-scatters once per step, or on every micro-step when asked to.
        assert r["reduce_scatters"][False] == {"steps": 4, "per_unit": 4.0,
                                               "diff": r["reduce_scatters"][False]["diff"]}
        assert r["reduce_scatters"][True]["per_unit"] == 16.0
        for each in (False, True):
            assert r["reduce_scatters"][each]["diff"] < TOL, r["reduce_scatters"]
        for name, over in r["overflow"].items():
            # windows: clean, inf (absorbed by hysteresis), inf (scale halves), clean
            assert [e[0] for e in over["log"]] == [False, True, True, False], (rank, name, over)
            assert [e[1] for e in over["log"]] == [True, False, False, True], (rank, name, over)
            assert [e[2] for e in over["log"]] == [1024.0, 1024.0, 512.0, 512.0], over
            assert [e[3] for e in over["log"]] == [0.05, 0.05, 0.05, 0.025], over
            assert over["steps"] == 2
    # Only rank 1's shard saw the FSDP overflow: the agreement is what made rank 0 skip.
    assert [f > 0 for f in results[0]["overflow"]["fsdp-full"]["local_flags"]] == [False] * 4
    assert [f > 0 for f in results[1]["overflow"]["fsdp-full"]["local_flags"]] == [
        False, True, True, False]
    for name in ("zero1", "fsdp-full"):
        assert results[0]["overflow"][name]["log"] == results[1]["overflow"][name]["log"]

    _zero1_checkpoint_loads_on_one_process(tmp_path, *results[0]["zero1_resume"]["step2"])


def _zero1_checkpoint_loads_on_one_process(tmp_path: Path, state: dict[int, Any],
                                           params: list[Any]) -> None:
    """The 2-rank zero1 checkpoint (each rank wrote its shard's Adam states) into this one
    process: every parameter's state and value as ddp had them at that step."""
    acc = ax.Accelerator(strategy="zero1", precision="fp32", grad_accum_steps=2)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = DataLoader(w.regression_data(64), batch_size=4)
    model, opt, loader, sched = acc.setup(model, opt, loader, sched)
    acc.load_state(tmp_path / "zero1-run")
    assert acc.optimizer_steps == 2 and opt.param_groups[0]["lr"] == 0.01 / 4
    assert w.max_diff([torch.tensor(p) for p in params], list(model.parameters())) < TOL
    loaded = opt.state_dict()["state"]
    assert sorted(loaded) == sorted(state)
    for index, entry in state.items():
        for key, value in entry.items():
            assert torch.allclose(loaded[index][key], torch.tensor(value), atol=TOL, rtol=0), (
                index, key)
