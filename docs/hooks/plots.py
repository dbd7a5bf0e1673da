"""Pictures of BENCHMARKS.md's tables, drawn at each build from the tables' own numbers (the
``<!-- accumix:benchmark-plots -->`` marker of ``docs/benchmarks.md``)."""

from __future__ import annotations

import re
from typing import Any


def benchmark_table(text: str, heading: str, nth: int = 0) -> list[dict[str, str]]:
    """The ``nth`` Markdown table under the ``## heading`` (its start) of BENCHMARKS.md, as rows
    of ``{column: cell}`` (a repeated column name gets ``#2``).

    Raises:
        ValueError: no such section or table: the picture's source moved, and the build says so.
    """
    match = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    tables = re.findall(r"((?:^\|.*\|\s*$\n?)+)", match.group(1) if match else "", flags=re.M)
    if len(tables) <= nth:
        raise ValueError(f"BENCHMARKS.md: no table {nth} under a heading starting {heading!r}; "
                         "docs/hooks/plots.py draws from it")
    rule = re.compile(r"^\|[-| ]+\|$")  # the header's underline
    lines = [line for line in tables[nth].strip().splitlines() if not rule.match(line)]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    header: list[str] = []
    for name in cells[0]:
        header.append(name if name not in header else f"{name} #{header.count(name) + 1}")
    return [dict(zip(header, row, strict=True)) for row in cells[1:]]


def _number(cell: str) -> float:
    return float(cell.replace(",", "").split()[0])


def _svg(figure: Any) -> str:
    import io

    out = io.StringIO()
    figure.savefig(out, format="svg", bbox_inches="tight")
    svg = out.getvalue()
    return svg[svg.index("<svg"):]  # drop the XML prolog: the SVG sits inside the page


def benchmark_plots(text: str) -> str:
    """Three pictures where one reads faster than a table: what crosses nodes as K grows, the
    step's cost against a raw loop, and JAX accumulation's time and exactness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "svg.fonttype": "none"})
    out = []

    rows = benchmark_table(text, "Hybrid sharding across nodes")
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for name in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == name
                and not r["gradients in the window"].startswith("full during")]
        ax.plot([_number(r["K"]) for r in mine], [_number(r["x model"]) for r in mine],
                marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="micro-steps per optimizer step (K)",
           ylabel="bytes across nodes / model's fp32 bytes",
           title="What crosses nodes per optimizer step (2 nodes x 2 ranks)")
    ax.set_xticks([1, 4, 16], ["1", "4", "16"])
    ax.legend(fontsize=8)
    out += [_svg(fig), "", "*From the table under \"Hybrid sharding across nodes (issue 32)\": "
            "hsdp crosses nodes once per step whatever K; fsdp and ZeRO-3 grow with K.*", ""]
    plt.close(fig)

    rows = benchmark_table(text, "The cost of the step")
    fig, ax = plt.subplots(figsize=(6, 2.4))
    names = [r["variant"] for r in rows]
    ax.barh(names, [_number(r["x raw loop"]) for r in rows], color="#5b8def")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set(xlabel="CPU time per optimizer step / raw PyTorch's (median of 100 rounds)",
           title="The cost of the step on a tiny CPU job (K=4)")
    out += [_svg(fig), "", "*From the table under \"The cost of the step (issue 2)\".*", ""]
    plt.close(fig)

    rows = benchmark_table(text, "accumix.jax vs optax", nth=1)  # the rerun after the fix
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 2.4))
    names = [r["method"] for r in rows if not r["method"].endswith("(control)")]
    mine = [r for r in rows if r["method"] in names]
    left.barh(names, [_number(r["x accumix (CPU)"]) for r in mine], color="#5b8def")
    left.invert_yaxis()
    left.set(xlabel="CPU time per step / accumix's", title="time")
    errors = [_number(r["max abs grad diff vs large batch"]) for r in mine]
    right.scatter(errors, range(len(names)), color="#e8804a", zorder=3)
    right.axvline(3.0e-8, color="grey", linestyle="--", linewidth=0.8)
    right.text(3.0e-8, len(names) - 0.6, " float32's floor", fontsize=7, color="grey")
    right.set(xscale="log", xlim=(1e-8, 1e-1), ylim=(len(names) - 0.5, -0.5),
              xlabel="max abs gradient error vs the large batch", title="exactness")
    right.set_yticks([])
    fig.suptitle("Accumulation on JAX, ragged tokens, K=8", fontsize=9, y=1.06)
    out += [_svg(fig), "", "*From the rerun table under \"accumix.jax vs optax MultiSteps and "
            "Keras 3 (issue 9)\"; float32's own floor on this job is 3.0e-08.*", ""]
    plt.close(fig)
    return "\n".join(out)
