"""A JAX job for ``accumix launch --nproc 2`` (or one plain process): train, save, resume.

    python jax_train.py OUT_DIR train    # ddp and fsdp vs the large batch; fsdp saves at step 2;
                                         # every strategy object (built before JAX starts) on
                                         # windows of 4 and 3 micro-batches; then a torch
                                         # DataLoader per process, saved mid-epoch; the
                                         # Trainer pre-empted on process 1 alone
    python jax_train.py OUT_DIR resume   # loads both saves, continues; writes the params;
                                         # a save to a directory per process is refused
    python jax_train.py OUT_DIR mismatch # process 1 asks for another K: a ConfigError (process
                                         # 0 first tries to bind JAX's coordinator port)

Each process feeds only its rows of every global micro-batch; the reference (one device, the
whole window) is computed in every process from the same data. Results: OUT_DIR/*.json, *.npz.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import numpy as np

import accumix.jax as axj
from tests import jax_workloads as w

K, WINDOWS, SAVE_AT = 2, 4, 2
ROWS = 4  # per process


def global_windows(processes: int):
    batches = w.micro_batches(K * WINDOWS, rows=ROWS * processes, seed=7)
    return [batches[i:i + K] for i in range(0, len(batches), K)]


def mine(window, processes: int):
    """This process's rows of each micro-batch (the global batch is the processes' rows in
    process order, as make_array_from_process_local_data assembles it)."""
    p = jax.process_index()
    return [jax.tree.map(lambda x: x[p * ROWS:(p + 1) * ROWS], micro) for micro in window]


def flat(params) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in
            jax.tree_util.tree_flatten_with_path(params)[0]}


class Rows:
    """24 rows of the ragged workload as a map-style dataset (3 batches of 4 per process)."""

    def __init__(self) -> None:
        self.rows = w.concat(w.micro_batches(12, rows=2, seed=11))

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        return {k: v[i] for k, v in self.rows.items()}


def loader_reference(windows_taken: int) -> list[list[dict[str, np.ndarray]]]:
    """The global windows the 2 processes' loaders assemble, rebuilt here from both ranks'
    shards (rank r takes every 2nd shuffled index): micro-batch m is rank 0's m-th batch then
    rank 1's."""
    import torch

    from accumix.data.loader import AcceleratedDataLoader
    from accumix.jax.data import to_numpy

    shards = []
    for rank in (0, 1):
        loader = AcceleratedDataLoader(
            torch.utils.data.DataLoader(Rows(), batch_size=4, shuffle=True),
            device=torch.device("cpu"), rank=rank, world_size=2, seed=5,
            on_batch=lambda _: None)
        epochs = [[to_numpy(b) for b in loader] for _ in range(2)]
        shards.append([[e[0:2], e[2:3]] for e in epochs])  # K=2: a full and a short window
    windows = []
    for epoch in range(2):
        for index in range(2):
            micro = [w.concat([shards[0][epoch][index][m], shards[1][epoch][index][m]])
                     for m in range(len(shards[0][epoch][index]))]
            windows.append(micro)
    return windows[:windows_taken]


def train_with_loader(out: Path, mode: str) -> None:
    import torch

    acc = axj.Accelerator(strategy="fsdp", precision="fp32", grad_accum_steps=K, seed=5)
    state, windows = acc.setup(w.init_params(), w.optimizer(),
                               torch.utils.data.DataLoader(Rows(), batch_size=4, shuffle=True))
    step = acc.train_step(w.item_loss)
    taken = 0
    if mode == "loader-resume":
        state = acc.load_state(out / "loader-run", state)
        taken = int(state.step)
    while taken < 4:
        for window in windows:
            state, _ = step(state, window)
            taken += 1
            if mode == "loader" and taken == 3:
                acc.save_state(out / "loader-run", state)
            if taken == 4:
                break
    gathered = jax.tree.map(
        lambda x: jax.experimental.multihost_utils.process_allgather(x, tiled=True),
        state.params)
    result = {"max_diff": w.max_diff(gathered, w.reference(loader_reference(4), items=True)),
              "params": {k: v.tolist() for k, v in flat(gathered).items()}}
    (out / f"{mode}-{jax.process_index()}.json").write_text(json.dumps(result))


def auto_agreement(out: Path) -> None:
    """strategy="auto" with different free memory per process: one choice (the minimum's), one
    step that runs; then "auto" on process 0 against "ddp" on process 1: a ConfigError."""
    from accumix.jax import memory

    rank = jax.process_index()
    memory.device_free_bytes = lambda: 1 if rank == 0 else 10**12  # nothing fits on process 0
    acc = axj.Accelerator(strategy="auto", precision="fp32", grad_accum_steps=K)
    state = acc.setup(w.init_params(), w.optimizer())
    state, metrics = acc.train_step(w.item_loss)(state, mine(global_windows(2)[0], 2))
    from tests.listening import job_listening  # the coordinator, gloo, torchrun's store

    result = {"chosen": repr(acc.strategy), "loss": float(metrics["loss"]),
              "listening": job_listening()}
    acc = axj.Accelerator(strategy="auto" if rank == 0 else "ddp", precision="fp32",
                          grad_accum_steps=K)
    try:
        acc.setup(w.init_params(), w.optimizer())
    except axj.ConfigError as exc:
        result["error"] = str(exc)
    (out / f"auto-{rank}.json").write_text(json.dumps(result))


def uneven_and_single(result: dict[str, object]) -> None:
    """Mean mode, ddp: process 0 passes a window of 2 micro-batches, process 1 of 1 (the end of
    an uneven stream); the update must equal the large batch of all 3 and be the same on both
    processes (SGD: Adam's first step hides a wrong scale). Then strategy='single' on 2
    processes must be refused."""
    import optax

    acc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=K)
    state = acc.setup(w.init_params(), optax.sgd(0.5))
    step = acc.train_step(w.mean_loss)
    batches = w.micro_batches(3, rows=ROWS, seed=13)  # one process's rows each
    state, metrics = step(state, batches[:2] if jax.process_index() == 0 else batches[2:])
    local = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), state.params)
    big = w.concat(batches)
    grads = jax.grad(lambda p: w.mean_loss(p, big, None))(w.init_params())
    ref = jax.tree.map(lambda p, g: p - 0.5 * g, w.init_params(), grads)
    result["uneven_mean"] = w.max_diff(local, ref)
    result["uneven_params"] = {k: v.tolist() for k, v in flat(local).items()}
    result["uneven_items"] = int(jax.device_get(metrics["num_items"]))
    try:
        axj.Accelerator(strategy="single", precision="fp32", grad_accum_steps=K)
        result["single"] = None
    except axj.ConfigError as exc:
        result["single"] = str(exc)


def uneven_eval(result: dict[str, object]) -> None:
    """``acc.eval_step`` when the processes pass different row counts (a validation set's last
    batch split over ranks, as the Trainer's ``shard_for_eval`` does: 5 rows and 3, 2 devices
    each), fsdp, both loss modes: the sums of all 8 rows, counted once (before, the global
    array of unequal local shapes failed). Then 3 rows against 1 (one per device on one,
    a device with no real row on the other)."""
    import optax

    acc = axj.Accelerator(strategy="fsdp", precision="fp32", grad_accum_steps=K)
    state = acc.setup(w.init_params(), optax.sgd(0.1))
    rows = w.micro_batches(1, rows=8, seed=23)[0]
    got = {}
    for name, loss_fn in (("item", w.item_loss), ("mean", w.mean_loss)):
        evaluate = acc.eval_step(loss_fn)
        for split in (5, 3):
            mine_rows = jax.tree.map(lambda x, n=split: x[:n] if jax.process_index() == 0
                                     else x[n:n + (8 - n if n == 5 else 1)], rows)
            total = 8 if split == 5 else 4
            everything = jax.tree.map(lambda x, t=total: x[:t], rows)
            loss_sum, items = (float(v) for v in jax.device_get(evaluate(state, mine_rows)))
            if name == "item":
                ref = w.item_loss(w.init_params(), everything, None)
            else:  # a mean over each row counts as mean x rows: the sum of the rows' losses
                ref = (w.mean_loss(w.init_params(), everything, None) * total, total)
            got[f"{name}-{split}"] = max(abs(loss_sum - float(ref[0])),
                                         abs(items - float(ref[1])))
    result["uneven_eval"] = got


def gather_rows(result: dict[str, object], acc: axj.Accelerator) -> None:
    """``acc.gather`` (issue 44): 2 rows of int64 (past int32's range) and bool on process 0,
    1 on process 1, in a dict with a 0-dim leaf: the concatenation in process order, in two
    ``process_allgather`` calls (before: three); then a trailing shape that differs: one line
    on both processes."""
    from jax.experimental import multihost_utils

    p = jax.process_index()
    ids = np.array([0, 2**40], np.int64) if p == 0 else np.array([10], np.int64)
    original, calls = multihost_utils.process_allgather, []
    multihost_utils.process_allgather = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        got = acc.gather({"ids": ids, "hit": ids > 5, "n": np.float32(p + 0.5)})
    finally:
        multihost_utils.process_allgather = original
    result["gather_calls"] = len(calls)
    result["gather"] = {"ids": got["ids"].tolist(), "hit": got["hit"].tolist(),
                        "n": got["n"].tolist(), "dtype": str(got["ids"].dtype)}
    try:
        acc.gather(np.zeros((2, 3) if p == 0 else (1, 4), np.float32))
        result["gather_error"] = None
    except axj.ConfigError as exc:
        result["gather_error"] = str(exc)


def strategy_objects() -> dict[str, axj.JaxStrategy]:
    """Every JAX strategy class, built before JAX starts (the README's way to ask for
    ``sync_each_microstep``): the mesh must wait for ``jax.distributed`` (was a RuntimeError
    in every process)."""
    return {"single": axj.SingleStrategy(), "ddp": axj.DDPStrategy(),
            "zero1": axj.ZeRO1Strategy(), "fsdp": axj.FSDPStrategy(),
            "fsdp-sync": axj.FSDPStrategy(sync_each_microstep=True),
            "hsdp": axj.HSDPStrategy()}  # replicas: the 2 processes, as 2 nodes of 2 devices


def uneven_batches() -> list[dict[str, np.ndarray]]:
    return w.micro_batches(15, rows=ROWS, seed=17)  # one process's rows each


def hsdp_on_one_process(result: dict[str, object], out: Path) -> None:
    """The hsdp state saved after the uneven job's first window (2 processes as 2 nodes of 2
    devices) loads into fsdp on one process and device, and its second window (both
    processes' micro-batches side by side) ends at the large batch of all 15 micro-batches."""
    import optax

    lr = 0.5
    batches = uneven_batches()
    ref = w.init_params()
    for big in (w.concat(batches[:7]), w.concat(batches[7:])):
        grads = jax.grad(lambda q, b=big: w.large_batch_loss(q, b, True))(ref)
        ref = jax.tree.map(lambda q, g: q - lr * g, ref, grads)
    acc = axj.Accelerator(strategy="fsdp", precision="fp32", grad_accum_steps=4)
    state = acc.load_state(out / "hsdp-run", acc.setup(w.init_params(), optax.sgd(lr)))
    result["hsdp_loaded_step"] = int(state.step)
    window = [w.concat([batches[7 + i], batches[11 + i]]) for i in range(4)]
    state, _ = acc.train_step(w.item_loss)(state, window)
    result["hsdp_resumed_diff"] = w.max_diff(state.params, ref)


def uneven_every_strategy(result: dict[str, object], early: dict[str, axj.JaxStrategy],
                          out: Path) -> None:
    """Item mode, K=4: process 0 passes 4 micro-batches, process 1 passes 3, then both 4; each
    strategy object made before JAX started. fsdp hung here (a process that skipped its padded
    micro-step missed the gathers and reduce-scatters its peer issued). SGD against the large
    batch of every real micro-batch; the same params on both processes."""
    import optax

    k, lr = 4, 0.5
    batches = uneven_batches()
    p = jax.process_index()
    windows = [batches[:4] if p == 0 else batches[4:7], batches[7:11] if p == 0 else batches[11:]]
    ref = w.init_params()
    for big in (w.concat(batches[:7]), w.concat(batches[7:])):
        grads = jax.grad(lambda q, b=big: w.large_batch_loss(q, b, True))(ref)
        ref = jax.tree.map(lambda q, g: q - lr * g, ref, grads)
    diffs, same = {}, {}
    for name in ("ddp", "zero1", "fsdp", "fsdp-sync", "hsdp"):
        acc = axj.Accelerator(strategy=early[name], precision="fp32", grad_accum_steps=k)
        state = acc.setup(w.init_params(), optax.sgd(lr))
        step = acc.train_step(w.item_loss)
        for i, window in enumerate(windows):
            state, _ = step(state, window)
            if name == "hsdp" and i == 0:  # issue 32 item 4: resumed on one process (reshard)
                acc.save_state(out / "hsdp-run", state)
        gathered = jax.tree.map(
            lambda x: jax.experimental.multihost_utils.process_allgather(x, tiled=True),
            state.params)
        diffs[name] = w.max_diff(gathered, ref)
        same[name] = {key: v.tolist() for key, v in flat(gathered).items()}
    result["uneven_strategies"] = diffs
    result["uneven_strategy_params"] = same
    try:
        axj.Accelerator(strategy=early["single"], precision="fp32", grad_accum_steps=k)
        result["single_object"] = None
    except axj.ConfigError as exc:
        result["single_object"] = str(exc)
    uneven_masked_mean(result)


def masked_mean_loss(params, batch, rng):
    """Mean mode, the usual masked token mean: 0/0 on the zeros that pad a short window."""
    err = (w.forward(params, batch["x"]) - batch["y"]) ** 2 * batch["mask"]
    return err.sum() / batch["mask"].sum()


def uneven_masked_mean(result: dict[str, object]) -> None:
    """fsdp in both modes, windows of 4 and 3 (K=4) in mean mode with ``masked_mean_loss``: a
    padded micro-step runs with its peer's (the collectives) and its gradient reaches a sum
    inside the backward (the absolute accumulator, sync's reduce-scatter), so it must be exactly
    zero, not 0 x NaN of the padding's 0/0 (was NaN when the step ran the padding itself).
    Every row has all its tokens: the mean over the 14 (device, micro-step) units is the large
    batch's mean."""
    import optax

    lr = 0.5
    batches = w.micro_batches(7, rows=ROWS, seed=19, ragged=False)
    window = batches[:4] if jax.process_index() == 0 else batches[4:]
    grads = jax.grad(lambda q: w.mean_loss(q, w.concat(batches), None))(w.init_params())
    ref = jax.tree.map(lambda q, g: q - lr * g, w.init_params(), grads)
    diffs = {}
    for name, strategy in (("fsdp", axj.FSDPStrategy()),
                           ("fsdp-sync", axj.FSDPStrategy(sync_each_microstep=True))):
        acc = axj.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=4)
        state = acc.setup(w.init_params(), optax.sgd(lr))
        state, _ = acc.train_step(masked_mean_loss)(state, window)
        diffs[name] = w.max_diff(state.params, ref)
    result["uneven_masked_mean"] = diffs


def auto_choice(out: Path) -> None:
    """micro_batch_size='auto' with a smaller memory_limit on process 1: both take its choice
    (4 of 2/4/8/16 rows per process), though process 0's limit fits every candidate."""
    from accumix.common.micro_batch_search import DEFAULT_HEADROOM
    from accumix.jax.micro_batch import window_peak_bytes

    def rows(n: int):
        return w.micro_batches(1, rows=n, seed=3)[0]

    # The peaks from the compiled step (every process makes the Accelerator: it is collective).
    probe = axj.Accelerator(strategy="ddp", precision="fp32", global_batch_size=32,
                            micro_batch_size="auto", memory_limit=10**9)
    state = probe.setup(w.init_params(), w.optimizer())
    peaks = [window_peak_bytes(probe, state, w.item_loss, rows, m, clip_norm=None)
             for m in (4, 8)]
    # Process 1: 4 fits, 8 does not; process 0: everything fits.
    limit = int(sum(peaks) / 2 / (1 - DEFAULT_HEADROOM)) if jax.process_index() == 1 else 10**9
    acc = axj.Accelerator(strategy="ddp", precision="fp32", global_batch_size=32,
                          micro_batch_size="auto", memory_limit=limit)
    state = acc.setup(w.init_params(), w.optimizer())
    chosen = acc.find_micro_batch_size(state, w.item_loss, rows)
    (out / f"auto-{jax.process_index()}.json").write_text(json.dumps(
        {"chosen": chosen, "grad_accum_steps": acc.grad_accum_steps}))


class SignalingRows(Rows):
    """``Rows`` whose first read on process 1 sends that process SIGTERM (a pre-emption of one
    process, while its first window loads)."""

    sent = False

    def __getitem__(self, i: int):
        if jax.process_index() == 1 and not SignalingRows.sent:
            import signal

            SignalingRows.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return super().__getitem__(i)


def preempted_trainer(out: Path) -> None:
    """Issue 38 case 4: the JAX Trainer on epochs of 2 windows (fewer than its 10-step read),
    SIGTERM to process 1 alone during step 1: both processes agree at the first epoch's end,
    save step-2 and stop with status 143 (before: the epoch's end read skipped the agreement,
    both trained on to max_steps=6 and saved nothing)."""
    import torch

    import accumix as ax
    from accumix.trainer import Trainer
    from accumix.trainer.jax_steps import JaxSteps

    acc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=K, seed=5)
    state, windows = acc.setup(w.init_params(), w.optimizer(),
                               torch.utils.data.DataLoader(SignalingRows(), batch_size=4))
    steps = JaxSteps(accelerator=acc, state=state, train_windows=windows, loss_fn=w.item_loss)
    trainer = Trainer(steps=steps, max_steps=6, run_dir=out / "preempted", loggers=[],
                      progress_bar=False, system_metrics_every=None)
    try:
        trainer.fit()
        result = {"stopped": None, "step": trainer.step}
    except ax.Preempted as exc:
        result = {"stopped": [exc.code, exc.step], "step": trainer.step}
    result["latest"] = (out / "preempted" / "latest").read_text().strip() \
        if (out / "preempted" / "latest").exists() else None
    (out / f"preempted-{jax.process_index()}.json").write_text(json.dumps(result))


def take_coordinator_port(out: Path) -> None:
    """Process 0, before JAX starts: another program binding the coordinator's port now (the
    seconds between the launch and rank 0's bind) must be refused; it was not, and rank 0
    then died with "Failed to start RPC server"."""
    import errno
    import socket

    from accumix.common.launch_env import detect_launch_env
    from accumix.jax.distributed import coordinator_address

    host, port = coordinator_address(detect_launch_env()).rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as thief:
        try:
            thief.bind((host, int(port)))
            taken = "taken"
        except OSError as exc:
            taken = errno.errorcode.get(exc.errno or 0, str(exc))
    (out / "port.json").write_text(json.dumps(taken))


def main(out: Path, mode: str, saved_processes: int) -> None:
    early = strategy_objects() if mode == "train" else {}  # before anything starts JAX
    if mode == "mismatch":
        if os.environ["RANK"] == "0":
            take_coordinator_port(out)
        try:  # RANK: jax.process_index() before the Accelerator would start JAX too early
            axj.Accelerator(strategy="ddp", precision="fp32",
                            grad_accum_steps=K + int(os.environ["RANK"]))
        except axj.ConfigError as exc:
            (out / f"mismatch-{jax.process_index()}.json").write_text(json.dumps(str(exc)))
        auto_agreement(out)
        return
    acc = axj.Accelerator(strategy="fsdp" if mode != "train" else "ddp", precision="fp32",
                          grad_accum_steps=K)
    processes = saved_processes if mode != "train" else jax.process_count()
    windows = global_windows(processes)
    result: dict[str, object] = {"process": jax.process_index(), "processes": acc.world_size,
                                 "devices": acc.num_devices, "launcher": acc.launch.launcher}
    if mode == "train":
        ref = w.reference(windows, items=True)
        for strategy in ("ddp", "fsdp"):
            acc = axj.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=K)
            state = acc.setup(w.init_params(), w.optimizer())
            step = acc.train_step(w.item_loss)
            for i, window in enumerate(windows):
                state, _ = step(state, mine(window, processes))
                if strategy == "fsdp" and i + 1 == SAVE_AT:
                    acc.save_state(out / "run", state)
                    # Issue 40: the same step to the test's S3, behind the next windows.
                    acc.save_state(f"{os.environ['ACCUMIX_TEST_S3']}/run", state,
                                   background=True)
            acc.end()  # waits for the background save
            result[strategy] = w.max_diff(state.params, ref)
            if strategy == "fsdp":
                gathered = jax.tree.map(
                    lambda x: jax.experimental.multihost_utils.process_allgather(x, tiled=True),
                    state.params)
                if acc.is_main_process:
                    np.savez(out / "uninterrupted.npz", **flat(gathered))
    else:
        done = np.load(out / "uninterrupted.npz")
        sources: list[tuple[object, str]] = [(out / "run", "")]
        if mode == "resume":  # issue 40: the same step from S3 (saved in the background)
            sources.append((f"{os.environ['ACCUMIX_TEST_S3']}/run", "_s3"))
        for source, suffix in sources:
            if suffix:
                acc = axj.Accelerator(strategy="fsdp", precision="fp32", grad_accum_steps=K)
            state = acc.setup(w.init_params(), w.optimizer())
            state = acc.load_state(source, state)
            result["loaded_step" + suffix] = int(state.step)
            step = acc.train_step(w.item_loss)
            rows = ROWS * processes // jax.process_count()
            for window in windows[SAVE_AT:]:
                p = jax.process_index()
                local = [jax.tree.map(lambda x, p=p, r=rows: x[p * r:(p + 1) * r], m)
                         for m in window]
                state, _ = step(state, local)
            gathered = jax.tree.map(
                lambda x: jax.experimental.multihost_utils.process_allgather(x, tiled=True),
                state.params)
            now = flat(gathered)
            result["bitwise" + suffix] = all(np.array_equal(done[k], now[k]) for k in now)
            result["max_diff" + suffix] = max(float(np.max(np.abs(done[k] - now[k])))
                                              for k in now)
        if mode == "reshard":
            hsdp_on_one_process(result, out)
        if mode == "resume":  # a run directory per process (no shared disk): refused
            try:
                acc.save_state(out / f"own-{jax.process_index()}", state)
            except axj.CheckpointError as exc:
                result["per_process"] = str(exc)
    if mode == "train" and acc.world_size > 1:
        uneven_and_single(result)
        uneven_eval(result)
        gather_rows(result, acc)
        uneven_every_strategy(result, early, out)
    (out / f"{mode}-{jax.process_index()}.json").write_text(json.dumps(result))
    if mode in ("train", "resume") and acc.world_size > 1:
        train_with_loader(out, "loader" if mode == "train" else "loader-resume")
    if mode == "train" and acc.world_size > 1:
        auto_choice(out)
        preempted_trainer(out)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 2)
