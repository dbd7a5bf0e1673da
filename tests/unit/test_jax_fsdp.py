"""accumix.jax fsdp: gathered at the use, two gradient modes, and the JAX memory model.

Exactness, fp16 skip agreement and the HLO placement run on conftest's 2 host devices; the
4-device memory job runs in one subprocess (XLA_FLAGS must be set before jax is imported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

jax = pytest.importorskip("jax")

import accumix.jax as axj  # noqa: E402
from accumix.errors import ConfigError  # noqa: E402
from accumix.jax.hlo import collective_counts  # noqa: E402
from tests import jax_workloads as w  # noqa: E402
from tests.scripts import jax_fsdp_memory as job  # noqa: E402
from tests.xla_flags import xla_flags  # noqa: E402

K = 4
ROOT = Path(__file__).resolve().parents[2]


def run(strategy, windows, *, items=True, precision="fp32", loss_scale=None):
    acc = axj.Accelerator(strategy=strategy, precision=precision, grad_accum_steps=K,
                          loss_scale=loss_scale)
    state = acc.setup(w.init_params(), w.optimizer())
    step = acc.train_step(w.item_loss if items else w.mean_loss, clip_norm=0.5)
    skipped = []
    for window in windows:
        state, metrics = step(state, window)
        skipped.append(bool(metrics["skipped"]))
    return acc, state, step, skipped


def windows_of(batches):
    return [batches[i:i + K] for i in range(0, len(batches), K)]


def test_sync_each_microstep_equals_the_large_batch_items_and_mean() -> None:
    windows = windows_of(w.micro_batches(3 * K))
    for items in (True, False):
        _, state, _, _ = run(axj.FSDPStrategy(sync_each_microstep=True), windows, items=items)
        assert w.max_diff(state.params, w.reference(windows, items=items, clip_norm=0.5)) < 1e-6
        assert int(state.step) == 3
        assert state.params["hidden"]["w"].sharding.spec == jax.sharding.PartitionSpec(
            None, "data")


def test_fp16_overflow_in_one_device_skips_alike_in_both_fsdp_modes() -> None:
    """An overflow only in rows of device 1: ddp and both fsdp modes skip the same window and
    end equal (item mode weighs each device's gradient by its own count before the sum)."""
    windows = windows_of(w.micro_batches(3 * K))
    windows[1][1]["y"][3, 0], windows[1][1]["mask"][3, 0] = 1e25, 1.0  # row 3: device 1
    ends = {}
    for name, strategy in (("ddp", "ddp"), ("fsdp", axj.FSDPStrategy()),
                           ("sync", axj.FSDPStrategy(sync_each_microstep=True))):
        with pytest.warns(UserWarning, match="emulated"):
            _, state, _, skipped = run(strategy, windows, precision="fp16-mixed",
                                       loss_scale=axj.DynamicLossScale(init_scale=8.0,
                                                                       hysteresis=1))
        assert skipped == [False, True, False], name
        assert int(state.step) == 2
        ends[name] = state.params
    assert w.max_diff(ends["fsdp"], ends["ddp"]) < 1e-6
    assert w.max_diff(ends["sync"], ends["ddp"]) < 1e-6


@pytest.mark.parametrize("sync", [False, True])
def test_where_each_modes_collectives_are(sync) -> None:
    """Default: gathers in the scan body (at each use, per micro-step), the gradient
    reduce-scatter once outside it; sync_each_microstep: the reduce-scatter inside the body.

    The gathers: one per use in the forward (hidden w, hidden b, out w) and one per use whose
    backward needs the value: out w (for the hidden activation's cotangent). The hidden w's
    backward needs only the input and the biases' adds need no value, so XLA drops those
    re-gathers. Before per-use gathering the re-gathers were merged with the forward's (3)."""
    acc, state, step, _ = run(axj.FSDPStrategy(sync_each_microstep=sync), [])
    counts = collective_counts(step.lower(state, acc.window(w.micro_batches(K))).compile()
                               .as_text())
    sharded = sum(x.sharding.spec != jax.sharding.PartitionSpec()
                  for x in jax.tree.leaves(state.params))
    assert sharded == 3  # the two weights and the hidden bias; the output bias (1,) is not
    assert counts["in_loop"]["all-gather"] == sharded + 1, counts  # at each use, per micro-step
    assert counts["outside"]["all-gather"] == 0, counts  # nothing gathered for the window
    if sync:
        assert counts["in_loop"]["reduce-scatter"] == sharded, counts
        assert counts["outside"]["reduce-scatter"] == 0, counts
    else:
        assert counts["in_loop"]["reduce-scatter"] == 0, counts
        assert counts["in_loop"]["all-reduce"] == 0, counts
        assert counts["outside"]["reduce-scatter"] == sharded, counts


def test_sync_each_microstep_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="sync_each_microstep"):
        axj.FSDPStrategy(sync_each_microstep="yes")


def test_memory_model_matches_the_compiled_step_on_2_devices() -> None:
    # Before issue 21's follow-up: fp16-mixed zero1 -16% and fsdp -18% (the loss scale's skip
    # select), bf16-true single/ddp +11% and fsdp-sync +16% (Adam's moments sized in float32).
    # After the per-use gather merged (terms measured for the old gather): fp16-mixed fsdp
    # +16%, bf16-true zero1 +14% and fsdp +11% (re-measured: accumix.jax.memory's docstring).
    for precision in ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true"):
        for word in ("single", "ddp", "zero1", "fsdp", "fsdp-sync"):
            got = job.measure(word, precision, 2)
            assert abs(got["model"] / got["measured"] - 1) < 0.10, (word, precision, got)
    # 8 layers: bf16-true fsdp-sync was -12% (each use's saved 16-bit shard, uncounted).
    got = job.measure("fsdp-sync", "bf16-true", 8)
    assert abs(got["model"] / got["measured"] - 1) < 0.10, got


def test_fsdp_memory_on_4_devices(tmp_path: Path) -> None:
    """The issue's job (8 layers of 512x512, Adam, K=16) on 4 host devices: the model within
    10% everywhere, and what fsdp saves against ddp (arguments + temporaries per device)."""
    jobs = [f"{s}/{p}/8" for p in ("fp32", "bf16-mixed")
            for s in ("ddp", "zero1", "fsdp", "fsdp-sync")]
    # Every other precision on the sharded strategies (before: fp16-mixed zero1 -11%, fsdp
    # -16%; bf16-true fsdp-sync +16%).
    jobs += [f"{s}/{p}/8" for p in ("fp16-mixed", "bf16-true") for s in ("zero1", "fsdp",
                                                                        "fsdp-sync")]
    # 2 layers, where the one-leaf terms weigh most (before the terms were re-measured for the
    # per-use gather: zero1 +11% to +16%, fsdp +14% to +22%).
    jobs += [f"{s}/{p}/2" for p in ("bf16-mixed", "fp16-mixed", "bf16-true")
             for s in ("zero1", "fsdp")]
    jobs += ["ddp/fp32/16", "fsdp/fp32/16", "fsdp-sync/fp32/16"]
    jobs += ["ddp/fp32/8/scan", "fsdp/fp32/8/scan", "fsdp-sync/fp32/8/scan"]  # stacked, scanned
    # Issue 30: the flax GPT (d=256, T=64, 2 rows per device, K=4), unrolled and under nn.scan,
    # and what plain JAX keeps for one micro-batch's backward (its activations).
    jobs += [f"{s}/fp32/8/gpt" for s in ("ddp", "fsdp", "fsdp-sync", "plain")]
    jobs += [f"{s}/fp32/8/gpt-scan" for s in ("ddp", "fsdp", "plain")]
    jobs += ["hsdp/fp32/8", "hsdp-defer/fp32/8"]  # issue 32: 2 replicas of 2 devices
    got = _measure_in_parallel(jobs, tmp_path)
    for name, row in got.items():  # the model counts a stacked leaf as gathered whole
        assert name.endswith(("/scan", "gpt", "gpt-scan")) or abs(
            row["model"] / row["measured"] - 1) < 0.10, (name, row)
    ddp = got["ddp/fp32/8"]["measured"]
    # Gathered for the window: fsdp 0.75x of ddp; gathered at use under one checkpoint (every
    # re-gather merged with the forward's): 0.58x and 0.41x; gathered at each use (per_use.py):
    # 0.42x and 0.27x (0.40x is the floor with full-size float32 accumulators).
    assert got["fsdp/fp32/8"]["measured"] <= 0.50 * ddp, got
    assert got["fsdp-sync/fp32/8"]["measured"] <= 0.30 * ddp, got
    assert got["zero1/fp32/8"]["measured"] < 0.75 * ddp, got
    # hsdp: fsdp over a node's 2 devices (measured 0.51x of ddp, the model -7%; defer 0.57x,
    # -1%): below ddp, and the model within 10% (above).
    assert got["hsdp/fp32/8"]["measured"] <= 0.55 * ddp, got
    assert got["hsdp-defer/fp32/8"]["measured"] <= 0.60 * ddp, got
    # 8 more layers add their shards, accumulators and Adam state, and the activations their
    # backward keeps (a row block each, twice at most), never a gathered copy of the model.
    n = job.WIDTH * job.WIDTH + job.WIDTH  # one layer's elements; its shard is n / 4
    activations = 8 * 2 * job.ROWS * job.WIDTH * 4
    for mode, accumulators in (("fsdp", 4 * n), ("fsdp-sync", n)):
        state = 8 * (n + accumulators + 2 * n)  # params n/4 x 4 B, Adam 2 x n/4 x 4 B
        growth = got[f"{mode}/fp32/16"]["measured"] - got[f"{mode}/fp32/8"]["measured"]
        assert growth <= state + activations, (mode, growth, state, got)
    # Scanned layers: each slice gathered per iteration inside the body (sync 0.36x; gathered
    # whole for the scan, as before per_use.scan, 0.83x). The default mode held 0.65x: the
    # scan's backward stacked every iteration's gradient (a second full float32 stack) and
    # the reduce-scatter copied the stack whole into its layout; now each iteration's
    # gradient joins its accumulator slice in the scan's backward and the stack is scattered
    # slice by slice: 0.43x, sync 0.27x.
    scan_ddp = got["ddp/fp32/8/scan"]["measured"]
    assert got["fsdp/fp32/8/scan"]["measured"] <= 0.50 * scan_ddp, got
    assert got["fsdp-sync/fp32/8/scan"]["measured"] <= 0.30 * scan_ddp, got
    _assert_the_gpt_at_its_floor(got)


def _measure_in_parallel(jobs: list[str], tmp_path: Path) -> dict:
    """``tests/scripts/jax_fsdp_memory.py`` on 4 host devices, the jobs split over two
    processes that compile side by side (one XLA compile keeps one core busy; CI has two): the
    flax GPT's rows in one, the rest in the other (about equal compile times)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(4),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    groups = [[j for j in jobs if j.endswith("/gpt")],
              [j for j in jobs if not j.endswith("/gpt")]]
    running = []
    try:
        for i, group in enumerate(groups):
            with (tmp_path / f"out{i}").open("w") as out, (tmp_path / f"err{i}").open("w") as err:
                running.append(subprocess.Popen(
                    [sys.executable, "tests/scripts/jax_fsdp_memory.py", *group], cwd=ROOT,
                    env=env, stdout=out, stderr=err))
        for proc in running:
            proc.wait(timeout=600)
    finally:
        for proc in running:
            proc.kill()
    got: dict = {}
    for i, proc in enumerate(running):
        assert proc.returncode == 0, (tmp_path / f"err{i}").read_text()[-2000:]
        got.update(json.loads((tmp_path / f"out{i}").read_text().strip().splitlines()[-1]))
    assert sorted(got) == sorted(jobs)
    return got


def _assert_the_gpt_at_its_floor(got: dict) -> None:
    """Issue 30, on the flax GPT (8 layers, 2 rows per device): fsdp held 0.58x of ddp, sync
    0.45x (0.60x and 0.49x at 2 layers), scanned 0.70x. Where it goes: fsdp's peak is the
    start of the backward, every layer's activations alive beside the sharded state (and the
    default mode's full-size accumulators). Its modelled state plus plain JAX's ``temp_size``
    for one micro-batch (0.50x, 0.37x) is a floor from below: plain's ``temp_size`` leaves out
    the activations XLA keeps in the gradients' output buffers. Read from XLA's live-range
    dump (bench/jax_fsdp_peak.py, checked by test_bench_jax_smoke.py), the floor is 0.508x
    and 0.385x, so the issue's 0.50x and 0.35x are below it. fsdp now holds 0.53x and 0.40x,
    within 4% of ddp's bytes of the lower floor (was 9%: a copy of each shard saved per use,
    a layout copy of every shard split on a later dimension); scanned, 0.53x, at its floor
    (the stacked per-iteration gradients gone; a scan keeps more activations)."""
    ddp = got["ddp/fp32/8/gpt"]["measured"]
    plain = got["plain/fp32/8/gpt"]["measured"]
    for mode, floor_at_least, now in (("fsdp", 0.49, 0.54), ("fsdp-sync", 0.35, 0.41)):
        row = got[f"{mode}/fp32/8/gpt"]
        floor = row["model"] + plain
        assert floor > floor_at_least * ddp, (mode, floor / ddp, got)
        assert row["measured"] <= now * ddp, (mode, row["measured"] / ddp, got)
        assert row["measured"] - floor <= 0.04 * ddp, (mode, (row["measured"] - floor) / ddp)
    scan_ddp, scan = got["ddp/fp32/8/gpt-scan"]["measured"], got["fsdp/fp32/8/gpt-scan"]
    floor = scan["model"] + got["plain/fp32/8/gpt-scan"]["measured"]
    assert floor > 0.50 * scan_ddp and scan["measured"] <= 0.54 * scan_ddp, (floor, got)
    assert scan["measured"] - floor <= 0.02 * scan_ddp, (scan, floor, scan_ddp)
