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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader

from accumix.errors import ConfigError
from accumix.precision.policy import PRECISION_WORDS
from accumix.recipes.gpt import GPT, GPTConfig
from accumix.recipes.text_data import (
    ByteDocumentDataset,
    decode,
    encode,
    pad_collate,
    split_files,
    stdlib_files,
)
from accumix.strategies.registry import STRATEGY_WORDS

BACKENDS = ("torch", "jax")
MODEL_FILE = "model.safetensors"


@dataclass(kw_only=True, frozen=True, slots=True)
class DataConfig:
    """Where the text comes from.

    Args:
        path: a directory of text files; None: the Python standard library's ``.py`` files.
        pattern: the glob of files under ``path`` (recursive with ``**``).
        max_files: use a random subset of this many files (None: all).
        val_fraction: share of files held out for validation (whole files).
        max_train_bytes: stop reading training text after this many bytes (None: all).
        max_val_bytes: the same for validation text (it bounds each evaluation's time).
        seed: seed of the file subset and of the split.
    """

    path: str | None = None
    pattern: str = "**/*.py"
    max_files: int | None = 300
    val_fraction: float = 0.05
    max_train_bytes: int | None = None
    max_val_bytes: int | None = 60_000
    seed: int = 0


@dataclass(kw_only=True, frozen=True, slots=True)
class OptimizerConfig:
    """AdamW and its schedule: linear warmup, then cosine or linear decay to ``min_lr_ratio``.

    Args:
        lr: the peak learning rate (at ``base_batch_size`` when that is given).
        weight_decay: AdamW's decoupled decay, on matrices only (not biases, norms).
        betas: AdamW's betas.
        warmup_steps: steps of linear warmup.
        decay: ``cosine``, ``linear`` or ``constant``.
        min_lr_ratio: the final learning rate as a fraction of the peak.
        base_batch_size: when given, ``lr`` is scaled from this batch to the global batch.
        scale_rule: ``linear`` or ``sqrt``, for that scaling.
    """

    lr: float = 2e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 10
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.1
    base_batch_size: int | None = None
    scale_rule: Literal["linear", "sqrt"] = "sqrt"


@dataclass(kw_only=True, frozen=True, slots=True)
class SampleConfig:
    """The text generated at the end (rank 0).

    Args:
        prompt: the text it continues.
        max_new_tokens: bytes to generate (0: no sample).
        temperature: sampling temperature (0: greedy).
        top_k: sample among the k likeliest bytes (None: all).
    """

    prompt: str = "def "
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = 20

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ConfigError("sample.prompt is empty; give at least one character")
        if self.max_new_tokens < 0:
            raise ConfigError(f"sample.max_new_tokens={self.max_new_tokens} is invalid; use >= 0")


@dataclass(kw_only=True, frozen=True, slots=True)
class TrainConfig:
    """Everything ``accumix train`` reads; YAML keys and ``key=value`` overrides use these names.

    Args:
        name: the run's name; the run directory is ``runs/<name>`` unless ``output_dir``.
        backend: ``torch`` (accumix) or ``jax`` (accumix.jax): the same model, data and outputs.
        init_from: a ``model.safetensors`` to start from (written by either backend's run:
            ``<run_dir>/model.safetensors``), instead of a fresh initialisation.
        output_dir: the run directory (metrics, checkpoints, plot).
        nproc: processes to launch on this machine: ``auto`` (GPUs, else CPU cores) or N.
        seed: seeds every rank identically (model init, shuffling).
        strategy: ``auto``, ``single``, ``ddp``, ``zero1``, ``fsdp``, ``deepspeed``.
        precision: ``auto``, ``fp32``, ``bf16-mixed``, ``fp16-mixed``, ``bf16-true``.
        compile: ``torch.compile`` the model (inductor) after the strategy wrapped it
            (``Accelerator(compile=True)``); the JAX backend always jits and ignores it.
        global_batch_size: documents per optimizer step over all ranks (fixed whatever nproc).
        micro_batch_size: documents per forward on one rank, or ``auto``: the largest that
            fits (probed with ``block_size``-token documents, the longest the data gives).
        memory_limit: what ``micro_batch_size=auto`` may use per device: bytes or a
            percentage such as ``"90%"``; null: the whole device.
        max_steps: optimizer steps to train (None: ``max_epochs`` decides).
        max_epochs: epochs to train (None: ``max_steps`` decides).
        eval_every: evaluate every N steps (and at the end); None: only at the end.
        checkpoint_every: save every N steps (and at the end); None: never.
        resume: continue from the run directory's latest checkpoint when there is one.
        grad_clip: the max gradient norm (None: no clipping).
        progress_bar: show the progress bar.
        plot: write ``metrics.png`` at the end.
        loggers: metric loggers: ``csv``, ``jsonl``, ``tensorboard``, ``mlflow``, ``wandb``,
            ``clearml`` (null: csv, jsonl and tensorboard when installed).
        log_model: trackers upload the final ``model.safetensors``.
        system_metrics_every: every rank's system metrics every N steps (null: off).
        model: the GPT's shape.
        data: the text.
        optimizer: AdamW and the LR schedule.
        sample: the generated text at the end.
    """

    name: str = "gpt-stdlib"
    backend: str = "torch"
    init_from: str | None = None
    output_dir: str | None = None
    nproc: int | Literal["auto"] = "auto"
    seed: int = 0
    strategy: str = "auto"
    precision: str = "auto"
    compile: bool = False
    global_batch_size: int = 32
    micro_batch_size: int | Literal["auto"] = 8
    memory_limit: int | str | None = None
    max_steps: int | None = 120
    max_epochs: int | None = None
    eval_every: int | None = 40
    checkpoint_every: int | None = 60
    resume: bool = True
    grad_clip: float | None = 1.0
    progress_bar: bool = True
    plot: bool = True
    loggers: tuple[str, ...] | None = None
    log_model: bool = False
    system_metrics_every: int | None = 10
    model: GPTConfig = field(default_factory=lambda: GPTConfig(
        block_size=128, n_layer=4, n_head=4, n_embd=256))
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r} is invalid; use one of "
                              f"{', '.join(BACKENDS)}")
        if self.backend == "jax" and self.strategy == "deepspeed":
            raise ConfigError("strategy='deepspeed' is a PyTorch engine; with backend=jax use "
                              "zero1 or fsdp (or backend=torch)")
        if self.init_from is not None and not Path(self.init_from).is_file():
            raise ConfigError(f"init_from={self.init_from!r} is not a file; give a "
                              "model.safetensors written by accumix train")
        if self.strategy not in STRATEGY_WORDS:
            raise ConfigError(f"strategy={self.strategy!r} is invalid; use one of "
                              f"{', '.join(STRATEGY_WORDS)}")
        if self.precision not in PRECISION_WORDS:
            raise ConfigError(f"precision={self.precision!r} is invalid; use one of "
                              f"{', '.join(PRECISION_WORDS)}")
        for name in ("nproc", "global_batch_size", "micro_batch_size", "max_steps",
                     "max_epochs", "eval_every", "checkpoint_every", "system_metrics_every"):
            value = getattr(self, name)
            if isinstance(value, int) and value < 1:
                raise ConfigError(f"{name}={value} is invalid; use an integer >= 1")
        if self.max_steps is None and self.max_epochs is None:
            raise ConfigError("max_steps and max_epochs are both null; give one of them")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError(f"grad_clip={self.grad_clip} is invalid; use a number > 0 or null")
        from accumix.trainer.loggers import LOGGER_WORDS

        unknown = [w for w in self.loggers or () if w not in LOGGER_WORDS]
        if unknown:
            raise ConfigError(f"loggers: unknown logger {unknown[0]!r}; use "
                              f"{', '.join(LOGGER_WORDS)}")
        if not 0 < self.data.val_fraction < 1:
            raise ConfigError(f"data.val_fraction={self.data.val_fraction} is invalid; use a "
                              "number in (0, 1)")

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name


def text_files(data: DataConfig) -> list[Path]:
    """The recipe's files: the stdlib's ``.py`` files, or ``data.pattern`` under ``data.path``.

    Raises:
        ConfigError: ``data.path`` is not a directory or holds no matching files.
    """
    if data.path is None:
        return stdlib_files(max_files=data.max_files, seed=data.seed)
    root = Path(data.path)
    if not root.is_dir():
        raise ConfigError(f"data.path={data.path!r} is not a directory")
    files = sorted(p for p in root.glob(data.pattern) if p.is_file())
    if len(files) < 2:
        raise ConfigError(f"data.path={data.path!r} has {len(files)} files matching "
                          f"{data.pattern!r}; it needs at least 2 (one is held out)")
    if data.max_files is not None and data.max_files < len(files):
        keep = torch.randperm(len(files), generator=torch.Generator().manual_seed(data.seed))
        files = sorted(files[i] for i in keep[: data.max_files].tolist())
    return files


def datasets(config: TrainConfig) -> tuple[list[Path], list[Path], ByteDocumentDataset,
                                           ByteDocumentDataset]:
    """The recipe's files, split by whole files, and their documents: (train files, held-out
    files, train, validation); the same for both backends."""
    files = text_files(config.data)
    train_files, val_files = split_files(files, config.data.val_fraction, seed=config.data.seed)
    block = config.model.block_size
    train = ByteDocumentDataset(train_files, block, max_bytes=config.data.max_train_bytes)
    val = ByteDocumentDataset(val_files, block, max_bytes=config.data.max_val_bytes)
    return train_files, val_files, train, val


def total_steps(config: TrainConfig, documents: int, world_size: int, grad_accum_steps: int,
                micro_batch_size: int | None = None) -> int:
    """The step the schedule decays to: ``max_steps``, or ``max_epochs`` worth of windows."""
    micro = micro_batch_size or config.micro_batch_size
    assert isinstance(micro, int)
    per_rank_batches = math.ceil(math.ceil(documents / world_size) / micro)
    steps_per_epoch = math.ceil(per_rank_batches / grad_accum_steps)
    return min(s for s in (config.max_steps, config.max_epochs and
                           config.max_epochs * steps_per_epoch) if s)


def _param_groups(model: GPT, weight_decay: float) -> list[dict[str, Any]]:
    # nanoGPT's split: decay matrices (weights of Linear and Embedding), not biases or norms.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def gpt_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    """The recipe's step: ``(loss_sum, num_items)`` over the batch's real (unpadded) tokens."""
    return model(batch["input_ids"], labels=batch["labels"])


def choose_micro_batch(acc: Any, config: TrainConfig, model: GPT, optimizer: Any, *,
                       cache: bool = True) -> tuple[Any, Any, int]:
    """``micro_batch_size=auto``: sets up the model and optimizer and probes them with
    ``block_size``-token documents (the longest the data gives); the choice is cached in the run
    directory when ``cache``. Returns the set-up model, optimizer and the chosen micro batch."""
    trained, stepped = acc.setup(model, optimizer)
    worst = [torch.zeros(config.model.block_size + 1, dtype=torch.int64)]  # a full block
    micro = acc.find_micro_batch_size(lambda batch: gpt_step(trained, batch),
                                      lambda n: pad_collate(worst * n),
                                      run_dir=config.run_dir if cache else None)
    return trained, stepped, micro


def new_optimizer(config: TrainConfig, model: GPT) -> torch.optim.Optimizer:
    """The recipe's AdamW (learning rate scaled to the global batch when asked)."""
    opt_cfg = config.optimizer
    lr = opt_cfg.lr
    if opt_cfg.base_batch_size is not None:
        from accumix.trainer import scale_lr

        lr = scale_lr(lr, global_batch_size=config.global_batch_size,
                      base_batch_size=opt_cfg.base_batch_size, rule=opt_cfg.scale_rule)
    return torch.optim.AdamW(_param_groups(model, opt_cfg.weight_decay), lr=lr,
                             betas=opt_cfg.betas)


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
                         compile=True if config.compile else None)
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
        checkpoint_every=config.checkpoint_every, run_dir=config.run_dir, resume=config.resume,
        grad_clip=config.grad_clip, progress_bar=config.progress_bar,
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


def load_weights(model: GPT, path: str) -> None:
    """Loads a ``model.safetensors`` of either backend into ``model`` (strict).

    Raises:
        ConfigError: the file's keys or shapes do not fit ``model`` (another model shape).
    """
    from safetensors.torch import load_file

    tensors = load_file(path)
    expected = model.state_dict()
    wrong = sorted(k for k in expected if k in tensors
                   and tuple(tensors[k].shape) != tuple(expected[k].shape))
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if wrong or missing or extra:
        detail = (f"{wrong[0]} is {tuple(tensors[wrong[0]].shape)}, this model's "
                  f"{tuple(expected[wrong[0]].shape)}" if wrong else
                  f"missing {missing[:3]}, unexpected {extra[:3]}")
        raise ConfigError(f"init_from={path!r} does not fit this GPT ({detail}); set model.* to "
                          "the shape it was trained with")
    model.load_state_dict(tensors)


@torch.no_grad()
def generate(model: torch.nn.Module, sample: SampleConfig, *, seed: int = 0) -> str:
    """Continues ``sample.prompt`` with the model (in eval mode), reproducibly."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    prompt = encode(sample.prompt).unsqueeze(0).to(device)
    out = model.generate(prompt, sample.max_new_tokens, temperature=sample.temperature,
                         top_k=sample.top_k, generator=torch.Generator(device).manual_seed(seed))
    model.train(was_training)
    return decode(out[0])
