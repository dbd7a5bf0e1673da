"""The architecture DESIGN.md draws, checked from the source: packages by concept, one run state,
no import circle through the façade, and backend-free modules that import no backend."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "accumix"
ROOT_MODULES = {"__init__.py", "accelerator.py", "errors.py", "testing.py"}
PACKAGES = {"common", "step", "precision", "strategies", "memory", "checkpoint", "data",
            "runtime", "trainer", "cli", "recipes", "jax"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every accumix module ``path`` imports, anywhere in it (top level, functions and
    ``TYPE_CHECKING`` blocks alike: a type-only import still ties the files together)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(
        ".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("accumix")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if not base.startswith("accumix"):
                continue
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name}
            for name, path in modules.items()}


def test_the_root_holds_the_packages_and_four_modules() -> None:
    files = {p.name for p in SRC.iterdir() if p.suffix == ".py"}
    folders = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert files == ROOT_MODULES
    assert folders == PACKAGES
    for package in PACKAGES:  # each says what it is for and what it may import
        doc = ast.get_docstring(ast.parse((SRC / package / "__init__.py").read_text()))
        assert doc, package


def test_no_import_circle_passes_through_the_facade() -> None:
    graph = _graph()
    seen, todo = set(), list(graph["accumix.accelerator"])
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(graph[name])
    assert "accumix.accelerator" not in seen
    # The pieces of the step take the run state, never the façade.
    for package in ("step", "checkpoint", "memory", "runtime", "data", "strategies",
                    "precision", "common"):
        users = [n for n, deps in graph.items()
                 if n.startswith(f"accumix.{package}") and "accumix.accelerator" in deps]
        assert users == [], package


def test_no_piece_reads_the_facades_private_attributes() -> None:
    private = re.compile(r"\bacc\._[a-z]")
    offenders = [f"{p.relative_to(SRC)}:{i}" for p in SRC.rglob("*.py")
                 if p.name != "accelerator.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if private.search(line)]
    assert offenders == []


def test_backend_free_modules_import_no_backend() -> None:
    backend = re.compile(r"^\s*(import|from)\s+(torch|jax|flax|optax)\b", re.M)
    for path in (SRC / "common").glob("*.py"):
        assert not backend.search(path.read_text()), path.name
    # the memory model the JAX side sizes with
    for name in ("model", "table", "param_counts", "strategy_choice", "device_memory"):
        text = (SRC / "memory" / f"{name}.py").read_text()
        top = text.split("if TYPE_CHECKING:")[0]
        assert not backend.search(top), name
    for name in ("words", "loss_scale", "reduce_dtype"):  # the words both backends parse
        assert not backend.search((SRC / "precision" / f"{name}.py").read_text()), name


def test_a_checkpoint_written_before_the_layout_resumes(tmp_path) -> None:
    """``tests/golden/pre_layout``: saved at step 2 by the code before the move (edc5529), with
    the weights of the same run after step 4. Resumed here, steps 3-4 give those weights."""
    import shutil

    from safetensors.torch import load_file

    from tests.golden import matches_golden
    from tests.golden.pre_layout.make import build, train

    golden = Path(__file__).resolve().parents[1] / "golden" / "pre_layout"
    shutil.copytree(golden / "run", tmp_path / "run")
    acc, model, opt, loader, sched = build()
    acc.load_state(tmp_path / "run")
    assert acc.optimizer_steps == 2
    train(acc, model, opt, loader, sched, until=4)
    expected = load_file(str(golden / "after-step-4.safetensors"))
    got = acc.unwrap(model).state_dict()
    assert expected.keys() == got.keys()
    # Recorded on another machine: within float32 rounding (tests/golden).
    assert all(matches_golden(expected[k], got[k]) for k in expected)
