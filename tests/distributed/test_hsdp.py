"""hsdp on 4 ranks as 2 simulated nodes of 2 (gloo on loopback, ``spawn(nodes=2)``).

One 4-rank job: hsdp equals the one-process large batch (K=1 and K=4, mean and item modes,
a short last window, both gradient modes) and every replica holds the same shard after each
step; an fp16 overflow on one rank of one node skips the step on every rank; ranks not
numbered node by node are refused; an out-of-memory split at the boundary crosses nodes once;
``auto`` picks hsdp when ddp does not fit; compiled blocks equal eager without recompiling;
``micro_batch_size="auto"`` with an out-of-memory backward; the memory model's hsdp row
against the measured model states; DeepSpeed ZeRO++ ``hpz="node"`` against the large batch
and resumed bitwise; a checkpoint saved on 2x2 resumes bitwise on 2x2 and on 4 ranks of fsdp
and ddp. Then ranks 0 and 1 of the same spawn start a world of 2 and resume it under fsdp (a
1x2 world) and ddp (2x1), and this process on one. The traffic across nodes, under two
``accumix launch --nnodes 2`` launchers, is in ``test_hsdp_launch.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.distributed import hsdp_jobs as jobs
from tests.distributed.hsdp_jobs import TOL, WORLD


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    return jobs.results(tmp_path_factory)  # the spawn test_reduce_dtype_error shares


def test_hsdp_equals_the_large_batch_and_replicas_agree(four_ranks) -> None:
    results, _ = four_ranks
    assert results[0]["exact"].pop("saved") < TOL  # save_model's full weights, rank 0
    for name in results[0]["exact"]:
        steps = [r["exact"][name][1] for r in results]
        assert steps == [2 if name.startswith("K4") else 8] * WORLD, (name, steps)
        for rank, r in enumerate(results):
            diff, _, _, mesh = r["exact"][name]
            assert diff < TOL and mesh == (2, 2), (name, rank, diff, mesh)
        # Replicas: rank r and r + 2 hold the same shard, bitwise, after every step.
        digests = [r["exact"][name][2] for r in results]
        assert digests[0] == digests[2] and digests[1] == digests[3], name
        assert digests[0] != digests[1], name


def test_a_block_left_out_of_any_micro_step_equals_the_large_batch(four_ranks) -> None:
    """Issue 38 case 1: a unit the window's last micro-step did not run kept its earlier
    micro-steps' reduce-scattered shard unreduced across nodes and unstepped (0.06 off)."""
    results, _ = four_ranks
    for r in results:
        assert r["skipped blocks"]["diff"] < TOL and r["skipped blocks"]["steps"] == 2, r[
            "skipped blocks"]


def test_lbfgs_closure_equals_plain_lbfgs(four_ranks) -> None:
    """Issue 38 case 2: LBFGS stepped the plain parameters fsdp had replaced (it stopped at
    once, on a zero gradient: 1.33 off after 3 steps on 2x2); now the sharded ones, its flat
    vectors gathered whole."""
    results, _ = four_ranks
    for r in results:
        diff, ref_losses, losses = r["lbfgs"]
        assert diff < 1e-5, r["lbfgs"]
        assert max(abs(a - b) for a, b in zip(ref_losses, losses, strict=True)) < 1e-6


def test_fp16_overflow_on_one_rank_of_one_node_skips_everywhere(four_ranks) -> None:
    results, _ = four_ranks
    logs = [r["overflow"]["log"] for r in results]
    # windows: clean, inf (absorbed by hysteresis), inf (scale halves), clean
    for log in logs:
        assert [e[:3] for e in log] == [(False, 1024.0, 0.05), (True, 1024.0, 0.05),
                                        (True, 512.0, 0.05), (False, 512.0, 0.025)], log
    assert [r["overflow"]["steps"] for r in results] == [2] * WORLD
    assert [e[3] for e in logs[0]] == [e[3] for e in logs[2]]  # replicas stay equal
    # Only the second shard (ranks 1 and 3) ever saw the inf that rank 2 produced.
    seen = [[f > 0 for f in r["overflow"]["local_flags"]] for r in results]
    assert seen[0] == seen[2] == [False] * 4
    assert seen[1] == seen[3] == [False, True, True, False]


def test_ranks_not_numbered_node_by_node_are_refused(four_ranks) -> None:
    results, _ = four_ranks
    for r in results:
        assert "ranks 0..1 are on nodes [0, 1]" in r["interleaved"], r["interleaved"]
        assert "srun --distribution=block" in r["interleaved"]


def test_out_of_memory_pieces_cross_nodes_once(four_ranks) -> None:
    results, _ = four_ranks
    for rank, r in enumerate(results):
        oom = r["oom"]
        # rank 3 raised at 4 rows, then 2 and 2: every rank ran 4 pieces of one row
        assert oom["diff"] < TOL and oom["raised"] == (3 if rank == 3 else 0), (rank, oom)
        # the gradient all-reduces across the replicas: the same bytes split or not
        assert oom["bytes"][0] == oom["bytes"][1] > 0, (rank, oom)


def test_auto_picks_hsdp_on_two_nodes_when_ddp_does_not_fit(four_ranks) -> None:
    results, _ = four_ranks
    for r in results:
        assert r["auto"]["chosen"] == ("hsdp", "grad_op") and r["auto"]["diff"] < TOL, r["auto"]


def test_compiled_blocks_equal_eager_without_recompiling(four_ranks) -> None:
    results, _ = four_ranks
    for r in results:
        compiled = r["compiled"]
        assert compiled["within"] and compiled["recompiles"] == 0, compiled
        assert compiled["frames"] > 0 and compiled["keys_clean"] and compiled["unwrap_is_user"]


def test_micro_batch_auto_with_an_out_of_memory_backward(four_ranks) -> None:
    results, _ = four_ranks
    for r in results:
        assert r["micro_batch_auto"] == {"chosen": 3, "steps": (4, 4), "unequal": []}, r


def test_memory_model_and_measured_states(four_ranks) -> None:
    """hsdp's rows within 10% of the model states held, the window's unsharded gradients under
    ``defer_reduce_scatter=True`` counted (the model was 1.22x low at K=2 before)."""
    results, _ = four_ranks
    for r in results:
        for case, memory in r["memory"].items():
            assert abs(memory["measured"] / memory["model"] - 1) < 0.10, (case, memory)
        default = r["memory"]["hsdp-full|2"]
        assert default["model"] < 0.6 * default["ddp"] and default["measured"] < 0.6 * (
            default["ddp"])
        # deferred, the window holds full-size gradients where the default holds a node's shard
        deferred = r["memory"]["hsdp-full-defer|2"]["measured"]
        half = 4 * 17_153 / 2  # half the fp32 gradients of its 17,153 parameters (2 a node)
        assert abs(deferred - default["measured"] - half) < 0.01 * half, r["memory"]


def test_checkpoint_moves_between_meshes(four_ranks) -> None:
    results, run_dir = four_ranks
    straight = results[0]["straight"]  # full parameters: complete on rank 0
    assert jobs.max_diff(straight, jobs.resume_reference()) < TOL
    resumed = results[0]
    assert all(np.array_equal(resumed["resumed/hsdp"][k], straight[k]) for k in straight)
    for name in ("fsdp", "ddp"):
        assert jobs.max_diff(resumed[f"resumed/{name}"], straight) < TOL, name
    assert [r["two ranks"] is None for r in results] == [False, False, True, True]
    two = results[0]["two ranks"]  # the world of 2 after the 4: full parameters on rank 0
    assert sorted(two) == ["ddp 2x1", "fsdp 1x2"]
    for name, got in two.items():
        assert jobs.max_diff(got, straight) < TOL, name
    assert jobs.max_diff(jobs.resume_run("single", load=str(run_dir)), straight) < TOL


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_hpz_within_a_node_equals_the_large_batch(four_ranks) -> None:
    results, _ = four_ranks
    for rank, r in enumerate(results):
        hpz = r["hpz"]
        diff, steps, size = hpz["K4/items"]
        assert diff < TOL and steps == 2, (rank, hpz["K4/items"])
        assert size == 2, (rank, hpz["K4/items"])  # the ranks of a node
    hpz = results[0]["hpz"]
    assert jobs.max_diff(hpz["straight"], jobs.resume_reference()) < TOL
    assert all(np.array_equal(hpz["resumed"][k], hpz["straight"][k]) for k in hpz["straight"])
