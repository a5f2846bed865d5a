"""The package's imports run one way, down the layers docs/code-layout.md lists, and no import of
a jaxcnn module hides inside a function (the commands', which keep JAX out of flag
parsing, excepted). Read from the source with `ast`: nothing is imported to check it."""

import ast
from pathlib import Path

from conftest import REPO

# Bottom to top, as in docs/code-layout.md ("How the code is laid out"). A module may import its
# own layer's modules (no cycle: checked below) and those of the layers under it.
LAYERS = [
    (
        "jaxcnn.errors",
        "jaxcnn.host_memory",
        "jaxcnn.stopping",
        "jaxcnn.requeue",
        "jaxcnn.config",
        "jaxcnn.run_config",
        "jaxcnn.platform_choices",
        "jaxcnn.compile_cache",
        "jaxcnn.compiling",
        "jaxcnn.layers",
    ),
    ("jaxcnn.sharding",),
    ("jaxcnn.data",),
    (
        "jaxcnn.results",
        "jaxcnn.plots",
        "jaxcnn.checkpoint",
        "jaxcnn.resume",
        "jaxcnn.distributed",
        "jaxcnn.autobatch",
        "jaxcnn.runs",
    ),
    ("jaxcnn.optim", "jaxcnn.models"),
    ("jaxcnn.program", "jaxcnn.saved_model", "jaxcnn.pretrained"),
    ("jaxcnn.steps",),
    ("jaxcnn.fit",),
    ("jaxcnn.pipeline",),
    ("jaxcnn.spmd",),
    ("jaxcnn.build",),
    ("jaxcnn.inference",),
    ("jaxcnn.export",),
    ("jaxcnn.analysis",),
    ("jaxcnn.benchmarks",),
    ("jaxcnn.recovery", "jaxcnn.run_record"),
    ("jaxcnn.run",),
    ("jaxcnn.commands",),
    ("jaxcnn.__main__",),
]
TRAINING = ("jaxcnn.build", "jaxcnn.spmd", "jaxcnn.pipeline", "jaxcnn.fit", "jaxcnn.steps", "jaxcnn.program")


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    for rank, names in enumerate(LAYERS):
        if any(module == name or module.startswith(name + ".") for name in names) or module == "jaxcnn":
            return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and to docs/code-layout.md's map")


def _imports(path: Path, modules: set[str]) -> list[tuple[str, bool]]:
    """(imported jaxcnn module, imported inside a function?) for every import in the file."""
    tree = ast.parse(path.read_text())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from pkg import sub` imports the submodule; `from pkg import name` the package
            targets = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            ]
        else:
            continue
        found += [(t, id(node) in nested) for t in targets if t.startswith("jaxcnn")]
    return found


def _graph() -> dict[str, list[tuple[str, bool]]]:
    files = sorted((REPO / "jaxcnn").rglob("*.py"))
    modules = {_module(f) for f in files}
    return {_module(f): _imports(f, modules) for f in files}


def test_imports_run_down_the_layers():
    upward = [
        f"{module} imports {target}"
        for module, imports in _graph().items()
        for target, _ in imports
        if target != "jaxcnn" and _layer(target) > _layer(module)
    ]
    assert not upward, upward


def test_no_import_cycle_and_no_import_hidden_in_a_function():
    graph = _graph()
    hidden = [
        f"{m} imports {t} in a function"
        for m, imps in graph.items()
        for t, lazy in imps
        if lazy and not m.startswith("jaxcnn.commands")
    ]
    assert not hidden, hidden
    edges = {m: {t for t, _ in imps if t in graph and t != m} for m, imps in graph.items()}
    done, visiting = set(), []

    def visit(module):
        assert module not in visiting, "import cycle: " + " -> ".join([*visiting[visiting.index(module) :], module])
        if module in done:
            return
        visiting.append(module)
        for target in edges[module]:
            if not module.startswith(target + "."):  # a submodule naming its own package's axes etc.
                visit(target)
        visiting.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_training_never_imports_the_analysis_or_benchmark_packages():
    graph = _graph()
    found = [f"{m} imports {t}" for m, imps in graph.items() if m.startswith(TRAINING)
             for t, _ in imps if t.startswith(("jaxcnn.analysis", "jaxcnn.benchmarks"))]  # fmt: skip
    assert not found, found


def test_the_analysis_package_never_imports_the_training_loop():
    """analysis/ reads compiled programs back; what runs `fit` is a benchmark (jaxcnn.benchmarks)."""
    graph = _graph()
    found = [f"{m} imports {t}" for m, imps in graph.items() if m.startswith("jaxcnn.analysis")
             for t, _ in imps if t.startswith("jaxcnn.fit")]  # fmt: skip
    assert not found, found
