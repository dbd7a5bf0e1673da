"""The default recipe behind ``accumix train`` and ``make run``: a small byte-level GPT learning
the Python standard library's own source.

Variable-length documents (pieces of ``.py`` files, each file's last piece short), padded per
batch, trained with the item-weighted loss ``backward(loss_sum, num_items=n)``; a fixed global
batch on however many processes were launched; whole files held out for validation. The run
writes ``runs/<name>/`` (metrics.csv, metrics.jsonl, checkpoints, metrics.png) and ends with the
validation loss and a sample of generated text.

Every setting is a key of ``TrainConfig``; ``accumix train job.yaml model.n_layer=6`` changes it.
"""

from __future__ import annotations

import math
import time
from typing import Any

from torch.utils.data import DataLoader

from accumix.errors import ConfigError
from accumix.recipes.gpt import GPT as GPT
from accumix.recipes.gpt import GPTConfig as GPTConfig
from accumix.recipes.gpt_training import choose_micro_batch as choose_micro_batch
from accumix.recipes.gpt_training import generate as generate
from accumix.recipes.gpt_training import gpt_step as gpt_step
from accumix.recipes.gpt_training import load_weights as load_weights
from accumix.recipes.gpt_training import new_optimizer as new_optimizer
from accumix.recipes.text_data import ByteDocumentDataset as ByteDocumentDataset
from accumix.recipes.text_data import decode as decode
from accumix.recipes.text_data import encode as encode
from accumix.recipes.text_data import pad_collate as pad_collate
from accumix.recipes.text_data import split_files as split_files
from accumix.recipes.text_data import stdlib_files as stdlib_files
from accumix.recipes.train_config import BACKENDS as BACKENDS
from accumix.recipes.train_config import DataConfig as DataConfig
from accumix.recipes.train_config import OptimizerConfig as OptimizerConfig
from accumix.recipes.train_config import SampleConfig as SampleConfig
from accumix.recipes.train_config import TrainConfig as TrainConfig
from accumix.recipes.train_data import datasets as datasets
from accumix.recipes.train_data import text_files as text_files

MODEL_FILE = "model.safetensors"


def total_steps(config: TrainConfig, documents: int, world_size: int, grad_accum_steps: int,
                micro_batch_size: int | None = None) -> int:
    """The step the schedule decays to: ``max_steps``, or ``max_epochs`` worth of windows."""
    micro = micro_batch_size or config.micro_batch_size
    assert isinstance(micro, int)
    per_rank_batches = math.ceil(math.ceil(documents / world_size) / micro)
    steps_per_epoch = math.ceil(per_rank_batches / grad_accum_steps)
    return min(s for s in (config.max_steps, config.max_epochs and
                           config.max_epochs * steps_per_epoch) if s)


def run(config: TrainConfig) -> int:
    """Trains the recipe on the processes this one was launched with (collective).

    Returns:
        0.

    Raises:
        ConfigError: settings that cannot work here (batch sizes that do not divide, ...).
    """
    import accumix as ax
    from accumix.recipes.tracking import SaveModelAtEnd, tracking_options
    from accumix.trainer import ThroughputMonitor, Trainer, warmup_schedule

    started = time.perf_counter()
    acc = ax.Accelerator(strategy=config.strategy, precision=config.precision,
                         global_batch_size=config.global_batch_size,
                         micro_batch_size=config.micro_batch_size, seed=config.seed,
                         memory_limit=config.memory_limit,
                         compile=True if config.compile else None,
                         reduce_dtype=config.reduce_dtype)
    train_files, val_files, train, val = datasets(config)
    model = GPT(config.model)
    if config.init_from is not None:
        load_weights(model, config.init_from)
    opt_cfg = config.optimizer
    optimizer = new_optimizer(config, model)
    micro, trained, stepped = config.micro_batch_size, model, optimizer
    if micro == "auto":  # probed now: the loader, the schedule and the Trainer get the choice
        trained, stepped, micro = choose_micro_batch(acc, config, model, optimizer)
    loader = DataLoader(train, batch_size=micro, shuffle=True, collate_fn=pad_collate)
    total = total_steps(config, len(train), acc.world_size, acc.grad_accum_steps, micro)
    scheduler = warmup_schedule(optimizer, warmup_steps=min(opt_cfg.warmup_steps, total),
                                total_steps=total, decay=opt_cfg.decay,
                                min_ratio=opt_cfg.min_lr_ratio)
    if stepped is not optimizer:  # set up already: the Trainer takes set-up objects only
        loader, scheduler = acc.setup(loader, scheduler)
    trainer = Trainer(
        model=trained, optimizer=stepped, train_loader=loader, scheduler=scheduler,
        val_loader=DataLoader(val, batch_size=micro, collate_fn=pad_collate),
        accelerator=acc, step_fn=gpt_step, max_steps=config.max_steps,
        max_epochs=config.max_epochs, eval_every=config.eval_every,
        checkpoint_every=config.checkpoint_every, **config.trainer_dirs(), resume=config.resume,
        grad_clip=config.grad_clip, progress_bar=config.progress_bar,
        preemption_signals=config.preemption_signals, requeue=config.requeue,
        callbacks=[ThroughputMonitor(flops_per_item=model.flops_per_token()),
                   SaveModelAtEnd(lambda: acc.save_model(config.run_dir))],
        **tracking_options(config),
    )
    acc.print(
        f"accumix train: {model.num_parameters() / 1e6:.1f}M-parameter GPT on "
        f"{len(train_files)} files ({train.num_targets / 1e6:.1f}M training bytes in "
        f"{len(train)} documents; {len(val_files)} files held out)\n"
        f"  {acc.world_size} process(es), strategy {acc.strategy.name}, precision "
        f"{acc.policy.name}, global batch {config.global_batch_size} = micro batch "
        f"{micro} x {acc.world_size} rank(s) x K={acc.grad_accum_steps}; "
        f"run directory {config.run_dir}", flush=True)
    result = trainer.fit()  # SaveModelAtEnd wrote the weights both backends load (init_from=)
    unwrapped = acc.unwrap(trainer.model)
    report(acc, config, result, num_val=len(val), started=started)
    if config.sample.max_new_tokens > 0:
        # Every rank generates the same text: a sharded model's forward is collective.
        text = generate(unwrapped, config.sample, seed=config.seed)
        acc.print("sample:\n" + text, flush=True)
    acc.end()
    return 0


def report(acc: Any, config: TrainConfig, result: Any, *, num_val: int, started: float) -> None:
    """The run's closing lines on the main process (either backend), and the plot."""
    from accumix.cli.plot import plot_metrics

    if acc.is_main_process:
        if math.isnan(result.loss) and result.resumed_from is not None:
            print(f"nothing to train: {result.resumed_from} is already at step {result.step} "
                  f"(max_steps={config.max_steps}); raise max_steps, or start afresh with "
                  "resume=false or another output_dir", flush=True)
        summary = f"done: step {result.step}"
        if not math.isnan(result.loss):
            summary += f", train loss {result.loss:.4f}"
        if result.val_loss is not None:
            summary += (f", validation loss {result.val_loss:.4f} (perplexity "
                        f"{math.exp(result.val_loss):.2f} per byte) on {num_val} held-out "
                        "documents")
        print(f"{summary}; {time.perf_counter() - started:.0f}s", flush=True)
        if config.plot and (config.run_dir / "metrics.csv").exists():
            try:
                print(f"plot: {plot_metrics(config.run_dir)}", flush=True)
            except ConfigError as exc:
                print(f"plot: skipped ({exc})", flush=True)

