"""On-policy distillation as a user runs it: one `hybridflow recipe=pipeline` command that trains a teacher
and distils a student from it (`teacher_stage`, `init_stage`), in one process without Ray
(tests/e2e/cli_in_one_process.py `without_ray`). The teacher is an SFT model, the student a shorter SFT run
from the same start (`pipeline_start`); the distillation stage's student must climb toward the teacher on held-out
accuracy, read from the recipe's own metrics, while the per-token reverse KL to the teacher falls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.cli_in_one_process import without_ray

# the default pipeline's SFT stage (conf/recipe/pipeline.yaml), each run from the pipeline's start: the teacher
# 600 steps (held-out 0.525 on a 2-core EPYC), the student 250 (0.32); then 40 distillation steps of 64 prompts
# x 8 samples from the student, the teacher scoring its tokens (~0.8 s a step): 0.39 there, the reverse KL
# 0.82 -> 0.5. A weak SFT teacher teaches slowly; from a GRPO-trained one the default pipeline's SFT model climbs
# 0.64 -> 0.88 in 100 steps (docs/results/distillation.md; the slow tier's twin, tests/e2e/test_pipeline.py)
SFT = ["trainer.prompts_per_step=128", "actor.samples_per_micro_batch=128", "actor.optim.lr=3.0e-3",
       "actor.optim.schedule_steps=1500", "actor.optim.weight_decay=1.0", "data.synthetic.train_first_operand_below=50",
       "data.synthetic.train_rows_not_below=200"]
STAGES = [
    {"name": "teacher", "recipe": "sft", "overrides": [*SFT, "trainer.total_steps=600", "trainer.val_every_steps=600"]},
    {"name": "student", "recipe": "sft", "init": {"name": "pipeline_start"},
     "overrides": [*SFT, "trainer.total_steps=250", "trainer.val_every_steps=250"]},
    {"name": "distill", "recipe": "distill", "teacher_stage": "teacher",
     "overrides": ["trainer.total_steps=40", "trainer.val_every_steps=20", "trainer.prompts_per_step=64",
                   "rollout.samples_per_prompt=8", "actor.optim.lr=4e-4", "trainer.old_log_probs=sampler"]},
]


def _stages_override() -> str:
    """pipeline.stages as one Hydra override (each stage override quoted: they hold '=')."""
    def stage(s: dict) -> str:
        fields = [f"name: {s['name']}", f"recipe: {s['recipe']}",
                  f"overrides: [{', '.join(json.dumps(o) for o in s['overrides'])}]"]
        fields += [f"init: {{name: {s['init']['name']}}}"] if "init" in s else []
        fields += [f"{key}: {s[key]}" for key in ("init_stage", "teacher_stage") if key in s]
        return "{" + ", ".join(fields) + "}"

    return "pipeline.stages=[" + ", ".join(stage(s) for s in STAGES) + "]"


def _validations(stage_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "val/accuracy" in r]


@pytest.mark.slow  # three stages, 850 SFT steps and 40 distillation steps: 2.5-4 minutes, too long for the default tier
@pytest.mark.budget(240)  # (which runs the two one-command distillation runs below)
def test_a_pipeline_trains_a_teacher_and_distils_a_student_that_climbs_toward_it(tmp_path):
    done = without_ray(["recipe=pipeline", _stages_override(), "data.synthetic.val_rows=500",
                        "trainer.val_prompts=500"], tmp_path, "distil", timeout_s=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    run_dir = tmp_path / "distil"
    teacher, student, distill = (json.loads((run_dir / d / "STAGE_COMPLETE").read_text())
                                 for d in ("00-teacher", "01-student", "02-distill"))
    assert student["init_model"] == str(run_dir / "00-teacher" / "base_model")  # pipeline_start: the tiny model built
    assert distill["init_model"] == student["final_model"]
    saved = json.loads((run_dir / "02-distill" / "config.json").read_text())
    assert saved["teacher"]["path"] == teacher["final_model"] and saved["teacher"]["reward_weight"] == 0.0
    assert teacher["final_accuracy"] >= student["final_accuracy"] + 0.1, (student, teacher)
    rows = _validations(run_dir / "02-distill")
    # the student's own metrics: held-out accuracy up (+7 points measured; 500 prompts: 2 points is one sigma)
    assert rows[-1]["val/accuracy"] >= student["final_accuracy"] + 0.03, (student, teacher, rows)
    kl = [json.loads(line)["distill/reverse_kl"] for line in (run_dir / "02-distill" / "metrics.jsonl").read_text().splitlines()]
    assert sum(kl[-5:]) / 5 < 0.8 * sum(kl[:5]) / 5, kl  # the student's samples move toward the teacher's


def test_top_k_distillation_with_gkd_s_mixture_runs_as_a_command(tmp_path, tiny_model_dir):
    """`teacher.objective=topk teacher.student_fraction=0.5`: the teacher (the tiny model of seed 0) scores its
    top k at every position of the student's (seed 1's) samples and of the data answers mixed in for half of
    them, and the step trains the divergence; the step's metrics say the share and the divergence."""
    done = without_ray(["recipe=distill", "model.tiny.seed=1", f"teacher.path={tiny_model_dir}",
                        "teacher.objective=topk", "teacher.top_k=4", "teacher.student_fraction=0.5",
                        "trainer.total_steps=2", "trainer.prompts_per_step=8", "rollout.samples_per_prompt=2",
                        "trainer.val_every_steps=2", "trainer.val_prompts=16", "data.synthetic.val_rows=16",
                        "trainer.old_log_probs=sampler"], tmp_path, "topk", timeout_s=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "topk" / "metrics.jsonl").read_text().splitlines()]
    assert [r["distill/student_fraction"] for r in rows] == [0.5, 0.5]
    assert all(r["distill/topk_divergence"] > 0 and 0 < r["distill/student_topk_mass"] <= 1 for r in rows), rows
    assert "val/accuracy" in rows[-1] and "reward/accuracy" in rows[0]


def test_several_teachers_each_score_their_own_prompts_with_metrics_per_teacher(tmp_path, tiny_model_dir):
    """`+teacher.teachers={a: ..., b: ...}` with the training data's `teacher` column naming each prompt's
    teacher: each is a role of its own, scores its prompts' samples, and the step reports each one's
    reverse KL and sample count over its own samples. A missing column is refused before start
    (tests/unit/test_distill.py)."""
    from hybridflow.data import ArithmeticSpec, make_arithmetic_rows

    rows = make_arithmetic_rows(48, ArithmeticSpec(), seed=3)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({**row, "teacher": "ab"[i % 2]}) + "\n" for i, row in enumerate(rows[:32])))
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(row) + "\n" for row in rows[32:]))
    done = without_ray(["recipe=distill", "model.tiny.seed=1", f"+teacher.teachers={{a: {tiny_model_dir}, b: {tiny_model_dir}}}",
                        "data=files", f"data.train_path={train}", f"data.val_path={val}", "data.max_prompt_tokens=16",
                        "trainer.total_steps=2",
                        "trainer.prompts_per_step=8", "rollout.samples_per_prompt=2", "trainer.val_every_steps=2",
                        "trainer.val_prompts=16", "trainer.old_log_probs=sampler"], tmp_path, "two", timeout_s=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    metrics = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    for row in metrics:
        assert row["distill/a/samples"] + row["distill/b/samples"] == 16, row
        # each over its own prompts' samples (a sampled estimate: either sign on 8 samples), the whole step's beside
        assert row["distill/a/reverse_kl"] != row["distill/b/reverse_kl"] and "distill/reverse_kl" in row
        assert row["timing/teacher_forward_s"] > 0
