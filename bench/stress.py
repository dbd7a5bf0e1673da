"""Back-to-back 2-rank jobs through the real launcher: how many end abnormally after they finished.

    python bench/stress.py --jobs 200                 # every strategy x every ending, in turn
    python bench/stress.py --quick                    # 1 job, zero1 no-end (the smoke test)
    python bench/stress.py --jobs 40 --strategies zero1 --endings no-end --load 1

Each job is ``accumix launch --nproc 2 bench/stress.py --job STRATEGY ENDING RUN_DIR``: a tiny
MLP, K=2 micro-steps, item-weighted (``acc.backward(loss_sum, num_items=n)`` with per-sample
masks, so the ranks count different items), a ``save_state`` after the second optimizer step,
then rank 0 prints the result line and the job ends one of three ways:

* ``end``: ``acc.end()``, then the script returns (the README's loop);
* ``no-end``: the script returns without ``acc.end()`` (the teardown is all at exit);
* ``preempt``: ``SystemExit(0)`` instead of ``acc.end()`` (what ``handle_preemption`` raises
  after its save).

The jobs cycle strategy-major through ``--strategies`` x ``--endings``. A job is abnormal when
the launcher's status is not 0, a rank was killed by a signal, the output says "terminate
called" (C++ ``std::terminate``: SIGABRT), or the result line is missing. ``--load P`` runs P
busy-loop processes meanwhile: a loaded machine makes exit races more likely. Prints the
abnormal exits per strategy and ending, "abnormal exits: X of N", then a table.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from _common import fmt, machine_line, markdown_table, median

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("ddp", "zero1", "fsdp", "deepspeed")
ENDINGS = ("end", "no-end", "preempt")
RESULT = "stress-result"
SIGNS = ("terminate called", "Signal 6", "SIGABRT", "Fatal Python error", "Segmentation fault")


# -- the job (every rank runs this under the launcher) ------------------------------------------
def job(strategy: str, ending: str, run_dir: str) -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import accumix as ax

    chosen = ax.DeepSpeedStrategy(stage=1) if strategy == "deepspeed" else strategy
    acc = ax.Accelerator(strategy=chosen, precision="fp32", grad_accum_steps=2, seed=0,
                         timeout=60.0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, generator=g)
    mask = (torch.rand(32, generator=g) > 0.3).float()
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(TensorDataset(x, y, mask), batch_size=4, shuffle=False)
    model, opt, loader = acc.setup(model, opt, loader)
    for xb, yb, mb in loader:  # 16 samples a rank: 4 micro-batches, 2 windows
        with acc.accumulate():
            err = (model(xb).squeeze(-1) - yb) ** 2 * mb
            acc.backward(err.sum(), num_items=mb.sum())
            opt.step()
            opt.zero_grad()
        if acc.sync_gradients and acc.optimizer_steps == 2:
            acc.save_state(run_dir)
    total = acc.reduce(torch.tensor([float(sum(p.detach().sum() for p in model.parameters()))]),
                       "sum").item()
    acc.print(f"{RESULT} {strategy} {ending} steps={acc.optimizer_steps} param-sum={total:.6f}")
    if ending == "preempt":
        raise SystemExit(0)
    if ending == "end":
        acc.end()


# -- the driver ----------------------------------------------------------------------------------
def abnormal(rc: int, output: str) -> str:
    """Why a finished job counts as abnormal, or "" when it ended cleanly."""
    if rc != 0:
        return f"status {rc}"
    for sign in SIGNS:
        if sign in output:
            return repr(sign)
    if RESULT not in output:
        return "no result line"
    return ""


def run_job(strategy: str, ending: str, workdir: Path, timeout: float) -> tuple[str, float, str]:
    """(why abnormal or "", seconds, the output's tail) of one launched job."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{strategy}-{ending}-", dir=workdir))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                       os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "accumix.cli.main", "launch", "--nproc", "2", __file__,
           "--job", strategy, ending, str(run_dir)]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = -1, f"timed out after {timeout:.0f}s\n{exc.stderr or ''}"
    seconds = time.perf_counter() - start
    why = abnormal(rc, output)
    return why, seconds, output[-4000:]


def _spin() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=None, help="jobs to run (default 24)")
    parser.add_argument("--quick", action="store_true",
                        help="1 job: zero1, no acc.end() (where the abort was reported)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--endings", default=",".join(ENDINGS))
    parser.add_argument("--load", type=int, default=0, help="busy-loop processes meanwhile")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a job may take")
    parser.add_argument("--log", help="append each abnormal job's output to this file")
    parser.add_argument("--job", nargs=3, metavar=("STRATEGY", "ENDING", "RUN_DIR"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(*args.job)
        return
    strategies, endings = args.strategies.split(","), args.endings.split(",")
    for word in strategies + endings:
        if word not in STRATEGIES + ENDINGS:
            parser.error(f"unknown strategy or ending {word!r}")
    combos = list(itertools.product(strategies, endings))
    if args.quick:
        combos = [("zero1", "no-end")]
    jobs = args.jobs if args.jobs is not None else (len(combos) if args.quick else 24)
    plan = list(itertools.islice(itertools.cycle(combos), jobs))

    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.load)]
    for proc in spinners:
        proc.start()
    runs: dict[tuple[str, str], list[str]] = {combo: [] for combo in combos}
    seconds: list[float] = []
    try:
        with tempfile.TemporaryDirectory(prefix="accumix-stress-") as tmp:
            for index, (strategy, ending) in enumerate(plan, 1):
                why, took, tail = run_job(strategy, ending, Path(tmp), args.timeout)
                runs[(strategy, ending)].append(why)
                seconds.append(took)
                if why:
                    print(f"job {index}/{jobs} {strategy} {ending}: abnormal ({why})", flush=True)
                    if args.log:
                        with open(args.log, "a") as log:
                            log.write(f"=== job {index} {strategy} {ending}: {why}\n{tail}\n")
                elif index % 10 == 0:
                    bad = sum(bool(w) for ws in runs.values() for w in ws)
                    print(f"job {index}/{jobs}: {bad} abnormal so far", flush=True)
    finally:
        for proc in spinners:
            proc.terminate()

    whys = Counter(w for ws in runs.values() for w in ws if w)
    bad = sum(whys.values())
    print(machine_line(f"load {args.load} busy process(es), loadavg {os.getloadavg()[0]:.2f}"))
    print(f"seconds per job: median {fmt(median(seconds))}, total {sum(seconds):.0f}")
    for strategy in strategies:
        mine = [w for (s, _), ws in runs.items() if s == strategy for w in ws]
        if mine:
            print(f"{strategy}: {sum(bool(w) for w in mine)} of {len(mine)} abnormal")
    if whys:
        print("why: " + ", ".join(f"{why} x{n}" for why, n in whys.most_common()))
    print(f"abnormal exits: {bad} of {len(plan)} ({100 * bad / max(len(plan), 1):.1f}%)")
    rows = [(s, e, len(ws), sum(bool(w) for w in ws)) for (s, e), ws in runs.items() if ws]
    print(markdown_table(["strategy", "ending", "jobs", "abnormal"], rows))


if __name__ == "__main__":
    main()
