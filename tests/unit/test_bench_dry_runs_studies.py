"""The studies' bench scripts at their smallest shape, run in this process (whose torch and hydra are
imported already): each composes and checks the commands it would run, and its reading of finished runs
runs on run directories in the recipes' own format, so it cannot rot."""

from __future__ import annotations

import json
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# A real GRPO run's metrics (recipes/ppo.py; tests/e2e/test_async.py holds a fresh run to the same keys).
GRPO_ROWS = json.loads((ROOT / "tests/e2e/fixtures/grpo_sync_metrics.json").read_text())["colocated"]


def _run(monkeypatch, script: str, *args: str) -> None:
    """`bench/<script> *args` run to the end in this process."""
    monkeypatch.setattr(sys, "argv", [script, *args])
    try:
        runpy.run_path(str(ROOT / "bench" / script), run_name="__main__")
    except SystemExit as stop:  # the scripts that end with sys.exit(main())
        assert not stop.code, stop.code


def _write_run(run_dir: Path, rows: list[dict]) -> Path:
    """A run directory whose metrics.jsonl the recipes' own logger wrote from `rows` (one per step)."""
    from hybridflow.output.tracking import MetricsLogger

    run_dir.mkdir(parents=True)
    logger = MetricsLogger(run_dir, ["jsonl"])
    for row in rows:
        logger.log(row["step"], {k: v for k, v in row.items() if k != "step"})
    logger.close()
    return run_dir


def _grpo_rows(steps: int, **per_step) -> list[dict]:
    """`steps` rows with a real GRPO step's keys, each key in `per_step` given by its function of the step."""
    return [{**GRPO_ROWS[(step - 1) % len(GRPO_ROWS)], "step": step, **{k: f(step) for k, f in per_step.items()}}
            for step in range(1, steps + 1)]


def _is_png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def closes_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.fixture
def keeps_torch_threads():
    """bench/pma_study.py sets torch's thread count for its process: this one's is put back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _pma_dry_runs(monkeypatch, tmp_path: Path, *experiments: list[str]) -> dict[str, list[str]]:
    """bench/pma_study.py's `experiments`, then `report`, dry-run on seed 0 under tmp_path/work; each
    run's checked command by run name (from the --out reports)."""
    commands = {}
    for experiment in [*experiments, ["report"]]:
        out = tmp_path / f"{'_'.join(experiment)}.json"
        _run(monkeypatch, "pma_study.py", *experiment, "--dry-run", "--seeds", "0", "--work", str(tmp_path / "work"),
             "--out", str(out))
        commands.update(json.loads(out.read_text())["commands"])
    return commands


def test_the_pma_study_bench_checks_the_pretraining_runs_and_scores_their_merges(tmp_path, monkeypatch, capsys,
                                                                                keeps_torch_threads):
    """bench/pma_study.py --dry-run, the pretraining experiments (constant, pmainit, spike) on seed 0:
    each run's command composed and checked to hold what the study sets (the schedule, the checkpoint
    interval, the hooks, the merged starting model), stand-in runs of the tiny model merged and scored
    in every window, then `report`'s tables and plots drawn from the results, all under --work."""
    work = tmp_path / "work"
    commands = _pma_dry_runs(monkeypatch, tmp_path, ["constant"], ["pmainit"], ["spike"])
    printed = capsys.readouterr().out
    assert [line.split(":")[0] for line in printed.splitlines() if ": hybridflow " in line] == list(commands) == [
        "const-s0", "wsd-s0", "init-last-sft-s0", "init-sma6x8-sft-s0", "spike-healthy", "spike-unrecovered",
        "spike-recovered"]
    assert {"actor.optim.lr_schedule=constant", "trainer.save_every_steps=4"} <= set(commands["const-s0"])
    assert {"actor.optim.lr_schedule=wsd", "actor.optim.decay_steps=80"} <= set(commands["wsd-s0"])
    assert "spike_recovery" in " ".join(commands["spike-recovered"])
    assert "spike_recovery" not in " ".join(commands["spike-unrecovered"])
    merged = work / "runs" / "init-sma6x8-s0"  # the SMA of the constant run's last 6 checkpoints every 8, made now
    assert f"model.path={merged}" in commands["init-sma6x8-sft-s0"] and list(merged.glob("*.safetensors"))

    constant = json.loads((work / "runs" / "constant.json").read_text())["0"]
    assert [f"{m}/N{n}/V{v}" for m in ("sma", "ema", "wma") for v in (4, 8, 16) for n in (3, 6, 10)
            if f"{m}/N{n}/V{v}" not in constant] == []  # every merge window scored
    assert constant["last"] > 0 and list(constant["curve"]) == [str(end) for end in range(60, 401, 20)]
    for table in ("## constant lr (1 seeds", "| sma | 6 |", "## PMA-init (1 seeds)", "## spike (seed 0)",
                  "| recovered |"):
        assert table in printed, table
    assert _is_png(work / "docs" / "pma.png") and _is_png(work / "docs" / "pma_spike.png")
    assert not (work / "docs" / "pma_grpo.png").exists()  # no GRPO results: that table is left out


def test_the_pma_study_bench_checks_the_sft_and_grpo_runs_and_scores_their_merges(tmp_path, monkeypatch, capsys,
                                                                                 keeps_torch_threads):
    """bench/pma_study.py --dry-run, the SFT and GRPO experiments (sft --schedule constant, with
    --trajectory, pmainit_grpo) on seed 0: each run's command checked, the SFT stand-in's merges scored
    (held-out loss and greedy accuracy on the smallest held-out set), GRPO started from its last
    checkpoint and from their SMA, `report`'s tables and plot; and the check refuses a config that does
    not hold what the study set."""
    work = tmp_path / "work"
    commands = _pma_dry_runs(monkeypatch, tmp_path, ["sft", "--schedule", "constant"],
                             ["sft", "--schedule", "constant", "--trajectory"], ["pmainit_grpo"])
    printed = capsys.readouterr().out
    assert [line.split(":")[0] for line in printed.splitlines() if ": hybridflow " in line] == [
        "sft-constant-s0", "sft-constant-s0", "grpo-last-s0", "grpo-sma4x25-s0"]
    assert {"actor.optim.lr_schedule=constant", "trainer.save_every_steps=25"} <= set(commands["sft-constant-s0"])
    merged = work / "runs" / "grpo-init-sma4x25-s0"  # the SMA of the SFT run's last 4 checkpoints, made now
    assert f"model.path={merged}" in commands["grpo-sma4x25-s0"] and list(merged.glob("*.safetensors"))
    sft = json.loads((work / "runs" / "sft_constant.json").read_text())["0"]
    assert 0 <= sft["sma/N4/V25"]["accuracy"] <= 1 and sft["last"]["loss"] > 0
    assert sorted(json.loads((work / "runs" / "sft_constant_trajectory.json").read_text())["0"], key=int) == [
        str(step) for step in range(550, 801, 25)]
    grpo = json.loads((work / "runs" / "pma_init_grpo.json").read_text())["0"]
    assert list(grpo["last"]["val"]) == [str(step) for step in range(10, 61, 10)]
    for table in ("## SFT, constant lr (1 seeds", "| seed | step 550 |", "## PMA-init into GRPO (1 seeds)"):
        assert table in printed, table
    assert _is_png(work / "docs" / "pma_grpo.png")

    from hybridflow.config import compose

    not_carried = runpy.run_path(str(ROOT / "bench/pma_study.py"))["not_carried"]  # the check a command must pass
    config = compose(["recipe=pretrain", "trainer.total_steps=3"])
    assert not_carried(config, ["recipe=pretrain", "trainer.total_steps=5", "trainer.total_steps=3"]) == []  # the last
    assert not_carried(config, ["recipe=sft", "trainer.total_steps=5"]) == ["recipe=sft", "trainer.total_steps=5"]


def test_the_weight_sync_bench_composes_each_placement_as_it_spawns_it(tmp_path, monkeypatch, capsys):
    """bench/weight_sync.py --dry-run: every mode's placement composed and checked as `hybridflow` runs it,
    and the same ranks, pools and engine width as the bench would spawn, its roles' specs and transport
    built on the tiny model; no Ray, no vLLM."""
    out = tmp_path / "weight_sync.json"
    _run(monkeypatch, "weight_sync.py", "--dry-run", "--models", "tiny", "--out", str(out))
    report = json.loads(out.read_text())
    assert list(report) == ["tiny, colocated TP1", "tiny, colocated TP2", "tiny, disaggregated 1->1",
                            "tiny, disaggregated 2->1", "tiny, disaggregated 1->2 (TP2)"]
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == list(report)
    assert [(m["ranks"], m["pools"], m["tensor_parallel_size"], m["transport"]) for m in report.values()] == [
        ({"actor": 2, "rollout": 2}, 1, 1, "colocated"), ({"actor": 2, "rollout": 2}, 1, 2, "colocated"),
        ({"actor": 1, "rollout": 1}, 2, 1, "broadcast"), ({"actor": 2, "rollout": 1}, 2, 1, "broadcast"),
        ({"actor": 1, "rollout": 2}, 2, 2, "broadcast")]
    last = report["tiny, disaggregated 1->2 (TP2)"]["overrides"]
    assert {"placement=disaggregated", "placement.pools.gen.devices_per_node=2", "rollout.tensor_parallel_size=2",
            "weight_sync.check=none"} <= set(last)
    assert {m["parameters"] for m in report.values()} == {1_001_600}  # the tiny model (docs/results/performance.md: 1.0M)

    from hybridflow.builders import build_tiny_model
    from hybridflow.run.pipeline_stages import compose_command

    bench = runpy.run_path(str(ROOT / "bench/weight_sync.py"))  # the check each mode passed, on a mismatch
    colocated_tp1 = compose_command(bench["command"]("tiny", 2, None, 1))
    one_to_two = bench["mode_pools"](1, 2, "x"), bench["mode_roles"](build_tiny_model(tmp_path / "tiny"), 2)
    assert set(bench["differences"](colocated_tp1, "tiny", *one_to_two)) == {
        "ranks per role", "one pool for both", "engine TP", "ranks per engine"}


def test_the_learning_curves_bench_plots_and_tables_each_runs_validations(tmp_path, monkeypatch, capsys,
                                                                         closes_figures):
    """bench/learning_curves.py on an SFT and a GRPO run directory in the recipes' format (the logger's
    metrics.jsonl, a real GRPO step's keys): one table line per run with each validation's step,
    minutes and accuracy, and the plot written."""
    sft = _write_run(tmp_path / "sft", [{"step": s, "actor/loss": 1.0 / s, "val/accuracy": s / 10} for s in (1, 2, 3)])
    grpo = _write_run(tmp_path / "grpo", _grpo_rows(4, **{"val/accuracy": lambda s: 0.5 + s / 100}))
    out = tmp_path / "curves.png"
    _run(monkeypatch, "learning_curves.py", str(out), f"sft={sft}", f"grpo_64x8={grpo}", "--start", "0.386")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["sft", "grpo_64x8"]
    points = [re.findall(r"step (\d+) \(([\d.]+) min\): ([\d.]+)", line) for line in lines]
    assert [[(int(s), float(a)) for s, _, a in p] for p in points] == [
        [(1, 0.1), (2, 0.2), (3, 0.3)], [(1, 0.51), (2, 0.52), (3, 0.53), (4, 0.54)]]
    assert _is_png(out)


def _driver_commands(out: Path) -> dict[str, list[str]]:
    """bench/precision_curves.sh's `hybridflow` commands by run name, its runs written under `out`."""
    text = (ROOT / "bench/precision_curves.sh").read_text().replace("\\\n", " ")
    common = shlex.split(re.search(r"^common=\((.*?)\)", text, re.S | re.M).group(1).replace("$out", str(out)))
    commands = [[*common, *shlex.split(line)[2:]] for line in text.splitlines()
                if line.startswith('.venv/bin/hybridflow "${common[@]}"')]
    return {next(a for a in c if a.startswith("logger.run_name=")).split("=")[1]: c for c in commands}


def test_the_precision_curves_bench_composes_its_drivers_runs_and_tables_their_rewards(tmp_path, monkeypatch,
                                                                                      capsys, closes_figures):
    """bench/precision_curves.sh's three commands composed and checked (float32, bfloat16 with float32
    master weights, pure bfloat16), then bench/precision_curves.py on three run directories of that
    naming in the recipes' format: a table line per run, its reward over the first and last 5 steps."""
    from hybridflow.run.pipeline_stages import compose_command

    commands = _driver_commands(tmp_path)
    assert list(commands) == ["float32", "bf16_mixed", "bf16_pure"]
    dtypes = {}
    for name, command in commands.items():
        config = compose_command(command)
        assert config.recipe.name == "grpo" and config.reward.fn.endswith("bench/digit_reward.py:score")
        assert config.logger.output_root == str(tmp_path) and config.logger.run_name == name
        dtypes[name] = (config.model.dtype.value, config.model.master_dtype.value, config.rollout.dtype.value)
    assert dtypes == {"float32": ("float32", "float32", "float32"), "bf16_mixed": ("bfloat16", "float32", "bfloat16"),
                      "bf16_pure": ("bfloat16", "bfloat16", "bfloat16")}

    runs = [_write_run(tmp_path / name, _grpo_rows(7, **{"reward/score": lambda s: s / 10})) for name in commands]
    out = tmp_path / "precision.png"
    _run(monkeypatch, "precision_curves.py", str(out), *map(str, runs))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == list(commands)
    assert all("reward steps 1-5 0.300, steps 3-7 0.500; rollout/log_prob_diff step 1" in line for line in lines)
    assert _is_png(out)
