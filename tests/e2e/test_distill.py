"""On-policy distillation as a user runs it: `hybridflow recipe=distill` commands in one process without Ray
(tests/e2e/cli_in_one_process.py `without_ray`), GKD's top-k mixture and several teachers. That the recipe
learns, in a pipeline that trains its teacher first (`recipe=distill_pipeline`: `teacher_stage`,
`init_stage`), is the slow tier's twin of the default pipeline (tests/e2e/test_pipeline.py)."""

from __future__ import annotations

import json


from tests.e2e.cli_in_one_process import without_ray


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
