"""``micro_batch_size="auto"`` on one CPU process: against ``memory_limit=`` the largest candidate
whose measured peak fits is chosen and the next one up does not fit (item and mean modes); the
measured peak is the process's real peak RSS growth; the loader is re-batched, K follows; bad
input is a one-line ConfigError."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax
from accumix.errors import ConfigError
from accumix.memory.micro_batch_cache import CACHE_FILE
from accumix.memory.micro_batch_probe import _far_over, measure
from tests.frozen_heap import frozen_heap
from tests.oom_injection import LogLines

GLOBAL = 24  # candidates on one rank: 1, 2, 3, 4, 6, 8, 12, 24


@pytest.fixture(autouse=True)
def _frozen_heap() -> Iterator[None]:
    with frozen_heap():  # the probes' garbage passes see this test's objects only
        yield


class Wide(nn.Module):
    """Few parameters, ``width`` KB of activations per row (5 MB at 4096): the peak grows with
    the rows."""

    def __init__(self, width: int = 1024) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(64, 64)
        self.scale = nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self.lin(x)).unsqueeze(-1) * self.scale).square()


def _set_up(width: int = 1024, **kwargs: object) -> tuple[ax.Accelerator, nn.Module, object]:
    acc = ax.Accelerator(global_batch_size=GLOBAL, micro_batch_size="auto", **kwargs)
    net = Wide(width)
    model, optimizer = acc.setup(net, torch.optim.AdamW(net.parameters()))
    return acc, model, optimizer


def _make(n: int) -> torch.Tensor:
    return torch.randn(n, 64)


def test_cpu_memory_limit_chooses_the_largest_measured_fit(tmp_path: Path) -> None:
    steps = {"mean": lambda model: lambda x: model(x).mean(),
             "items": lambda model: lambda x: (model(x).sum(), x.shape[0])}
    for mode, step_of in steps.items():  # the modes' peaks differ (mean's backward expands)
        acc, model, _ = _set_up()
        peaks = {n: measure(acc._run, step_of(model), _make, n).peak for n in (6, 8)}
        limit = int((peaks[6] + peaks[8]) / 2 / 0.9)  # 6 fits with 10% headroom, 8 does not
        assert peaks[6] <= 0.9 * limit < peaks[8]
        acc, model, _ = _set_up(memory_limit=limit)
        asked: list[int] = []
        assert acc.find_micro_batch_size(step_of(model), lambda n, a=asked: a.append(n) or _make(n),
                                         run_dir=tmp_path / mode) == 6, mode
        # make_batch(1) keys the cache; on CPU the two smallest sizes are probed first (their
        # peaks predict the others), then bisection: 6 fits, 8 does not.
        assert asked[:3] == [1, 1, 2] and {6, 8} <= set(asked) and max(asked) <= 12, mode
        choice = acc.micro_batch_choice
        assert (choice.grad_accum_steps, choice.limit_bytes) == (4, limit)
        assert choice.peak_bytes <= 0.9 * limit
        assert len(json.loads((tmp_path / mode / CACHE_FILE).read_text())) == 1
    data = TensorDataset(torch.randn(48, 64))
    loader = acc.setup(DataLoader(data, batch_size=5, shuffle=True))
    assert (loader.batch_size, acc.grad_accum_steps, len(loader)) == (6, 4, 8)


def test_cpu_never_runs_a_size_predicted_far_past_the_limit() -> None:
    """Peaks 100 and 150 bytes at 1 and 2 rows: 50 a row; budget 900 (1000 less 10%)."""
    results = {1: [[0.0, 100.0, 1000.0], [0.0, 100.0, 1000.0]],
               2: [[0.0, 150.0, 1000.0], [0.0, 150.0, 1000.0]]}
    assert not _far_over(results, 32, 0.1)  # 100 + 31 x 50 = 1650 < 2 x 900
    assert _far_over(results, 64, 0.1)  # 3250
    results[2][1][1] = 900.0  # one rank's rows are costlier: it decides for all
    assert _far_over(results, 4, 0.1)  # 100 + 3 x 800 = 2500
    assert not _far_over({1: results[1]}, 64, 0.1)  # nothing to predict from yet


def test_measured_peak_is_the_real_peak_rss_growth() -> None:
    script = f"""
import sys; sys.path.insert(0, {str(Path(__file__).parents[2])!r})
import torch
from tests.unit.test_micro_batch_auto import _make, _set_up
from accumix.memory.micro_batch_probe import _far_over, measure
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
acc, model, _ = _set_up(4096)
step = lambda x: model(x).mean()
measure(acc._run, step, _make, 2)  # warm up: first-call allocations are not the step's
before = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
meter = measure(acc._run, step, _make, 40)
print(meter.growth, status("VmHWM:") - before)
# An optimizer step updating states that exist already (issue 38): only its temporaries grow
from accumix.memory.peak_memory import PeakMeter
net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
opt = torch.optim.AdamW(net.parameters())
for _ in range(2):
    net(torch.randn(8, 1024)).square().mean().backward()
    opt.step()
net(torch.randn(8, 1024)).square().mean().backward()
meter = PeakMeter(torch.device("cpu"))
with meter.measure():
    before = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    opt.step()
    rss = status("VmHWM:") - before
print(meter.growth, rss)
"""
    # Large blocks mapped and unmapped at once: the resident set follows the tensors.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env=env).stdout.split()
    measured, rss = int(out[-4]), int(out[-3])
    assert rss > 150 * 2**20  # the step really grew the process (5 MB a row x 40)
    assert 0.9 < measured / rss < 1.1, (measured, rss)
    # 16.8 MB of parameters, 33.6 MB of states: the single-tensor step's temporaries, one
    # parameter's at a time (4.2 MB each); the meter said 50.3 MB (every state counted again)
    measured, rss = int(out[-2]), int(out[-1])
    assert measured < 10 * 2**20 and abs(measured - rss) < 2 * 2**20, (measured, rss)


def test_bad_input_is_one_line_config_error() -> None:
    with pytest.raises(ax.ConfigError, match="needs global_batch_size"):
        ax.Accelerator(micro_batch_size="auto")
    with pytest.raises(ax.ConfigError, match="'large' is invalid"):
        ax.Accelerator(global_batch_size=8, micro_batch_size="large")
    with pytest.raises(ax.ConfigError, match="above the device's"):
        ax.Accelerator(global_batch_size=8, micro_batch_size="auto", memory_limit=2**62)
    acc, model, _ = _set_up(memory_limit=2**20)  # below the model with one row
    with pytest.raises(ax.ConfigError, match="not chosen yet") as error:
        acc.setup(DataLoader(TensorDataset(torch.randn(4, 64)), batch_size=2))
    assert "\n" not in str(error.value)
    with pytest.raises(ax.ConfigError, match="not even a micro-batch of 1 fits") as error:
        acc.find_micro_batch_size(lambda x: model(x).mean(), _make)
    assert "\n" not in str(error.value)
    with pytest.raises(ax.ConfigError, match="headroom"):
        acc.find_micro_batch_size(lambda x: model(x).mean(), _make, headroom=1.5)
    acc = ax.Accelerator(grad_accum_steps=2, global_batch_size=GLOBAL, micro_batch_size="auto",
                         memory_limit=np.int64(2**30))  # a numpy number is a number
    net = Wide()
    model, _ = acc.setup(net, torch.optim.SGD(net.parameters()))
    with pytest.raises(ax.ConfigError, match="grad_accum_steps=2 with micro_batch_size='auto'"):
        acc.find_micro_batch_size(lambda x: model(x).mean(), _make)


def test_recipe_auto_then_an_elastic_restart_on_two_ranks(tmp_path: Path) -> None:
    """``accumix train micro_batch_size=auto``: one rank chooses 8 of 16 (K=2) under a limit,
    checkpoints; the restart on 2 ranks keeps global 16, probes again (another world: another
    cache key) and derives K=1. The one-rank run is the command's ``main`` in this process (a
    run with nproc=1 trains in the process that parses the command); the restart is the
    command itself, which launches its 2 ranks."""
    from accumix.cli.main import main

    tiny = ["model.n_layer=1", "model.n_embd=64", "model.n_head=2", "model.block_size=64",
            "data.max_files=20", "data.max_val_bytes=2000", "sample.max_new_tokens=0",
            "optimizer.warmup_steps=1", "global_batch_size=16", "micro_batch_size=auto",
            "memory_limit=7000000", "progress_bar=false", "plot=false", "eval_every=null",
            f"output_dir={tmp_path}"]
    for key in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS"):
        os.environ.pop(key, None)  # conftest puts the environment back
    logger, handler = logging.getLogger("accumix"), LogLines()
    level = logger.level  # under pytest (root handlers) accumix adds no handler of its own
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        assert main(["train", *tiny, "max_steps=1", "checkpoint_every=1", "nproc=1"]) == 0
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    done = subprocess.run(
        [sys.executable, "-m", "accumix.cli.main", "train", *tiny, "max_steps=2",
         "checkpoint_every=2", "nproc=2"], capture_output=True, text=True, timeout=240,
        env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in [*handler.lines, *done.stderr.splitlines()]
             if "micro_batch_size=auto chose" in line]
    assert "micro_batch_size=auto chose 8 (K=2 on 1 rank, global 16): peak" in lines[0]
    assert "micro_batch_size=auto chose 8 (K=1 on 2 ranks, global 16): peak" in lines[1]
    assert len(json.loads((tmp_path / CACHE_FILE).read_text())) == 2
    assert [r.split(",")[0] for r in (tmp_path / "metrics.csv").read_text().split()[1:]] == [
        "1", "2"]


def test_trainer_chooses_with_nothing_more_and_equals_the_explicit_run() -> None:
    """The Trainer probes with its step_fn (which draws noise: the probe must give the RNG
    back) on the loader's largest sample (reading samples draws too: augmentation), re-batches
    the loader and trains as the run given the chosen size does, bitwise."""
    from accumix.trainer import Trainer

    class Augmented(TensorDataset):
        def __getitem__(self, i: int) -> tuple[torch.Tensor]:
            return (self.tensors[0][i] + 0.1 * torch.randn(64),)

    def noisy(model: nn.Module, batch: tuple[torch.Tensor]) -> torch.Tensor:
        return model(batch[0] + 0.1 * torch.randn_like(batch[0])).mean()

    weights = []
    for micro in ("auto", GLOBAL):
        acc = ax.Accelerator(global_batch_size=GLOBAL, micro_batch_size=micro, seed=0)
        net = Wide(64)
        data = Augmented(torch.randn(48, 64, generator=torch.Generator().manual_seed(1)))
        trainer = Trainer(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=0.1),
                          train_loader=DataLoader(data, batch_size=5 if micro == "auto" else
                                                  micro, shuffle=True),
                          accelerator=acc, step_fn=noisy, max_steps=2, progress_bar=False)
        trainer.fit()
        assert (acc.grad_accum_steps, trainer.train_loader.batch_size) == (1, GLOBAL)
        weights.append(acc.unwrap(trainer.model).scale.detach().clone())
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], Wide(64).scale)


def test_estimate_memory_shows_the_choice_without_training(
        capsys: pytest.CaptureFixture[str]) -> None:
    from accumix.cli.main import main

    assert main(["estimate-memory", "model.n_layer=1", "model.n_embd=64", "model.n_head=2",
                 "model.block_size=64", "global_batch_size=16", "micro_batch_size=auto",
                 "memory_limit=7000000", "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "micro_batch_size=auto chose 8 (K=2 on 1 rank, global 16): peak" in out
    assert "micro batch 8 x 64 tokens" in out


def test_probe_keeps_a_window_in_progress_and_every_state() -> None:
    """Probed mid-window after an Adam step (state, a scheduler, BatchNorm, eval mode): the
    gradients already accumulated come back as the same tensors with the same values, and
    nothing else moves (a plain torch copy taken before is the reference)."""
    acc = ax.Accelerator(global_batch_size=GLOBAL, micro_batch_size="auto", memory_limit=2**30)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 1))
    adam = torch.optim.Adam(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(adam, 1, gamma=0.5)
    model, optimizer = acc.setup(net, adam)
    model(_make(4)).mean().backward()
    adam.step()
    scheduler.step()
    model.eval()
    model(_make(4)).sum().backward()  # the window in progress
    grads = {name: p.grad for name, p in model.named_parameters()}
    before = [copy.deepcopy(x) for x in (grads, adam.state_dict(), scheduler.state_dict(),
                                         model.state_dict(), torch.get_rng_state())]
    acc.find_micro_batch_size(lambda x: model(x).mean(), _make)
    for name, p in model.named_parameters():
        assert p.grad is grads[name] and torch.equal(p.grad, before[0][name]), name
    assert _same(adam.state_dict(), before[1])
    assert scheduler.state_dict() == before[2] and not model.training
    assert _same(model.state_dict(), before[3]) and torch.equal(torch.get_rng_state(), before[4])


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class Narrow(Wide):
    """Wide(1024)'s parameter count (64 x 48 + 48 + 2064 = 5184) in other shapes: 48 x 2064
    activations a row instead of 64 x 1024."""

    def __init__(self) -> None:
        super().__init__(2064)
        self.lin = nn.Linear(64, 48)


def test_cache_is_not_reused_for_other_shapes_or_dtype(tmp_path: Path) -> None:
    """Same parameter count, other shapes (Narrow) or dtype (float64): probed again, and the
    answer is the one a run without the cache chooses (4 for both)."""
    chosen = []
    for make in (Wide, Narrow, lambda: Wide().double()):
        acc = ax.Accelerator(global_batch_size=GLOBAL, micro_batch_size="auto",
                             memory_limit=12_000_000)
        net = make()
        model, _ = acc.setup(net, torch.optim.SGD(net.parameters()))
        dtype = next(net.parameters()).dtype
        step = (lambda m, t: lambda x: m(x.to(t)).mean())(model, dtype)
        acc.find_micro_batch_size(step, _make, run_dir=tmp_path)
        choice = acc.micro_batch_choice
        chosen.append((choice.micro_batch_size, choice.probes > 0))
    # Wide: 8 fits, 12 does not; the others need more a row: 4 (what each chooses without a
    # cache). Each probed (True) again: the old key (parameter count) reused 8 for Narrow.
    assert chosen == [(8, True), (4, True), (4, True)]
    assert len(json.loads((tmp_path / CACHE_FILE).read_text())) == 3


def test_deepspeed_reduction_buckets_count_what_each_device_holds() -> None:
    """A GPU's allocator holds ZeRO's whole 5e8-element bucket (two with ``overlap_comm``); on
    CPU only the elements its hooks write become resident (at most the trainable ones)."""
    from accumix.strategies.deepspeed_probe import bucket_elements

    big = 500_000_000
    assert bucket_elements(big, 400, overlap_comm=False, resident_when_written=False) == [big]
    assert bucket_elements(big, 400, overlap_comm=True, resident_when_written=False) == [big, big]
    assert bucket_elements(big, 400, overlap_comm=True, resident_when_written=True) == [400]
    assert bucket_elements(100, 400, overlap_comm=False, resident_when_written=True) == [100]
    assert bucket_elements(100, 400, overlap_comm=True, resident_when_written=True) == [100, 100]


def test_cache_is_not_reused_for_other_strategy_settings(tmp_path: Path) -> None:
    """The cached answer is keyed by the strategy's memory settings (FSDP's activation
    checkpointing here; DeepSpeed's bucket sizes): a restart that changes them probes again
    (before, it reused the answer with 0 probes); the same settings reuse it."""
    probes = []
    for checkpointing in (True, False, False):
        acc = ax.Accelerator(strategy=ax.FSDPStrategy(activation_checkpointing=checkpointing),
                             global_batch_size=GLOBAL, micro_batch_size="auto",
                             memory_limit=12_000_000)
        net = Wide()
        model, _ = acc.setup(net, torch.optim.SGD(net.parameters()))
        acc.find_micro_batch_size(lambda x, m=model: m(x).mean(), _make, run_dir=tmp_path)
        probes.append(acc.micro_batch_choice.probes > 0)
        acc.end()
    assert probes == [True, True, False]
    assert len(json.loads((tmp_path / CACHE_FILE).read_text())) == 2


def test_a_size_the_step_refuses_is_left_out_and_named() -> None:
    """BatchNorm refuses 1 row: when no larger size fits, the answer is the one-line
    ConfigError naming the smallest runnable size and what 1 row raised (before: the model's
    own ``ValueError`` from probing 1 row, as if the model were broken)."""
    acc = ax.Accelerator(global_batch_size=GLOBAL, micro_batch_size="auto", memory_limit=1000)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16))
    model, _ = acc.setup(net, torch.optim.SGD(net.parameters()))
    with pytest.raises(ConfigError, match=r"not even a micro-batch of 2 fits in memory_limit=1000 "
                       r".*; 1 row\(s\) raised ValueError: Expected more than 1 value"):
        acc.find_micro_batch_size(lambda x: model(x).mean(), _make)
