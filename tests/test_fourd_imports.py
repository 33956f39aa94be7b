"""How fourd's modules import each other, read from their source (AST): packages import only lower layers, no
module-level cycle, and the planner's side imports no torch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Lowest first; a module imports from its own package or a lower layer, never from its own layer or above.
LAYERS = [
    {"errors", "compat", "digest"},
    {"schedules", "model", "manifest"},
    {"layout"},
    {"config"},
    {"data", "comm"},
    {"ckpt", "parallel"},
    {"hf", "plan"},
    {"sim", "measure"},
    {"train", "lab"},
    {"cli"},
    {"__main__"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
# No upward edge is left: the measuring code (calibrate, peak FLOP/s, timing) lives in fourd/measure/.
KNOWN_UPWARD: set[tuple[str, str]] = set()
TORCH_FREE = (
    "fourd.plan",
    "fourd.sim",
    "fourd.schedules",
    "fourd.layout",
    "fourd.config",
    "fourd.errors",
    "fourd.cli",
)


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, top_only: bool) -> set[str]:
    """The fourd modules (or torch) a module imports: at module level only, or anywhere; TYPE_CHECKING blocks aside."""
    found, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        if not (top_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))):
            todo += ast.iter_child_nodes(node)
    return found


SOURCES = {_module(p): ast.parse(p.read_text()) for p in sorted((ROOT / "fourd").rglob("*.py"))}


def _edges(top_only: bool) -> dict[str, set[str]]:
    """module -> the fourd modules it imports (a `from fourd.x import y` names fourd.x.y when that is a module)."""
    return {
        m: {i for i in _imports(t, top_only) if i in SOURCES and i != m} for m, t in SOURCES.items()
    }


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def test_packages_import_only_lower_layers():
    assert set(LAYER) >= {_package(m) for m in SOURCES} - {"__init__"}, (
        "a new package: give it a layer"
    )
    upward = sorted(
        (m, i)
        for m, imported in _edges(top_only=False).items()
        for i in imported
        if _package(i) != _package(m) and LAYER.get(_package(i), -1) >= LAYER.get(_package(m), -1)
    )
    assert set(upward) == KNOWN_UPWARD, upward
    assert not any(
        _package(i) == "hf"
        for m, imported in _edges(False).items()
        if _package(m) == "data"
        for i in imported
    )


def test_no_module_level_import_cycle():
    edges, state, cycles = _edges(top_only=True), {}, []

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for i in sorted(edges[m]):
            if state.get(i) == "open":
                cycles.append(path[path.index(i) :] + [i])
            elif i not in state:
                visit(i, [*path, i])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert cycles == []


@pytest.mark.parametrize("prefix", TORCH_FREE)
def test_the_planner_side_imports_no_torch(prefix):
    """Statically (the module-level imports, followed through fourd) and for real, in a fresh interpreter."""
    edges, seen, todo = (
        _edges(top_only=True),
        set(),
        [m for m in SOURCES if m == prefix or m.startswith(prefix + ".")],
    )
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += edges[m]
    torch = sorted(
        m
        for m in seen
        if any(i.split(".")[0] == "torch" for i in _imports(SOURCES[m], top_only=True))
    )
    assert torch == [], f"{prefix} reaches torch at import through {torch}"
    modules = sorted(m for m in SOURCES if m.startswith(prefix) and not m.endswith("__main__"))
    probe = f"import sys\nfor m in {modules!r}: __import__(m)\nassert 'torch' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-400:]
