"""The house rules DESIGN.md sets for the code's layout, checked on the source: imports flow one way
(no cycle among jaxtron's modules, the tools and launch.py), the schema imports nothing of the code
that uses it, every module opens with a docstring saying its concern, and no package module passes
~400 lines."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 420  # "~400": a module past this is two concerns
PACKAGE = sorted((ROOT / "jaxtron").glob("*.py"))
SCRIPTS = sorted((ROOT / "tools").glob("*.py")) + [ROOT / "launch.py"]


def _name(path: Path) -> str:
    """The module name an import statement would use for `path`."""
    if path.parent.name == "jaxtron":
        return f"jaxtron.{path.stem}"
    return path.stem  # tools import each other as top-level modules (text_inputs)


def _imports(path: Path, known: set[str]) -> set[str]:
    """The known modules `path` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            candidates = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found |= {c for c in candidates if c in known}
    return found - {_name(path)}


def _graph() -> dict[str, set[str]]:
    files = PACKAGE + SCRIPTS
    known = {_name(f) for f in files}
    return {_name(f): _imports(f, known) for f in files}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep, path + [dep])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_import_cycle():
    graph = _graph()
    assert len(graph) > 20 and graph["jaxtron.train"]  # the scan really reads the imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_schema_and_the_model_import_no_parallel_code():
    graph = _graph()
    assert graph["jaxtron.config"] == {"jaxtron.errors", "jaxtron.presets"}  # files -> dicts
    assert graph["jaxtron.presets"] == {"jaxtron.errors"} and graph["jaxtron.errors"] == set()
    assert not graph["jaxtron.model"] & {"jaxtron.pipeline", "jaxtron.train", "jaxtron.step"}


@pytest.mark.parametrize("path", PACKAGE, ids=lambda p: p.name)
def test_package_module_is_one_concern(path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_LINES, f"{path.name}: {len(text.splitlines())} lines"
    if path.name != "__init__.py":
        assert ast.get_docstring(ast.parse(text)), f"{path.name} does not say its concern"
