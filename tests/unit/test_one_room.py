"""Each change has one room (issue 32): read from the code's syntax trees.

- no recipe starts Ray or spawns its role groups itself (hybridflow/run/lifecycle.py does);
- nothing branches on which transport class it holds (`isinstance` on a transport): a transport
  says what it can do (`supports_staging`, `gathers_whole`, ...);
- no code outside the schedules (hybridflow/rollout_schedules.py) branches on the staleness depth:
  the config checks, the recipe and the launcher ask the chosen schedule (`stale`, `overlaps`,
  `stages_weights`, `reloads_weights`). The one exception is the range check of the value itself;
- nothing compares `rollout.backend` with an engine's name: the code asks the engine's entry
  (hybridflow/config/engines.py: `tensor_parallel`, `own_pool`, `serves_adapters`, ...).
Each rule is also run on a planted violation, so it can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = [p for d in ("hybridflow", "workers", "recipes") for p in sorted((ROOT / d).rglob("*.py"))]
TRANSPORT_CLASSES = {"Transport", "Colocated", "Gloo"}


def _name(node: ast.AST) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def recipe_starts(tree: ast.AST) -> list[int]:
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Call) and _name(n.func) in ("start_ray", "spawn_roles")]


def transport_isinstance(tree: ast.AST) -> list[int]:
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and _name(n.func) == "isinstance" and len(n.args) == 2:
            classes = n.args[1].elts if isinstance(n.args[1], ast.Tuple) else [n.args[1]]
            if any(_name(c) in TRANSPORT_CLASSES for c in classes):
                found.append(n.lineno)
    return found


def depth_branches(tree: ast.AST) -> list[int]:
    """Comparisons with `max_staleness`, and tests of its truth (if / while / and / or / not)."""
    def is_depth(node):
        return _name(node) == "max_staleness"

    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare) and any(is_depth(x) for x in [n.left, *n.comparators]):
            range_check = len(n.ops) == 1 and isinstance(n.ops[0], ast.GtE) and \
                isinstance(n.comparators[0], ast.Constant) and n.comparators[0].value == 0
            if not range_check:
                found.append(n.lineno)
        tests = [n.test] if isinstance(n, (ast.If, ast.IfExp, ast.While)) else \
            n.values if isinstance(n, ast.BoolOp) else [n.operand] if isinstance(n, ast.UnaryOp) else []
        found += [n.lineno for t in tests if is_depth(t)]
        if isinstance(n, ast.Call) and _name(n.func) == "bool" and n.args and is_depth(n.args[0]):
            found.append(n.lineno)
    return found


def engine_name_branches(tree: ast.AST) -> list[int]:
    """Comparisons of a `backend` attribute (rollout.backend) with a string: `== "vllm"`, `in ("hf", ...)`."""
    def is_name(node):
        return isinstance(node, ast.Constant) and isinstance(node.value, str) or \
            isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(isinstance(e, ast.Constant) for e in node.elts)

    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare)
            and any(_name(x) == "backend" for x in [n.left, *n.comparators])
            and any(is_name(x) for x in [n.left, *n.comparators])]


def _violations(rule, paths) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{line}" for p in paths for line in rule(ast.parse(p.read_text()))]


def test_no_recipe_starts_ray_or_spawns_its_groups():
    assert _violations(recipe_starts, sorted((ROOT / "recipes").glob("*.py"))) == []
    assert recipe_starts(ast.parse("start_ray(config)\ngroups = launch.spawn_roles(config, roles)")) == [1, 2]


def test_nothing_branches_on_the_transport_class():
    assert _violations(transport_isinstance, CODE) == []
    assert transport_isinstance(ast.parse("if isinstance(t, (int, Gloo)):\n    pass")) == [1]


def test_only_the_schedules_branch_on_the_staleness_depth():
    outside = [p for p in CODE if p.name != "rollout_schedules.py"]
    assert _violations(depth_branches, outside) == []
    planted = "if t.max_staleness >= 2:\n    pass\nx = bool(cfg.max_staleness)\nok = d.max_staleness >= 0\n" \
              "y = a if config.trainer.max_staleness else b"
    assert depth_branches(ast.parse(planted)) == [1, 3, 5]


def test_nothing_branches_on_the_rollout_engines_name():
    outside = [p for p in CODE if p.name != "engines.py"]  # the registry's own lookup
    assert _violations(engine_name_branches, outside) == []
    planted = "if config.rollout.backend == 'vllm':\n    pass\nx = cfg.backend in ('hf', 'vllm')\nok = a.backends == []"
    assert engine_name_branches(ast.parse(planted)) == [1, 3]
