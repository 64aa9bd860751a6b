"""The framework (hybridflow/) never imports the role code (workers/) or the recipes: they build on
the framework, not the other way round (STYLE 1). Config reaches workers as schema nodes, built into
role specs in recipes/roles.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

FRAMEWORK = Path(__file__).resolve().parents[2] / "hybridflow"


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            found.append((node.lineno, str(node.args[0].value)))  # importlib.import_module("workers.x")
    return found


@pytest.mark.parametrize("package", ["workers", "recipes"])
def test_the_framework_does_not_import(package):
    offenders = [f"{path.relative_to(FRAMEWORK.parent)}:{line} imports {module}"
                 for path in sorted(FRAMEWORK.rglob("*.py"))
                 for line, module in _imported_modules(path)
                 if module == package or module.startswith(package + ".")]
    assert not offenders, "\n".join(offenders)


def test_the_scan_sees_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from workers.actor import ActorWorker\nimport importlib\n"
                      "importlib.import_module('workers.critic')\n")
    assert sorted(m for _, m in _imported_modules(sample)) == ["importlib", "workers.actor", "workers.critic"]


def _config_json_reads(path: Path) -> list[int]:
    """Lines where a file reads a `config.json`: a call that opens, reads or parses (open, read_text,
    read_bytes, json.load/loads, from_json_file) with the string "config.json" in its arguments or receiver."""
    tree = ast.parse(path.read_text(), filename=str(path))
    readers = {"open", "read_text", "read_bytes", "load", "loads", "from_json_file"}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in readers:
            if any(isinstance(n, ast.Constant) and n.value == "config.json" for n in ast.walk(node)):
                lines.append(node.lineno)
    return lines


def test_config_json_is_read_in_one_module():
    """Model facts (heads, layers, sizes, parameters) come from hybridflow/config/model_facts.py only,
    so no two checks read a model's config.json with different names or fallbacks."""
    root = FRAMEWORK.parent
    offenders = [f"{path.relative_to(root)}:{line}"
                 for folder in ("hybridflow", "workers", "recipes")
                 for path in sorted((root / folder).rglob("*.py"))
                 if path != FRAMEWORK / "config" / "model_facts.py"
                 for line in _config_json_reads(path)]
    assert not offenders, "config.json read outside hybridflow/config/model_facts.py: " + ", ".join(offenders)


def test_the_config_json_scan_sees_a_read(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import json\nfrom pathlib import Path\n"
                      "def heads(d):\n    return json.loads((Path(d) / 'config.json').read_text())['n_head']\n"
                      "def exists(d):\n    return (Path(d) / 'config.json').is_file()\n")
    assert _config_json_reads(sample) == [4, 4]  # json.loads and read_text on line 4; is_file is no read


def _runtime_imports(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import in `path` that runs (module level or inside a function; not the
    `if TYPE_CHECKING:` blocks, which only annotations read), relative imports resolved against `package`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                 and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
                 for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]  # a.b: a module, else a name of a
    return found


def _module_names(root: Path, folders=("hybridflow", "workers", "recipes")) -> dict[str, Path]:
    modules = {}
    for folder in folders:
        for path in (root / folder).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_circles(root: Path, folders=("hybridflow", "workers", "recipes")) -> list[list[str]]:
    """The project's import circles: each strongly connected set of two or more modules of `folders`
    in the graph of imports that run (`_runtime_imports`; `from a import b` is an edge to `a.b` when
    that is a module, else to `a`)."""
    modules = _module_names(root, folders)
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for _, imported in _runtime_imports(path, package):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        edges[name] = targets
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(modules):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circles_among_the_project_modules():
    """A module that imports one that imports it back (at module level or inside a function) is one
    design split across two files; issue 39 counted 8 such circles. None is left."""
    circles = import_circles(FRAMEWORK.parent)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_the_circle_count_sees_an_in_function_import_and_ignores_type_only_ones(tmp_path):
    (tmp_path / "hybridflow").mkdir()
    (tmp_path / "hybridflow" / "__init__.py").write_text("")
    (tmp_path / "hybridflow" / "a.py").write_text("from hybridflow.b import f\n")
    (tmp_path / "hybridflow" / "b.py").write_text("def f():\n    from hybridflow import a\n")
    (tmp_path / "hybridflow" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                  "    from hybridflow.d import D\n")
    (tmp_path / "hybridflow" / "d.py").write_text("from . import c\n")
    assert import_circles(tmp_path, ("hybridflow",)) == [["hybridflow.a", "hybridflow.b"]]


def _outside_config_and_stdlib(path: Path) -> list[str]:
    import sys

    return [f"{path.name}:{line} imports {module}" for line, module in _runtime_imports(path, "hybridflow.config")
            if module and module.split(".")[0] not in sys.stdlib_module_names
            and module != "hybridflow.config" and not module.startswith("hybridflow.config.")]


def test_the_schema_imports_only_the_config_package_and_the_standard_library():
    """The schema is data and each section's own rules; what needs the runtime (registries, schedules,
    precision, the adapter's limits) is hybridflow/checks.py, run by to_config and the stage."""
    offenders = _outside_config_and_stdlib(FRAMEWORK / "config" / "schema.py")
    assert not offenders, "\n".join(offenders)


def test_the_schema_import_check_fails_on_a_planted_runtime_import(tmp_path):
    planted = tmp_path / "schema.py"
    planted.write_text("import enum\nfrom hybridflow.config.recipes import recipe_spec\n"
                       "def check():\n    from hybridflow.algos import POLICY_LOSSES\n")
    assert _outside_config_and_stdlib(planted) == ["schema.py:4 imports hybridflow.algos.POLICY_LOSSES"]


PLACEMENT_READS = {"pools", "roles"}  # config.placement.<these>: the plan's pools and roles' pools


def placement_reads(path: Path) -> list[str]:
    """Where a file reads what the stage's plan decides from the config instead of the plan:
    `<...>.placement.pools`, `<...>.placement.roles` (or a local `placement.pools`) and any
    `.tensor_parallel_size`. The schema's own checks of its fields (`self.<field>`) are not reads."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if node.attr in PLACEMENT_READS and (
                (isinstance(owner, ast.Attribute) and owner.attr == "placement")
                or (isinstance(owner, ast.Name) and owner.id == "placement")):
            found.append(f"{path}:{node.lineno} reads placement.{node.attr}")
        elif node.attr == "tensor_parallel_size" and not (isinstance(owner, ast.Name) and owner.id == "self"):
            found.append(f"{path}:{node.lineno} reads .tensor_parallel_size")
    return found


def test_only_the_planner_reads_pools_roles_and_rollout_tp_from_the_config():
    """The stage's `Plan` (hybridflow/planning/plan.py) is built once (from the config, or by
    placement=auto's search) and carried: the launcher, pool reservation, role spawning, the memory
    model, the config's rules and the workers ask it, so placement=auto's choice reaches all of them."""
    root = FRAMEWORK.parent
    files = [p for package in ("hybridflow", "workers", "recipes") for p in sorted((root / package).rglob("*.py"))
             if "planning" not in p.relative_to(root).parts[:2]]
    offenders = [hit for path in files for hit in placement_reads(path)]
    assert not offenders, "\n".join(offenders)


def test_the_placement_scan_sees_each_kind_of_read(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("a = config.placement.pools['x']\nb = placement.roles['actor']\n"
                      "c = config.rollout.tensor_parallel_size\nd = self.cfg.tensor_parallel_size\n"
                      "e = self.tensor_parallel_size\nf = plan.pools\ng = config.placement.device\n")
    assert sorted(int(hit.split(":")[1].split()[0]) for hit in placement_reads(sample)) == [1, 2, 3, 4]


# the config package is the schema and its pure rules: besides itself and the standard library it asks only the
# registry (hybridflow/config/engines.py, recipes.py register their entries), and to_config the checks that
# need the runtime (hybridflow/checks.py)
CONFIG_MAY_IMPORT = {"hybridflow.registry", "hybridflow.checks"}


def test_the_config_package_imports_no_runtime_module():
    offenders = [f for path in sorted((FRAMEWORK / "config").glob("*.py")) for f in _outside_config_and_stdlib(path)
                 if f.split(" imports ")[1].startswith("hybridflow.")  # Hydra and OmegaConf compose it
                 and f.split(" imports ")[1].rsplit(".", 1)[0] not in CONFIG_MAY_IMPORT
                 and f.split(" imports ")[1] not in CONFIG_MAY_IMPORT]
    assert not offenders, "\n".join(offenders)


def _calls_of(path: Path, attribute: str) -> list[int]:
    """Lines where `path` calls `<anything>.<attribute>(...)`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == attribute]


def test_the_plan_is_built_from_the_config_in_one_place_and_reaches_the_run_by_argument():
    """`Plan.from_config` is called by hybridflow/planning/auto.py `decide_plan` only; the stage carries the plan
    (hybridflow/stage.py), never a context variable or a module's state."""
    root = FRAMEWORK.parent
    callers = [f"{path.relative_to(root)}:{line}" for folder in ("hybridflow", "workers", "recipes")
               for path in sorted((root / folder).rglob("*.py")) for line in _calls_of(path, "from_config")
               if "Plan.from_config" in path.read_text().splitlines()[line - 1]]
    assert callers == [callers[0]] and callers[0].startswith("hybridflow/planning/auto.py:"), callers
    ambient = [f"{path.relative_to(root)}" for folder in ("hybridflow", "workers", "recipes")
               for path in sorted((root / folder).rglob("*.py"))
               if "ContextVar[Plan" in path.read_text() or '_STATE["plan"]' in path.read_text()]
    assert not ambient, ambient


def function_level_imports(root: Path, folders=("hybridflow", "workers", "recipes")) -> list[str]:
    """Imports of the project's own modules made inside a function (not at module level, not type-only)."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for function in ast.walk(tree):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                            and node.module.split(".")[0] in folders:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.module}")
    return sorted(set(found))


FUNCTION_LEVEL_IMPORTS = 203  # 214 at 39980d7, 203 after issue 71; lower it as imports move to module level, never raise it


def test_function_level_imports_of_the_project_do_not_grow():
    """An import inside a function hides a dependency from the module's head (and from the layering checks
    above, unless they look inside functions as these do): each one is counted, and the count may only fall."""
    found = function_level_imports(FRAMEWORK.parent)
    assert len(found) <= FUNCTION_LEVEL_IMPORTS, (
        f"{len(found)} function-level imports of the project's own modules, more than {FUNCTION_LEVEL_IMPORTS}: "
        "import at module level where no circle forbids it")


def test_the_function_level_import_count_sees_one(tmp_path):
    (tmp_path / "hybridflow").mkdir()
    (tmp_path / "hybridflow" / "a.py").write_text("from hybridflow.b import x\ndef f():\n    from hybridflow.c import y\n"
                                                  "    import json\n")
    assert function_level_imports(tmp_path, ("hybridflow",)) == ["hybridflow/a.py:3 hybridflow.c"]
