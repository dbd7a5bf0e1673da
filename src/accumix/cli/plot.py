"""``accumix plot RUN_DIR``: loss, lr, loss scale, grad norm and throughput from metrics.csv.

Writes ``RUN_DIR/metrics.png`` with matplotlib's Agg backend (no display needed). Needs
matplotlib: ``pip install 'accumix[plot]'``.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

from accumix.common.safe_write import replace_with
from accumix.errors import ConfigError

PLOT_NAME = "metrics.png"


def _floats(rows: list[dict[str, str]], column: str) -> list[float]:
    out = []
    for row in rows:
        try:
            out.append(float(row.get(column) or "nan"))
        except ValueError:
            out.append(math.nan)
    return out


def read_metrics(run_dir: str | Path) -> list[dict[str, str]]:
    """The rows of ``run_dir/metrics.csv``.

    Raises:
        ConfigError: no such file, or it has no rows.
    """
    path = Path(run_dir) / "metrics.csv"
    if not path.is_file():
        raise ConfigError(f"{str(path)!r} does not exist; give a run directory the Trainer "
                          "wrote (with the csv logger)")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ConfigError(f"{str(path)!r} has no rows yet")
    return rows


def plot_metrics(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Draws the run's curves into a PNG.

    Args:
        run_dir: a run directory with ``metrics.csv``.
        output: the PNG's path; default ``run_dir/metrics.png``.

    Returns:
        The PNG's path.

    Raises:
        ConfigError: no metrics, or matplotlib is not installed.
    """
    rows = read_metrics(run_dir)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plotting needs matplotlib; pip install 'accumix[plot]'") from None
    steps = _floats(rows, "step")
    tokens = _floats(rows, "tokens_per_s")
    has_tokens = any(math.isfinite(t) for t in tokens)
    panels = [
        ("loss", ["loss", "val_loss"], "linear"),
        ("learning rate", ["lr"], "linear"),
        ("loss scale", ["loss_scale"], "log"),
        ("grad norm", ["grad_norm"], "log"),
        ("tokens/s" if has_tokens else "samples/s",
         ["tokens_per_s" if has_tokens else "samples_per_s"], "linear"),
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 * len(panels)), sharex=True)
    for ax, (title, columns, scale) in zip(axes, panels, strict=True):
        drawn = False
        for column in columns:
            points = [(s, v) for s, v in zip(steps, _floats(rows, column), strict=True)
                      if math.isfinite(v)]
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            style = {"marker": "o", "linestyle": "-"} if column.startswith("val_") else {}
            ax.plot(xs, ys, label=column, **style)
            drawn = True
            if scale == "log" and min(ys) > 0:
                ax.set_yscale("log")
        if not drawn:
            ax.text(0.5, 0.5, "not recorded (fp32/bf16 have no loss scale)" if title ==
                    "loss scale" else "not recorded", ha="center", va="center",
                    transform=ax.transAxes, color="gray")
        elif len(columns) > 1:
            ax.legend(loc="upper right")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    skipped = [s for s, k in zip(steps, _floats(rows, "skipped"), strict=True) if k == 1]
    for s in skipped:
        axes[0].axvline(s, color="red", alpha=0.2)
    axes[-1].set_xlabel("optimizer step")
    fig.suptitle(f"{Path(run_dir).resolve().name}: {len(rows)} steps"
                 + (f", {len(skipped)} skipped" if skipped else ""))
    fig.tight_layout()
    path = Path(output) if output is not None else Path(run_dir) / PLOT_NAME
    # Never through a link planted at the name: a fresh file renamed over it.
    replace_with(path, lambda tmp: fig.savefig(tmp, dpi=100, format=path.suffix[1:] or "png"))
    plt.close(fig)
    return path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plot", help="PNG of loss, lr, loss scale, grad norm and throughput",
        description="Plot a run's metrics.csv (loss and validation loss, learning rate, loss "
        "scale, gradient norm, throughput) into RUN_DIR/metrics.png.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory with metrics.csv")
    parser.add_argument("--output", "-o", default=None, help="the PNG path (default: "
                        "RUN_DIR/metrics.png)")
    parser.set_defaults(run=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    print(plot_metrics(args.run_dir, args.output))
    return 0
