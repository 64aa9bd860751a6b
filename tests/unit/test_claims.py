"""docs/claims.md maps each headline claim of README.md and docs/ to the tests that show it. Checked
here from the syntax trees, without importing or collecting the tests: every test it names exists,
a "(slow)" follows exactly the slow ones, each row's tier is the one the tests' marks give, its
bench scripts and pages exist, and its summary counts the rows.

A test is slow when a decorator is `pytest.mark.slow`, when its module sets `pytestmark` to it, or
(for one case of a parametrized test) when its `pytest.param(..., marks=pytest.mark.slow)` says so.
A parametrized id `test_x[case]` resolves to `test_x`, and its case to the entries of the
`parametrize` decorators (ids from `ids=[...]`, `pytest.param(..., id=...)`, or the values, joined
with "-" from the decorator nearest the function outwards, as pytest names them). A bare `test_x`
whose cases are partly slow runs in the default run: its tier is default."""

from __future__ import annotations

import ast
import itertools
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLAIMS = ROOT / "docs" / "claims.md"
HEADER = ["claim", "where", "test", "tier"]
TIERS = ("default", "slow", "bench", "none")
ENTRY = re.compile(r"^`(?P<ref>[^`]+)`(?P<slow> \(slow\))?$")
NODE_ID = re.compile(r"^(?P<path>tests/[\w/]+\.py)::(?P<names>[\w:]+?)(?:\[(?P<case>[^\]]+)\])?$")
SUMMARY = re.compile(r"\*\*Summary: (\d+) claims: default (\d+), slow (\d+), bench (\d+), none (\d+)\.\*\*")
PAGE = re.compile(r"[\w./-]+\.md\b")


@dataclass
class Row:
    line: int
    cells: list[str]


def table_rows(text: str) -> list[Row]:
    """The body rows of every markdown table whose header is claim | where | test | tier."""
    rows, in_table = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells == HEADER:
            in_table = True
        elif in_table and not set("".join(cells)) <= set("-: "):
            rows.append(Row(number, cells))
    return rows


# ---- marks, read from a test module's syntax tree ------------------------------------------------

def is_slow_mark(node: ast.expr | None) -> bool:
    """`pytest.mark.slow` (or `mark.slow`, or called with a reason), alone or in a list of marks."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(is_slow_mark(e) for e in node.elts)
    if isinstance(node, ast.Call):
        node = node.func
    return node is not None and ast.unparse(node) in ("pytest.mark.slow", "mark.slow")


@dataclass
class Module:
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef]  # "test_y", or "TestC::test_y"
    slow: bool  # a module-level pytestmark holds pytest.mark.slow
    slow_classes: set[str]  # classes decorated with pytest.mark.slow
    lists: dict[str, ast.expr]  # module-level NAME = [...] / (...), for argvalues given by name


@cache
def read_module(path: Path) -> Module:
    module = Module({}, False, set(), {})
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            module.functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            if any(is_slow_mark(d) for d in node.decorator_list):
                module.slow_classes.add(node.name)
            module.functions.update({f"{node.name}::{item.name}": item for item in node.body
                                     if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))})
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "pytestmark":
                module.slow = is_slow_mark(node.value)
            elif isinstance(node.value, (ast.List, ast.Tuple)):
                module.lists[node.targets[0].id] = node.value
    return module


def parametrize_calls(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.Call]:
    """The function's parametrize decorators, nearest the function first (the order of pytest's ids)."""
    return [d for d in reversed(function.decorator_list)
            if isinstance(d, ast.Call) and ast.unparse(d.func).endswith("mark.parametrize")]


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def value_id(node: ast.expr, argname: str, index: int) -> str:
    """The id pytest makes of one value: a string, number, bool or None as it prints; else name + index."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return f"{argname}{index}"
    return str(value) if isinstance(value, (str, int, float, bool, type(None))) else f"{argname}{index}"


def cases_of(call: ast.Call, module: Module) -> list[tuple[str | None, bool]] | None:
    """(case id, slow) for each entry of one parametrize decorator; None when its values are not
    written out in the module (a call, a comprehension); an id is None when `ids=` is computed."""
    names = call.args[0] if call.args else keyword(call, "argnames")
    values = call.args[1] if len(call.args) > 1 else keyword(call, "argvalues")
    if isinstance(values, ast.Name):
        values = module.lists.get(values.id)
    if not isinstance(names, ast.Constant) or not isinstance(values, (ast.List, ast.Tuple)):
        return None
    argnames = [n.strip() for n in str(names.value).split(",")]
    ids = keyword(call, "ids")
    given = ([e.value if isinstance(e, ast.Constant) else None for e in ids.elts]
             if isinstance(ids, (ast.List, ast.Tuple)) else None)
    cases = []
    for index, entry in enumerate(values.elts):
        slow, own_id = False, None
        if isinstance(entry, ast.Call) and ast.unparse(entry.func).endswith("param"):
            slow, own = is_slow_mark(keyword(entry, "marks")), keyword(entry, "id")
            own_id = own.value if isinstance(own, ast.Constant) else None
            parts = entry.args
        else:
            parts = entry.elts if len(argnames) > 1 and isinstance(entry, (ast.Tuple, ast.List)) else [entry]
        if own_id is not None:  # pytest.param's id wins over ids=
            case_id = own_id
        elif given is not None:
            case_id = given[index] if index < len(given) else None
        elif ids is not None:
            case_id = None
        else:
            case_id = "-".join(value_id(p, n, index) for p, n in zip(parts, argnames))
        cases.append((case_id, slow))
    return cases


def is_slow(path: Path, name: str, case: str | None) -> bool | str:
    """Whether the test (or its case) is left out of the default run, or a problem found reading it."""
    module = read_module(path)
    function = module.functions.get(name)
    if function is None:
        return f"{path.name} defines no test {name}"
    if not name.split("::")[-1].startswith("test"):
        return f"{name} is a helper, not a test pytest collects"
    if module.slow or name.split("::")[0] in module.slow_classes or any(map(is_slow_mark, function.decorator_list)):
        return True
    per_decorator = [cases_of(call, module) for call in parametrize_calls(function)]
    if not per_decorator:
        return f"{name} is not parametrized: no case [{case}]" if case else False
    if any(c is None for c in per_decorator):  # values not written out: marks unseen unless written inline
        hidden = any("mark.slow" in ast.unparse(call) for call in parametrize_calls(function))
        return f"{name}: cannot tell which cases are slow" if hidden else False
    combos = [("-".join(str(i) for i, _ in combo) if all(i is not None for i, _ in combo) else None,
               any(s for _, s in combo)) for combo in itertools.product(*per_decorator)]
    if case is None:
        return all(slow for _, slow in combos)  # partly slow: the default run runs the rest
    matching = [slow for case_id, slow in combos if case_id == case]
    if not matching:
        if any(case_id is None for case_id, _ in combos) and not any(slow for _, slow in combos):
            return False  # ids computed at collection, and no case is slow
        return f"{name} has no case [{case}]"
    return matching[0]


# ---- the checks of one row, and of the page -------------------------------------------------------

def entry_problems(ref: str, annotated_slow: bool, tier: str, root: Path) -> tuple[list[str], bool | None]:
    """Problems with one entry of a test cell, and whether it is slow (None for a bench script)."""
    if tier == "bench":
        if not ref.startswith("bench/") or not (root / ref).is_file():
            return [f"`{ref}` is not a script under bench/"], None
        return ([f"`{ref}` is a bench script, not a slow test"] if annotated_slow else []), None
    match = NODE_ID.match(ref)
    if not match:
        return [f"`{ref}` is not a node id tests/<file>.py::<test>"], None
    path = root / match["path"]
    if not path.is_file():
        return [f"`{ref}`: no file {match['path']}"], None
    slow = is_slow(path, match["names"], match["case"])
    if isinstance(slow, str):
        return [f"`{ref}`: {slow}"], None
    if slow != annotated_slow:
        said = "marked (slow) but runs in the default run" if annotated_slow else "slow but not marked (slow)"
        return [f"`{ref}` is {said}"], slow
    return [], slow


def row_problems(row: Row, root: Path) -> list[str]:
    where = f"line {row.line}"
    if len(row.cells) != len(HEADER):
        return [f"{where}: {len(row.cells)} cells, not {len(HEADER)} (a '|' inside a cell?)"]
    claim, pages, test, tier = row.cells
    problems = [f"{where}: no page {p}" for p in PAGE.findall(pages)
                if not (root / p).is_file() and not (root / "docs" / p).is_file()]
    if tier not in TIERS:
        return problems + [f"{where}: tier {tier!r} is not one of {list(TIERS)}"]
    if tier == "none":
        return problems + ([] if test == "none" else [f"{where}: tier none, but the test cell names {test!r}"])
    entries = [ENTRY.match(e.strip()) for e in test.split("<br>")]
    if not all(entries):
        return problems + [f"{where}: test cell {test!r}: each entry is `ref` or `ref` (slow), joined by <br>"]
    slows = []
    for entry in entries:
        found, slow = entry_problems(entry["ref"], bool(entry["slow"]), tier, root)
        problems += [f"{where}: {p}" for p in found]
        slows.append(slow)
    if tier != "bench" and None not in slows:
        actual = "slow" if all(slows) else "default"
        if actual != tier:
            problems.append(f"{where}: tier {tier}, but the tests named make it {actual}")
    return problems


def check_claims(text: str, root: Path = ROOT) -> list[str]:
    """Every problem with a claims page: its rows, and its summary against them."""
    rows = table_rows(text)
    problems = [p for row in rows for p in row_problems(row, root)]
    summary = SUMMARY.search(text)
    counts = [len(rows)] + [sum(1 for r in rows if r.cells[-1] == t) for t in TIERS]
    if summary is None:
        problems.append("no summary line '**Summary: N claims: default N, slow N, bench N, none N.**'")
    elif [int(n) for n in summary.groups()] != counts:
        problems.append(f"the summary says {summary[0]!r}; the tables hold {counts[0]} claims: "
                        + ", ".join(f"{t} {n}" for t, n in zip(TIERS, counts[1:])))
    return problems


# ---- whether a cited test exercises its claim ------------------------------------------------------

SPAN = re.compile(r"`([^`]+)`")
NAME = re.compile(r"[A-Za-z_]\w*")
# words of a backticked span too common to say which key or function a test exercises
COMMON = {"true", "false", "none", "null", "venv", "python", "pytest", "hybridflow", "with", "tests", "docs",
          "recipe", "bench"}


def claim_names(claim: str) -> set[str]:
    """The config keys' parts and the names of functions and commands in the claim's backticked spans
    (`trainer.max_staleness=1` -> trainer, max_staleness), four letters or more."""
    return {part for span in SPAN.findall(claim) for key in re.findall(r"[A-Za-z_][\w.]*", span)
            for part in key.split(".") if len(part) >= 4 and part.lower() not in COMMON}


@cache
def module_definitions(path: Path) -> dict[str, str]:
    """Each top-level or nested def/class's source, and each module-level assignment's, by name."""
    text = path.read_text()
    tree, found = ast.parse(text), {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.setdefault(node.name, ast.get_source_segment(text, node) or "")
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        found.update({t.id: ast.get_source_segment(text, node) or "" for t in targets if isinstance(t, ast.Name)})
    return found


def cited_source(path: Path, names: str, depth: int = 2) -> str:
    """A test function's source and, `depth` levels down, that of the module's fixtures, helpers and
    constants it names (a fixture's run arguments are a constant of the module)."""
    definitions = module_definitions(path)
    seen = [names.split("::")[-1]]
    for _ in range(depth):
        named = set(NAME.findall("\n".join(definitions.get(n, "") for n in seen))) & set(definitions)
        seen += sorted(named - set(seen))
    return "\n".join(definitions.get(n, "") for n in seen)


def exercise_problems(text: str, root: Path = ROOT) -> list[str]:
    """Each cited test (default and slow rows) whose source names none of its claim's backticked keys,
    functions or commands: a test that does not exercise what the row claims."""
    problems = []
    for row in table_rows(text):
        if len(row.cells) != len(HEADER) or row.cells[-1] not in ("default", "slow"):
            continue
        names = claim_names(row.cells[0])
        for entry in filter(None, (ENTRY.match(e.strip()) for e in row.cells[2].split("<br>")) if names else []):
            node = NODE_ID.match(entry["ref"])
            if node and (root / node["path"]).is_file() and not any(
                    n in cited_source(root / node["path"], node["names"]) for n in names):
                problems.append(f"line {row.line}: `{entry['ref']}` names none of the claim's {sorted(names)}; "
                                f"cite a test that exercises the claim, or name in the claim (in backticks) the key "
                                f"or function this test calls")
    return problems


# ---- tests -----------------------------------------------------------------------------------------

def test_every_claim_names_tests_that_exist_with_the_tier_their_marks_give():
    assert check_claims(CLAIMS.read_text()) == []


def test_every_cited_test_names_the_key_or_function_its_claim_is_about():
    assert exercise_problems(CLAIMS.read_text()) == []


def test_a_cited_test_that_never_calls_the_claims_function_is_reported(tmp_path):
    root = fake_repo(tmp_path)
    (root / "tests" / "unit" / "test_fake.py").write_text(FAKE_TESTS + "\n\nUSED = 'reward.fn'\n\n\n"
                                                           "def test_uses_a_constant():\n    assert USED\n")
    fake = "tests/unit/test_fake.py"
    text = page(f"| `reward.fn=math_verify` scores by value | README.md | `{fake}::test_fast` | default |",
                f"| `reward.fn=x` is read | README.md | `{fake}::test_uses_a_constant` | default |")
    assert exercise_problems(text, root) == [
        f"line 5: `{fake}::test_fast` names none of the claim's ['math_verify', 'reward']; cite a test that exercises "
        f"the claim, or name in the claim (in backticks) the key or function this test calls"]


def test_the_page_maps_the_headline_claims_and_is_linked():
    rows = table_rows(CLAIMS.read_text())
    assert 40 <= len(rows) <= 95, len(rows)  # headline claims, not every test: a page that stays readable
    assert {r.cells[-1] for r in rows} == set(TIERS)
    for page in ("README.md", "docs/reliability.md"):
        assert "claims.md" in (ROOT / page).read_text(), f"{page} does not link docs/claims.md"


def test_the_marks_are_read_as_pytest_reads_them():
    """Real tests of each kind: a slow decorator, a module-level pytestmark, a slow pytest.param among
    default ones (the bare id runs by default), ids from a list, and a helper called `slow` that is no mark."""
    def slow(ref: str) -> bool | str:
        match = NODE_ID.match(ref)
        return is_slow(ROOT / match["path"], match["names"], match["case"])

    staleness = "tests/e2e/test_async.py::test_max_staleness_0_gives_the_metrics_of_the_loop_before_async"
    assert slow(f"{staleness}[colocated]") is True and slow(f"{staleness}[disaggregated]") is False
    assert slow(staleness) is False
    sync = "tests/e2e/test_weight_sync.py::test_disaggregated_sync_over_a_gloo_group"
    assert slow(f"{sync}[2to1]") is False  # its ids from a list
    assert slow("tests/e2e/test_resume_rank_count.py::test_resume_on_another_rank_count_matches_the_uninterrupted_run")
    assert slow("tests/e2e/test_real_model.py::test_lora_grpo_one_step_off_on_the_real_model_serves_the_adapter_at_"
                "a_twentieth_of_the_model") is True
    assert slow("tests/unit/test_agents.py::"
                "test_a_tool_that_raises_hangs_or_returns_a_non_string_gives_a_counted_error_observation") is False
    assert slow("tests/unit/test_config.py::test_unknown_keys_and_bad_types_fail_in_composition") is False


FAKE_TESTS = '''
import pytest

CASES = [1, pytest.param(2, marks=pytest.mark.slow, id="two")]


def helper():
    pass


def test_fast():
    pass


@pytest.mark.slow
def test_long():
    pass


@pytest.mark.parametrize("n", CASES)
def test_cases(n):
    pass


@pytest.mark.parametrize("kind", ["a", pytest.param("b", marks=[pytest.mark.slow])])
@pytest.mark.parametrize("x,y", [(1, 2), (3, 4)], ids=["low", "high"])
def test_grid(x, y, kind):
    pass
'''
FAKE_SLOW_MODULE = "import pytest\n\npytestmark = pytest.mark.slow\n\n\ndef test_everything():\n    pass\n"
HEAD = "| claim | where | test | tier |\n| --- | --- | --- | --- |\n"


def fake_repo(tmp_path: Path) -> Path:
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_fake.py").write_text(FAKE_TESTS)
    (tmp_path / "tests" / "unit" / "test_all_slow.py").write_text(FAKE_SLOW_MODULE)
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "measure.py").write_text("")
    (tmp_path / "README.md").write_text("")
    return tmp_path


def page(*rows: str, summary: str | None = None) -> str:
    counts = [sum(r.rstrip(" |").endswith(f"| {t}") for r in rows) for t in TIERS]
    summary = summary or f"**Summary: {len(rows)} claims: " + ", ".join(
        f"{t} {n}" for t, n in zip(TIERS, counts)) + ".**"
    return summary + "\n\n" + HEAD + "\n".join(rows) + "\n"


def test_a_page_whose_rows_agree_with_the_marks_passes(tmp_path):
    root = fake_repo(tmp_path)
    fake = "tests/unit/test_fake.py"
    text = page(
        f"| fast | README.md | `{fake}::test_fast`<br>`{fake}::test_long` (slow) | default |",
        f"| long | README.md | `{fake}::test_long` (slow)<br>`tests/unit/test_all_slow.py::test_everything` (slow) | slow |",
        f"| cases | README.md | `{fake}::test_cases`<br>`{fake}::test_cases[1]`<br>`{fake}::test_cases[two]` (slow) | default |",
        f"| grid | README.md | `{fake}::test_grid[low-a]`<br>`{fake}::test_grid[high-b]` (slow) | default |",
        "| measured | README.md | `bench/measure.py` | bench |",
        "| hoped | README.md | none | none |")
    assert check_claims(text, root) == []


def test_a_planted_missing_test_and_a_wrong_tier_are_reported(tmp_path):
    root = fake_repo(tmp_path)
    fake = "tests/unit/test_fake.py"
    rows = {
        "no such test": f"| a | README.md | `{fake}::test_gone` | default |",
        "no such file": "| b | README.md | `tests/unit/test_nowhere.py::test_fast` | default |",
        "slow, unmarked": f"| c | README.md | `{fake}::test_fast`<br>`{fake}::test_long` | default |",
        "marked, not slow": f"| d | README.md | `{fake}::test_fast` (slow) | slow |",
        "wrong tier": f"| e | README.md | `{fake}::test_long` (slow) | default |",
        "module pytestmark": "| f | README.md | `tests/unit/test_all_slow.py::test_everything` | default |",
        "slow case unmarked": f"| g | README.md | `{fake}::test_cases[two]` | default |",
        "no such case": f"| h | README.md | `{fake}::test_grid[low-c]` | default |",
        "missing bench": "| i | README.md | `bench/nothing.py` | bench |",
        "none that names a test": f"| j | README.md | `{fake}::test_fast` | none |",
        "unknown tier": f"| k | README.md | `{fake}::test_fast` | nightly |",
        "missing page": f"| l | docs/nowhere.md | `{fake}::test_fast` | default |",
        "a helper": f"| m | README.md | `{fake}::helper` | default |",
    }
    problems = check_claims(page(*rows.values()), root)
    expected = {
        "no such test": "defines no test test_gone",
        "no such file": "no file tests/unit/test_nowhere.py",
        "slow, unmarked": f"`{fake}::test_long` is slow but not marked (slow)",
        "marked, not slow": "marked (slow) but runs in the default run",
        "wrong tier": "tier default, but the tests named make it slow",
        "module pytestmark": "`tests/unit/test_all_slow.py::test_everything` is slow but not marked (slow)",
        "slow case unmarked": f"`{fake}::test_cases[two]` is slow but not marked (slow)",
        "no such case": "test_grid has no case [low-c]",
        "missing bench": "`bench/nothing.py` is not a script under bench/",
        "none that names a test": "tier none, but the test cell names",
        "unknown tier": "tier 'nightly' is not one of",
        "missing page": "no page docs/nowhere.md",
        "a helper": "helper is a helper, not a test pytest collects",
    }
    for line, (case, message) in enumerate(expected.items(), 5):  # rows start after the summary and header
        assert any(p.startswith(f"line {line}: ") and message in p for p in problems), (case, problems)


def test_a_summary_that_does_not_count_the_rows_is_reported(tmp_path):
    root = fake_repo(tmp_path)
    row = "| fast | README.md | `tests/unit/test_fake.py::test_fast` | default |"
    wrong = "**Summary: 2 claims: default 2, slow 0, bench 0, none 0.**"
    assert check_claims(page(row, summary=wrong), root) == [
        f"the summary says {wrong!r}; the tables hold 1 claims: default 1, slow 0, bench 0, none 0"]
    assert check_claims(HEAD + row + "\n", root) == [
        "no summary line '**Summary: N claims: default N, slow N, bench N, none N.**'"]


def test_ci_runs_the_readme_test_command_then_the_slow_tier():
    """Every tier of the table runs in CI: `.ci/run` is the README's test command, then `-m slow`."""
    readme = (ROOT / "README.md").read_text()
    command = "bash scripts/setup.sh && .venv/bin/python -m pytest"
    assert f"```bash\n{command}\n```" in readme
    steps = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert steps == [command, ".venv/bin/python -m pytest -m slow"]
