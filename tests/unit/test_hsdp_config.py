"""hsdp without processes: the mesh from the launch environment and its refusals, the launch
variables that name the node, the memory model's hsdp rows and ``auto`` on several nodes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import accumix as ax
from accumix.cli.main import main
from accumix.common.launch_env import LaunchEnv, detect_launch_env, slurm_tasks_per_node
from accumix.memory.model import DEFER_ROWS, HSDP_ROWS, STRATEGIES, SYNC_ROWS, estimate_memory
from accumix.memory.strategy_choice import choose_strategy
from accumix.precision import Policy
from accumix.strategies.node_groups import mesh_shape
from accumix.strategies.registry import choose_auto_strategy

GIB = 1024**3


def _launch(world: int, per_node: int, nodes: int | None = None) -> LaunchEnv:
    return LaunchEnv(world_size=world, local_world_size=per_node,
                     num_nodes=nodes if nodes is not None else world // per_node)


@pytest.mark.parametrize("replicas,world,per_node,shape", [
    (None, 4, 2, (2, 2)), (None, 64, 8, (8, 8)), (4, 8, 4, (4, 2)), (16, 64, 8, (16, 4)),
])
def test_mesh_shape(replicas, world, per_node, shape) -> None:
    assert mesh_shape(replicas, _launch(world, per_node)) == shape


@pytest.mark.parametrize("replicas,world,per_node,message", [
    (None, 4, 4, "one replica of 4 ranks: that is strategy='fsdp'"),
    (None, 1, 1, "one replica of 1 ranks: that is strategy='fsdp'"),
    (None, 4, 1, "shard groups of one rank: that is strategy='ddp'"),
    (4, 4, 2, "replicas=4 makes shard groups of one rank: that is strategy='ddp'"),
    (1, 8, 4, "replicas=1 has one replica of 8 ranks"),
    (3, 8, 4, "replicas=3 does not divide the world of 8 ranks; use replicas in [2, 4]"),
    (2, 16, 4, "shard groups of 8 ranks, which do not fit in the 4 ranks of a node"),
])
def test_degenerate_and_wrong_meshes_are_refused(replicas, world, per_node, message) -> None:
    with pytest.raises(ax.ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        mesh_shape(replicas, _launch(world, per_node))


@pytest.mark.parametrize("replicas", [0, -2, True, 2.0, "2"])
def test_replicas_must_be_a_count(replicas) -> None:
    with pytest.raises(ax.ConfigError, match=r"HSDPStrategy\(replicas=.*\) is invalid"):
        ax.HSDPStrategy(replicas=replicas)


def test_one_process_refuses_hsdp_at_creation_and_the_cli_exits_2(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ax.ConfigError, match="use it, or launch on several nodes"):
        ax.Accelerator(strategy="hsdp")
    for nproc in (1, 2):  # 2: refused before launching the ranks
        assert main(["train", "strategy=hsdp", f"nproc={nproc}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "that is strategy='fsdp'" in err, err


def test_launch_variables_name_the_node() -> None:
    torchrun = detect_launch_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                  "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                                  "GROUP_WORLD_SIZE": "2"})
    assert (torchrun.node_rank, torchrun.num_nodes) == (1, 2)
    plain = detect_launch_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert (plain.node_rank, plain.num_nodes) == (1, 2)  # by hand: nodes in rank order
    # srun without --ntasks-per-node: the step's compressed list gives this node's tasks
    slurm = detect_launch_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "10", "SLURM_LOCALID": "1",
                               "SLURM_STEP_ID": "0", "SLURM_NODEID": "2",
                               "SLURM_STEP_NUM_NODES": "3",
                               "SLURM_STEP_TASKS_PER_NODE": "4(x2),2"})
    assert (slurm.local_world_size, slurm.node_rank, slurm.num_nodes) == (2, 2, 3)
    assert [slurm_tasks_per_node("4(x2),2", n) for n in range(4)] == [4, 4, 2, None]
    assert slurm_tasks_per_node("garbage", 0) is None
    mpi = detect_launch_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                             "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (mpi.node_rank, mpi.num_nodes) == (1, 2)


def test_memory_model_hsdp_rows_are_fsdp_over_a_node() -> None:
    one_node = {e.strategy: e for e in estimate_memory(7 * 10**9, world_size=8,
                                                       precision="bf16-mixed",
                                                       block_params=10**8)}
    nodes = {e.strategy: e for e in estimate_memory(7 * 10**9, world_size=64,
                                                    precision="bf16-mixed", block_params=10**8,
                                                    ranks_per_node=8)}
    assert list(nodes) == [*STRATEGIES[:4], *HSDP_ROWS, *STRATEGIES[4:]]
    for sharding in ("grad_op", "full"):
        hsdp, fsdp = nodes[f"hsdp-{sharding}"], one_node[f"fsdp-{sharding}"]
        assert (hsdp.params_bytes, hsdp.grads_bytes, hsdp.optimizer_bytes) == (
            fsdp.params_bytes, fsdp.grads_bytes, fsdp.optimizer_bytes)
    assert nodes["hsdp-full"].total_bytes < nodes["ddp"].total_bytes / 4
    # A window: hsdp's default reduce-scatters each micro-step (its K=1 rows); deferred, each
    # rank holds the window's unsharded fp32 gradients, as fsdp's default does.
    window = {e.strategy: e for e in estimate_memory(7 * 10**9, world_size=64,
                                                     precision="bf16-mixed", block_params=10**8,
                                                     ranks_per_node=8, grad_accum_steps=4)}
    assert list(window) == [*STRATEGIES[:4], *SYNC_ROWS, *HSDP_ROWS, *DEFER_ROWS,
                            *STRATEGIES[4:]]
    for sharding in ("grad_op", "full"):
        hsdp, defer = window[f"hsdp-{sharding}"], window[f"hsdp-{sharding}-defer"]
        assert hsdp == nodes[f"hsdp-{sharding}"]
        assert defer.grads_bytes == window[f"fsdp-{sharding}"].grads_bytes == 4 * 7 * 10**9
        assert (defer.params_bytes, defer.optimizer_bytes) == (hsdp.params_bytes,
                                                               hsdp.optimizer_bytes)
    # one node, or one rank per node: no hsdp row
    for per_node in (64, 1):
        rows = [e.strategy for e in estimate_memory(10**6, world_size=64,
                                                    ranks_per_node=per_node)]
        assert rows == list(STRATEGIES)
    with pytest.raises(ax.ConfigError, match="ranks_per_node=3 does not divide world_size=64"):
        estimate_memory(10**6, world_size=64, ranks_per_node=3)


def test_auto_on_several_nodes_prefers_hsdp_to_zero1_and_fsdp() -> None:
    # 2**30 parameters, bf16-mixed Adam, 16 ranks on 2 nodes: ddp 16 GiB, hsdp grad_op 4.0,
    # hsdp full 2.5, zero1 8.5 (it would gather the parameters across nodes), fsdp full 1.5
    estimates = estimate_memory(2**30, world_size=16, precision="bf16-mixed",
                                block_params=2**28, ranks_per_node=8)

    def pick(gib: float) -> tuple[str, str | None, str]:
        choice = choose_strategy(estimates, device_bytes=int(gib * GIB), world_size=16,
                                 ranks_per_node=8)
        return choice.strategy, choice.sharding, choice.reason

    assert pick(24)[:2] == ("ddp", None)
    name, sharding, reason = pick(10)
    assert (name, sharding) == ("hsdp", "grad_op")
    assert reason == ("hsdp (sharding=grad_op): 4.00 GiB per rank fits 80% of 10.00 GiB; ddp "
                      "needs 16.00 GiB; sharded within the 8 ranks of a node, replicated "
                      "across nodes: the nodes exchange gradient shards once per step")
    assert pick(4)[:2] == ("hsdp", "full")
    assert pick(2)[:2] == ("fsdp", "full")  # not even sharded within a node


def test_auto_strategy_object_on_several_nodes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), *(nn.Linear(64, 64) for _ in range(4)))
    opt = torch.optim.Adam(model.parameters())
    totals = {e.strategy: e.total_bytes for e in estimate_memory(
        model, world_size=4, ranks_per_node=2)}
    device = int((totals["ddp"] + totals["hsdp-grad_op"]) / 2 / 0.8)
    strategy, reason = choose_auto_strategy(model, [opt], policy=Policy(name="fp32"),
                                            world_size=4, device_bytes=device,
                                            ranks_per_node=2)
    assert isinstance(strategy, ax.HSDPStrategy) and strategy.sharding == "grad_op", reason
    assert strategy.requested_replicas is None  # the launch's nodes


def test_estimate_memory_cli_lists_hsdp_on_several_nodes(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate-memory", "--params", "7e9", "--world-size", "64", "--nodes", "8",
                 "--device-gib", "80", "--precision", "bf16-mixed"]) == 0
    out = capsys.readouterr().out
    assert "8 nodes x 8 ranks" in out and "hsdp-full" in out
    assert out.strip().splitlines()[-1].startswith("auto: hsdp (sharding=grad_op)")
    assert main(["estimate-memory", "--params", "7e9", "--world-size", "4", "--nodes",
                 "3"]) == 2
    assert "--nodes=3 is invalid" in capsys.readouterr().err
    assert main(["estimate-memory", "--params", "7e9", "--world-size", "64", "--nodes", "8",
                 "--device-gib", "80", "--precision", "bf16-mixed", "--grad-accum-steps",
                 "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "8 nodes x 8 ranks, K=4," in lines[0]
    assert [line.split()[0] for line in lines[2:15]] == [
        *STRATEGIES[:4], *SYNC_ROWS, *HSDP_ROWS, *DEFER_ROWS, *STRATEGIES[4:]]
    assert main(["estimate-memory", "--params", "7e9", "--grad-accum-steps", "0"]) == 2
    assert "--grad-accum-steps=0 is invalid" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs,message", [
    ({"stage": 2, "hpz": "node"}, r"hpz='node'\) partitions ZeRO-3's parameters; use stage=3"),
    ({"stage": 3, "hpz": 1}, r"hpz=1\) is invalid"),
    ({"stage": 3, "hpz": "rack"}, r"hpz='rack'\) is invalid"),
])
def test_deepspeed_hpz_needs_stage_3_and_a_size(kwargs, message) -> None:
    from accumix.strategies.deepspeed import DeepSpeedStrategy  # refused before its import

    with pytest.raises(ax.ConfigError, match=message):
        DeepSpeedStrategy(**kwargs)


def test_deepspeed_hpz_partition_within_a_node() -> None:
    from accumix.strategies.deepspeed_config import deepspeed_config
    from accumix.strategies.node_groups import hpz_partition_size

    assert hpz_partition_size("node", _launch(64, 8)) == 8
    assert hpz_partition_size(4, _launch(64, 8)) == 4
    with pytest.raises(ax.ConfigError, match="that is plain ZeRO-3; leave hpz out"):
        hpz_partition_size("node", _launch(8, 8))
    with pytest.raises(ax.ConfigError, match="do not divide the 8 ranks of a node"):
        hpz_partition_size(16, _launch(64, 8))
    config = deepspeed_config(stage=3, grad_accum_steps=1, micro_batch_size=2, dp_world_size=4,
                              policy=Policy(name="fp32"), loss_scale=None,
                              hpz_partition_size=2)
    assert config["zero_optimization"]["zero_hpz_partition_size"] == 2
    with pytest.raises(ax.ConfigError, match="zero_hpz_partition_size=4"):
        deepspeed_config(stage=3, grad_accum_steps=1, micro_batch_size=2, dp_world_size=4,
                         policy=Policy(name="fp32"), loss_scale=None, hpz_partition_size=2,
                         user_config={"zero_optimization": {"zero_hpz_partition_size": 4}})
