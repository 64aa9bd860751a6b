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
