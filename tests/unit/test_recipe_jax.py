"""``accumix train backend=jax``: the default recipe on accumix.jax, its outputs, resume,
weights across backends, and bad values."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

jax = pytest.importorskip("jax")

from accumix.cli.main import main  # noqa: E402
from tests.xla_flags import xla_flags  # noqa: E402

TINY = ["eval_every=2", "checkpoint_every=2", "model.n_layer=1", "model.n_embd=32",
        "model.n_head=2", "model.block_size=32", "data.max_files=8", "data.max_val_bytes=2000",
        "sample.max_new_tokens=8", "nproc=1", "progress_bar=false", "global_batch_size=16",
        "micro_batch_size=4", "optimizer.lr=1e-2", "optimizer.warmup_steps=1",
        "precision=fp32", "seed=3"]


def train(run_dir: Path, *extra: str, capsys=None) -> str:
    assert main(["train", *TINY, f"output_dir={run_dir}", *extra]) == 0
    return capsys.readouterr().out if capsys is not None else ""


def rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def test_jax_recipe_learns_and_writes_the_torch_recipes_outputs(tmp_path, capsys) -> None:
    out = train(tmp_path / "jax", "backend=jax", "max_steps=6", capsys=capsys)
    jax_rows = rows(tmp_path / "jax")
    assert [int(r["step"]) for r in jax_rows] == list(range(1, 7))
    losses = [float(r["loss"]) for r in jax_rows]
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 0.5  # ln(256) = 5.55 at the start
    assert jax_rows[1]["val_loss"] and not jax_rows[0]["val_loss"]
    assert (tmp_path / "jax" / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "jax" / "step-6").is_dir() and (tmp_path / "jax" / "model.safetensors")
    assert "accumix train (jax)" in out and "strategy ddp" in out and "sample:\ndef " in out
    train(tmp_path / "torch", "max_steps=2")
    assert list(rows(tmp_path / "torch")[0]) == list(jax_rows[0])  # the same columns


def test_a_second_run_resumes_and_ends_bitwise_as_an_uninterrupted_one(tmp_path,
                                                                       capsys) -> None:
    run_dir = tmp_path / "run"
    train(run_dir, "backend=jax", "max_steps=4", capsys=capsys)
    whole = (run_dir / "model.safetensors").read_bytes()
    # As if the run had died after its step-2 checkpoint.
    shutil.rmtree(run_dir / "step-4")
    (run_dir / "latest").write_text("step-2\n")
    (run_dir / "model.safetensors").unlink()
    caplog_out = train(run_dir, "backend=jax", "max_steps=4", capsys=capsys)
    assert (run_dir / "model.safetensors").read_bytes() == whole
    assert [int(r["step"]) for r in rows(run_dir)] == [1, 2, 3, 4]
    assert "done: step 4" in caplog_out


def _val_losses(weights: Path) -> tuple[float, float]:
    """The validation loss of ``weights`` under each backend (fp32, the same held-out files)."""
    import accumix as ax
    import accumix.jax as axj
    from accumix.recipes import default, default_jax
    from accumix.trainer.config import load_config
    from accumix.trainer.evaluation import evaluate
    from accumix.trainer.jax_steps import JaxSteps

    config = load_config(default.TrainConfig, None, [*TINY, f"init_from={weights}"])
    files = default.text_files(config.data)
    _, val_files = default.split_files(files, config.data.val_fraction, seed=config.data.seed)
    val = default.ByteDocumentDataset(val_files, config.model.block_size,
                                      max_bytes=config.data.max_val_bytes)
    from functools import partial

    from torch.utils.data import DataLoader

    model = default.GPT(config.model)
    default.load_weights(model, str(weights))
    acc = ax.Accelerator(strategy="single", precision="fp32")
    model = acc.setup(model)
    torch_loss = evaluate(model, DataLoader(val, batch_size=4, collate_fn=default.pad_collate),
                          default.gpt_step, acc)["val_loss"]
    acc.end()
    jacc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=1)
    params = default_jax.initial_params(config)
    tx, _ = default_jax.optimizer_and_schedule(config, params, 2, 16)
    state = jacc.setup(params, tx)
    collate = partial(default_jax.padded_collate, length=config.model.block_size, rows=4)
    steps = JaxSteps(accelerator=jacc, state=state, train_windows=None,
                     loss_fn=lambda p, b, r: default_jax.gpt_jax.loss_sum(p, b, config.model),
                     val_loader=DataLoader(val, batch_size=4, collate_fn=collate),
                     preemption_signals=())
    return torch_loss, steps.validate()["val_loss"]


def test_weights_cross_backends_with_the_same_validation_loss(tmp_path, capsys) -> None:
    train(tmp_path / "torch", "max_steps=2", capsys=capsys)
    torch_loss, jax_loss = _val_losses(tmp_path / "torch" / "model.safetensors")
    assert abs(torch_loss - jax_loss) < 1e-4 and torch_loss < 5.5
    train(tmp_path / "jax", "backend=jax", "max_steps=2", capsys=capsys)
    torch_loss, jax_loss = _val_losses(tmp_path / "jax" / "model.safetensors")
    assert abs(torch_loss - jax_loss) < 1e-4 and jax_loss < 5.5
    # And the JAX run starts from the torch weights when told to.
    out = train(tmp_path / "again", "backend=jax", "max_steps=1",
                f"init_from={tmp_path / 'torch' / 'model.safetensors'}", capsys=capsys)
    assert "done: step 1" in out


@pytest.mark.parametrize("args,message", [
    (["backend=tensorflow"], "backend='tensorflow' is invalid; use one of torch, jax"),
    (["backend=jax", "strategy=deepspeed"], "strategy='deepspeed' is a PyTorch engine"),
    (["init_from=/nonexistent/model.safetensors"], "is not a file"),
    (["backend=jax", "nproc=1", "micro_batch_size=auto"],
     "reports no memory size; pass memory_limit="),
    (["backend=jax", "nproc=1", "micro_batch_size=auto", "memory_limit=90%"],
     "memory_limit='90%' is a share of a total this device does not report; give bytes"),
])
def test_bad_values_exit_2_with_one_line(args, message, capsys) -> None:
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_subprocess_gets_exit_status_2_and_no_traceback() -> None:
    done = subprocess.run([sys.executable, "-m", "accumix.cli.main", "train",
                           "backend=jax", "strategy=deepspeed"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_weights_of_another_shape_exit_2_with_one_line(tmp_path, capsys) -> None:
    from safetensors.torch import save_file

    from accumix.recipes.gpt import GPT, GPTConfig

    small = GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32))
    weights = tmp_path / "model.safetensors"
    save_file({k: v.clone().contiguous() for k, v in small.state_dict().items()}, str(weights))
    for backend in ("jax", "torch"):
        code = main(["train", *TINY, "model.n_embd=64", f"backend={backend}", "max_steps=1",
                     f"init_from={weights}", f"output_dir={tmp_path / backend}"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, err
        assert "does not fit this GPT" in err[-1] and "model.*" in err[-1], err


def test_sigterm_saves_at_the_next_read_and_exits_143(tmp_path, capsys) -> None:
    """A pre-emption signal (the flag its handler sets) saves the state and stops as the torch
    Trainer does: ``Preempted``, exit status 143, which a scheduler retries (it was 0, which
    reads as done)."""
    from accumix.trainer import Callback
    from accumix.trainer.jax_steps import JaxSteps

    class Signal(Callback):
        def on_optimizer_step(self, trainer, metrics):
            if metrics.step == 3:
                trainer.steps._watch._on_signal(15, None)

    original = JaxSteps.__init__

    def patched(self, **kwargs):
        original(self, **{**kwargs, "read_every": 1})

    from accumix.trainer.trainer import Trainer

    fit = Trainer.fit

    def fit_with_signal(self):
        self.callbacks.append(Signal())
        return fit(self)

    mp = pytest.MonkeyPatch()
    mp.setattr(JaxSteps, "__init__", patched)
    mp.setattr(Trainer, "fit", fit_with_signal)
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(["train", *TINY, "backend=jax", "max_steps=8", "checkpoint_every=null",
                  f"output_dir={tmp_path}"])
    finally:
        mp.undo()
    assert exit_info.value.code == 143
    # Set while step 3's row was handed out, the flag is agreed at the next read (step 4): a
    # read's one gather comes before its rows, which carry every process's system metrics.
    assert (tmp_path / "latest").read_text().strip() == "step-4"


def _recipe_peaks(sizes: list[int]) -> dict[int, int]:
    """The recipe's compiled window step's bytes per device for each micro batch (TINY, fp32,
    max_steps=3), as ``micro_batch_size=auto`` measures them (``block_size``-token rows)."""
    from functools import partial

    import accumix.jax as axj
    from accumix.jax.micro_batch import window_peak_bytes
    from accumix.recipes import default, default_jax
    from accumix.trainer.config import load_config

    config = load_config(default.TrainConfig, None, [*TINY, "max_steps=3"])
    acc = axj.Accelerator(strategy=config.strategy, precision="fp32", global_batch_size=16,
                          micro_batch_size="auto", memory_limit=10**9, seed=config.seed)
    params = default_jax.initial_params(config)
    tx, _ = default_jax.optimizer_and_schedule(config, params, 3, 16)
    state = acc.setup(params, tx)
    return {m: window_peak_bytes(acc, state, default_jax.make_loss_fn(config.model),
                                 partial(default_jax.worst_batch, config.model), m,
                                 clip_norm=config.grad_clip) for m in sizes}


def test_auto_chooses_under_memory_limit_equals_the_explicit_run_and_caches(
        tmp_path, capsys) -> None:
    """``micro_batch_size=auto`` with a memory_limit between the compiled peaks of 4 and 8 rows
    (2 devices: candidates 2, 4, 8, 16) chooses 4, says so in the torch recipe's one line,
    trains bitwise as ``micro_batch_size=4`` does; the restart with the same settings reads the
    run directory's cache and compiles no probe; ``accumix estimate-memory`` shows the same
    choice (2 rows per device) without training."""
    import json
    import logging

    from accumix.common.micro_batch_search import DEFAULT_HEADROOM
    from accumix.jax import micro_batch
    from accumix.memory.micro_batch_cache import CACHE_FILE

    peaks = _recipe_peaks([4, 8])
    assert peaks[4] < peaks[8], peaks
    limit = int((peaks[4] + peaks[8]) / 2 / (1 - DEFAULT_HEADROOM))
    auto = ["backend=jax", "micro_batch_size=auto", f"memory_limit={limit}"]
    compiled, said = [], []
    original = micro_batch.window_peak_bytes
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("accumix")
    mp = pytest.MonkeyPatch()
    level = logger.level
    logger.setLevel(logging.INFO)  # as the CLI's own handler sets it (pytest's may not)
    logger.addHandler(handler)
    mp.setattr(micro_batch, "window_peak_bytes",
               lambda *a, **k: compiled.append(a[4]) or original(*a, **k))
    try:
        out = train(tmp_path / "auto", *auto, "max_steps=3", capsys=capsys)
        probes = len(compiled)
        assert "= micro batch 4 x 1 process(es) x K=4" in out
        train(tmp_path / "explicit", "backend=jax", "max_steps=3", capsys=capsys)
        assert (tmp_path / "auto" / "model.safetensors").read_bytes() == (
            tmp_path / "explicit" / "model.safetensors").read_bytes()
        assert [r["loss"] for r in rows(tmp_path / "auto")] == [
            r["loss"] for r in rows(tmp_path / "explicit")]
        train(tmp_path / "auto", *auto, "max_steps=4", capsys=capsys)  # resumes from step 3
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        mp.undo()
    said = [line for line in said if "micro_batch_size=auto chose" in line]
    assert said[0].startswith("micro_batch_size=auto chose 4 (K=4 on 1 rank, global 16): peak ")
    assert said[1] == (f"micro_batch_size=auto chose 4 (K=4 on 1 rank, global 16) (cached in "
                       f"{tmp_path / 'auto'})") and len(said) == 2, said
    assert main(["estimate-memory", *TINY, *auto, "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert said[0] in out.splitlines() and "micro batch 2 x 32 tokens per device, K=4" in out
    assert probes >= 2 and 8 in compiled[:probes] and len(compiled) == probes  # none again
    assert [json.loads((tmp_path / "auto" / CACHE_FILE).read_text())[k]["micro_batch_size"]
            for k in json.loads((tmp_path / "auto" / CACHE_FILE).read_text())] == [4]
    assert [int(r["step"]) for r in rows(tmp_path / "auto")] == [1, 2, 3, 4]



def test_auto_elastic_restart_on_two_processes_chooses_again(tmp_path) -> None:
    """One process chooses 16 (K=1) and checkpoints; the restart on 2 processes keeps global
    16, finds no answer for its world in the cache, chooses again (agreed: 8 each) and goes on
    from step 1; the run directory then holds both answers."""
    import json
    import os

    from accumix.memory.micro_batch_cache import CACHE_FILE

    tiny = [a for a in TINY if not a.startswith(("micro_batch_size", "nproc", "sample"))]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "XLA_FLAGS")}
    env["XLA_FLAGS"] = xla_flags()  # one host device per process, the suite's faster compile
    lines = []
    for steps, nproc in ((1, 1), (2, 2)):
        done = subprocess.run(
            [sys.executable, "-m", "accumix.cli.main", "train", *tiny, "backend=jax",
             "micro_batch_size=auto", f"memory_limit={10**9}", "sample.max_new_tokens=0",
             "plot=false", "eval_every=null", f"max_steps={steps}", f"checkpoint_every={steps}",
             f"nproc={nproc}", f"output_dir={tmp_path}"],
            capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        lines += [x for x in done.stderr.splitlines() if "micro_batch_size=auto chose" in x]
    assert "micro_batch_size=auto chose 16 (K=1 on 1 rank, global 16): peak" in lines[0]
    assert "micro_batch_size=auto chose 8 (K=1 on 2 ranks, global 16): peak" in lines[1]
    assert len(lines) == 2, lines
    assert sorted(v["micro_batch_size"] for v in json.loads(
        (tmp_path / CACHE_FILE).read_text()).values()) == [8, 16]
    assert [int(r["step"]) for r in rows(tmp_path)] == [1, 2]


def test_auto_global_batch_smaller_than_the_world_is_a_config_error() -> None:
    """``micro_batch_size=auto`` with a global batch that the processes do not divide: the
    candidates' one-line ConfigError before anything is set up. Before: ZeroDivisionError in
    the schedule's length (global // world = 0 rows per process)."""
    from types import SimpleNamespace

    from accumix.errors import ConfigError
    from accumix.recipes import default, default_jax
    from accumix.trainer.config import load_config

    config = load_config(default.TrainConfig, None, [*TINY, "backend=jax",
                                                     "micro_batch_size=auto",
                                                     "memory_limit=1000000000",
                                                     "global_batch_size=1"])
    acc = SimpleNamespace(world_size=2)  # never set up: the check comes first
    with pytest.raises(ConfigError, match=r"global_batch_size=1 does not divide over 2 "):
        default_jax.set_up(acc, config, {}, 100)
