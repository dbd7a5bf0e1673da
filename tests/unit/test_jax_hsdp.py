"""accumix.jax hsdp (issue 32) and reduce_dtype (issue 33).

One subprocess runs ``tests/scripts/jax_hsdp.py`` on 4 host devices as 2 simulated nodes of 2
(XLA_FLAGS must be set before jax is imported): exactness, the compiled HLO's placement and
bytes, checkpoints across layouts, the lowered HLO's 16-bit operands, the error against float64,
an fp16 overflow on the wire, item mode on an fp16 wire. The rest runs on conftest's 2 devices
and compiles nothing.
(The 2-process job, ``tests/distributed/test_jax_processes.py``, trains hsdp with
``replicas=None`` over 2 processes; the memory against ``memory_analysis()`` is in
``test_jax_fsdp.py``'s 4-device job.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import accumix.jax as axj  # noqa: E402
from accumix.errors import ConfigError  # noqa: E402
from accumix.jax.hlo import collective_ops  # noqa: E402
from accumix.jax.memory import estimate_jax_memory, first_fitting  # noqa: E402
from accumix.jax.wire import Wire  # noqa: E402
from tests.xla_flags import xla_flags  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _float_across(placement: dict) -> list:
    return [op for op in placement["ops"] if op[2] and op[3][0] != "s32"]


def test_hsdp_and_reduce_dtype_on_two_simulated_nodes(tmp_path: Path) -> None:
    env = dict(os.environ, XLA_FLAGS=xla_flags(4),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    done = subprocess.run([sys.executable, "tests/scripts/jax_hsdp.py", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])

    # Exact against the one-device large batch: K=4 items with a short last window, K=1, and
    # the deferred mode in mean mode; sharded on "fsdp", replicated over "replica".
    assert r["mesh"] == {"replica": 2, "fsdp": 2} and r["specs"] == "P(None, 'fsdp')"
    assert r["default"] < 1e-6 and r["k1"] < 1e-6 and r["defer"] < 1e-6, r
    assert r["steps"] == 3 and r["replicas_equal"]

    # Placement (compiled HLO; groups are mesh positions, nodes {0,1} and {2,3}): every
    # all-gather and reduce-scatter stays inside a node; the default mode's run in the scan
    # body (per use, per micro-step), the deferred mode's reduce-scatters after it; no
    # collective spanning nodes runs in the body.
    for mode, scattered_in_loop in (("default", True), ("defer", False)):
        ops = r[f"{mode}_hlo"]["ops"]
        gathers = [op for op in ops if op[0] == "all-gather"]
        scatters = [op for op in ops if op[0] == "reduce-scatter"]
        assert len(gathers) == 4 and all(op[1] and not op[2] for op in gathers), ops
        assert len(scatters) == 3 and all(op[1] == scattered_in_loop and not op[2]
                                          for op in scatters), ops
        assert not any(op[1] and op[2] for op in ops), ops
    # The float bytes crossing nodes per step (the gradient shards' all-reduce and the loss
    # sums) do not grow with K: K=1 and K=4 compile to the same node-spanning all-reduces.
    assert _float_across(r["default_hlo"]) == _float_across(r["k1_hlo"]), r

    # Checkpoints: reloaded on the same mesh it continues bit for bit; the state restored
    # under fsdp and ddp (another layout), and fsdp's save under hsdp again, is the saved one.
    assert r["resume_bitwise"]
    assert r["reshard"] == {"fsdp": [True, "P(None, 'data')"], "ddp": [True, "P()"],
                            "fsdp->hsdp": [True, "P(None, 'fsdp')"]}

    # reduce_dtype="bf16": the lowered step's gradient collectives take bf16 operands on every
    # strategy (the loss sums stay float32 scalars, the validity counts s32); where each runs.
    wire = r["wire"]
    for name in ("ddp", "zero1"):
        assert wire[name] == [["all-reduce", "bf16", False, True],
                              ["all-reduce", "s32", False, True]], wire
    assert ["reduce-scatter", "bf16", False, True] in wire["fsdp"], wire
    assert ["reduce-scatter", "bf16", True, True] in wire["fsdp-sync"], wire
    for name, in_loop in (("hsdp", True), ("hsdp-defer", False)):
        assert ["reduce-scatter", "bf16", in_loop, False] in wire[name], wire
        assert ["all-reduce", "bf16", False, True] in wire[name], wire
    assert wire["fsdp-sync/effective"].startswith("every micro-step")
    assert wire["hsdp/effective"].endswith("all-reduce across nodes once per optimizer step")

    # Error against float64 (ddp, 6 SGD steps, the same 64 rows per step): bf16 rounds once
    # per step whatever K is (measured 5.9e-4 at K=1, 6.7e-4 at K=16); float32 8.6e-8.
    err = r["error"]
    assert err["bf16/1"] <= 1e-2 and err["bf16/16"] <= 2 * err["bf16/1"], err
    assert err["fp32/16"] <= 1e-6, err

    # fp16 on the wire under fp16-mixed: the overflow in device 1's rows skips that window on
    # every device, the scale backs off, the params stay finite.
    assert r["fp16"] == {"skipped": [False, True, False], "steps": 2,
                         "scales": [8.0, 4.0, 4.0], "finite": True}, r["fp16"]
    # Issue 38 case 5: item mode on an fp16 wire at the default scale 65536 (windows of 4, 4,
    # 4, 2): the wire carried scale x the gradient of the window's loss sum (windows skipped,
    # the scale backing off, params far off); normalised, none skips and the params stay on
    # the fp32 large batch (fp16 compute).
    assert set(r["fp16_items"]) == {"ddp", "hsdp", "hsdp-defer"}
    for name, got in r["fp16_items"].items():
        assert (got["skipped"], got["scale"]) == (0, 65536.0) and got["diff"] < 1e-4, (name, got)


@pytest.mark.parametrize("kwargs, match", [
    ({}, r"in one process of 2 devices needs HSDPStrategy\(replicas=N\)"),
    ({"replicas": 1}, "one replica of 2 devices: that is strategy='fsdp'"),
    ({"replicas": 2}, "shard groups of one device: that is strategy='ddp'"),
    ({"replicas": 3}, "replicas=3 does not divide the 2 devices and no hybrid mesh fits"),
])
def test_degenerate_meshes_are_refused_in_one_line(kwargs, match) -> None:
    """Refused when the Accelerator is made (the mesh is built then), never a fallback."""
    with pytest.raises(ConfigError, match=match) as caught:
        axj.Accelerator(strategy=axj.HSDPStrategy(**kwargs), precision="fp32")
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="replicas=N"):
        axj.Accelerator(strategy="hsdp", precision="fp32")  # the word: replicas=None
    with pytest.raises(ConfigError, match="replicas=0"):
        axj.HSDPStrategy(replicas=0)


def test_reduce_dtype_words_effective_dtypes_and_the_fp16_refusal(cpu_bf16: bool) -> None:
    """On a CPU with native bf16 (faked: issue 38, the suite assumed none) and without: the
    "emulated" warning for bf16 comes only without it."""
    import warnings

    acc = axj.Accelerator(strategy="fsdp", precision="fp32", reduce_dtype="bf16")
    assert acc.effective_dtypes.as_params() == {
        "dtype_params": "float32", "dtype_compute": "float32",
        "dtype_accumulation": "float32", "dtype_reduction": "bfloat16",
        "dtype_masters": "float32", "dtype_reductions": "once per optimizer step"}
    assert acc.strategy.wire == Wire("bfloat16", 2)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        true = axj.Accelerator(strategy="ddp", precision="bf16-true")
    assert ["emulated" in str(w.message) for w in said] == ([] if cpu_bf16 else [True])
    assert true.effective_dtypes.reduction == "float32"  # the default: what JAX reduced in
    assert axj.Accelerator(strategy="single", precision="fp32",
                           reduce_dtype=jnp.bfloat16).effective_dtypes.reduction == "none"
    with pytest.raises(ConfigError, match=r"reduce_dtype='fp16' needs loss scaling.*'bf16'"), \
            warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        axj.Accelerator(strategy="ddp", precision="bf16-mixed", reduce_dtype="fp16")
    assert ["emulated" in str(w.message) for w in said] == ([] if cpu_bf16 else [True])
    assert axj.Accelerator(strategy="ddp", precision="auto").policy.name == (
        "bf16-mixed" if cpu_bf16 else "fp32")
    with pytest.raises(ConfigError, match="reduce_dtype='int8' is invalid"):
        axj.Accelerator(strategy="ddp", precision="fp32", reduce_dtype="int8")


def test_the_wire_casts_and_float32_is_the_identity() -> None:
    """The wire only casts: what it is given is normalised already (the step weighs each
    micro-step by its share of the window's mean, ``accumix.jax.wire``; the numbers are
    ``fp16_items`` above)."""
    g = jnp.asarray([60000.0, 3.0, -1.0], jnp.float32)
    assert Wire().send(g) is g and Wire().receive(g, g) is g  # the default: nothing at all
    fp16 = Wire("float16", 4)
    sent = fp16.send(g)
    assert sent.dtype == jnp.float16 and float(sent[0]) == 60000.0
    assert fp16.receive(sent, g).dtype == jnp.float32
    complex_g = jnp.asarray([1 + 2j], jnp.complex64)
    assert fp16.send(complex_g) is complex_g  # complex leaves travel as they are


def test_hlo_reads_the_three_spellings_of_replica_groups() -> None:
    text = "\n".join([
        "ENTRY main {",
        "  a = f32[4]{0} all-reduce(x), replica_groups={{0,2},{1,3}}, to_apply=r",
        "  b = bf16[2,4]{1,0} reduce-scatter(y), replica_groups=[2,2]<=[4], dimensions={0}",
        "  c = (f32[], f32[]) all-reduce(p, q), replica_groups=mesh['axis_0'=2,'axis_1'=1,"
        "'axis_2'=2], device_ids=([2,2]T(1,0)) {'axis_0'}, use_global_device_ids=true",
        "}"])
    a, b, c = collective_ops(text)
    assert a.groups == ((0, 2), (1, 3)) and a.spans({0: 0, 1: 0, 2: 1, 3: 1})
    assert b.groups == ((0, 1), (2, 3)) and b.dtypes == ("bf16",) and b.payload_bytes == 32
    assert c.groups == ((0, 1), (2, 3)) and c.result_bytes == 8 and not c.in_loop


def test_memory_rows_auto_and_estimate_memory_know_hsdp(capsys) -> None:
    """hsdp's rows are fsdp's over a node's devices; on several nodes auto tries hsdp right
    after ddp (as the torch side); ``estimate-memory --backend jax --nodes 2`` prints them."""
    from accumix.cli.main import main

    params = {"w": jax.ShapeDtypeStruct((512, 512), jnp.float32)}
    rows = {e.strategy: e for e in estimate_jax_memory(params, optax.adam(1e-3), num_devices=8,
                                                       replicas=2)}
    over_4 = {e.strategy: e for e in estimate_jax_memory(params, optax.adam(1e-3),
                                                         num_devices=4)}
    assert rows["hsdp"].total_bytes == over_4["fsdp-sync"].total_bytes
    assert rows["hsdp-defer"].total_bytes == over_4["fsdp"].total_bytes
    budget = rows["hsdp-defer"].total_bytes / 0.8 + 1  # ddp does not fit, hsdp-defer does
    name, reason = first_fitting(rows.__getitem__, device_bytes=budget, nodes=2)
    assert name == "hsdp-defer" and "replicated across the 2 nodes" in reason, reason
    assert first_fitting(rows.__getitem__, device_bytes=budget)[0] == "fsdp"  # one node
    with pytest.raises(ConfigError, match="replicas=3 is invalid with 8 devices"):
        estimate_jax_memory(params, num_devices=8, replicas=3)

    assert main(["estimate-memory", "--backend", "jax", "--params", "1e6", "--world-size", "4",
                 "--nodes", "2", "--device-gib", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 nodes x 2 devices" in out and "\nhsdp " in out and "\nhsdp-defer " in out, out
    assert main(["estimate-memory", "--backend", "jax", "--params", "1e6", "--world-size", "2",
                 "--nodes", "2"]) == 2
    assert "hsdp needs 2 or more" in capsys.readouterr().err
    # Issue 33: the reduction's bytes (float32 unless told), and the recipe's key on JAX.
    assert main(["estimate-memory", "--backend", "jax", "--params", "1e6", "--world-size", "2",
                 "--reduce-dtype", "bf16", "--device-gib", "1"]) == 0
    assert "gradient reduction in bfloat16: 1.9 MiB per device" in capsys.readouterr().out
    from accumix.cli.train import load_train_config

    assert load_train_config(["backend=jax", "reduce_dtype=bf16"]).reduce_dtype == "bf16"


def test_estimate_memory_on_jax_takes_grad_accum_steps(capsys, monkeypatch) -> None:
    """Issue 38 case 9: ``--grad-accum-steps`` was ignored on JAX ("every micro-step: K x
    that"; the recipe's own K for the window and the compiled steps): the per-micro-step
    traffic is sized for it as on torch, and the recipe's window and steps use it."""
    from accumix.cli import estimate_memory
    from accumix.cli.main import main

    args = ["estimate-memory", "--params", "1e7", "--world-size", "4", "--nodes", "2",
            "--grad-accum-steps", "16", "--device-gib", "1"]
    assert main([*args, "--backend", "torch"]) == 0
    torch_line = capsys.readouterr().out.splitlines()[-2]
    assert main([*args, "--backend", "jax"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert ", K=16, " in out[0], out[0]
    assert "hsdp's reduce-scatter every micro-step: 16 x that (610.4 MiB)" in out[-2], out[-2]
    assert torch_line.endswith("16 x that (610.4 MiB))"), torch_line
    # The recipe (no --params): the compiled steps (recorded, not compiled here) and the
    # window take K=16, not the recipe's global 16 / (2 devices x 4 rows) = 2.
    asked = []

    def activations(config, params, optimizer, devices, precision, grad_accum_steps=None):
        asked.append(grad_accum_steps)
        return dict.fromkeys(("single", "ddp", "zero1", "fsdp", "fsdp-sync"), 0), "recorded"
    monkeypatch.setattr(estimate_memory, "_jax_activations", activations)
    recipe = ["backend=jax", "model.n_layer=1", "model.n_embd=64", "model.n_head=2",
              "model.block_size=32", "micro_batch_size=4", "global_batch_size=16"]
    for k, window in ((None, 2), (16, 16)):
        more = ["--grad-accum-steps", str(k)] if k else []
        assert main(["estimate-memory", *recipe, "--world-size", "2", "--device-gib", "1",
                     *more]) == 0
        out = capsys.readouterr().out.splitlines()
        assert f"K={window};" in out[0] and f"{window} x that" in out[-2], out
    assert asked == [None, 16]
