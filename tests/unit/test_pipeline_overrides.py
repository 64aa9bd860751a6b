"""What the command line sets reaches the pipeline's stages (hybridflow/run/pipeline_stages.py): every
stage that reads the key, the user's value over the pipeline's and the stage's own; a stage-scoped
form for one stage; a key no stage reads refused before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.run.pipeline_stages import compose_command
from hybridflow.config import ConfigError
from hybridflow.run.pipeline_stages import route, routing_lines
from recipes.pipeline import check_stages

ROOT = Path(__file__).resolve().parents[2]


def stages(args: list[str], tmp_path: Path) -> dict:
    config = compose_command(args)
    return {stage.name: c for stage, c in zip(config.pipeline.stages, check_stages(config, tmp_path))}


def test_a_typed_key_reaches_every_stage_that_reads_it_and_wins(tmp_path):
    # the default pipeline's common_overrides set train_rows=7700 and its stages total_steps 800 / 250
    got = stages(["reward.fn=math_answer", "trainer.total_steps=7", "data.synthetic.train_rows=300",
                  "rollout.temperature=0.7"], tmp_path)
    assert {name: c.reward.fn for name, c in got.items()} == {"sft": "math_answer", "grpo": "math_answer"}
    assert {name: c.trainer.total_steps for name, c in got.items()} == {"sft": 7, "grpo": 7}
    assert {name: c.data.synthetic.train_rows for name, c in got.items()} == {"sft": 300, "grpo": 300}
    # SFT validates greedily: sampling keys are not handed to it
    assert got["grpo"].rollout.temperature == 0.7 and got["sft"].rollout.temperature == 1.0


def test_a_stage_scoped_key_reaches_that_stage_only_and_beats_the_typed_one(tmp_path):
    got = stages(["trainer.total_steps=7", "stages.grpo.trainer.total_steps=3"], tmp_path)
    assert got["sft"].trainer.total_steps == 7 and got["grpo"].trainer.total_steps == 3


def test_a_group_choice_reaches_the_stages_and_model_path_starts_the_first(tmp_path):
    got = stages(["model=local_hf", "model.path=/models/m", "model.dtype=bfloat16"], tmp_path)
    assert all(c.model.dtype.value == "bfloat16" for c in got.values())
    assert got["sft"].model.path == "/models/m" and got["grpo"].model.path.endswith("01-grpo/init_model")


def test_the_console_says_which_stage_got_what():
    config = compose_command(["rollout.temperature=0.7", "stages.sft.trainer.total_steps=5"])
    assert routing_lines(config) == ["pipeline: stage sft gets trainer.total_steps=5",
                                     "pipeline: stage grpo gets rollout.temperature=0.7"]


@pytest.mark.parametrize("args, message", [
    (["recipe.demo_prompts=4"], r"no stage of this pipeline reads recipe.demo_prompts.*recipe=demo"),
    (["stages.nope.trainer.total_steps=3"], r"no stage 'nope'; its stages are \['sft', 'grpo'\]"),
    (["stages.sft.algorithm.kl_penalty_coef=0.1"], r"stage sft \(recipe=sft\) does not read algorithm"),
    (["stages.sft.logger.run_name=x"], r"the pipeline sets logger.run_name for each stage itself"),
    (["recipe=grpo", "stages.grpo.trainer.total_steps=3"], r"recipe=grpo has no stages: give it as trainer"),
    (["stages.grpo.actor.optim.lr=-1"], r"pipeline.stages\[1\] \(grpo, recipe=grpo\).*optim.lr=-1"),
    (["stages.sft.actor.lora.rank=4", "stages.sft.actor.lora.save_adapter_only=true"],
     r"pipeline.stages\[0\] \(sft\) sets actor.lora.save_adapter_only=true, but stage grpo starts from"),
])
def test_an_override_that_would_change_nothing_is_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        compose_command(args)


def test_the_command_refuses_it_before_anything_starts(tmp_path):
    done = subprocess.run([sys.executable, "-m", "hybridflow.cli", "algorithm.kl_penalty_coef=0.1",
                           "stages.sft.recipe.demo_prompts=2", f"logger.output_root={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "stages.sft.recipe.demo_prompts=2" in done.stderr and not any(tmp_path.iterdir())
    assert "algorithm.kl_penalty_coef" not in done.stderr  # grpo reads it


def test_routing_keeps_the_pipelines_own_keys():
    config = compose_command(["logger.run_name=r", "trainer.resume=true", "model.path=/m"])
    assert route(config) == {"sft": [], "grpo": []}


def test_an_existing_run_name_without_resume_is_refused_before_anything_starts(tmp_path):
    from hybridflow.cli import run
    from hybridflow.config import compose
    from hybridflow.checks.preflight import InputError

    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "metrics.jsonl").write_text('{"step": 1}\n')
    config = compose(["recipe=sft", f"logger.output_root={tmp_path}", "logger.run_name=sft"])
    with pytest.raises(InputError, match=r"already holds a run \(1 metrics rows\).*trainer.resume=true.*another "
                                         r"logger.run_name"):
        run(config)
    assert (tmp_path / "sft" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in (tmp_path / "sft").iterdir()) == ["metrics.jsonl"]


def test_a_reward_function_typed_on_the_default_pipeline_is_checked_in_every_stage_that_scores(tmp_path,
                                                                                                 monkeypatch):
    from hybridflow.checks.preflight import InputError, check_inputs

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text("def score(response, difficulty, **_):\n    return 1.0\n")
    config = compose_command(["reward.fn=my_rewards.py:score"])
    with pytest.raises(InputError) as refused:
        check_inputs(config)
    message = str(refused.value)
    for stage in ("pipeline.stages[0] (sft)", "pipeline.stages[1] (grpo)"):
        assert f"{stage}: data: the synthetic task has no column 'difficulty'" in message
