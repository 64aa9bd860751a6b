"""The suite's time budget (tests/budget.py) fails a run on a planted slow test, names it and says by
how much, and lets a test under its budget pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.budget import (DRIFT_MARGIN, MAX_SLOWDOWN, SHARED_CORES_FACTOR, TIER_BUDGET_S, slowdown,
                          violations, workload_s)

ROOT = Path(__file__).resolve().parents[2]

PLANTED = '''
import time
import pytest

@pytest.mark.budget(0.02)
def test_planted_slow():
    time.sleep(1.0)  # past 0.02 s x every scale the check may apply (2 x 1.6 x 1.7 x a slowdown of 3: 0.33 s)

@pytest.mark.budget(5)
def test_within_budget():
    time.sleep(0.05)
'''


def run_planted(tmp_path: Path, *flags: str, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_planted.py").write_text(PLANTED)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.budget", "-p", "no:cacheprovider",
                           "-o", "addopts=", *flags, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


@pytest.mark.parametrize("flags", [(), ("-n", "2")], ids=["one-process", "xdist"])
def test_a_planted_slow_test_fails_the_run_and_is_named(tmp_path, flags):
    # Under pytest-xdist (the suite's own addopts) only the workers collect the budgets; the
    # controlling process must still see them on the reports, and report once.
    done = run_planted(tmp_path, *flags)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "2 passed" in done.stdout  # the tests themselves passed: the budget failed the run
    assert "over the time budget" in done.stdout and "test_planted.py::test_planted_slow" in done.stdout
    assert "test_within_budget" not in done.stdout.split("over the time budget")[1]
    assert done.stdout.count("test_planted.py::test_planted_slow:") == 1
    assert "tests/budget.py: this machine ran tests/budget.py's fixed workload in" in done.stdout  # asked first


def test_the_check_can_be_turned_off(tmp_path):
    done = run_planted(tmp_path, HYBRIDFLOW_TEST_BUDGET="off")
    assert done.returncode == 0 and "over the time budget" not in done.stdout, done.stdout[-2000:]


def test_budgets_scale_with_the_machine_and_the_tier_total_counts():
    budgets = {"a": 10.0, "b": 10.0}
    limit = 10.0 * DRIFT_MARGIN
    assert violations({"a": limit - 1, "b": 1.0}, budgets, 1.0, None) == []  # within 10 s x the drift margin
    assert violations({"a": limit + 1}, budgets, 1.0, None)[0].startswith(f"a: {limit + 1:.0f} s, budget {limit:.0f} s")
    assert violations({"a": limit + 1}, budgets, 2.0, None) == []  # a CPU without bfloat16: twice the time
    shared = limit * SHARED_CORES_FACTOR  # beside another worker's test
    assert violations({"a": shared - 1}, budgets, 1.0, None, shared_cores=True) == []
    assert "beside another worker" in violations({"a": shared + 1}, budgets, 1.0, None, shared_cores=True)[0]
    over = TIER_BUDGET_S["default"] * DRIFT_MARGIN + 1
    assert violations({"a": over}, {"a": over}, 1.0, "default")[-1].startswith("the default tier")
    assert violations({"a": over}, {"a": over}, 1.0, None) == []  # a partial run has no tier total
    # With the session's wall clock given (what CI pays), that is the tier's total, not the sum of
    # durations that parallel workers overlap.
    assert violations({"a": over, "b": over}, {"a": over, "b": over}, 1.0, "default", wall_s=over - 2) == []
    assert violations({"a": 1.0}, {"a": 10.0}, 1.0, "default", wall_s=over)[-1].startswith("the default tier")


def test_a_machine_measured_slower_than_its_usual_scales_the_budgets_by_that(monkeypatch):
    import tests.budget as budget

    monkeypatch.setattr(budget, "USUAL_WORKLOAD_S", {"bf16": 0.1, "no_bf16": 0.2})
    assert slowdown(0.25, 1.0) == pytest.approx(2.5)  # a CPU with bfloat16, 2.5x its usual
    assert slowdown(0.25, 2.0) == pytest.approx(1.25)  # the same seconds on a CPU kind whose usual is slower
    assert slowdown(0.05, 1.0) == 1.0  # faster than usual never tightens the budgets
    assert slowdown(10.0, 1.0) == MAX_SLOWDOWN  # a stalled machine excuses at most MAX_SLOWDOWN times the budget
    monkeypatch.setattr(budget, "USUAL_WORKLOAD_S", {"bf16": None, "no_bf16": 0.2})
    assert slowdown(0.25, 1.0) == 1.0  # no usual recorded for this kind: no scaling
    limit = 10.0 * DRIFT_MARGIN
    assert violations({"a": 2 * limit}, {"a": 10.0}, 1.0, None) != []
    scaled = violations({"a": 2 * limit}, {"a": 10.0}, 1.0, None, slower=1.9)
    assert scaled and "x 1.90 slower than usual now" in scaled[0]
    assert violations({"a": 2 * limit}, {"a": 10.0}, 1.0, None, slower=2.1) == []


def test_the_workload_is_timed_in_one_thread_and_leaves_the_thread_count_alone():
    import torch

    before = torch.get_num_threads()
    seconds = workload_s(repeats=1)
    assert 0.0 < seconds < 30.0 and torch.get_num_threads() == before


def test_only_a_whole_tier_is_held_to_the_tier_total():
    from types import SimpleNamespace

    from tests.budget import _whole_tier

    def config(args, marks, keyword=""):
        return SimpleNamespace(args=args, option=SimpleNamespace(markexpr=marks, keyword=keyword))

    assert _whole_tier(config(["tests"], "not slow")) == "default"  # `pytest` (addopts' -m 'not slow')
    assert _whole_tier(config([], "slow")) == "slow"
    assert _whole_tier(config(["tests/unit"], "not slow")) is None
    assert _whole_tier(config(["tests"], "not slow", keyword="sft")) is None
    assert _whole_tier(config(["tests"], "slow and e2e")) is None


def test_heavy_files_go_first_and_each_file_keeps_its_tests_in_order(monkeypatch):
    from types import SimpleNamespace

    import tests.budget as budget

    monkeypatch.setattr(budget, "FILE_SECONDS", {"default": {"e/heavy.py": 300, "e/mid.py": 100},
                                                 "slow": {"e/mid.py": 900}})

    def item(nodeid, slow=False):
        return SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: name == "slow" and slow or None)

    items = [item("u/a.py::t1"), item("e/mid.py::t1"), item("u/a.py::t2"), item("e/heavy.py::t1"),
             item("e/mid.py::t2"), item("e/heavy.py::t2"), item("u/b.py::t1")]
    budget.heaviest_first(items)
    assert [i.nodeid for i in items] == ["e/heavy.py::t1", "e/heavy.py::t2", "e/mid.py::t1", "e/mid.py::t2",
                                         "u/a.py::t1", "u/a.py::t2", "u/b.py::t1"]
    slow = [item("e/heavy.py::s1", slow=True), item("e/mid.py::s1", slow=True)]
    budget.heaviest_first(slow)  # a slow run orders by the slow tier's seconds
    assert [i.nodeid for i in slow] == ["e/mid.py::s1", "e/heavy.py::s1"]


def test_the_test_processes_and_the_runs_they_start_use_one_openmp_thread():
    """tests/conftest.py: two pytest-xdist workers share two cores, so a second OpenMP thread in a test
    process only spins at barriers beside the other worker's processes; a `hybridflow` run started
    from here (and its Ray workers) inherits the setting."""
    import torch

    assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "1"
