"""Bench scripts' dry runs, in this process: each composes and checks the `hybridflow` commands its
runs would start and reads a small metrics.jsonl it writes as a finished run's, so it cannot rot."""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(monkeypatch, capsys, script: str, *args: str) -> list[str]:
    """`bench/<script> --dry-run *args` run to the end in this process (torch and Hydra imported
    already); the lines it printed."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script's own sys.path inserts end with the test
    monkeypatch.setattr(sys, "argv", [script, "--dry-run", *args])
    runpy.run_path(str(ROOT / "bench" / script), run_name="__main__")
    return capsys.readouterr().out.splitlines()


def test_the_async_learning_bench_composes_every_runs_command_and_reports_on_their_metrics(
        monkeypatch, capsys, tmp_path):
    """bench/async_learning.py --dry-run: each schedule's and seed's command composed and checked with the
    tiny model as the SFT model, then the report and the plot read metrics written in a temporary
    directory (one synchronous step 2 s, an asynchronous one 1 s): nothing lands under --root."""
    root = tmp_path / "runs"
    lines = _dry_run(monkeypatch, capsys, "async_learning.py", "--steps", "6", "--val-every", "3", "--seeds", "0",
                     "1", "--schedules", "b", "c", "d", "--root", str(root), "--plot", str(tmp_path / "plot.png"))
    commands = {line.split(":")[0]: line for line in lines if ": hybridflow " in line}
    assert list(commands) == ["b_seed0", "c_seed0", "d_seed0", "b_seed1", "c_seed1", "d_seed1"]
    for name, line in commands.items():
        assert f"seed={name[-1]} " in line and "trainer.total_steps=6 trainer.val_every_steps=3" in line, line
        assert f"logger.output_root={root.resolve()} logger.run_name={name}" in line and "model.path=/" in line
    assert "trainer.max_staleness=1 trainer.old_log_probs=actor" in commands["c_seed1"]
    assert "trainer.max_staleness=2 trainer.old_log_probs=actor rollout.on_update=recompute" in commands["d_seed0"]
    rows = {line.split(")")[0]: line for line in lines
            if line.startswith("| (") and line.count("|") == 13}  # the schedules' table, not the accuracy by step
    assert rows["| (b"].split(" | ")[1] == "2.000" and rows["| (c"].split(" | ")[1] == "1.000"  # s/step
    assert "| 1.00 / 2 |" in rows["| (d"] and "| 0 / 0 |" in rows["| (b"]  # staleness mean / max
    assert any(line.startswith("  (c) 1.000 s/step") and line.endswith("2.00x faster than (b)") for line in lines)
    assert any(line.startswith("plot: ") for line in lines)
    assert not root.exists() and not (tmp_path / "plot.png").exists()


def test_the_async_steps_bench_composes_each_schedule_and_refuses_one_an_override_undoes(
        monkeypatch, capsys):
    """bench/async_steps.py --dry-run: the three schedules' commands composed and checked, each run's
    reading of its metrics.jsonl on one written here (the warm-up steps left out of the medians); an
    --extra override that undoes a schedule's staleness stops it, naming the schedule."""
    lines = _dry_run(monkeypatch, capsys, "async_steps.py", "--steps", "4")
    commands = [line for line in lines if ": hybridflow " in line]
    assert [line.split(":")[0] for line in commands] == [
        "colocated, sync", "disaggregated, sync", "disaggregated, max_staleness=1"]
    assert all("trainer.total_steps=4" in line for line in commands)
    assert "placement=disaggregated trainer.max_staleness=1 trainer.old_log_probs=actor" in commands[2]
    results = [line for line in lines if ": hybridflow " not in line]
    # steps 3 and 4: 1.25 s apart, each stage 0.5 s (the two warm-up steps' stages took 9 s)
    assert len(results) == 3 and all("step_s=1.250 " in line and "generate_s=0.500 " in line for line in results)
    capsys.readouterr()
    with pytest.raises(SystemExit, match="disaggregated, max_staleness=1: .* does not carry trainer.max_staleness=1"):
        _dry_run(monkeypatch, capsys, "async_steps.py", "--steps", "5", "--extra", "trainer.max_staleness=0")


def test_the_memory_steps_bench_composes_its_run_and_renders_the_table_from_a_saved_config(monkeypatch, capsys):
    """bench/memory_steps.py --dry-run: the run's command composed and checked on the tiny model, its
    micro-batch chosen and config.json saved as the run does, the floor and the table rendered from a
    metrics.jsonl of 12 steps (peaks 1.01 + 0.01 per step) into a copy of the doc; a placement that
    moves the actor off the `global` pool the table reads is refused."""
    lines = _dry_run(monkeypatch, capsys, "memory_steps.py", "--steps", "12", "--val-every", "5")
    command = lines[0]
    assert command.startswith("memory: hybridflow model=local_hf model.path=/")
    assert ("trainer.total_steps=12 trainer.prompts_per_step=4 rollout.samples_per_prompt=4 trainer.val_every_steps=5 "
            "trainer.val_prompts=100 model.dtype=bfloat16 rollout.dtype=bfloat16") in command
    floor = float(re.search(r"floor per process ([0-9.]+) GiB", lines[1])[1])
    assert 0 < floor and re.search(r"micro-batch \d+ rows chosen by the run", lines[1])
    table = [line.split(" | ") for line in lines if re.match(r"\| \d+ \|", line)]
    assert [row[0] for row in table] == ["| 1", "| 10", "| 12"] and table[1][-1] == "0.25 |"  # validated at 10
    assert "Last step's peak / step 10's: **1.02**" in "\n".join(lines)  # 1.12 / 1.10
    largest = float(re.search(r"largest peak / floor: \*\*([0-9.]+)\*\*", "\n".join(lines))[1])
    assert largest == pytest.approx(1.12 / floor, abs=0.01)  # the floor printed to 2 decimals
    with pytest.raises(SystemExit, match="the actor on pool 'global'"):
        _dry_run(monkeypatch, capsys, "memory_steps.py", "--steps", "12", "--", "placement=disaggregated")


def test_the_qwen05_bench_builds_a_tiny_shaped_model_with_its_builder_and_composes_its_run(monkeypatch, capsys):
    """bench/qwen05_steps.py --dry-run: its builder at tiny shapes (saved as a bfloat16 Qwen2, checked),
    the run's command on it composed and checked (two actor ranks, the step count, the extra override
    reaching it), and a small metrics.jsonl's steps printed as a run's are."""
    import torch

    with torch.random.fork_rng():  # the builder seeds torch's generator
        lines = _dry_run(monkeypatch, capsys, "qwen05_steps.py", "--steps", "2", "rollout.dtype=bfloat16")
    assert lines[0].startswith("model: ")
    assert "2 layers, hidden 64, vocabulary 128 (the run builds 24 layers, hidden 896" in lines[0]
    command = lines[1]
    assert command.startswith("grpo: hybridflow recipe=grpo model=local_hf model.path=/")
    assert "trainer.total_steps=2 " in command and command.endswith("rollout.dtype=bfloat16")
    assert lines[2:] == ["step 1: peak 4.25 GiB, resident at the end 3.50 GiB, update 60 s, generate 30 s",
                         "step 2: peak 4.50 GiB, resident at the end 3.50 GiB, update 120 s, generate 30 s"]


def test_the_learning_seeds_bench_composes_grpo_and_ppo_from_each_seeds_merge_and_reads_their_curves(
        monkeypatch, capsys, tmp_path):
    """bench/learning_seeds.py: --dry-run composes each seed's GRPO and PPO command from that seed's PMA
    merge; without the merges it refuses before running anything, naming the pipeline bench that makes
    them; and a finished run's curve gives the table's columns (+20 points, 5 minutes, the gain)."""
    pipelines = tmp_path / "p"
    lines = _dry_run(monkeypatch, capsys, "learning_seeds.py", "--seeds", "0", "2", "--pipelines", str(pipelines),
                     "trainer.total_steps=9")
    assert [line.split(":")[0] for line in lines] == ["seed 0 grpo", "seed 0 ppo", "seed 2 grpo", "seed 2 ppo"]
    assert f"model.path={pipelines / 'seed2' / '01-grpo' / 'init_model'} seed=2" in lines[3]
    assert all(line.endswith("trainer.total_steps=9") for line in lines)  # extra overrides win: they come last

    monkeypatch.setattr(sys, "argv", ["learning_seeds.py", "--seeds", "1", "--pipelines", str(pipelines),
                                      "--root", str(tmp_path / "r")])
    with pytest.raises(SystemExit, match=r"bench/pipeline_seeds.py --seeds 1 --root"):
        runpy.run_path(str(ROOT / "bench" / "learning_seeds.py"), run_name="__main__")
    assert not (tmp_path / "r").exists()

    bench = runpy.run_path(str(ROOT / "bench" / "learning_seeds.py"))
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 1, "actor/loss": 0.5}] + [{"step": s, "time/elapsed_s": m * 60, "val/accuracy": a}
                                               for s, m, a in [(25, 1.0, 0.55), (50, 2.0, 0.66), (150, 6.0, 0.8)]]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    summary = bench["summarize"](run, start=0.45)
    assert summary["first_plus_20_points"] == [50, 2.0, 0.66] == summary["last_within_5_minutes"]
    assert summary["end"] == [150, 6.0, 0.8] and summary["gain"] == 0.35
    assert ("| 0 | grpo | 0.450 | 0.660 at 2.0 min | 0.660 (2.0 min) | 0.800 at 6.0 min | **+35.0** |"
            in bench["table"]({"0/grpo": summary}))
    assert bench["summarize"](run, start=0.70)["first_plus_20_points"] is None  # +20 never reached
    assert bench["finished"](run, ["trainer.total_steps=500", "trainer.total_steps=150"])  # the last one wins
    assert not bench["finished"](run, ["trainer.total_steps=151"])  # stopped before its last validation
    assert not bench["finished"](tmp_path / "never_ran", ["trainer.total_steps=150"])
