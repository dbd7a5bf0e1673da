"""The cluster engines' variables (issue 39): what ``accumix launch`` plans from Kubeflow's
``PET_*``, a PyTorchJob pod's and SkyPilot's variables, flags that contradict them refused in
one line, a PyTorchJob pod read as a node, Kubeflow's JAX runtime, and never a silent world of
1 when the engine says the job has more. Each environment here is the one the engine's job file
in docs/guides/clusters.md gives its pods."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from accumix.cli.launch import plan_launch, torchrun_args
from accumix.common.engine_env import check_joined, engine_nodes, jax_runtime_env, node_range
from accumix.common.launch_env import LaunchEnv
from accumix.common.preemption import parse_signals
from accumix.errors import ConfigError
from accumix.runtime.env import detect_launch_env

K8S = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}
# Kubeflow Trainer v2's torch-distributed runtime, pod 1 of a 2-node TrainJob (clusters.md).
TRAINJOB = {**K8S, "PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1",
            "PET_MASTER_ADDR": "mnist-node-0-0.mnist", "PET_MASTER_PORT": "29400"}
# SkyPilot's run section on node 1 of `num_nodes: 2`.
SKY = {"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "1",
       "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n", "SKYPILOT_NUM_GPUS_PER_NODE": "0"}
# A PyTorchJob Worker pod (replica 2 of Master + 3 Workers) running `python train.py`, as an
# older training-operator sets it, and as a recent one does (PET_* too, nprocPerNode "auto").
PYTORCHJOB = {**K8S, "RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0",
              "MASTER_PORT": "23456"}
PYTORCHJOB_PET = {**PYTORCHJOB, "PET_NNODES": "4", "PET_NODE_RANK": "3",
                  "PET_NPROC_PER_NODE": "auto", "PET_MASTER_ADDR": "job-master-0",
                  "PET_MASTER_PORT": "23456"}


def _plan(environ: dict[str, str], **flags: object) -> tuple:
    plan = plan_launch(environ=environ, **flags)  # type: ignore[arg-type]
    return plan.nproc, plan.nnodes, plan.node_rank, plan.master_addr, plan.master_port


def test_launch_plans_from_each_engine() -> None:
    assert _plan(TRAINJOB) == (4, 2, 1, "mnist-node-0-0.mnist", 29400)
    assert _plan(SKY, nproc=2) == (2, 2, 1, "10.0.0.5", 29500)  # SkyPilot names no port
    assert _plan(SKY, nproc=2, master_port=8008)[-1] == 8008  # no contradiction: a choice
    assert _plan(PYTORCHJOB, nproc=1) == (1, 4, 3, "job-master-0", 23456)
    assert _plan(PYTORCHJOB_PET, nproc=1) == (1, 4, 3, "job-master-0", 23456)
    plan = plan_launch(environ=TRAINJOB)
    assert torchrun_args(plan, "train.py", [])[:5] == [
        "--nnodes=2", "--nproc-per-node=4", "--node-rank=1",
        "--master-addr=mnist-node-0-0.mnist", "--master-port=29400"]
    # Flags that agree are fine; a one-node engine job rendezvouses on loopback.
    assert _plan(TRAINJOB, nnodes=2, node_rank=1, nproc=4)[:3] == (4, 2, 1)
    one = _plan({**TRAINJOB, "PET_NNODES": "1", "PET_NODE_RANK": "0"})
    assert one[1:4] == (1, 0, "127.0.0.1") and one[4] != 29400


@pytest.mark.parametrize(("environ", "flags", "message"), [
    (TRAINJOB, {"nnodes": 1}, "--nnodes 1 contradicts PET_NNODES=2 (set by Kubeflow)"),
    (TRAINJOB, {"node_rank": 0}, "--node-rank 0 contradicts PET_NODE_RANK=1 (set by Kubeflow)"),
    (TRAINJOB, {"nproc": 2}, "--nproc 2 contradicts PET_NPROC_PER_NODE=4 (set by Kubeflow)"),
    (TRAINJOB, {"master_addr": "127.0.0.1"}, "--master-addr 127.0.0.1 contradicts "
                                             "PET_MASTER_ADDR=mnist-node-0-0.mnist"),
    (TRAINJOB, {"master_port": 1}, "--master-port 1 contradicts PET_MASTER_PORT=29400"),
    (SKY, {"nnodes": 1, "nproc": 2}, "--nnodes 1 contradicts SKYPILOT_NUM_NODES=2 (set by "
                                     "SkyPilot)"),
    (SKY, {"master_addr": "10.0.0.6", "nproc": 2}, "contradicts SKYPILOT_NODE_IPS's first "
                                                   "line 10.0.0.5"),
    (PYTORCHJOB, {"node_rank": 0}, "--node-rank 0 contradicts RANK=3 (set by Kubeflow)"),
    ({**SKY, "SKYPILOT_NODE_IPS": "10.0.0.5"}, {}, "SKYPILOT_NODE_IPS has 1 address(es) but "
                                                   "SKYPILOT_NUM_NODES=2"),
    ({**TRAINJOB, "PET_NNODES": "two"}, {}, "PET_NNODES='two' is invalid; use N or MIN:MAX"),
])
def test_flags_that_contradict_the_engine_are_refused_in_one_line(
        environ: dict[str, str], flags: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        plan_launch(environ=environ, **flags)  # type: ignore[arg-type]
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_pytorchjob_pod_is_a_node() -> None:
    # Before: one node of 4 (local world = world), so hsdp, the memory model's per-node shares
    # and "auto" were wrong.
    for variables in (PYTORCHJOB, PYTORCHJOB_PET):
        env = detect_launch_env(variables)
        assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 0, 1)
        assert (env.node_rank, env.num_nodes, env.launcher) == (3, 4, "kubernetes")
        assert (env.master_addr, env.master_port) == ("job-master-0", 23456)
        check_joined(env, variables)  # what joined is what the operator started
    # torchrun's ranks inside an engine's node say the engine (their local ranks are torchrun's)
    ranks = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
             "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}
    assert detect_launch_env({**TRAINJOB, **ranks}).launcher == "kubernetes"
    assert detect_launch_env({**SKY, **ranks}).launcher == "skypilot"
    assert detect_launch_env({**K8S, **ranks}).launcher == "torchrun"  # a pod, no engine


def test_nowhere_a_silent_world_of_one() -> None:
    alone = LaunchEnv()
    for environ, said in ((TRAINJOB, "PET_NNODES=2"), (SKY, "SKYPILOT_NUM_NODES=2")):
        with pytest.raises(ConfigError, match=f"{said} but this process joined a job of 1 "
                                              r"node\(s\) \(1 process\(es\)\)"):
            check_joined(alone, environ)
    # A launcher that ignored the engine: each pod trained alone as a world of 4 (issue 39).
    each_pod = LaunchEnv(rank=1, world_size=4, local_world_size=4, num_nodes=1,
                         launcher="kubernetes")
    with pytest.raises(ConfigError, match="each node would train alone"):
        check_joined(each_pod, TRAINJOB)
    with pytest.raises(ConfigError, match="PET_NPROC_PER_NODE=4 but this node joined 2"):
        check_joined(LaunchEnv(world_size=4, local_world_size=2, num_nodes=2), TRAINJOB)
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES=2 but this process joined a job "
                                          "of 1"):
        check_joined(alone, {"JAX_NUM_PROCESSES": "2"}, backend="jax")
    # What joined matches: no error; SLURM, MPI and Ray start every process themselves.
    check_joined(LaunchEnv(world_size=8, local_world_size=4, num_nodes=2), TRAINJOB)
    check_joined(LaunchEnv(world_size=2, num_nodes=2, launcher="ray"), SKY)
    check_joined(alone, {**TRAINJOB, "PET_NNODES": "1", "PET_NPROC_PER_NODE": "auto"})
    check_joined(alone, {"JAX_NUM_PROCESSES": "2"})  # torch does not read JAX's variables


def test_kubeflow_jax_runtime() -> None:
    env = {**K8S, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1",
           "JAX_COORDINATOR_ADDRESS": "jax-example-node-0-0.jax-example:6666"}
    launch, address = jax_runtime_env(env)
    assert address == "jax-example-node-0-0.jax-example:6666"
    assert (launch.rank, launch.world_size, launch.num_nodes, launch.launcher) == (
        1, 2, 2, "kubernetes")
    assert jax_runtime_env({**env, "JAX_COORDINATOR_ADDRESS": "h",
                            "JAX_COORDINATOR_PORT": "1234"})[1] == "h:1234"
    with pytest.raises(ConfigError, match="JAX_COORDINATOR_ADDRESS='h' has no port"):
        jax_runtime_env({**env, "JAX_COORDINATOR_ADDRESS": "h"})
    with pytest.raises(ConfigError, match="JAX_PROCESS_ID=2 is invalid with "
                                          "JAX_NUM_PROCESSES=2"):
        jax_runtime_env({**env, "JAX_PROCESS_ID": "2"})
    assert jax_runtime_env({}) is None


def test_slurm_and_elastic_ranges() -> None:
    assert node_range("PET_NNODES", "1:2") == (1, 2) and node_range("x", "3") == (3, 3)
    with pytest.raises(ConfigError, match="PET_NNODES='2:1' is invalid"):
        node_range("PET_NNODES", "2:1")
    nodes = engine_nodes({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2",
                          "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "0",
                          "SLURM_STEP_NODELIST": "n[3-4]", **TRAINJOB})
    assert (nodes.engine, nodes.master_addr, nodes.default_port) == ("slurm", "n3", 10077)
    # SLURM names the nodes and node 0; the port is accumix's choice from the job id, which
    # --master-port may change (a contradiction of the nodes is refused).
    step = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "n[3-4]"}
    assert _plan(step, nproc=1)[1:] == (2, 1, "n3", 10077)
    assert _plan(step, nproc=1, master_port=12345)[-1] == 12345
    with pytest.raises(ConfigError, match="--node-rank 0 contradicts SLURM_NODEID=1"):
        plan_launch(nproc=1, node_rank=0, environ=step)


# -- docs/guides/clusters.md: each job file against the variables its engine gives ----------------
DOCS = Path(__file__).resolve().parents[2] / "docs" / "guides" / "clusters.md"


def _blocks(info: str) -> list[str]:
    return re.findall(rf"```{info}\n(.*?)```", DOCS.read_text(), flags=re.S)


def _launch_flags(command: list[str]) -> dict[str, object]:
    """``accumix launch [flags] SCRIPT`` -> plan_launch's keyword arguments."""
    from accumix.cli.main import build_parser

    args = build_parser().parse_args(command[1:])
    assert args.command == "launch" and args.script, command
    return {"nproc": args.nproc, "nnodes": args.nnodes, "node_rank": args.node_rank,
            "master_addr": args.master_addr, "master_port": args.master_port}


def test_the_cluster_guides_job_files_fit_their_engines_variables() -> None:
    from accumix.cli.train import load_train_config

    manifests = [yaml.safe_load(block) for block in _blocks("yaml")]
    trainjob, pytorchjob, jaxjob, sky = manifests
    # TrainJob: numNodes and numProcPerNode become the PET_* the tests above set; its command
    # plans that job from them with no flag in the way.
    spec = trainjob["spec"]["trainer"]
    assert (trainjob["kind"], trainjob["spec"]["runtimeRef"]["name"]) == (
        "TrainJob", "torch-distributed")
    assert (str(spec["numNodes"]), str(spec["numProcPerNode"])) == (
        TRAINJOB["PET_NNODES"], TRAINJOB["PET_NPROC_PER_NODE"])
    assert _plan(TRAINJOB, **_launch_flags(spec["command"]))[:3] == (4, 2, 1)
    # PyTorchJob: the replicas are WORLD_SIZE, each pod runs python train.py as a node.
    replicas = pytorchjob["spec"]["pytorchReplicaSpecs"]
    assert sum(r["replicas"] for r in replicas.values()) == int(PYTORCHJOB["WORLD_SIZE"])
    for replica in replicas.values():
        (container,) = replica["template"]["spec"]["containers"]
        assert container["name"] == "pytorch" and container["command"] == ["python", "train.py"]
    # JAX runtime: numNodes processes, accumix train as one process (no self-launch).
    assert jaxjob["spec"]["runtimeRef"]["name"] == "jax-distributed"
    assert jaxjob["spec"]["trainer"]["numNodes"] == 2  # JAX_NUM_PROCESSES in the JAX test
    command = jaxjob["spec"]["trainer"]["command"]
    assert command[:3] == ["accumix", "train", "job.yaml"]
    assert load_train_config(command[3:]).backend == "jax"
    # SkyPilot: num_nodes is SKYPILOT_NUM_NODES; the run line plans the job on a node.
    assert sky["num_nodes"] == int(SKY["SKYPILOT_NUM_NODES"])
    (line,) = [row for row in sky["run"].splitlines() if row.startswith("accumix launch")]
    # (8 processes on this test machine's cores: forced, as a node of 8 GPUs would not need.)
    assert _plan({**SKY, "ACCUMIX_OVERSUBSCRIBE": "1"},
                 **{**_launch_flags(line.split()), "nproc": 8}) == (
        8, 2, 1, "10.0.0.5", 29500)
    # sbatch: the --signal is the signal the job saves on, requeue on; one launcher per node.
    (script,) = _blocks("bash")
    warning = re.search(r"#SBATCH --signal=(\w+)@(\d+)", script)
    (srun,) = [row for row in script.splitlines() if row.startswith("srun ")]
    words = srun.split()
    assert "--ntasks-per-node=1" in script and words[1:3] == ["accumix", "launch"]
    config = load_train_config(words[words.index("train") + 2:])
    assert parse_signals(config.preemption_signals) == parse_signals([warning.group(1)])
    assert config.requeue and int(warning.group(2)) >= 60
    step = {"SLURM_JOB_ID": "88", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "gpu[1-2]",
            "SLURM_CPUS_ON_NODE": "16"}
    assert _plan(step, **_launch_flags(words[1:words.index("train") - 1] + ["x.py"]))[1:4] == (
        2, 1, "gpu1")


# -- elastic jobs (issue 43) -----------------------------------------------------------------------
def test_elastic_launch_plans_torchruns_c10d_rendezvous_on_node_0() -> None:
    plan = plan_launch(nproc=1, nnodes="1:2", node_rank=1, master_addr="10.0.0.5",
                       master_port=29400, environ={})
    assert (plan.nnodes, plan.max_restarts) == (2, 3)  # the most nodes; 3 restarts by default
    assert torchrun_args(plan, "train.py", []) == [
        "--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.5:29400",
        "--rdzv-conf=is_host=0", "--nproc-per-node=1", "--max-restarts=3", "train.py"]
    host = plan_launch(nproc=1, nnodes="1:2", node_rank=0, master_addr="10.0.0.5",
                       max_restarts=5, rdzv_conf="last_call_timeout=5", environ={})
    assert torchrun_args(host, "t.py", [])[2:6] == [
        "--rdzv-endpoint=10.0.0.5:29500", "--rdzv-conf=last_call_timeout=5,is_host=1",
        "--nproc-per-node=1", "--max-restarts=5"]
    etcd = plan_launch(nproc=1, nnodes="2:4", rdzv_backend="etcd-v2",
                       rdzv_endpoint="etcd:2379", environ={})
    assert torchrun_args(etcd, "t.py", [])[:3] == [
        "--nnodes=2:4", "--rdzv-backend=etcd-v2", "--rdzv-endpoint=etcd:2379"]
    # An elastic PyTorchJob's variables say the same.
    pod = {**K8S, "PET_NNODES": "1:2", "PET_RDZV_BACKEND": "c10d",
           "PET_RDZV_ENDPOINT": "job-worker-0:23456", "PET_MAX_RESTARTS": "4",
           "PET_NPROC_PER_NODE": "1"}
    plan = plan_launch(environ=pod)
    assert torchrun_args(plan, "t.py", [])[:3] == [
        "--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=job-worker-0:23456"]
    assert plan.max_restarts == 4
    with pytest.raises(ConfigError, match="--nnodes 2 contradicts PET_NNODES=1:2"):
        plan_launch(nnodes=2, environ=pod)
    with pytest.raises(ConfigError, match="nnodes=1:2 needs --master-addr: the address of node "
                                          "0, where the c10d rendezvous runs"):
        plan_launch(nproc=1, nnodes="1:2", environ={})
    with pytest.raises(ConfigError, match=r"--nnodes='2:1' is invalid; use N or MIN:MAX"):
        plan_launch(nproc=1, nnodes="2:1", environ={})


def test_the_log_line_of_a_world_change() -> None:
    from accumix.common.batch_sizes import resumed_grad_accum_steps, world_change

    def geometry(world: int, steps: int, given: str) -> dict:
        return {"steps": steps, "configured": steps, "given": given, "micro_batch_size": 4,
                "dp_world_size": world}

    saved = geometry(2, 2, "global_batch_size")
    mine = geometry(1, 4, "global_batch_size")
    steps = resumed_grad_accum_steps(saved, mine, global_batch_size=16, assigned=False)
    assert world_change(saved, mine, steps) == "world 2 -> 1: K 2 -> 4, global batch 16 kept"
    # Without global_batch_size K is kept, and the global batch is not: said so.
    mine = geometry(1, 2, "grad_accum_steps")
    saved = geometry(2, 2, "grad_accum_steps")
    steps = resumed_grad_accum_steps(saved, mine, global_batch_size=None, assigned=False)
    assert world_change(saved, mine, steps) == (
        "world 2 -> 1: K 2 -> 2, global batch 16 -> 8: K is kept without global_batch_size "
        "(give global_batch_size=16 to keep the global batch)")
    assert world_change(saved, saved, 2) is None
    # A checkpoint's global batch a new world cannot divide: the worlds that can are named.
    with pytest.raises(ConfigError, match=r"data-parallel world sizes that would divide it: "
                                          r"\[1, 3\]"):
        resumed_grad_accum_steps(geometry(3, 1, "global_batch_size"),
                                 geometry(2, 2, "global_batch_size"), global_batch_size=12,
                                 assigned=False)


def test_the_ranks_one_line_error_is_printed_once_by_the_launcher(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every rank (and, in an elastic job, every restart on a world that cannot work) fails
    with the same error: each hands its line over in torchrun's error file, the launcher prints
    the first once (before: one line per rank and per attempt)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from accumix.cli.launch import failure_status, reported_error
    from accumix.cli.main import main

    monkeypatch.setenv("ACCUMIX_LAUNCH", "1")
    failures = {}
    for rank in (0, 1):
        error_file = tmp_path / f"error-{rank}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        assert main(["train", "max_steps=0"]) == 2
        failures[rank] = ProcessFailure(rank, 1000 + rank, 2, str(error_file))
    assert capsys.readouterr().err == ""  # the ranks print nothing themselves
    line = "accumix train: error: max_steps=0 is invalid; use an integer >= 1"
    assert (reported_error(failures), failure_status(failures)) == (line, (2, ""))
    # A peer that died of the first one's exit (a broken collective): the line is not lost.
    failures[1] = ProcessFailure(1, 1001, 1, "")
    assert reported_error(failures) == line and failure_status(failures)[0] == 1
    monkeypatch.delenv("ACCUMIX_LAUNCH")  # not under accumix launch: the rank prints it
    assert main(["train", "max_steps=0"]) == 2
    assert capsys.readouterr().err.count("max_steps=0 is invalid") == 1
