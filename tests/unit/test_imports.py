"""Imports run one way: no circle between the project's modules, ``pipeline`` never
imports ``flows``, nor ``train`` but in the train stage (its library), ``train`` never imports
``flows`` or a stage, and the pure CAPO math (steps,
critique parsing, voting, rewards, significance, tokenization, the loss) imports no engine,
orchestrator, database or project I/O module.

Every ``import`` statement counts, also those inside functions (a lazy import still ties two
modules together). The graph is read from the source with :mod:`ast`; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("pipeline", "critic_eval", "flows", "train")
# layer -> layers it must not import
FORBIDDEN_LAYERS = {"pipeline": {"flows", "train", "critic_eval"}, "train": {"flows", "critic_eval"},
                    "critic_eval": {"flows", "train"}}
PURE = ("pipeline.core", "pipeline.core.segment", "pipeline.core.critique", "pipeline.core.critique.escape",
        "pipeline.core.critique.templates", "pipeline.core.critique.parse", "pipeline.core.critique.health",
        "pipeline.core.critique.mode", "pipeline.core.mc", "pipeline.core.voting",
        "pipeline.core.rewards", "pipeline.core.significance", "pipeline.core.tokenization", "train.loss")
PURE_MAY_IMPORT = {"train.loss": {"torch"}, "pipeline.core.significance": {"scipy"}}  # besides the standard library, numpy and other pure modules


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            parts = f.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(name: str, path: Path) -> set[str]:
    """Every module name ``path`` imports (absolute, with ``from a import b`` also as ``a.b``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                pkg = name.split(".")[: -node.level] if not path.name == "__init__.py" else name.split(".")
                base = ".".join([*pkg, *([node.module] if node.module else [])])
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {i for i in _imports(m, p) if i in mods and i != m} for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert _cycles(_graph()) == []


STAGE_OVER_LIBRARY = {"pipeline.stages.train": {"train"}}
"""The one exception to the layers: the train stage runs its library (the update loop on tensors), as
every other stage runs its engines; ``train`` in turn imports no stage (below)."""


def test_layers_import_one_way():
    bad = [f"{m} -> {i}" for m, deps in _graph().items() for i in deps
           if i.split(".")[0] in FORBIDDEN_LAYERS.get(m.split(".")[0], set()) - STAGE_OVER_LIBRARY.get(m, set())]
    assert bad == []


def test_the_trainer_library_imports_no_stage():
    bad = [f"{m} -> {i}" for m, deps in _graph().items() if m.split(".")[0] == "train" for i in deps
           if i == "pipeline.stages" or i.startswith("pipeline.stages.")]
    assert bad == []


@pytest.mark.parametrize("module", PURE)
def test_pure_math_imports_no_engine_orchestrator_or_io(module):
    import sys

    mods = _modules()
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for name in _imports(module, mods[module]):
        top = name.split(".")[0]
        if name in mods or top in PACKAGES:
            if name in mods and name not in PURE and name.split(".")[0] in PACKAGES and name != top:
                bad.append(name)
        elif top not in stdlib and top != "numpy" and top not in PURE_MAY_IMPORT.get(module, set()) and top != "__future__":
            bad.append(name)
    assert bad == [], f"{module} imports {bad}"


def test_pipeline_train_and_critic_eval_import_no_orchestrator():
    """Prefect, Dask and Ray belong to ``flows/``: the stages and the trainer run without them."""
    mods = _modules()
    bad = [f"{m} -> {i}" for m, p in mods.items() if m.split(".")[0] != "flows"
           for i in _imports(m, p) if i.split(".")[0] in ("prefect", "prefect_dask", "prefect_ray", "dask", "ray")]
    assert bad == []


def test_every_package_is_in_the_distribution():
    """``pyproject.toml`` lists its packages by hand: a subpackage left out is missing from a wheel
    or a non-editable ``pip install .`` (an editable install hides it)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(f.parent.relative_to(REPO).parts) for pkg in PACKAGES for f in (REPO / pkg).rglob("__init__.py")}
    assert listed == found, f"missing from pyproject.toml: {sorted(found - listed)}; not packages: {sorted(listed - found)}"
