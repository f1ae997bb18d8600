"""The house's shape, checked on the source: jaxtron's subpackages stand in layers and every import
goes down them or stays in its own room (so no cycle can form); the schema imports nothing of the
code that uses it; the model does not touch the mesh; every module opens with a docstring saying
its one concern, which docs/architecture.md's module table shows (a module is split where its
concerns part, not at a line count)."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from jaxtron.parallel import MESH_AXES

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "scripts" / "doc_tables.py")
doc_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(doc_tables)  # the import graph and the docs' generated tables
LAYERS, MODULES, SCRIPTS = doc_tables.LAYERS, doc_tables.MODULES, doc_tables.SCRIPTS
_name, _room, _graph = doc_tables.module_name, doc_tables.room, doc_tables.graph


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a jaxtron module that climbs to a higher layer, as 'a -> b'."""
    rank = {room: i for i, room in enumerate(LAYERS)}
    found = []
    for module, deps in sorted(graph.items()):
        if not module.startswith("jaxtron."):
            continue  # scripts stand above the whole package
        for dep in sorted(deps):
            if dep == "jaxtron" or not dep.startswith("jaxtron."):
                continue
            if rank[_room(dep)] > rank[_room(module)]:
                found.append(f"{module} -> {dep}")
    return found


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


def test_every_module_has_a_room_in_the_layers():
    rooms = {_room(_name(f)) for f in MODULES if _name(f) != "jaxtron"}
    assert rooms == set(LAYERS), rooms ^ set(LAYERS)
    packages = [room for room in LAYERS if (ROOT / "jaxtron" / room / "__init__.py").exists()]
    assert len(packages) >= 5, packages


def test_imports_go_down_the_layers():
    graph = _graph()
    assert len(graph) > 40 and graph["jaxtron.train.loop"]  # the scan really reads the imports
    assert _upward(graph) == []


def test_the_layer_check_finds_an_upward_import():
    graph = {"jaxtron.model": {"jaxtron.train.loop", "jaxtron.parallel"}, "jaxtron.train.loop": set(),
             "jaxtron.parallel": set()}
    assert _upward(graph) == ["jaxtron.model -> jaxtron.train.loop"]


def test_no_import_cycle():
    graph = _graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_schema_and_the_model_import_no_parallel_code():
    graph = _graph()
    assert graph["jaxtron.config"] == {"jaxtron.config.schema"}
    assert graph["jaxtron.config.schema"] == {"jaxtron.config.errors", "jaxtron.config.presets",
                                              "jaxtron.config.model"}
    assert graph["jaxtron.config.presets"] == {"jaxtron.config.errors"}
    assert graph["jaxtron.config.model"] == set()
    assert graph["jaxtron.config.errors"] == set()
    model = [name for name in graph if name.startswith("jaxtron.model")]
    assert len(model) >= 5, model
    for name in model:
        assert not {dep for dep in graph[name] if dep.startswith(
            ("jaxtron.parallel.pipeline", "jaxtron.train", "jaxtron.step"))}, name


@pytest.mark.parametrize("init", sorted((ROOT / "jaxtron").glob("*/__init__.py")),
                         ids=lambda p: p.parent.name)
def test_a_package_init_only_names_what_its_modules_hold(init):
    """The code lives in modules named for what they hold (config/schema.py, step/train_step.py);
    a package's __init__ has its docstring and the names it hands on, nothing else."""
    body = ast.parse(init.read_text()).body
    code = [f"line {node.lineno}: {type(node).__name__}" for node in body[1:]
            if not isinstance(node, (ast.Import, ast.ImportFrom))]
    assert isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), init
    assert code == [], code


# what only the operations set and parallel/ may touch: the ambient mesh, per-device programs,
# shardings by mesh axis, and the collectives
MESH_MECHANICS = {"get_abstract_mesh", "shard_map", "PartitionSpec", "NamedSharding", "Mesh",
                  "AxisType", "with_sharding_constraint", "psum", "psum_scatter", "pmax", "pmin",
                  "pmean", "ppermute", "all_gather", "all_to_all", "axis_index", "axis_size"}


def _mesh_mechanics(path: Path) -> list[str]:
    """Each use of a mesh mechanic or a mesh axis name in `path` (docstrings and comments
    aside), as 'file:line name'."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
                  and ast.get_docstring(node) is not None}
    found = []
    for node in ast.walk(tree):
        name = (node.attr if isinstance(node, ast.Attribute) else
                node.id if isinstance(node, ast.Name) else
                node.value if isinstance(node, ast.Constant) and id(node) not in docstrings
                and node.value in MESH_AXES else
                next((a.name for a in node.names if a.name in MESH_MECHANICS), None)
                if isinstance(node, ast.ImportFrom) else None)
        if name in MESH_MECHANICS or (isinstance(node, ast.Constant) and name):
            found.append(f"{path.name}:{node.lineno} {name}")
    return found


def test_the_model_says_what_it_computes_not_how_it_runs():
    """jaxtron/model/ neither reads the mesh, nor names a mesh axis, nor runs a per-device
    program or a collective: the operations set (jaxtron/ops/) does."""
    found = [hit for path in sorted((ROOT / "jaxtron" / "model").glob("*.py"))
             for hit in _mesh_mechanics(path)]
    assert found == []


def test_the_mesh_check_finds_mechanics(tmp_path):
    """The scan above finds a collective over a named axis, a shard_map and the ambient mesh,
    and lets a docstring name an axis."""
    sample = tmp_path / "sample.py"
    sample.write_text('"""tensor"""\nimport jax\nfrom jax.sharding import PartitionSpec\n'
                      'y = jax.lax.psum(1, "tensor")\n'
                      'm = jax.sharding.get_abstract_mesh()\nf = jax.shard_map\n')
    found = sorted(hit.split(":")[1] for hit in _mesh_mechanics(sample))
    assert found == ["3 PartitionSpec", "4 psum", "4 tensor", "5 get_abstract_mesh",
                     "6 shard_map"]


def test_checkpoints_know_nothing_of_the_input():
    """The train state does not depend on the input pipeline: a checkpoint saves the iterator as
    Grain's item and hands its directory back on restore; the data check is a callable."""
    graph = _graph()
    of_checkpoints = {dep for module, deps in graph.items()
                      if module.startswith("jaxtron.checkpoint") for dep in deps}
    assert of_checkpoints and not {d for d in of_checkpoints if d.startswith("jaxtron.data")}


@pytest.mark.parametrize("path", MODULES + SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_says_its_concern(path):
    assert ast.get_docstring(ast.parse(path.read_text())), f"{path} does not say its concern"


def test_the_docs_tables_are_the_codes():
    """docs/architecture.md's module table and the README's mesh-axis table are made from the
    code (scripts/doc_tables.py): a module, an import or an axis the docs leave out fails here."""
    for doc, (marker, make) in doc_tables.TABLES.items():
        text = (ROOT / doc).read_text()
        assert doc_tables.rewritten(text, marker, make()) == text, (
            f"{doc} differs from the code: run python scripts/doc_tables.py")
    assert [row.split("`")[1] for row in doc_tables.axis_table()[2:]] == list(MESH_AXES)


def test_ruff_finds_nothing():
    """pyproject.toml's [tool.ruff]: pyflakes, pycodestyle, sorted imports, 100 columns in jaxtron/."""
    ruff = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", str(ROOT)],
                          capture_output=True, text=True, cwd=ROOT)
    assert ruff.returncode == 0, ruff.stdout + ruff.stderr


@pytest.mark.parametrize("init", sorted((ROOT / "jaxtron").glob("*/__init__.py")),
                         ids=lambda p: p.parent.name)
def test_no_package_hides_a_submodule(init):
    """A name a package's __init__ binds (a function `attention`) that is also a submodule's name
    (attention.py) makes `from jaxtron.model import attention` the function, not the module."""
    package = f"jaxtron.{init.parent.name}"
    submodules = {p.stem for p in init.parent.glob("*.py")} - {"__init__"}
    bound = set()
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Assign):
            bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom) and node.module != package:  # not a submodule
            bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            bound |= {a.asname for a in node.names if a.asname and a.asname != a.name}
    assert not bound & submodules, sorted(bound & submodules)



def _imported(node: ast.AST) -> list[str]:
    """The modules an import statement, or an import_module/__import__ call by name, takes."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [node.module] if node.module and not node.level else []
    if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")):
        return [str(node.args[0].value)]
    return []


def _shared_by_import(path: Path) -> list[str]:
    """Each import in `path` of conftest or a test_* module, as 'file:line module': at any depth,
    by name, and in a string that parses as Python (code a subprocess runs) at its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        inner = [node]
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                inner = list(ast.walk(ast.parse(node.value)))
            except (SyntaxError, ValueError):
                continue  # prose, a path, a pattern: not code
        found += [f"{path.name}:{node.lineno} {name}" for each in inner for name in _imported(each)
                  if name.split(".")[0] == "conftest" or name.split(".")[0].startswith("test_")]
    return found


def test_test_modules_share_through_helpers_only():
    """What test modules share is in tests/helpers.py: a test module that imports another runs
    that one's module code again under its own name and ties the two together, and conftest.py
    holds pytest's hooks and fixtures only."""
    tests = ROOT / "tests"
    found = [hit for path in [*sorted(tests.glob("test_*.py")), tests / "helpers.py",
                              tests / "conftest.py"] for hit in _shared_by_import(path)]
    assert not found, f"import from tests/helpers.py instead: {', '.join(found)}"


def test_the_shared_import_check_finds_them_at_any_depth(tmp_path):
    """The scan above finds conftest and test modules imported at the top, in a function, by
    name, and in code for a subprocess; helpers and a module named like a test's are fine."""
    sample = tmp_path / "test_sample.py"
    # the names filled in: this file's own strings import nothing
    sample.write_text("import {0}\nfrom helpers import ROOT\nimport testing\n\n\ndef f():\n"
                      "    from {1} import x\n    importlib.import_module('{2}')\n"
                      "    run(['python', '-c', 'from {2}.sub import y'])\n"
                      .format("conftest", "test_data", "test_preemption"))
    assert _shared_by_import(sample) == [
        "test_sample.py:1 conftest", "test_sample.py:7 test_data",
        "test_sample.py:8 test_preemption", "test_sample.py:9 test_preemption.sub"]


def test_each_test_marked_slow_for_time_is_a_test():
    """tests/slow_tests.txt names tests that exist: a renamed test would otherwise leave the
    list and run in `pytest` again, unnoticed. (conftest.py reads it; no test module imports
    conftest, so the file is read here too.)"""
    listed = [line.split("  #")[0].strip()
              for line in (ROOT / "tests" / "slow_tests.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert len(listed) == len(set(listed)) > 0
    for node in listed:
        path, name = node.split("::")
        source = ROOT / path
        assert source.is_file(), node
        assert f"def {name.split('[')[0]}(" in source.read_text(), node
