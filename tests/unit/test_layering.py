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


def _runtime_imports(path: Path, package: str, with_type_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import in `path` that runs (module level or inside a function; not the
    `if TYPE_CHECKING:` blocks, which only annotations read, unless `with_type_only`), relative imports
    resolved against `package`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only = set() if with_type_only else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
        and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING" for n in ast.walk(node)}
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


def import_edges(root: Path, folders=("hybridflow", "workers", "recipes"), with_type_only: bool = False
                 ) -> dict[str, dict[str, int]]:
    """Module -> {module of `folders` it imports: the line}, from `_runtime_imports` (`from a import b` is an
    edge to `a.b` when that is a module, else to `a`)."""
    modules = _module_names(root, folders)
    edges: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: dict[str, int] = {}
        for line, imported in _runtime_imports(path, package, with_type_only):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.setdefault(imported, line)
        edges[name] = targets
    return edges


def import_circles(root: Path, folders=("hybridflow", "workers", "recipes"), with_type_only: bool = False
                   ) -> list[list[str]]:
    """The project's import circles: each strongly connected set of two or more modules of `folders`
    in the graph of imports that run (`import_edges`; with `with_type_only`, the `if TYPE_CHECKING:` ones too)."""
    modules = _module_names(root, folders)
    edges = import_edges(root, folders, with_type_only)
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
    assert import_circles(tmp_path, ("hybridflow",), with_type_only=True) == [["hybridflow.a", "hybridflow.b"],
                                                                               ["hybridflow.c", "hybridflow.d"]]


def test_no_import_circles_among_the_framework_modules_counting_type_only_imports():
    """A type named for an annotation only (`if TYPE_CHECKING:`) is still a dependency: a module whose types
    another needs while it imports that one back is one design in two files (issue 81 counted 2 such circles).
    The type goes to the lower module, or the lower module states what it needs as a Protocol."""
    circles = import_circles(FRAMEWORK.parent, ("hybridflow",), with_type_only=True)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


# The framework's layers, lowest first. A module may import its own layer and those below it, never one above
# (type-only imports included). A pattern names a module and its submodules (`hybridflow` alone: the top
# package's __init__, its version); `package.*` names the submodules only, so the config package's front door (`hybridflow.config`: compose, to_config, ConfigError, which run the
# checks that need the runtime) sits above its modules (the schema and its pure rules, which everything reads).
# The longest pattern that names a module gives its layer; a module no pattern names fails the test.
LAYERS = [
    # 0 base: the top package and the rooms' front doors (a docstring each; a room's module no longer pattern names
    # falls to layer 0 with them, so its first import above the base fails), the registry type, the console, Batch,
    # dtypes, the dependency patches, the schema and its pure rules
    ["hybridflow", "hybridflow.run", "hybridflow.checks", "hybridflow.output", "hybridflow.registry",
     "hybridflow.output.console", "hybridflow.batch", "hybridflow.precision", "hybridflow.patches", "hybridflow.config.*"],
    # 1 libraries: pure parts built on the base, each with one job
    ["hybridflow.batch_keys", "hybridflow.algos", "hybridflow.data", "hybridflow.rewards", "hybridflow.agents",
     "hybridflow.builders", "hybridflow.checkpoint", "hybridflow.merge", "hybridflow.checks.model",
     "hybridflow.checks.memory_budget", "hybridflow.output.tracking"],
    # 2 runtime: distribution, weight movement, the schedules, what the trained roles share
    ["hybridflow.controller", "hybridflow.resharding", "hybridflow.rollout_schedules", "hybridflow.training"],
    # 3 decisions: the plan (and its search) and the rules that ask the runtime
    ["hybridflow.planning", "hybridflow.checks.rules"],
    # 4 the stage: a composed, checked config and its plan, a pipeline's stages, the cluster and its faults
    ["hybridflow.config", "hybridflow.run.stage", "hybridflow.run.pipeline_stages", "hybridflow.run.cluster",
     "hybridflow.run.faults"],
    # 5 the run: start, loop, end, and the checks before it
    ["hybridflow.run.launch", "hybridflow.run.lifecycle", "hybridflow.run.runner", "hybridflow.checks.preflight"],
    # 6 the command
    ["hybridflow.cli"],
]

def layer_of(module: str, layers=LAYERS) -> int | None:
    best, found = -1, None
    for number, patterns in enumerate(layers):
        for pattern in patterns:
            package = pattern.removesuffix(".*")
            named = module == pattern or (module.startswith(package + ".") and pattern != "hybridflow")
            if named and len(pattern) > best:
                best, found = len(pattern), number
    return found


def upward_imports(root: Path, layers=LAYERS) -> list[str]:
    """Every import (type-only ones included) of a framework module by one of a lower layer, and every
    framework module no layer names."""
    edges = import_edges(root, ("hybridflow",), with_type_only=True)
    unplaced = [f"{m} is in no layer (add it to LAYERS)" for m in sorted(edges) if layer_of(m, layers) is None]
    upward = [f"{a}:{line} imports {b} (layer {layer_of(b, layers)} above {layer_of(a, layers)})"
              for a in sorted(edges) for b, line in sorted(edges[a].items())
              if layer_of(a, layers) is not None and layer_of(b, layers) is not None
              and layer_of(b, layers) > layer_of(a, layers)]
    return unplaced + upward


def test_no_framework_module_imports_one_of_a_layer_above_it():
    """The layers are written down in LAYERS above: base, libraries, runtime, decisions, the stage, the run,
    the command. A lower module that needs something from above takes it as an argument (`hybridflow plan`
    is given `compose_command` by hybridflow/cli.py) or the thing moves down (issue 81 counted 3 upward imports)."""
    offenders = upward_imports(FRAMEWORK.parent)
    assert not offenders, "\n".join(offenders)


def test_the_layer_check_sees_an_upward_import_and_an_unplaced_module(tmp_path):
    package = tmp_path / "hybridflow"
    (package / "config").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "config" / "__init__.py").write_text("from hybridflow.rules import check\n")
    (package / "config" / "schema.py").write_text("import os\n")
    (package / "rules.py").write_text("from hybridflow.config.schema import os\n")
    (package / "algos.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from hybridflow.rules import check\n")
    (package / "extra.py").write_text("")
    layers = [["hybridflow", "hybridflow.config.*"], ["hybridflow.algos"], ["hybridflow.rules"], ["hybridflow.config"]]
    assert layer_of("hybridflow.config.schema", layers) == 0 and layer_of("hybridflow.config", layers) == 3
    assert upward_imports(tmp_path, layers) == ["hybridflow.extra is in no layer (add it to LAYERS)",
                                                "hybridflow.algos:3 imports hybridflow.rules (layer 2 above 1)"]


def _outside_config_and_stdlib(path: Path) -> list[str]:
    import sys

    return [f"{path.name}:{line} imports {module}" for line, module in _runtime_imports(path, "hybridflow.config")
            if module and module.split(".")[0] not in sys.stdlib_module_names
            and module != "hybridflow.config" and not module.startswith("hybridflow.config.")]


def test_the_schema_imports_only_the_config_package_and_the_standard_library():
    """The schema is data and each section's own rules; what needs the runtime (registries, schedules,
    precision, the adapter's limits) is hybridflow/checks/rules.py, run by to_config and the stage."""
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
# need the runtime (hybridflow/checks/rules.py)
CONFIG_MAY_IMPORT = {"hybridflow.registry", "hybridflow.checks.rules"}


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
    (hybridflow/run/stage.py), never a context variable or a module's state."""
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


FUNCTION_LEVEL_IMPORTS = 191  # 214 at 39980d7, 203 after issue 71, 197 after issue 81 (hosts, layers), 191 after its engine object; lower it as imports move to module level, never raise it


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


# A dict-like container made empty at module level and filled at run time is a registry of live objects, keyed by
# what one caller names and another looks up (issue 81 removed the colocated receivers by worker group and the
# actor's module offered to the exact engine: the host now introduces the workers of a process to each other).
REGISTRY_TYPES = {"dict", "WeakValueDictionary", "WeakKeyDictionary", "defaultdict", "OrderedDict"}
PLAIN_VALUES = {"int", "float", "bool", "str", "bytes", "None"}  # a dict[..., <these>] holds settings, not objects
LIVE_REGISTRIES_ALLOWED = {  # module.name: why it may stay
    "hybridflow.controller.ray_host._TASKS": "a memo of Ray's remote wrapper of each function `Host.apply` runs, "
                                             "keyed by the function itself: built from its key, never looked up by name",
}


def _holds_plain_values(annotation: ast.expr | None) -> bool:
    """Whether an annotation says `dict[K, V]` with V plain data (`PLAIN_VALUES`, a union or tuple of them)."""
    if not isinstance(annotation, ast.Subscript) or not isinstance(annotation.slice, ast.Tuple):
        return False
    value = annotation.slice.elts[-1]
    names = {n.id if isinstance(n, ast.Name) else "None" for n in ast.walk(value)
             if isinstance(n, ast.Name) or (isinstance(n, ast.Constant) and n.value is None)}
    return bool(names) and names <= PLAIN_VALUES | {"tuple"}


def _entries_written(value: ast.expr) -> bool:
    """Whether a literal or call spells out entries (`{'a': 1}`, `dict(a=1)`, `OrderedDict([('a', 1)])`)."""
    if isinstance(value, ast.Dict):
        return bool(value.keys)
    return bool(value.keywords) or any(isinstance(a, (ast.Dict, ast.List, ast.Tuple)) and (
        a.keys if isinstance(a, ast.Dict) else a.elts) for a in value.args)


def module_registries(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each module-level name `path` binds to an empty dict (`{}`, `dict()`), a
    `WeakValueDictionary`, `WeakKeyDictionary`, `defaultdict` or `OrderedDict` made without entries, unless its
    annotation says its values are plain data. A table written out at module level (its entries in the
    literal) is no registry."""
    found = []
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.Assign):
            targets, value, annotation = node.targets, node.value, None
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value, annotation = [node.target], node.value, node.annotation
        else:
            continue
        dict_like = isinstance(value, ast.Dict) or (isinstance(value, ast.Call) and getattr(
            value.func, "attr", getattr(value.func, "id", None)) in REGISTRY_TYPES)
        if dict_like and not _entries_written(value) and not _holds_plain_values(annotation):
            found += [(node.lineno, t.id) for t in targets if isinstance(t, ast.Name)]
    return found


def test_no_module_keeps_a_registry_of_live_objects():
    """Objects of one run reach each other by argument or by the host's introduction (hybridflow/controller/
    context.py `introduce`), never through a module's dict keyed by a name: such a dict outlives a stage's
    workers, and whoever knows the key reaches into another role's objects (STYLE 15)."""
    root = FRAMEWORK.parent
    found = {}
    for folder in ("hybridflow", "workers"):
        for path in sorted((root / folder).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            found.update({f"{module}.{name}": f"{path.relative_to(root)}:{line}" for line, name in module_registries(path)})
    offenders = [f"{where} {name}" for name, where in sorted(found.items()) if name not in LIVE_REGISTRIES_ALLOWED]
    assert not offenders, "module-level registries of live objects: " + ", ".join(offenders)
    stale = sorted(set(LIVE_REGISTRIES_ALLOWED) - set(found))
    assert not stale, f"allowed registries no longer there (drop them from LIVE_REGISTRIES_ALLOWED): {stale}"


def test_the_registry_scan_sees_a_registry_and_passes_tables_and_settings(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import weakref\nfrom collections import defaultdict\n"
                      "_LOCAL: dict[str, 'Receiver'] = {}\n_OFFERED = weakref.WeakValueDictionary()\n"
                      "_BY_NAME = defaultdict(list)\n_SEEN = dict()\n"
                      "_TABLE = {'a': 1}\n_TIMEOUTS: dict[str, float] = {}\n_HELD: dict[int, tuple[int, float | None]] = {}\n"
                      "_NAMED = dict(a=1)\ndef f():\n    cache = {}\n")
    assert module_registries(sample) == [(3, "_LOCAL"), (4, "_OFFERED"), (5, "_BY_NAME"), (6, "_SEEN")]


# The two classes issue 81 cut down: the actor worker holds its model, optimizer and what it is called
# for (each objective, the loop, the weight path and the state live in hybridflow/ rooms); the worker
# group speaks only to the host protocol (hybridflow/controller/hosts.py).
SIZE_LIMITS = {"workers/actor.py": 250, "hybridflow/controller/worker_group.py": 300}


def test_the_actor_worker_and_the_worker_group_stay_small():
    root = Path(__file__).resolve().parents[2]
    over = {path: lines for path, limit in SIZE_LIMITS.items()
            if (lines := len((root / path).read_text().splitlines())) > limit}
    assert not over, f"over their line limits (SIZE_LIMITS): {over}; move generic machinery into a hybridflow/ room"
