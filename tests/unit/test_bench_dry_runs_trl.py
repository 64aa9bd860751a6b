"""The dry runs of the bench scripts that run TRL beside HybridFlow: each prepares its inputs, composes and
checks HybridFlow's commands, composes TRL's, and reads and renders stand-in results, in this process
(the test process has torch and Hydra imported already); nothing starts Ray, vLLM or TRL."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(monkeypatch, script: str, *args: str) -> dict:
    """`bench/<script> --dry-run *args` run here to the end; the script's globals."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts bench/ on it
    monkeypatch.setattr(sys, "argv", [script, "--dry-run", *args])
    return runpy.run_path(str(ROOT / "bench" / script), run_name="__main__")


def test_the_grpo_vs_trl_bench_composes_each_sides_command_and_renders_the_table(tmp_path, monkeypatch, capsys):
    """bench/grpo_vs_trl.py --dry-run: the tiny model's inputs prepared, HybridFlow's command composed
    and checked (the shapes both sides share, HybridFlow's micro-batch half of TRL's over its 2 ranks),
    TRL's command lines (one process; torchrun over 2) composed, and stand-in results read, summarised
    against the FLOP floor and rendered into a copy of docs/results/performance.md, which stays as it was."""
    doc = ROOT / "docs" / "results" / "performance.md"
    before = doc.read_text()
    bench = _dry_run(monkeypatch, "grpo_vs_trl.py", "--work", str(tmp_path), "--out", str(tmp_path / "dry.json"),
                     "--prompts-per-step", "4", "--samples-per-prompt", "2", "--samples-per-micro-batch", "8",
                     "--max-response-tokens", "6", "--lr", "3e-5")
    report = json.loads((tmp_path / "dry.json").read_text())
    sides = report["results"]["models"]["tiny"]["sides"]
    assert list(sides) == ["hybridflow", "trl", "trl-ddp"]
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed if line.startswith("tiny ")] == [f"tiny {s}" for s in sides]

    ours = sides["hybridflow"]["command"]
    for override in ("trainer.total_steps=2", "trainer.prompts_per_step=4", "rollout.samples_per_prompt=2",
                     "rollout.max_response_tokens=6", "actor.samples_per_micro_batch=4", "actor.optim.lr=3e-05",
                     "actor.skip_zero_advantage_samples=false"):
        assert override in ours, override
    one, ddp = sides["trl"]["command"], sides["trl-ddp"]["command"]
    flags = dict(zip(one[2::2], one[3::2]))  # python trl_grpo_steps.py --flag value ...
    assert one[1].endswith("bench/trl_grpo_steps.py") and flags["--threads"] == "2"
    assert {k: flags[k] for k in ("--steps", "--prompts-per-step", "--samples-per-prompt", "--samples-per-micro-batch",
                                  "--max-response-tokens", "--lr")} == {
        "--steps": "2", "--prompts-per-step": "4", "--samples-per-prompt": "2", "--samples-per-micro-batch": "8",
        "--max-response-tokens": "6", "--lr": "3e-05"}
    assert ddp[1:6] == ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr"]
    assert ddp[-2:] == ["--threads", "1"]
    assert len(Path(flags["--prompts"]).read_text().splitlines()) == 2 * 4  # the prompts of 2 steps, in draw order
    assert (Path(flags["--model"]) / "config.json").is_file()  # the model both sides load

    for side, run in sides.items():
        summary = run["summary"]
        assert summary["step_s_median"] > 0 and summary["floor_s_median"] > 0, side
        assert summary["ratio_to_floor"] == pytest.approx(summary["step_s_median"] / summary["floor_s_median"]), side
    stages = sides["hybridflow"]["steps"][0]
    assert stages["step_s"] == pytest.approx(sum(stages[f"{s}_s"] for s in bench["STAGES"]))

    rendered = Path(report["doc"]).read_text()
    assert report["text"] in rendered and Path(report["doc"]).parent == tmp_path / "dry_run"
    for label in bench["SIDES"].values():
        assert f"| {label} | " in report["text"], label
    assert "4 prompts x 2 samples = 8 samples per step" in report["text"]
    assert doc.read_text() == before


def test_the_real_learning_bench_composes_the_run_and_its_step_0_evaluation_and_renders_the_curves(
        tmp_path, monkeypatch, capsys):
    """bench/real_learning_vs_trl.py --dry-run: the chat data written, HybridFlow's GRPO run and its step-0
    evaluation composed and checked with the answer length TRL gets (the command once kept 64 tokens
    whatever --max-response-tokens said), TRL's command composed, and stand-in results read (the step
    seconds from timing/step_s), plotted and rendered into copies; docs/ stays as it was."""
    doc, png = ROOT / "docs" / "results" / "learning.md", ROOT / "bench" / "results" / "learning_real_vs_trl.png"
    before = doc.read_text(), png.read_bytes()
    bench = _dry_run(monkeypatch, "real_learning_vs_trl.py", "--work", str(tmp_path), "--out",
                     str(tmp_path / "dry.json"), "--max-response-tokens", "32", "--prompts-per-step", "4",
                     "--lr", "2e-5")
    report = json.loads((tmp_path / "dry.json").read_text())
    sides = report["results"]["sides"]
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed[:3]] == ["hybridflow", "trl", "hybridflow step 0"]

    ours, initial, trl = sides["hybridflow"]["command"], report["initial_command"], sides["trl"]["command"]
    for override in ("recipe=grpo", "trainer.total_steps=2", "trainer.prompts_per_step=4", "actor.optim.lr=2e-05",
                     "model.dtype=bfloat16", "reward.fn=math_answer"):
        assert override in ours, override
    assert "recipe=evaluate" in initial and "recipe.eval_samples=0" in initial
    for command in (ours, initial):  # the last one given wins
        assert [o for o in command if o.startswith("rollout.max_response_tokens=")][-1] == "rollout.max_response_tokens=32"
    flags = dict(zip(trl[2::2], trl[3::2]))
    assert {k: flags[k] for k in ("--steps", "--prompts-per-step", "--max-response-tokens", "--lr", "--reward",
                                  "--dtype", "--val-every")} == {
        "--steps": "2", "--prompts-per-step": "4", "--max-response-tokens": "32", "--lr": "2e-05",
        "--reward": "math_answer", "--dtype": "bfloat16", "--val-every": "1"}
    assert len(Path(flags["--prompts"]).read_text().splitlines()) == 2 * 4
    assert len(Path(flags["--val"]).read_text().splitlines()) == 8

    assert [p["step"] for p in sides["hybridflow"]["validation"]] == [0, 1, 2]  # step 0 from the evaluation
    assert [p["step"] for p in sides["trl"]["validation"]] == [0, 1, 2]
    assert len(sides["hybridflow"]["step_s"]) == 2 and len(sides["trl"]["step_s"]) == 2
    assert "| held-out accuracy at step | 0 | 1 | 2 | minutes for the run |" in report["text"]
    for label in bench["LABELS"].values():
        assert f"| {label} | " in report["text"], label
    assert report["text"] in Path(report["doc"]).read_text() and Path(report["doc"]).parent == tmp_path / "dry_run"
    assert Path(report["plot"]).read_bytes()[:4] == b"\x89PNG"
    assert (doc.read_text(), png.read_bytes()) == before

    with pytest.raises(SystemExit, match="rollout.max_response_tokens=16, not 32"):  # a drifted key is refused
        bench["check_composed"]([*ours[1:], "rollout.max_response_tokens=16"], {"rollout.max_response_tokens": 32})


def test_the_distill_vs_trl_bench_composes_both_sides_on_one_student_teacher_and_prompts(tmp_path, monkeypatch, capsys):
    """bench/distill_vs_trl.py --dry-run with two seeds: tiny stand-in student and teacher built, HybridFlow's
    recipe=distill run and its step-0 evaluation composed and checked (the settings both sides share), TRL's
    command given the same models, step shape and lr, and per seed the prompts in HybridFlow's draw order; the
    sides' order alternating per seed; stand-in results read and rendered. A HybridFlow run that trained on
    other prompts than TRL's file is refused."""
    bench = _dry_run(monkeypatch, "distill_vs_trl.py", "--work", str(tmp_path), "--out", str(tmp_path / "dry.json"),
                     "--seeds", "0,1", "--lr", "3e-4", "--max-response-tokens", "6")
    report = json.loads((tmp_path / "dry.json").read_text())
    results = report["results"]
    assert results["order"] == {"0": ["hybridflow", "trl"], "1": ["trl", "hybridflow"]}  # A B, then B A
    printed = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if line.startswith(("seed", "hybridflow"))]
    assert printed == ["hybridflow step 0", "seed 0 hybridflow", "seed 0 trl", "seed 1 trl", "seed 1 hybridflow"]

    for seed in ("0", "1"):
        ours, trl = results["runs"][seed]["hybridflow"]["command"], results["runs"][seed]["trl"]["command"]
        overrides = dict(o.split("=", 1) for o in ours[1:])
        assert {k: overrides[k] for k in ("recipe", "trainer.total_steps", "trainer.prompts_per_step",
                                          "rollout.samples_per_prompt", "rollout.max_response_tokens",
                                          "actor.optim.lr", "seed")} == {
            "recipe": "distill", "trainer.total_steps": "2", "trainer.prompts_per_step": "4",
            "rollout.samples_per_prompt": "2", "rollout.max_response_tokens": "6", "actor.optim.lr": "0.0003",
            "seed": seed}
        flags = dict(zip(trl[2::2], trl[3::2]))  # python trl_distill_steps.py --flag value ...
        assert trl[1].endswith("bench/trl_distill_steps.py")
        assert (flags["--student"], flags["--teacher"]) == (overrides["model.path"], overrides["teacher.path"])
        assert {k: flags[k] for k in ("--steps", "--prompts-per-step", "--samples-per-prompt", "--max-response-tokens",
                                      "--lr", "--seed", "--val-every")} == {
            "--steps": "2", "--prompts-per-step": "4", "--samples-per-prompt": "2", "--max-response-tokens": "6",
            "--lr": "0.0003", "--seed": seed, "--val-every": "1"}
        assert flags["--prompts"] == report["prompts"][seed]
        assert len(Path(flags["--prompts"]).read_text().splitlines()) == 2 * 4  # 2 steps of 4 prompts, in draw order
        assert len(Path(flags["--val"]).read_text().splitlines()) == 8  # every held-out prompt the run validates on
        for side in ("hybridflow", "trl"):
            run = results["runs"][seed][side]
            assert [p["step"] for p in run["validation"]] == [0, 1, 2], side
            assert run["summary"]["step_s_median"] > 0, side
    assert report["prompts"]["0"] != report["prompts"]["1"]  # each seed its loader's own order
    assert "recipe=evaluate" in results["initial_command"] and "recipe.eval_samples=0" in results["initial_command"]
    assert "| held-out accuracy at step | 0 | 1 | 2 |" in report["text"]
    for label in bench["LABELS"].values():
        assert f"| {label}, seed 1 | " in report["text"], label
    assert "Seed 1: HybridFlow's median step takes 0.200x TRL's (run order: trl, hybridflow)." in report["text"]

    run_dir = tmp_path / "dry_run" / "runs" / "hybridflow-seed0"  # a run whose loader drew other prompts
    trained = [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    trained[1]["prompt_index"][0] += 1
    (run_dir / "trained_prompts.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trained))
    indices = bench["prepare"](tmp_path / "again", bench["argparse"].Namespace(
        train_rows=64, val_rows=8, prompts_per_step=4, steps=2), [0])["indices"][0]
    with pytest.raises(SystemExit, match=r"trained on other prompts than the file TRL reads \(steps \[2\]"):
        bench["hybridflow_result"](run_dir, ours, indices)
