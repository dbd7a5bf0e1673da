"""The default recipe's settings: ``TrainConfig`` and its parts (data, optimizer, sample).

Every setting is a key of ``TrainConfig``; ``accumix train job.yaml model.n_layer=6`` changes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from accumix.common.locations import is_url
from accumix.errors import ConfigError
from accumix.precision.reduce_dtype import check_fp16_reduction, parse_reduce_dtype
from accumix.precision.words import PRECISION_WORDS
from accumix.recipes.config_checks import check_init_from
from accumix.recipes.gpt import GPTConfig
from accumix.strategies.registry import STRATEGY_WORDS

BACKENDS = ("torch", "jax")


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

    def __post_init__(self) -> None:
        for name in ("max_files", "max_train_bytes", "max_val_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"data.{name}={value} is invalid; use an integer >= 1 or null")


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

    def __post_init__(self) -> None:
        # torch's AdamW would refuse these with a traceback on every rank, after the launch.
        if self.lr < 0:
            raise ConfigError(f"optimizer.lr={self.lr} is invalid; use a number >= 0")
        if self.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay={self.weight_decay} is invalid; use a "
                              "number >= 0")
        if not all(0 <= beta < 1 for beta in self.betas):
            raise ConfigError(f"optimizer.betas={list(self.betas)} is invalid; use two numbers "
                              "in [0, 1), e.g. [0.9, 0.95]")
        if self.warmup_steps < 0:
            raise ConfigError(f"optimizer.warmup_steps={self.warmup_steps} is invalid; use an "
                              "integer >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optimizer.min_lr_ratio={self.min_lr_ratio} is invalid; use a "
                              "number in [0, 1]")
        if self.base_batch_size is not None and self.base_batch_size < 1:
            raise ConfigError(f"optimizer.base_batch_size={self.base_batch_size} is invalid; "
                              "use an integer >= 1 or null")


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
        if self.temperature < 0:
            raise ConfigError(f"sample.temperature={self.temperature} is invalid; use >= 0")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"sample.top_k={self.top_k} is invalid; use an integer >= 1 or "
                              "null")


@dataclass(kw_only=True, frozen=True, slots=True)
class TrainConfig:
    """Everything ``accumix train`` reads; YAML keys and ``key=value`` overrides use these names.

    Args:
        name: the run's name; the run directory is ``runs/<name>`` unless ``output_dir``.
        backend: ``torch`` (accumix) or ``jax`` (accumix.jax): the same model, data and outputs.
        init_from: a ``model.safetensors`` to start from (written by either backend's run:
            ``<run_dir>/model.safetensors``), instead of a fresh initialisation.
        output_dir: the run directory (metrics, checkpoints, plot); an object store URL
            (``s3://bucket/job``) holds the checkpoints, and the rest goes to ``runs/<name>``.
        nproc: processes to launch on this machine: ``auto`` (GPUs, else CPU cores) or N.
        seed: seeds every rank identically (model init, shuffling).
        strategy: ``auto``, ``single``, ``ddp``, ``zero1``, ``fsdp``, ``hsdp`` (several
            nodes), ``deepspeed``.
        precision: ``auto``, ``fp32``, ``bf16-mixed``, ``fp16-mixed``, ``bf16-true``.
        reduce_dtype: what gradients travel in between ranks: ``fp32``, ``bf16``, ``fp16``
            (``fp16-mixed`` only); null: the precision's (float32; bf16 under ``bf16-true``;
            float32 under every precision on the JAX backend).
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
        checkpoint_background: write the periodic saves behind the training loop (the loop
            waits only while the state is copied to host memory).
        resume: continue from the run directory's latest checkpoint when there is one.
        grad_clip: the max gradient norm (None: no clipping).
        progress_bar: show the progress bar.
        plot: write ``metrics.png`` at the end.
        loggers: metric loggers: ``csv``, ``jsonl``, ``tensorboard``, ``mlflow``, ``wandb``,
            ``clearml``, each once (``[csv,mlflow]``; one word alone or ``csv,mlflow`` is read
            as that list; null: csv, jsonl and tensorboard when installed).
        log_model: trackers upload the final ``model.safetensors``.
        system_metrics_every: every rank's system metrics every N steps (null: off).
        preemption_signals: the signals that save at the next step and stop (exit status
            143): ``[SIGTERM]``; ``[SIGUSR1]`` for ``sbatch --signal=USR1@90``.
        requeue: after that save, rank 0 asks SLURM to requeue the job (``scontrol requeue``).
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
    reduce_dtype: str | None = None
    compile: bool = False
    global_batch_size: int = 32
    micro_batch_size: int | Literal["auto"] = 8
    memory_limit: int | str | None = None
    max_steps: int | None = 120
    max_epochs: int | None = None
    eval_every: int | None = 40
    checkpoint_every: int | None = 60
    checkpoint_background: bool = False
    resume: bool = True
    grad_clip: float | None = 1.0
    progress_bar: bool = True
    plot: bool = True
    loggers: tuple[str, ...] | None = None
    log_model: bool = False
    system_metrics_every: int | None = 10
    preemption_signals: tuple[str, ...] = ("SIGTERM",)
    requeue: bool = False
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
        if self.init_from is not None:
            check_init_from(self.init_from)
        if self.strategy not in STRATEGY_WORDS:
            raise ConfigError(f"strategy={self.strategy!r} is invalid; use one of "
                              f"{', '.join(STRATEGY_WORDS)}")
        if self.precision not in PRECISION_WORDS:
            raise ConfigError(f"precision={self.precision!r} is invalid; use one of "
                              f"{', '.join(PRECISION_WORDS)}")
        if self.reduce_dtype is not None:
            try:
                wire = parse_reduce_dtype(str(self.reduce_dtype))
            except ConfigError:
                raise ConfigError(f"reduce_dtype={self.reduce_dtype!r} is invalid; use fp32, "
                                  "bf16, fp16 or null (the precision's)") from None
            if self.precision != "auto":  # "auto" resolves on each rank; the Accelerator checks
                # One line here, not one traceback per rank after the launch.
                check_fp16_reduction(wire, loss_scaled=self.precision == "fp16-mixed",
                                     precision=self.precision)
        for name in ("nproc", "global_batch_size", "micro_batch_size", "max_steps",
                     "max_epochs", "eval_every", "checkpoint_every", "system_metrics_every"):
            value = getattr(self, name)
            if isinstance(value, int) and value < 1:
                raise ConfigError(f"{name}={value} is invalid; use an integer >= 1")
        if self.max_steps is None and self.max_epochs is None:
            raise ConfigError("max_steps and max_epochs are both null; give one of them")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError(f"grad_clip={self.grad_clip} is invalid; use a number > 0 or null")
        from accumix.common.preemption import parse_signals
        from accumix.trainer.loggers import check_logger_words

        parse_signals(self.preemption_signals, key="preemption_signals")

        try:
            check_logger_words(list(self.loggers or ()))
        except ConfigError as exc:
            raise ConfigError(f"loggers: {exc}") from None
        if not 0 < self.data.val_fraction < 1:
            raise ConfigError(f"data.val_fraction={self.data.val_fraction} is invalid; use a "
                              "number in (0, 1)")

    @property
    def run_dir(self) -> Path:
        """The local run directory (metrics, plot, model; the checkpoints unless
        ``output_dir`` is an object store URL)."""
        if self.output_dir and not is_url(self.output_dir):
            return Path(self.output_dir)
        return Path("runs") / self.name

    def trainer_dirs(self) -> dict[str, Any]:
        """The Trainer's ``run_dir`` (where checkpoints go), ``local_dir`` and
        ``checkpoint_background``."""
        remote = bool(self.output_dir) and is_url(self.output_dir or "")
        return {"run_dir": self.output_dir if remote else self.run_dir,
                "local_dir": self.run_dir if remote else None,
                "checkpoint_background": self.checkpoint_background}
